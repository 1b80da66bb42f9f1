// Walks a BlockGraph for one concrete configuration and finds which storages autograd
// keeps for backward, exactly as the pinned LibTorch plus the saved-tensor hook count them:
// unique storages (views share their base's), parameter storages excluded.
//
// Example:
//   WalkOptions options;
//   options.input_requires_grad = false;  // the study's first block
//   absl::StatusOr<BlockWalk> walk =
//       WalkBlock(ModelGraphsFor(config, AttentionMode::kFlash)->layer, config, options);
#ifndef ESTIMATOR_SAVED_WALKER_H_
#define ESTIMATOR_SAVED_WALKER_H_

#include <array>
#include <memory>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "estimator/graph/block_graph.h"
#include "estimator/graph/family.h"
#include "estimator/spec/config.h"
#include "estimator/graph/rules.h"
#include "estimator/graph/shape.h"

namespace memledger {

struct WalkOptions {
  // checkpointed: the block runs under checkpointing; it keeps only its input (which
  // counts as saved) plus, for a selective policy, the outputs of the policy's ops.
  bool checkpointed = false;
  // input_requires_grad is false for the study's first block, whose input is the model
  // input.
  bool input_requires_grad = true;
  // input_embeddings_hooked: a prologue walked with enable_input_require_grads' forward
  // hook, which transformers' activation_checkpointing_enable registers
  // (modeling_utils.py:3180-3189): `output.requires_grad_(True)` on what the input
  // embeddings return (BlockGraph::input_embeddings). When the embeddings are frozen that
  // output is a leaf, which then requires grad: its AccumulateGrad node holds it, and its
  // .grad, until the graph dies (KeepReason::kLeafHeld). Otherwise a no-op.
  bool input_embeddings_hooked = false;
  // policy: the selective must-save op kinds; empty means plain full checkpointing.
  SavePolicy policy;
  // record_storages fills BlockWalk::storages (the per-op breakdown).
  bool record_storages = false;
  // record_layouts fills BlockWalk::tensor_layouts and ::storage_list (what the liveness
  // simulation, estimator/step/liveness.h, replays).
  bool record_layouts = false;
  // rules: what each op views and keeps; null means RuleTable::Pinned(). Not owned.
  const RuleTable* rules = nullptr;
  // recompute_core_attention: Megatron's selective recompute: the core attention ops
  // keep nothing; what they read from outside the core (q, k, v) is kept instead.
  bool recompute_core_attention = false;
};

// Why a storage is counted.
enum class KeepReason : uint8_t {
  kAutograd,         // a backward node saved it
  kCheckpointInput,  // a checkpointed block's input, saved by the checkpoint node
  kSelectiveCache,   // a must-saved output held in the selective cache
  // held by a checkpointed block's call arguments (transformers' bound keyword
  // arguments): alive until its backward, but saved by nobody, so no saved-tensor hook
  // sees it. Not in saved_bytes; in held_after_forward_bytes.
  kCheckpointHeld,
  // a wrapped Python number a backward node keeps (KeepRule::wrapped_number): held, but
  // never packed, so no saved-tensor hook sees it. In held_after_forward_bytes only.
  kWrappedNumber,
  // a leaf made to require grad by enable_input_require_grads' hook
  // (WalkOptions::input_embeddings_hooked): its AccumulateGrad node holds it until the
  // graph dies, and no saved-tensor hook sees it. In held_after_forward_bytes only.
  kLeafHeld,
};

// "autograd", "checkpoint", "cache", "checkpoint_held", "wrapped_number", "leaf_held"
const char* KeepReasonName(KeepReason reason);

// KeptStorage is one counted storage: the first op and tensor that kept it.
struct KeptStorage {
  int op = -1;  // index into BlockGraph::ops; -1 for the checkpoint node
  int tensor = 0;
  int storage_owner = 0;  // the tensor that allocated the storage (tensor is a view of it)
  Layout layout;  // of the kept tensor (a view may be smaller than its storage)
  int64_t bytes = 0;  // the whole storage's nbytes
  KeepReason reason = KeepReason::kAutograd;
};

// KeptGlobal is a model-level storage (TensorDef::global) a block keeps.
struct KeptGlobal {
  ModelTensor id = ModelTensor::kNone;
  int64_t bytes = 0;
  DType dtype = DType::kFloat32;
  bool held = false;  // only held by a checkpoint's call arguments (kCheckpointHeld)
};

// WalkedTensor is one tensor of the graph as the walk laid it out.
struct WalkedTensor {
  int storage = -1;  // into BlockWalk::storage_list; -1 if the walk never reached it
  Layout layout;
  bool requires_grad = false;
};

// WalkedStorage is one storage the walk created (parameters, model-level tensors and the
// block input first, then every op's new outputs in execution order).
struct WalkedStorage {
  int64_t bytes = 0;
  int owner = 0;  // the tensor that allocated it
  bool is_parameter = false;
  bool is_buffer = false;  // a module buffer: resident, never freed
  bool is_global = false;
  bool is_weight_copy = false;
  // node_keepers: how many ops' backward nodes keep it (the checkpoint node, which may
  // too, not counted), parameters included; cached: in the selective cache.
  int node_keepers = 0;
  bool cached = false;
};

// BlockWalk is what one block keeps. The input and output storages are reported apart
// because they are shared with the neighbouring blocks and counted once for the model;
// so are model-level storages, which any number of blocks may keep.
struct BlockWalk {
  bool keeps_input = false;
  bool keeps_output = false;
  // holds_output: the output storage is held and not kept (the hook's leaf,
  // KeepReason::kLeafHeld): in held_bytes.
  bool holds_output = false;
  // nbytes of the input storage (= the output's for a layer; the output's for the
  // prologue, which has no input)
  int64_t boundary_bytes = 0;
  int64_t inner_bytes = 0;     // other storages autograd keeps, model-level ones excluded
  // held_bytes: storages backward nodes keep that no saved-tensor hook sees (wrapped
  // numbers): not in inner_bytes.
  int64_t held_bytes = 0;
  int64_t cache_bytes = 0;     // selective cache
  // The same by the storages' dtypes (indexed by DType), and the boundary's dtype.
  std::array<int64_t, kNumDTypes> inner_by_dtype{};
  std::array<int64_t, kNumDTypes> cache_by_dtype{};
  DType boundary_dtype = DType::kFloat32;
  // weight_copy_bytes: the part of inner_bytes that is copies of parameters (autocast's
  // casts of weights, kept by the matmuls that use them).
  int64_t weight_copy_bytes = 0;
  // buffer_bytes: the part of inner_bytes that is module buffers (Gemma 3's embed_scale,
  // kept by a product): saved, as a saved-tensor hook sees them, but resident before the
  // step, so not held by the forward.
  int64_t buffer_bytes = 0;
  std::vector<KeptGlobal> kept_globals;
  std::vector<KeptStorage> storages;  // if WalkOptions::record_storages
  // if WalkOptions::record_layouts:
  std::vector<WalkedTensor> tensor_layouts;  // indexed like BlockGraph::tensors
  std::vector<WalkedStorage> storage_list;
};

// BlockLayouts is what every walk of one block for one config computes first, whatever
// its options: each tensor's layout and storage (ATen's view and copy rules). Walks of
// the same block and config (a layer checkpointed or not, under each policy) share it.
struct BlockLayouts;

// LayoutBlock computes `graph`'s layouts for `config`; null when that fails or
// overflows (a walk without them then reports why).
std::shared_ptr<const BlockLayouts> LayoutBlock(const BlockGraph& graph,
                                                const ModelConfig& config);
// LayoutBlock for a config its caller validated: not checked again.
std::shared_ptr<const BlockLayouts> LayoutBlock(const BlockGraph& graph,
                                                const ValidConfig& config);

// WalkBlock returns InvalidArgument for an invalid config and OutOfRange if a byte
// count overflows int64. `layouts`, when given, must be LayoutBlock(graph, config)'s.
// REQUIRES: `graph`'s input and output storages have the same size.
absl::StatusOr<BlockWalk> WalkBlock(const BlockGraph& graph, const ModelConfig& config,
                                    const WalkOptions& options,
                                    const BlockLayouts* layouts = nullptr);
// WalkBlock for a config its caller validated: not checked again.
absl::StatusOr<BlockWalk> WalkBlock(const BlockGraph& graph, const ValidConfig& config,
                                    const WalkOptions& options,
                                    const BlockLayouts* layouts = nullptr);

}  // namespace memledger

#endif  // ESTIMATOR_SAVED_WALKER_H_
