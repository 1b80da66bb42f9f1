// Walk: the walker's per-call state and steps (estimator/saved/walker.h is the API). Private
// to //estimator:walker: walker.cc walks (what autograd keeps, the memo), and
// walk_layouts.cc holds Layouts, ATen's layout rules op by op.
#ifndef ESTIMATOR_SAVED_WALK_H_
#define ESTIMATOR_SAVED_WALK_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "estimator/graph/block_graph.h"
#include "estimator/spec/config.h"
#include "estimator/graph/rules.h"
#include "estimator/graph/shape.h"
#include "estimator/graph/walk_memo.h"
#include "estimator/saved/walker.h"

namespace memledger {
namespace walk_internal {

struct TensorState {
  Layout layout;
  int storage = -1;
};

struct StorageState {
  int64_t bytes = 0;
  int owner = 0;
  bool is_parameter = false;
  bool is_buffer = false;
  bool is_global = false;
  bool is_weight_copy = false;  // .to() of a parameter (autocast's cast of a weight)
  bool kept = false;    // by autograd or the checkpoint node
  bool cached = false;  // by the selective cache
  bool held = false;    // by a checkpoint's call arguments (KeepReason::kCheckpointHeld)
};

}  // namespace walk_internal

struct BlockLayouts {
  std::vector<walk_internal::TensorState> tensors;
  std::vector<walk_internal::StorageState> storages;
  std::vector<int> storage_of;  // per tensor: tensors[i].storage, the walk memo's key
};

namespace walk_internal {

// Walk holds the per-call state; nothing is shared between calls but the layouts it may
// start from.
class Walk {
 public:
  Walk(const BlockGraph& graph, const ModelConfig& config, const WalkOptions& options)
      : graph_(graph), config_(config), options_(options),
        rules_(options.rules != nullptr ? *options.rules : RuleTable::Pinned()) {
    // Only the core attention's recompute asks which op made a tensor.
    if (options.recompute_core_attention) {
      producer_.assign(graph.tensors.size(), -1);
      for (size_t op = 0; op < graph.ops.size(); ++op) {
        for (int out : graph.ops[op].outputs) producer_[out] = static_cast<int>(op);
      }
    }
  }

  // LayoutsOnly runs the layout half of every op and returns the result; null when an
  // op's layout fails or a size overflows.
  std::shared_ptr<const BlockLayouts> LayoutsOnly();

  absl::StatusOr<BlockWalk> Run(const BlockLayouts* layouts);

 private:
  // ApplyOps keeps what the checkpoint node and then each op (when `walk_ops`) keep.
  absl::Status ApplyOps(bool walk_ops);

  // Facts: each storage's keeps (and with layouts, each tensor's requires_grad and each
  // storage's keepers), as the memo holds them.
  WalkMemo::Facts Facts() const;

  // Memoizable: whether this walk may read or feed its graph's memo. It must start
  // from layouts (its storages known before any op) and apply every op with the pinned
  // rules, recording no storages (records name ops, which a memo does not keep); the
  // layouts it records are its own, the requires_grad and keepers the memo's.
  bool Memoizable() const {
    return graph_.walk_memo != nullptr && laid_out_ && !options_.record_storages &&
           (options_.rules == nullptr || options_.rules == &RuleTable::Pinned());
  }

  const SymbolValues& Symbols() {
    if (!symbols_.has_value()) symbols_.emplace(config_);
    return *symbols_;
  }

  WalkMemo::Options MemoOptions() const;

  // LeafStorages makes the storages of the parameters, model-level tensors and input.
  void LeafStorages();

  Layout Evaluate(const std::vector<SymDim>& shape);

  void NewStorage(int tensor, const Layout& layout, DType dtype, bool is_parameter);

  void NewContiguous(int tensor, const int64_t* sizes, int ndim) {
    NewStorage(tensor, Layout::Contiguous(sizes, ndim, &overflow_),
               graph_.tensors[tensor].dtype, false);
  }

  // NewDenseLike: a new tensor laid out as ATen lays out one made like `like`.
  void NewDenseLike(int tensor, const Layout& like);

  void ViewOf(int tensor, int base, const Layout& layout) {
    tensors_[tensor].layout = layout;
    tensors_[tensor].storage = tensors_[base].storage;
  }

  absl::Status Internal(const OpDef& op, absl::string_view what);

  // Layouts derives each output's layout and storage from the inputs, as ATen does
  // (walk_layouts.cc).
  absl::Status Layouts(const OpDef& op);

  absl::Status Apply(int op_index);

  void Keep(int op, int tensor, KeepReason reason);

  BlockWalk Summarize();

  const BlockGraph& graph_;
  const ModelConfig& config_;
  const WalkOptions& options_;
  const RuleTable& rules_;
  // symbols_: the config's sizes, made on first use (a walk from layouts needs none).
  std::optional<SymbolValues> symbols_;
  std::vector<TensorState> tensors_;  // what Layouts makes, unless laid out already
  // laid_: the tensors' layouts the walk reads: tensors_, or a BlockLayouts' own.
  const std::vector<TensorState>* laid_ = &tensors_;
  std::vector<char> requires_grad_;  // per tensor
  std::vector<int> producer_;  // per tensor: the op that made it, -1: none
  std::vector<StorageState> storages_;
  // node_keepers_: with record_layouts, per storage, how many ops' nodes kept it (the
  // checkpoint node not counted).
  std::vector<int> node_keepers_;
  std::vector<KeptStorage> storages_recorded_;
  bool overflow_ = false;
  bool laid_out_ = false;  // the layouts came from a BlockLayouts: Apply skips them
};

}  // namespace walk_internal
}  // namespace memledger

#endif  // ESTIMATOR_SAVED_WALK_H_
