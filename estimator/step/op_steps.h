// Op steps (internal to estimator/step/liveness): what each op does to memory when the
// step simulation runs it, one row per OpType. A row holds the op's forward temporaries
// (what its Python statement or ATen composite makes before its outputs), its kernel's
// workspace (what it allocates and frees after them) and its backward node's formula
// (the gradients it makes for its inputs and the workspaces between), each citing the
// line it mirrors. What the forward keeps for the backward is the op's keep rule, in
// estimator/graph/rules.cc; the engine's protocol around a node (recompute, release,
// validate_outputs, the input buffers) is Simulation::Node's.
//
// Example (as Simulation::Node runs a node):
//   OpCall call(memory, plan, inst.ids, op, options, config.shard.tp);
//   if (const OpSteps& steps = StepsOf(op.type); steps.backward != nullptr) {
//     steps.backward(call, incoming, grads);  // grads[i]: input i's gradient
//   }
#ifndef ESTIMATOR_STEP_OP_STEPS_H_
#define ESTIMATOR_STEP_OP_STEPS_H_

#include <cstdint>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "estimator/graph/rules.h"
#include "estimator/spec/config.h"
#include "estimator/step/liveness.h"
#include "estimator/step/step_ledger.h"

namespace memledger::liveness_internal {

struct SegmentPlan;

// Ids are a few storages' Memory ids (an op's temporaries, its outputs), kept inline.
using Ids = absl::InlinedVector<int, 8>;

// The gradients a backward formula makes, on the ledger.
//
// NewGrad is a new contiguous tensor of `layout`'s sizes.
inline Handle NewGrad(Memory& memory, const Layout& layout, DType dtype) {
  Handle h;
  h.layout = ContiguousOf(layout);
  h.dtype = dtype;
  h.storage = memory.Alloc(NumelOf(layout) * ElementSizeBytes(dtype), MemoryCategory::kTemporary);
  return h;
}
// NewGradLike is an elementwise backward's result: TensorIterator lays it out like its
// gradient input when that is dense and of the same sizes (a transposed gradient gives
// a transposed result), else contiguous.
inline Handle NewGradLike(Memory& memory, const Handle& like, const Layout& layout, DType dtype) {
  if (!SameSizes(like.layout, layout) || !NonOverlappingAndDense(like.layout)) {
    return NewGrad(memory, layout, dtype);
  }
  Handle h;
  h.layout = like.layout;
  h.dtype = dtype;
  h.storage = memory.Alloc(NumelOf(layout) * ElementSizeBytes(dtype), MemoryCategory::kTemporary);
  return h;
}
// Alias is the same tensor once more (a new reference).
inline Handle Alias(Memory& memory, const Handle& h) {
  memory.Ref(h.storage);
  return h;
}
// ViewOf is a view of `h` with `layout`.
inline Handle ViewOf(Memory& memory, const Handle& h, const Layout& layout) {
  Handle view = Alias(memory, h);
  view.layout = layout;
  view.is_view = true;
  return view;
}

// FlashSplits are the CPU flash kernel's block sizes for a sequence of length t: the q
// block by thresholds on t (256, 64 or 32, at most t), the kv block 512 (at most t).
struct FlashSplits {
  int64_t q = 0;
  int64_t kv = 0;
};
FlashSplits FlashSplitsFor(int64_t t);

// OpCall is one call of an op as its rows see it: the op, its tensors' walked layouts
// and dtypes, the storages' ledger ids, the ledger and the run's options.
class OpCall {
 public:
  OpCall(Memory& memory, const SegmentPlan& plan, const std::vector<int>& ids, const OpDef& op,
         const StepOptions& options, int64_t tp)
      : memory_(memory), plan_(plan), ids_(ids), op_(op), options_(options), tp_(tp) {}

  const OpDef& op() const { return op_; }
  Memory& memory() { return memory_; }
  bool cuda() const { return memory_.cuda(); }
  int64_t cpu_threads() const { return options_.cpu_threads; }
  int64_t tp() const { return tp_; }

