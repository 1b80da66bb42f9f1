#include "estimator/saved/walker.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/graph/family.h"
#include "estimator/saved/walk.h"

namespace memledger {
namespace walk_internal {

std::shared_ptr<const BlockLayouts> Walk::LayoutsOnly() {
  tensors_.resize(graph_.tensors.size());
  storages_.reserve(graph_.tensors.size());
  LeafStorages();
  for (size_t op = 0; !overflow_ && op < graph_.ops.size(); ++op) {
    if (!Layouts(graph_.ops[op]).ok()) return nullptr;
  }
  if (overflow_) return nullptr;
  auto layouts = std::make_shared<BlockLayouts>();
  layouts->storage_of.reserve(tensors_.size());
  for (const TensorState& t : tensors_) layouts->storage_of.push_back(t.storage);
  layouts->tensors = std::move(tensors_);
  layouts->storages = std::move(storages_);
  return layouts;
}

absl::StatusOr<BlockWalk> Walk::Run(const BlockLayouts* layouts) {
  // A reentrant checkpointed block without a policy keeps nothing inside: skip its ops.
  const bool walk_ops = !options_.checkpointed || !options_.policy.empty() ||
                        config_.checkpoint_impl == CheckpointImpl::kNonReentrant;
  laid_out_ = layouts != nullptr && walk_ops;
  if (laid_out_) {
    laid_ = &layouts->tensors;  // read, never copied
    storages_ = layouts->storages;
  } else {
    tensors_.resize(graph_.tensors.size());
    storages_.reserve(graph_.tensors.size());
    LeafStorages();
  }
  // A walk its graph's memo remembers takes the keeps from there (walk_memo.h); any
  // other applies every op, and the memo remembers what it kept.
  WalkMemo* memo = Memoizable() ? graph_.walk_memo.get() : nullptr;
  const WalkMemo::Options memo_options = MemoOptions();
  const WalkMemo::Facts* remembered =
      memo != nullptr ? memo->Find(memo_options, layouts->storage_of) : nullptr;
  if (remembered != nullptr) {
    const WalkMemo::Flags& flags = remembered->flags;
    for (size_t s = 0; s < storages_.size(); ++s) {
      storages_[s].kept = (flags[s] & WalkMemo::kKept) != 0;
      storages_[s].cached = (flags[s] & WalkMemo::kCached) != 0;
      storages_[s].held = (flags[s] & WalkMemo::kHeld) != 0;
    }
    if (options_.record_layouts) {
      requires_grad_ = remembered->requires_grad;
      node_keepers_ = remembered->node_keepers;
    }
  } else {
    if (absl::Status s = ApplyOps(walk_ops); !s.ok()) return s;
    if (memo != nullptr && !overflow_) memo->Remember(memo_options, layouts->storage_of, Facts());
  }
  BlockWalk walk;
  if (!overflow_) walk = Summarize();
  if (overflow_) {
    return absl::OutOfRangeError(absl::StrCat(
        "byte counts overflow int64 for width=", config_.width,
        " heads=", config_.heads, " batch=", config_.batch, " seq=", config_.seq));
  }
  return walk;
}

absl::Status Walk::ApplyOps(bool walk_ops) {
  requires_grad_.assign(graph_.tensors.size(), false);
  for (size_t i = 0; i < graph_.tensors.size(); ++i) {
    const TensorDef& def = graph_.tensors[i];
    const bool is_input = static_cast<int>(i) == graph_.input;
    requires_grad_[i] =
        (def.is_parameter && !def.frozen) || (is_input && options_.input_requires_grad);
  }
  if (options_.checkpointed) {
    // torch.utils.checkpoint saves the block's positional tensor argument, the hidden
    // states (checkpoint.py, _CheckpointFrame.save_inputs; the reentrant
    // CheckpointFunction's save_for_backward), which saved-tensor hooks see. The
    // model-level tensors the layer is called with (RoPE's cos and sin, position ids)
    // are keyword arguments that transformers binds into the checkpointed function
    // (modeling_layers.py:120, partial(forward, self, **kwargs)): held until the
    // checkpoint's backward, never saved.
    Keep(-1, graph_.input, KeepReason::kCheckpointInput);
    for (size_t i = 0; i < graph_.tensors.size(); ++i) {
      if (graph_.tensors[i].is_global()) {
        Keep(-1, static_cast<int>(i), KeepReason::kCheckpointHeld);
      }
    }
  }
  // Once a size overflows, layouts are meaningless: stop and report the overflow
  // (an "impossible view" then is the overflow's doing, not a graph bug).
  for (size_t op = 0; walk_ops && !overflow_ && op < graph_.ops.size(); ++op) {
    absl::Status s = Apply(static_cast<int>(op));
    if (!s.ok() && !overflow_) return s;
  }
  return absl::OkStatus();
}

WalkMemo::Facts Walk::Facts() const {
  WalkMemo::Facts facts;
  facts.flags.resize(storages_.size());
  for (size_t s = 0; s < storages_.size(); ++s) {
    facts.flags[s] = static_cast<uint8_t>((storages_[s].kept ? WalkMemo::kKept : 0) |
                                          (storages_[s].cached ? WalkMemo::kCached : 0) |
                                          (storages_[s].held ? WalkMemo::kHeld : 0));
  }
  if (options_.record_layouts) {
    facts.requires_grad = requires_grad_;
    facts.node_keepers = node_keepers_;
    facts.node_keepers.resize(storages_.size());
  }
  return facts;
}

WalkMemo::Options Walk::MemoOptions() const {
  return {options_.checkpointed, options_.input_requires_grad,
          options_.input_embeddings_hooked, options_.recompute_core_attention,
          config_.checkpoint_impl == CheckpointImpl::kNonReentrant, options_.policy,
          options_.record_layouts};
}

void Walk::LeafStorages() {
  for (size_t i = 0; i < graph_.tensors.size(); ++i) {
    const TensorDef& def = graph_.tensors[i];
    if (def.is_parameter || def.is_buffer || def.is_global() ||
        static_cast<int>(i) == graph_.input) {
      NewStorage(static_cast<int>(i), Evaluate(def.shape), def.dtype, def.is_parameter);
      storages_.back().is_global = def.is_global();
      storages_.back().is_buffer = def.is_buffer;
    }
  }
}

Layout Walk::Evaluate(const std::vector<SymDim>& shape) {
  int64_t sizes[Layout::kMaxDims];
  for (size_t i = 0; i < shape.size(); ++i) {
    CheckedInt64 dim = shape[i].Evaluate(Symbols());
    overflow_ = overflow_ || dim.overflowed();
    sizes[i] = dim.value();
  }
  return Layout::Contiguous(sizes, static_cast<int>(shape.size()), &overflow_);
}

void Walk::NewStorage(int tensor, const Layout& layout, DType dtype, bool is_parameter) {
  // A host tensor of a CUDA step holds no device bytes.
  const bool off_device = config_.device == Device::kCuda && graph_.tensors[tensor].host;
  CheckedInt64 bytes = layout.Numel() * (off_device ? 0 : ElementSizeBytes(dtype));
  overflow_ = overflow_ || bytes.overflowed();
  StorageState storage;
  storage.bytes = bytes.value();
  storage.owner = tensor;
  storage.is_parameter = is_parameter;
  storages_.push_back(std::move(storage));
  tensors_[tensor].layout = layout;
  tensors_[tensor].storage = static_cast<int>(storages_.size()) - 1;
}

void Walk::NewDenseLike(int tensor, const Layout& like) {
  NewStorage(tensor, Layout::DenseLike(like), graph_.tensors[tensor].dtype, false);
}

absl::Status Walk::Internal(const OpDef& op, absl::string_view what) {
  return absl::InternalError(absl::StrCat("estimator graph op '", op.name, "' (",
                                          OpTypeName(op.type), "): ", what));
}

absl::Status Walk::Apply(int op_index) {
  const OpDef& op = graph_.ops[op_index];
  if (!laid_out_) {
    if (absl::Status s = Layouts(op); !s.ok()) return s;
  }
  const OpSemantics& semantics = rules_.Of(op.type);

  bool has_grad_fn = false;
  for (int i : semantics.differentiable_inputs) {
    has_grad_fn = has_grad_fn || (!op.no_grad && requires_grad_[op.inputs[i]]);
  }
  // Integer and bool outputs (topk's indices, a mask) never require grad.
  for (int out : op.outputs) {
    const DType dtype = graph_.tensors[out].dtype;
    requires_grad_[out] = has_grad_fn && dtype != DType::kInt64 && dtype != DType::kInt32 &&
                          dtype != DType::kBool;
    if (out == graph_.input_embeddings && options_.input_embeddings_hooked &&
        !requires_grad_[out]) {
      // The hook's leaf; its AccumulateGrad node, not the op's (it has none), holds it:
      // no node keep (the step simulation holds it itself, InFlight::leaf).
      requires_grad_[out] = true;
      Keep(-1, out, KeepReason::kLeafHeld);
    }
  }

  if (options_.checkpointed) {
    // Inside a checkpointed block autograd keeps nothing; the policy's ops put their
    // outputs in the selective cache instead. A non-reentrant checkpoint runs the
    // block with grad, its saved tensors packed into empty holders, but for those
    // SavedVariable stores without the hooks (wrapped numbers), which the nodes hold.
    if (op.policy_kind.has_value() && options_.policy.Saves(*op.policy_kind)) {
      for (int out : op.outputs) Keep(op_index, out, KeepReason::kSelectiveCache);
    }
    if (config_.checkpoint_impl == CheckpointImpl::kNonReentrant && has_grad_fn) {
      for (const KeepRule& rule : semantics.keeps) {
        if (!rule.wrapped_number) continue;
        Keep(op_index, rule.is_output ? op.outputs[rule.index] : op.inputs[rule.index],
             KeepReason::kWrappedNumber);
      }
    }
    return absl::OkStatus();
  }
  if (!has_grad_fn) return absl::OkStatus();  // no backward node, nothing saved
  if (options_.recompute_core_attention && op.core_attention) {
    // Recomputed in the backward from its inputs: the core keeps what it reads from
    // outside itself (q, k, v), as a checkpoint keeps its input.
    for (int input : op.inputs) {
      const int producer = producer_[input];
      if (producer >= 0 && graph_.ops[producer].core_attention) continue;
      if (!graph_.tensors[input].is_parameter) Keep(op_index, input, KeepReason::kCheckpointInput);
    }
    return absl::OkStatus();
  }
  for (const KeepRule& rule : semantics.keeps) {
    if (rule.needs_grad_of_input >= 0 &&
        !requires_grad_[op.inputs[rule.needs_grad_of_input]]) {
      continue;
    }
    Keep(op_index, rule.is_output ? op.outputs[rule.index] : op.inputs[rule.index],
         rule.wrapped_number ? KeepReason::kWrappedNumber : KeepReason::kAutograd);
  }
  return absl::OkStatus();
}

void Walk::Keep(int op, int tensor, KeepReason reason) {
  StorageState& storage = storages_[(*laid_)[tensor].storage];
  if (options_.record_layouts && reason != KeepReason::kSelectiveCache) {
    node_keepers_.resize(storages_.size());
    node_keepers_[(*laid_)[tensor].storage] += op >= 0;
  }
  if (storage.is_parameter) return;  // parameters are accounted elsewhere
  const bool held = reason == KeepReason::kCheckpointHeld ||
                    reason == KeepReason::kWrappedNumber || reason == KeepReason::kLeafHeld;
  bool& flag = reason == KeepReason::kSelectiveCache ? storage.cached
               : held                                ? storage.held
                                                     : storage.kept;
  if (flag) return;
  flag = true;
  if (options_.record_storages) {
    storages_recorded_.push_back(
        KeptStorage{op, tensor, storage.owner, (*laid_)[tensor].layout, storage.bytes, reason});
  }
}

BlockWalk Walk::Summarize() {
  BlockWalk walk;
  const int input_storage = graph_.input >= 0 ? (*laid_)[graph_.input].storage : -1;
  const int output_storage = (*laid_)[graph_.output].storage;
  walk.keeps_input = input_storage >= 0 && storages_[input_storage].kept;
  walk.keeps_output = output_storage >= 0 && storages_[output_storage].kept;
  walk.holds_output = output_storage >= 0 && storages_[output_storage].held &&
                      !storages_[output_storage].kept && !storages_[output_storage].is_global;
  const int boundary_storage = input_storage >= 0 ? input_storage : output_storage;
  walk.boundary_bytes = storages_[boundary_storage].bytes;
  walk.boundary_dtype = graph_.tensors[storages_[boundary_storage].owner].dtype;
  CheckedInt64 inner = 0, cache = 0;
  for (int s = 0; s < static_cast<int>(storages_.size()); ++s) {
    const StorageState& storage = storages_[s];
    const DType dtype = graph_.tensors[storage.owner].dtype;
    if (storage.cached) {
      cache += storage.bytes;
      walk.cache_by_dtype[static_cast<int>(dtype)] += storage.bytes;
    }
    if (storage.is_global && (storage.kept || storage.held)) {
      walk.kept_globals.push_back(KeptGlobal{graph_.tensors[storage.owner].global,
                                             storage.bytes, dtype, !storage.kept});
      continue;
    }
    if (storage.held && !storage.kept && !storage.is_global) walk.held_bytes += storage.bytes;
    if (!storage.kept || s == input_storage || s == output_storage) continue;
    inner += storage.bytes;
    walk.inner_by_dtype[static_cast<int>(dtype)] += storage.bytes;
    if (storage.is_weight_copy) walk.weight_copy_bytes += storage.bytes;
    if (storage.is_buffer) walk.buffer_bytes += storage.bytes;
  }
  walk.inner_bytes = inner.value();
  walk.cache_bytes = cache.value();
  overflow_ = overflow_ || inner.overflowed() || cache.overflowed();
  walk.storages = std::move(storages_recorded_);
  if (options_.record_layouts) {
    walk.tensor_layouts.reserve(laid_->size());
    for (size_t i = 0; i < laid_->size(); ++i) {
      const TensorState& t = (*laid_)[i];
      walk.tensor_layouts.push_back(
          WalkedTensor{t.storage, t.layout, static_cast<bool>(requires_grad_[i])});
    }
    walk.storage_list.reserve(storages_.size());
    node_keepers_.resize(storages_.size());
    for (size_t i = 0; i < storages_.size(); ++i) {
      const StorageState& s = storages_[i];
      walk.storage_list.push_back(WalkedStorage{s.bytes, s.owner, s.is_parameter,
                                                s.is_buffer, s.is_global, s.is_weight_copy,
                                                node_keepers_[i], s.cached});
    }
  }
  return walk;
}

}  // namespace walk_internal

using walk_internal::Walk;

const char* KeepReasonName(KeepReason reason) {
  switch (reason) {
    case KeepReason::kAutograd:
      return "autograd";
    case KeepReason::kCheckpointInput:
      return "checkpoint";
    case KeepReason::kSelectiveCache:
      return "cache";
    case KeepReason::kCheckpointHeld:
      return "checkpoint_held";
    case KeepReason::kWrappedNumber:
      return "wrapped_number";
    case KeepReason::kLeafHeld:
      return "leaf_held";
  }
  return "?";
}

std::shared_ptr<const BlockLayouts> LayoutBlock(const BlockGraph& graph,
                                                const ModelConfig& config) {
  absl::StatusOr<ValidConfig> valid = ValidConfig::Of(config);
  if (!valid.ok()) return nullptr;
  return LayoutBlock(graph, *valid);
}

std::shared_ptr<const BlockLayouts> LayoutBlock(const BlockGraph& graph,
                                                const ValidConfig& config) {
  return Walk(graph, *config, WalkOptions()).LayoutsOnly();
}

absl::StatusOr<BlockWalk> WalkBlock(const BlockGraph& graph, const ModelConfig& config,
                                    const WalkOptions& options, const BlockLayouts* layouts) {
  absl::StatusOr<ValidConfig> valid = ValidConfig::Of(config);
  if (!valid.ok()) return valid.status();
  return WalkBlock(graph, *valid, options, layouts);
}

absl::StatusOr<BlockWalk> WalkBlock(const BlockGraph& graph, const ValidConfig& config,
                                    const WalkOptions& options, const BlockLayouts* layouts) {
  return Walk(graph, *config, options).Run(layouts);
}

}  // namespace memledger
