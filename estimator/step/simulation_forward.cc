// The step simulation: a segment's forward, as autograd and the checkpoints run it.
#include "estimator/step/simulation.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace memledger::liveness_internal {

FlashSplits FlashSplitsFor(int64_t t) {
  const int64_t q = t >= 768 ? 256 : (t >= 192 ? 64 : 32);
  return FlashSplits{std::min(q, t), std::min<int64_t>(512, t)};
}

// LeadingTemporaries: what an op's Python statement or ATen composite makes before its
// result (profiled: the eager experts' no-grad statements, SDPA's mask conversion), the
// survivors added to `prelude`, which dies after the op. Inlined into Forward, which asks
// for every op: most have none, and a call's entry and exit cost more than the switch.
[[gnu::always_inline]] inline void Simulation::LeadingTemporaries(const OpDef& op,
                                                               const Instance& inst,
                                                               Ids* prelude) {
  switch (op.type) {
    case OpType::kOneHot: {
      // one_hot's aminmax of the indices: two 0-dim int64 tensors, read and freed.
      const int min = memory_.Alloc(8, MemoryCategory::kTemporary);
      const int max = memory_.Alloc(8, MemoryCategory::kTemporary);
      memory_.Unref(min);
      memory_.Unref(max);
      return;
    }
    case OpType::kExpertHits: {
      // expert_mask.sum(dim=(-1, -2)): (E + 1) int64; greater(., 0): the 0 wrapped as an
      // 8-byte tensor, (E + 1) bools; both results die after nonzero.
      const int64_t classes = TensorOf(inst, op.inputs[0]).layout.sizes[0];
      prelude->push_back(memory_.Alloc(classes * 8, MemoryCategory::kTemporary));
      const int zero = memory_.HostAlloc(8, MemoryCategory::kTemporary);
      prelude->push_back(memory_.Alloc(classes, MemoryCategory::kTemporary));
      memory_.Unref(zero);
      return;
    }
    case OpType::kRepeatInterleave: {
      // Repeat.cpp: the repeats' index first (repeat_interleave_common: the repeats'
      // cumsum, freed on return, and the (R) int64 index it fills), then index_select.
      const int64_t repeats = NumelOf(TensorOf(inst, op.inputs[1]).layout);
      const int64_t rows = NumelOf(TensorOf(inst, op.outputs[0]).layout);
      const int cumsum = memory_.Alloc(repeats * 8, MemoryCategory::kTemporary);
      prelude->push_back(memory_.Alloc(rows * 8, MemoryCategory::kTemporary));
      memory_.Unref(cumsum);
      return;
    }
    case OpType::kEqScalar:
      // expert_idx == self.num_experts: the number wrapped as an 8-byte tensor.
      prelude->push_back(memory_.HostAlloc(8, MemoryCategory::kTemporary));
      return;
    case OpType::kSdpaBoolMask: {
      // scalar_tensor(0) and scalar_tensor(-inf) in the query's dtype, before the where.
      const int64_t element = ElementSizeBytes(inst.plan->graph->tensors[op.outputs[0]].dtype);
      prelude->push_back(memory_.Alloc(element, MemoryCategory::kTemporary));
      prelude->push_back(memory_.Alloc(element, MemoryCategory::kTemporary));
      return;
    }
    default:
      return;
  }
}