  // Input i's and output o's walked layout and dtype; whether input i requires grad.
  const Layout& layout(int input) const;
  DType dtype(int input) const;
  bool needs(int input) const;
  const Layout& output_layout(int output) const;
  DType output_dtype(int output) const;
  // StorageOf: the ledger id of input i's storage (-1: a parameter or not made).
  int StorageOf(int input) const;

  Handle NewGrad(const Layout& layout, DType dtype) {
    return liveness_internal::NewGrad(memory_, layout, dtype);
  }
  Handle NewGradLike(const Handle& like, const Layout& layout, DType dtype) {
    return liveness_internal::NewGradLike(memory_, like, layout, dtype);
  }
  Handle Alias(const Handle& h) { return liveness_internal::Alias(memory_, h); }
  Handle ViewOf(const Handle& h, const Layout& layout) {
    return liveness_internal::ViewOf(memory_, h, layout);
  }
  // Reshape is ATen's reshape of a gradient: a view when the strides allow, else a copy.
  Handle Reshape(const Handle& h, const Layout& target);
  // ScaledPowerGrad is grad * (c * x.pow(e)) as pow's and rsqrt's backward formulas run:
  // the power (a copy even for e = 1), the wrapped scalar c, their product, then the
  // gradient; the two temporaries die after it.
  Handle ScaledPowerGrad(const Layout& layout, DType dtype);
  // Temporary allocates `bytes` that the op frees before it returns (Memory::Unref).
  int Temporary(int64_t bytes) { return memory_.Alloc(bytes, MemoryCategory::kTemporary); }
  // CublasWorkspace: on CUDA, the GEMM's cuBLAS workspace (Memory::CublasWorkspace).
  void CublasWorkspace() { memory_.CublasWorkspace(); }

 private:
  Memory& memory_;
  const SegmentPlan& plan_;
  const std::vector<int>& ids_;
  const OpDef& op_;
  const StepOptions& options_;
  int64_t tp_;
};

// OpSteps is one op's row. A null rule does nothing: the op makes no temporary before
// its outputs, its kernel no workspace; a null backward is an op with no backward node
// modelled (not differentiable, or reached only by a bug).
struct OpSteps {
  // leading: what the op makes before its outputs and frees once it returns, pushed on
  // `prelude` (what dies earlier, it frees itself).
  void (*leading)(OpCall& call, Ids* prelude) = nullptr;
  // workspace: what the kernel allocates and frees after its outputs are made.
  void (*workspace)(OpCall& call) = nullptr;
  // backward: the node's formula for the incoming gradient `grad`: grads[i] for each
  // input i that gets one (at most the op's inputs), and what it allocates and frees
  // between them, in the kernel's order. The engine's steps around it are Node's.
  void (*backward)(OpCall& call, const Handle& grad, Handle* grads) = nullptr;
  // viewed_back, for a view whose backward views the gradient back (view, reshape,
  // permute, transpose, t, unsqueeze): sets `back` to the layout it gives `grad` (the
  // gradient of the output) in the input's sizes, `input`; false where that is a
  // reshape the strides refuse, which copies.
  bool (*viewed_back)(const OpDef& op, const Layout& grad, const Layout& input,
                      Layout* back) = nullptr;
  // forward_inert: the forward gives the op nothing of its own on the CPU or CUDA (no
  // wrapped scalar, promotion copy, mask, temporary or workspace): a view that makes no
  // storage is skipped (SegmentStructure::inert).
  bool forward_inert = false;
};

// StepsOf: `type`'s row.
const OpSteps& StepsOf(OpType type);

// ViewsBack: `type` is a view whose backward views the gradient back (viewed_back).
inline bool ViewsBack(OpType type) { return StepsOf(type).viewed_back != nullptr; }

}  // namespace memledger::liveness_internal

#endif  // ESTIMATOR_STEP_OP_STEPS_H_
