// The step simulation: a segment's forward, as autograd and the checkpoints run it.
#include "estimator/step/simulation.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace memledger::liveness_internal {

absl::Status Simulation::Forward(Instance& inst, const Handle* input, Pass pass,
                                 Handle* output) {
  const SegmentPlan& plan = *inst.plan;
  const SegmentStructure& structure = *plan.structure;
  const BlockGraph& graph = *plan.graph;
  const std::vector<WalkedStorage>& storages = plan.walk.storage_list;
  // KeepsOf: how many of storage s's keeps this pass makes.
  auto keeps_of = [&](size_t s) {
    if (pass.keeps == Pass::Keeps::kNone) return 0;
    if (pass.keeps == Pass::Keeps::kUnpacked) return structure.unpacked_keeps[s];
    return structure.node_keeps[s];
  };
  inst.ids.assign(storages.size(), -1);
  // local: made here and still referenced by the forward's locals (the early stop's
  // unwinding frees them): kept for an early stop only, in the simulation's room for it
  // (one forward at a time stops early).
  std::vector<bool>& local = early_stop_locals_;
  local.assign(pass.early_stop ? storages.size() : 0, false);
  // An unreachable node (OpDef::no_grad) holds what it saved where the pass's nodes
  // keep what they save: not under a non-reentrant checkpoint's pack hook, which stores
  // holders, but in its recompute, whose hook returns the tensor (checkpoint.py,
  // _recomputation_hook). held_by_nodes: those storages, until their release; a
  // recompute that stops early unwinds the locals that hold the dead nodes.
  const bool nodes_hold = pass.keeps == Pass::Keeps::kAll;
  std::vector<int> held_by_nodes;
  auto unwind = [&] {
    for (int s : held_by_nodes) memory_.Unref(inst.ids[s]);
    return StopRecompute(inst, local, output);
  };
  for (size_t s = 0; s < storages.size(); ++s) {
    if (!storages[s].is_global) continue;
    // A model-level tensor (token ids, RoPE's tables): made once, held by the caller.
    const ModelTensor id = graph.tensors[storages[s].owner].global;
    const int global = globals_.Find(id);
    if (global < 0) {
      return absl::InternalError(
          absl::StrCat("step simulation: no model-level ", ModelTensorName(id)));
    }
    inst.ids[s] = global;
    for (int k = keeps_of(s); k > 0; --k) memory_.Keep(global);
  }
  if (input != nullptr && structure.input_storage >= 0) {
    inst.ids[structure.input_storage] = input->storage;
    for (int k = keeps_of(structure.input_storage); k > 0; --k) memory_.Keep(input->storage);
  }
  memory_.SetOp(At(inst, -1, nullptr));
  // A sliding-window layer's first cache update on CUDA: lazy_initialization moves the
  // DynamicSlidingWindowLayer's window size to the keys' device
  // (`self._sliding_window_tensor.to(self.device)`, cache_utils.py), an 8-byte tensor
  // the cache holds, before its first cat; on the CPU the same tensor.
  bool window_moved = !memory_.cuda() || inst.segment < 0 ||
                      config_.AttentionOf(inst.segment) != LayerAttention::kSliding;
  // Not the views that touch no memory (SegmentStructure::inert; their view types are
  // none that this loop gives a temporary or a workspace).
  for (const SegmentStructure::ForwardStep& step : structure.forward_steps) {
    const int i = step.op;
    const OpDef& op = graph.ops[i];
    memory_.SetOpIndex(i);
    const bool replayed = pass.replay && FromCache(inst, op);
    // The recompute stops at the pack that fills the last holder: before the kernel when
    // that is an input's, after it when an output's.
    const bool stop_here = pass.early_stop && i == structure.last_pack_op;
    // An op with a Scalar operand wraps it first: an 8-byte double tensor, converted to
    // the op's dtype (4 B in fp32), freed after the op.
    Ids prelude;
    // mul.Tensor with a wrapped Python number: the wrapped number is its output 1, which
    // MulBackward0 keeps; its conversion dies in the op.
    int wrapped_number = -1;
    if ((op.type == OpType::kAddScalar || op.type == OpType::kMulScalar ||
         op.type == OpType::kDivScalar || op.type == OpType::kMulWrapped) &&
        !replayed) {
      const Memory::Wrapped scalar = memory_.WrapScalar(graph.tensors[op.outputs[0]].dtype);
      if (op.type == OpType::kMulWrapped) {
        wrapped_number = scalar.wrapped;
        prelude = {scalar.converted};
      } else {
        prelude = {scalar.wrapped, scalar.converted};
      }
      // Under a selective checkpoint's dispatch mode the number is wrapped again
      // (StepOptions::python_dispatch_mode).
      if ((pass.record || pass.replay) && options_.python_dispatch_mode) {
        prelude.push_back(
            memory_.HostAlloc(ElementSizeBytes(DType::kFloat64), MemoryCategory::kTemporary));
      }
    }
    // What the op's Python statement or ATen composite makes before its outputs (its
    // row's leading temporaries), alive until it returns.
    const OpSteps& steps = StepsOf(op.type);
    if (steps.leading != nullptr && !replayed) {
      OpCall call = OpCallOf(inst, op);
      steps.leading(call, &prelude);
    }
    if (stop_here && !structure.last_pack_is_output) {
      for (int p : prelude) memory_.Unref(p);
      return unwind();
    }
    // An elementwise op on CPU computes in its inputs' common dtype: an input of another
    // dtype is copied to it first (TensorIterator's promote_inputs_to_common_dtype), and
    // the copy dies after the op. Autocast's bf16 matmul outputs meet fp32 tensors so. The
    // kernel makes it after VariableType has saved the inputs, whose pack hook may have
    // stopped a recompute (above). On CUDA the kernels cast as they load
    // (TensorIterator.cpp, compute_types: the temporaries only `if (common_device ==
    // kCPU)`), and cat copies each input into its slice.
    if ((op.type == OpType::kAdd || op.type == OpType::kMulTensor ||
         op.type == OpType::kDivTensor || op.type == OpType::kSub ||
         op.type == OpType::kKvCacheCat) &&
        !replayed && !memory_.cuda()) {
      const DType common = graph.tensors[op.outputs[0]].dtype;
      for (int in : op.inputs) {
        if (graph.tensors[in].dtype == common) continue;
        prelude.push_back(memory_.Alloc(NumelOf(TensorOf(inst, in).layout) *
                                            ElementSizeBytes(common),
                                        MemoryCategory::kTemporary));
      }
    }
    if (op.type == OpType::kKvCacheCat && !replayed && !window_moved) {
      forward_holds_.emplace_back(
          memory_.Alloc(ElementSizeBytes(DType::kInt64), MemoryCategory::kTemporary),
          inst.segment);
      window_moved = true;
    }
    // CPU dropout makes its noise (output 1) first, scales it in place by a Python
    // number (wrapped, then gone), then the product (the step's order).
    for (int o = 0; o < step.n_outputs; ++o) {
      const SegmentStructure::ForwardStep::Output& made = step.outputs[o];
      const int out = made.tensor;
      if (op.type == OpType::kDropout && o == 1 && !replayed) {
        memory_.ScalarOp(graph.tensors[out].dtype);  // noise.div_(1 - p)
      }
      if (!made.makes) continue;
      const int s = made.storage;
      int id;
      if (replayed) {
        // The op is skipped: its output is popped from the cache (_CachedTorchDispatchMode,
        // storage.pop(0)), the cache's reference now the output's.
        auto entry = inst.cached.find(s);
        id = entry->second;
        inst.cached.erase(entry);
        memory_.Ref(id);
        memory_.Release(id);
      } else if (wrapped_number >= 0 && out == op.outputs[1]) {
        id = wrapped_number;  // made before the op, by the Python binding
      } else {
        id = memory_.Alloc(storages[s].bytes, MemoryCategory::kTemporary);
        if (pass.record && FromCache(inst, op)) {
          memory_.Keep(id);
          inst.cached[s] = id;
        }
      }
      inst.ids[s] = id;
      if (pass.early_stop) local[s] = true;
      // Autocast caches the cast of a leaf that requires grad (autocast_mode.cpp,
      // cached_cast: arg.requires_grad() && arg.is_leaf()): not a frozen weight's. A
      // selective checkpoint's replay under torch's dispatch mode runs the module's
      // forward, so autocast casts a cached call's arguments too (a bias's cast, which
      // nothing saves, stays to the recompute's end); memledger's runtime does not
      // (CallIsReplayed).
      if (config_.amp != DType::kFloat32 && storages[s].is_weight_copy &&
          !inst.plan->graph->tensors[op.inputs[0]].frozen && !replayed &&
          !(pass.replay && !options_.python_dispatch_mode && CallIsReplayed(inst, op))) {
        memory_.Ref(id);
        forward_holds_.emplace_back(id, inst.segment);
      }
      if (op.type == OpType::kKvCacheCat && !replayed) {
        memory_.Ref(id);  // the DynamicCache's reference
        forward_holds_.emplace_back(id, inst.segment);
      }
      for (int k = keeps_of(s); k > 0; --k) memory_.Keep(id);
      if (nodes_hold && structure.node_hold_until[s] >= 0) {
        memory_.Ref(id);
        held_by_nodes.push_back(s);
      }
    }
    // The kernel's workspace, after its outputs.
    if (steps.workspace != nullptr && !replayed) {
      OpCall call = OpCallOf(inst, op);
      steps.workspace(call);
    }
    for (auto it = prelude.rbegin(); it != prelude.rend(); ++it) memory_.Unref(*it);
    if (stop_here) return unwind();
    // Outputs nobody reads die inside the op (SDPA's logsumexp without grad, layer
    // norm's statistics); then, by Python's reference counting, every storage whose last
    // reader this op was (the caller holds the segment's input and output).
    for (int o = 0; o < step.n_outputs; ++o) {
      const SegmentStructure::ForwardStep::Output& made = step.outputs[o];
      if (!made.unread) continue;
      memory_.Unref(inst.ids[made.storage]);
      if (pass.early_stop) local[made.storage] = false;
    }
    for (int s : structure.frees[i]) {
      // The decoder model's locals take it over from the prologue (ForwardPass lets go).
      if (structure.decoder_local[s]) {
        decoder_locals_.push_back(inst.ids[s]);
      } else {
        memory_.Unref(inst.ids[s]);
      }
      if (pass.early_stop) local[s] = false;
    }
    if (nodes_hold) {
      for (int s : structure.node_releases[i]) {
        auto it = std::find(held_by_nodes.begin(), held_by_nodes.end(), s);
        if (it == held_by_nodes.end()) continue;  // not made by this pass
        memory_.Unref(inst.ids[s]);
        held_by_nodes.erase(it);
      }
    }
    if (i == graph.decoder_returns_after && decoder_returns_.has_value()) {
      (*decoder_returns_)();
      decoder_returns_.reset();
    }
  }
  output->storage = inst.ids[structure.output_storage];
  if (structure.decoder_local[structure.output_storage]) {
    memory_.Ref(output->storage);  // the caller's reference, and a decoder local's
    decoder_locals_.push_back(output->storage);
  }
  output->layout = TensorOf(inst, graph.output).layout;
  output->dtype = graph.tensors[graph.output].dtype;
  return absl::OkStatus();
}

absl::Status Simulation::StopRecompute(Instance& inst, const std::vector<bool>& local,
                                       Handle* output) {
  const SegmentPlan& plan = *inst.plan;
  const SegmentStructure& structure = *plan.structure;
  for (size_t s = 0; s < local.size(); ++s) {
    if (local[s]) memory_.Unref(inst.ids[s]);
  }
  for (size_t s = 0; s < local.size(); ++s) {
    const WalkedStorage& storage = plan.walk.storage_list[s];
    if (inst.ids[s] < 0 || storage.is_global || static_cast<int>(s) == structure.input_storage) {
      continue;
    }
    for (int k = structure.unpacked_keeps[s]; k > 0; --k) memory_.Release(inst.ids[s]);
  }
  *output = Handle();
  return absl::OkStatus();
}

}  // namespace memledger::liveness_internal