// ForwardWorkspace: what a forward kernel allocates and frees besides its outputs
// (inlined into Forward as LeadingTemporaries is).
[[gnu::always_inline]] inline absl::Status Simulation::ForwardWorkspace(const OpDef& op,
                                                                      const Instance& inst) {
  // The output's dtype, looked up only by the cases that ask (most ops have none).
  auto dtype = [&] { return inst.plan->graph->tensors[op.outputs[0]].dtype; };
  if (memory_.cuda()) {
    // A CUDA GEMM's cuBLAS workspace, after its output (CublasWorkspace); the CPU
    // kernels' workspaces below are not a CUDA step's, but the tensor-parallel
    // functions' buffers are device tensors there too.
    if (IsGemm(op.type)) CublasWorkspace();
    if (op.type != OpType::kGatherLinear && op.type != OpType::kVocabParallelCrossEntropy) {
      return absl::OkStatus();
    }
  }
  switch (op.type) {
    case OpType::kFlashAttentionMasked:  // the same blocks (profiled with a mask)
    case OpType::kFlashAttention: {
      // cpu_flash_attention: per-thread fp32 blocks of q x kv scores, row max and sum,
      // and the q x d_head output accumulator; a reduced-precision copy of the scores
      // for bf16/fp16 (empty in fp32).
      const Layout& q = TensorOf(inst, op.inputs[0]).layout;  // (B, H, T, d_head)
      const int64_t t = q.sizes[2], head = q.sizes[3];
      const FlashSplits splits = FlashSplitsFor(t);
      const int64_t q_split = splits.q, kv_split = splits.kv;
      const int64_t threads = options_.cpu_threads;
      const int64_t per_thread = q_split * kv_split + 2 * q_split + q_split * head;
      const int buf = memory_.Alloc(threads * per_thread * 4, MemoryCategory::kTemporary);
      const DType out = dtype();
      const int reduced = memory_.Alloc(
          out == DType::kFloat32 ? 0 : threads * q_split * kv_split * ElementSizeBytes(out),
          MemoryCategory::kTemporary);
      memory_.Unref(buf);
      memory_.Unref(reduced);
      return absl::OkStatus();
    }
    case OpType::kSafeSoftmax: {
      // After the softmax: which rows are all -inf (isneginf of the input, a bool per
      // element, then all over the last dim, a bool per row) and a 0-dim zero in the
      // output's dtype, freed before it returns.
      const Layout& x = TensorOf(inst, op.inputs[0]).layout;
      const int64_t numel = NumelOf(x);
      const int neg_inf = memory_.Alloc(numel, MemoryCategory::kTemporary);
      const int rows = memory_.Alloc(numel / x.sizes[x.ndim - 1], MemoryCategory::kTemporary);
      memory_.Transient(ElementSizeBytes(dtype()));
      memory_.Unref(rows);
      memory_.Unref(neg_inf);
      return absl::OkStatus();
    }
    case OpType::kMeanDim: {
      // mean over a dim: sum, then div_ by the count, a wrapped scalar (8 B, then the
      // dtype's size).
      memory_.ScalarOp(dtype());
      return absl::OkStatus();
    }
    case OpType::kMean: {
      // mean of everything: sum (with more than one thread, through an 8-byte partial
      // result), then a division by the element count, a wrapped double scalar (8 B)
      // converted to the tensor's dtype.
      if (options_.cpu_threads > 1) memory_.Transient(8);
      memory_.ScalarOp(dtype());
      return absl::OkStatus();
    }
    case OpType::kSort: {
      // The CPU sort's scratch copy of the values, after both outputs (profiled: values,
      // indices, then a tensor of the input's size, freed before it returns).
      const Layout& x = TensorOf(inst, op.inputs[0]).layout;
      memory_.Transient(NumelOf(x) * ElementSizeBytes(inst.plan->graph->tensors[op.inputs[0]].dtype));
      return absl::OkStatus();
    }
    case OpType::kHistc: {
      // histogram_histc: its bin edges (bins + 1, fp32) and a (bins) fp32 partial
      // histogram next to the output, both freed before it returns (profiled, one thread).
      const int64_t bins = NumelOf(TensorOf(inst, op.outputs[0]).layout);
      const int edges = memory_.Alloc((bins + 1) * 4, MemoryCategory::kTemporary);
      memory_.Transient(bins * 4);
      memory_.Unref(edges);
      return absl::OkStatus();
    }
    case OpType::kCumsum: {
      // cumsum(dtype=int32): the input converted to int32 first, freed after.
      memory_.Transient(NumelOf(TensorOf(inst, op.inputs[0]).layout) * 4);
      return absl::OkStatus();
    }
    case OpType::kInversePermutation: {
      // inv[perm] = torch.arange(len): the arange dies with the statement.
      memory_.Transient(NumelOf(TensorOf(inst, op.inputs[0]).layout) * 8);
      return absl::OkStatus();
    }
    case OpType::kGatherLinear: {
      // The input all-gathered into a (B, T, in) buffer, freed once the matmul is done.
      // On CUDA the matmul's cuBLAS workspace joins it.
      const WalkedTensor& x = TensorOf(inst, op.inputs[0]);
      const int gathered = memory_.Alloc(
          NumelOf(x.layout) * config_.tp *
              ElementSizeBytes(inst.plan->graph->tensors[op.inputs[0]].dtype),
          MemoryCategory::kTemporary);
      CublasWorkspace();
      memory_.Unref(gathered);
      return absl::OkStatus();
    }
    case OpType::kVocabParallelCrossEntropy: {
      // In place on the logits (N, V / tp): their row max (N fp32) all-reduced and
      // subtracted, then the target logits and the rows' sums of exp (N fp32 each),
      // all-reduced, alive until the op returns (its outputs exist by then).
      const int64_t rows_bytes = TensorOf(inst, op.inputs[0]).layout.sizes[0] * 4;
      memory_.Transient(rows_bytes);
      const int target = memory_.Alloc(rows_bytes, MemoryCategory::kTemporary);
      const int sums = memory_.Alloc(rows_bytes, MemoryCategory::kTemporary);
      memory_.Unref(sums);
      memory_.Unref(target);
      return absl::OkStatus();
    }
    default:
      return absl::OkStatus();
  }
}

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
         op.type == OpType::kMulWrapped) &&
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
        prelude.push_back(memory_.HostAlloc(8, MemoryCategory::kTemporary));
      }
    }
    // An elementwise op on CPU computes in its inputs' common dtype: an input of another
    // dtype is copied to it first (TensorIterator's promote_inputs_to_common_dtype), and
    // the copy dies after the op. Autocast's bf16 matmul outputs meet fp32 tensors so.
    // On CUDA the kernels cast as they load (TensorIterator.cpp, compute_types: the
    // temporaries only `if (common_device == kCPU)`), and cat copies each input into
    // its slice.
    if ((op.type == OpType::kAdd || op.type == OpType::kMulTensor ||
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
    // The causal mask is ones(T, T).triu(1): the ones die after triu.
    if (op.type == OpType::kCausalMask) {
      const Layout& mask = TensorOf(inst, op.outputs[0]).layout;
      prelude.push_back(memory_.Alloc(NumelOf(mask), MemoryCategory::kTemporary));
    }
    // The math SDPA's mask: ones(L, S, bool), its tril (the ones die), then
    // where(tril, 0, -inf) with both numbers as 0-dim tensors of the mask's dtype; the
    // tril and the numbers die after the where.
    if (op.type == OpType::kSdpaCausalMask) {
      const Layout& mask = TensorOf(inst, op.outputs[0]).layout;
      const int64_t element = ElementSizeBytes(graph.tensors[op.outputs[0]].dtype);
      const int ones = memory_.Alloc(NumelOf(mask), MemoryCategory::kTemporary);
      prelude.push_back(memory_.Alloc(NumelOf(mask), MemoryCategory::kTemporary));
      memory_.Unref(ones);
      prelude.push_back(memory_.Alloc(element, MemoryCategory::kTemporary));
      prelude.push_back(memory_.Alloc(element, MemoryCategory::kTemporary));
    }
    if (!replayed) LeadingTemporaries(op, inst, &prelude);
    if (stop_here && !structure.last_pack_is_output) {
      for (int p : prelude) memory_.Unref(p);
      return StopRecompute(inst, local, output);
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
      if (config_.amp != DType::kFloat32 && storages[s].is_weight_copy && !replayed &&
          !(pass.replay && CallIsReplayed(inst, op))) {
        memory_.Ref(id);
        forward_holds_.emplace_back(id, inst.segment);
      }
      if (op.type == OpType::kKvCacheCat && !replayed) {
        memory_.Ref(id);  // the DynamicCache's reference
        forward_holds_.emplace_back(id, inst.segment);
      }
      for (int k = keeps_of(s); k > 0; --k) memory_.Keep(id);
    }
    if (!replayed) {
      if (absl::Status s = ForwardWorkspace(op, inst); !s.ok()) return s;
    }
    for (auto it = prelude.rbegin(); it != prelude.rend(); ++it) memory_.Unref(*it);
    if (stop_here) return StopRecompute(inst, local, output);
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
