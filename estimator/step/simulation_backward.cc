// The step simulation: a segment's backward nodes, as the autograd engine runs them, and
// the checkpoints' recomputes.
#include "estimator/step/simulation.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"

namespace memledger::liveness_internal {
namespace {

// ViewedBack sets `back` to the layout a view's backward gives `grad` (the gradient of
// its output) in its input's sizes, `input`: the inverse permutation, the transpose, the
// unsqueezed dimension dropped, or grad.reshape(self.sizes()) (a reshape that copied in
// the forward has a CloneBackward0 + UnsafeViewBackward0 pair that ends the same way);
// false where that reshape cannot view and copies. REQUIRES: ViewsBack(op.type).
bool ViewedBack(const OpDef& op, const Layout& grad, const Layout& input, Layout* back) {
  switch (op.type) {
    case OpType::kPermute:
      back->ndim = grad.ndim;
      for (int i = 0; i < grad.ndim; ++i) {
        back->sizes[op.attributes.permutation[i]] = grad.sizes[i];
        back->strides[op.attributes.permutation[i]] = grad.strides[i];
      }
      return true;
    case OpType::kTranspose:
      *back = Transposed(grad, op.attributes.dim, op.attributes.dim1);
      return true;
    case OpType::kT:
      *back = Transposed(grad, 0, 1);
      return true;
    case OpType::kUnsqueeze:
      back->ndim = grad.ndim - 1;
      for (int i = 0, j = 0; i < grad.ndim; ++i) {
        if (i == op.attributes.dim) continue;
        back->sizes[j] = grad.sizes[i];
        back->strides[j++] = grad.strides[i];
      }
      return true;
    default: {  // view, _unsafe_view, reshape
      bool overflow = false;
      return ViewStrides(grad, input.sizes.data(), input.ndim, back, &overflow);
    }
  }
}

}  // namespace

void Simulation::Accumulate(Buffers& buffers, int tensor, const Handle& grad) {
  auto [it, inserted] = buffers.emplace(tensor, grad);
  if (inserted) return;
  Handle& old = it->second;
  // InputBuffer::accumulate: in place when the buffer holds the only reference to a
  // dense tensor (can_accumulate_inplace), else a new sum.
  if (memory_.refs(old.storage) == 1 && !old.is_view && NonOverlappingAndDense(old.layout)) {
    memory_.Unref(grad.storage);
    return;
  }
  Handle sum = NewGradLike(old, old.layout, old.dtype);
  memory_.Unref(old.storage);
  memory_.Unref(grad.storage);
  old = sum;
}

void Simulation::AccumulateGrad(const ParameterKey& parameter, const Layout& layout,
                                const Handle& grad) {
  auto it = grads_.find(parameter);
  if (it != grads_.end()) {
    memory_.Unref(grad.storage);  // .grad += new, in place
    return;
  }
  // AccumulateGrad steals a gradient nobody else holds that has the parameter's layout;
  // otherwise it clones it. A later micro-batch's backward (the shadow pass) adds into
  // the .grad instead, unless ZeRO-3's reduce-scatter freed it with the unit's.
  const bool once = !zero3_;
  if (memory_.refs(grad.storage) == 1 && SameLayout(grad.layout, layout)) {
    memory_.MakeGradient(grad.storage, once);
    grads_.emplace(parameter, grad.storage);
    return;
  }
  const int64_t bytes = NumelOf(layout) * ElementSizeBytes(grad.dtype);
  const int clone = once ? memory_.AllocOnce(bytes, MemoryCategory::kGradient)
                         : memory_.Alloc(bytes, MemoryCategory::kGradient);
  memory_.Unref(grad.storage);
  grads_.emplace(parameter, clone);
}

void Simulation::Route(Instance& inst, int tensor, const Handle& grad, Buffers& buffers,
                       bool capture_parameters) {
  tensor = RoutedTensor(inst, tensor);
  const TensorDef& def = inst.plan->graph->tensors[tensor];
  if (def.is_parameter && !capture_parameters) {
    const ParameterKey key = KeyOf(inst, tensor);
    Handle ready = grad;  // a tied weight's: the sum of both uses'
    if (!TiedGradientReady(key, def.is_tied, &ready)) return;
    AccumulateGrad(key, TensorOf(inst, tensor).layout, ready);
    return;
  }
  Accumulate(buffers, tensor, grad);
}

// Node runs op `op_index`'s backward node (one of SegmentStructure::backward_steps,
// which Backward visits) as Engine::evaluate_function does: the formula's outputs and
// workspaces, then validate_outputs (sum_to a broadcast input's shape), then the incoming
// gradients die, then the saved tensors are released, then each output goes to its
// input's buffer (or .grad).
absl::Status Simulation::Node(Instance& inst, int op_index, const char* node,
                              Buffers::iterator found, Buffers& buffers,
                              bool capture_parameters) {
  const SegmentPlan& plan = *inst.plan;
  const SegmentStructure& structure = *plan.structure;
  const OpDef& op = plan.graph->ops[op_index];
  const Handle grad = found->second;
  buffers.erase(found);
  memory_.SetOp(At(inst, op_index, node));
  // Under a non-reentrant checkpoint the first node to unpack a saved tensor runs the
  // recompute (checkpoint.py, _checkpoint_hook's unpack_hook).
  if (inst.frame.has_value() && !inst.frame->recomputed && structure.packs[op_index]) {
    if (absl::Status s = Recompute(inst); !s.ok()) return s;
    memory_.SetOp(At(inst, op_index, node));
  }

  auto needs = [&](int input) { return TensorOf(inst, op.inputs[input]).requires_grad; };
  auto layout_of = [&](int input) -> const Layout& {
    return TensorOf(inst, op.inputs[input]).layout;
  };
  auto dtype_of = [&](int input) { return plan.graph->tensors[op.inputs[input]].dtype; };
  // One gradient per input (an op has at most four, MakePlan checks): only as many made.
  const size_t n_inputs = op.inputs.size();
  absl::InlinedVector<Handle, 4> grad_slots(n_inputs);
  Handle* const grads = grad_slots.data();

  switch (op.type) {
    case OpType::kSelect:
      // select_backward: zeros of the input's sizes, the gradient copied into a slice.
      grads[0] = NewGrad(layout_of(0), grad.dtype);
      break;
    case OpType::kAdd:
      // grad to both inputs (the same tensor); validate_outputs reduces a broadcast one.
      if (needs(0)) grads[0] = Alias(grad);
      if (needs(1)) grads[1] = Alias(grad);
      break;
    case OpType::kAddmm: {
      // (bias, mat1, mat2): mm_mat1_backward = grad.mm(mat2^T) (contiguous);
      // mm_mat2_backward = mat1^T.mm(grad), laid out like mat2 when mat2 is a
      // transposed contiguous weight; bias: grad itself, summed by validate_outputs.
      if (needs(1)) {
        grads[1] = NewGrad(layout_of(1), grad.dtype);
        CublasWorkspace();
      }
      if (needs(2)) {
        grads[2] = NewGrad(layout_of(2), grad.dtype);
        if (!layout_of(2).IsContiguous()) grads[2].layout = layout_of(2);
        CublasWorkspace();
      }
      if (needs(0)) grads[0] = Alias(grad);
      break;
    }
    case OpType::kMm:
      // MmBackward0 computes mat2's gradient (the weight's, laid out like it) first.
      if (needs(1)) {
        grads[1] = NewGrad(layout_of(1), grad.dtype);
        if (!layout_of(1).IsContiguous()) grads[1].layout = layout_of(1);
        CublasWorkspace();
      }
      if (needs(0)) {
        grads[0] = NewGrad(layout_of(0), grad.dtype);
        CublasWorkspace();
      }
      break;
    case OpType::kMulTensor: {
      // MulBackward0 computes other's gradient, grad * self, then self's, grad * other
      // (profiled: the copy promoting a bf16 self for other's product is freed before
      // self's product is made), each in the broadcast shape; validate_outputs then casts
      // and reduces them input by input.
      // Each product is in grad's and the other factor's common dtype; a factor of
      // another dtype is copied to it first (TensorIterator's input promotion).
      auto product = [&](int factor) {
        const DType common = PromoteTypes(grad.dtype, dtype_of(factor));
        std::optional<int> promoted;
        if (dtype_of(factor) != common && !memory_.cuda()) {  // CPU's promotion only
          promoted = memory_.Alloc(NumelOf(layout_of(factor)) * ElementSizeBytes(common),
                                   MemoryCategory::kTemporary);
        }
        Handle h = NewGradLike(grad, grad.layout, common);
        if (promoted) memory_.Unref(*promoted);
        return h;
      };
      if (needs(1)) grads[1] = product(0);
      if (needs(0)) grads[0] = product(1);
      break;
    }
    case OpType::kAddScalar:
    case OpType::kContiguous:
    case OpType::kKvCacheCat:
      // grad itself (clone's backward too; cat's narrow of it all, which validate_outputs
      // casts to a promoted input's dtype)
      grads[0] = Alias(grad);
      break;
    case OpType::kToDtype:
      // .to() of the same dtype is the tensor itself; else the gradient is cast back.
      grads[0] = dtype_of(0) == grad.dtype ? Alias(grad) : NewGrad(layout_of(0), dtype_of(0));
      break;
    case OpType::kPow:    // pow_backward(grad, self, 2) = grad * (2 * self.pow(1))
    case OpType::kRsqrt:  // -0.5 * grad * result.pow(3)
      grads[0] = ScaledPowerGrad(layout_of(0), grad.dtype);
      break;
    case OpType::kMean:
    case OpType::kMeanDim: {
      // grad.expand(self's sizes) / count, the wrapped count (8 B, then the dtype's).
      const Memory::Wrapped scalar = memory_.WrapScalar(grad.dtype);
      grads[0] = NewGrad(layout_of(0), grad.dtype);
      memory_.Drop(scalar);
      break;
    }
    case OpType::kGelu:
    case OpType::kSilu:
    case OpType::kNeg:
    case OpType::kLogSoftmax:
    case OpType::kTanh:  // tanh_backward(grad, result)
      grads[0] = NewGradLike(grad, layout_of(0), grad.dtype);
      break;
    case OpType::kMulWrapped: {
      // grad * other: the kept wrapped number, converted to grad's dtype for the op.
      const int converted =
          memory_.HostAlloc(ElementSizeBytes(grad.dtype), MemoryCategory::kTemporary);
      grads[0] = NewGradLike(grad, layout_of(0), grad.dtype);
      memory_.Unref(converted);
      break;
    }
    case OpType::kSlice:
      // slice_backward: zeros of the input's sizes, the gradient copied into a slice.
      grads[0] = NewGrad(layout_of(0), grad.dtype);
      break;
    case OpType::kCat: {
      // cat_tensors_backward: each input's gradient is a narrow view of grad.
      const int dim = layout_of(0).ndim - 1;
      for (int i = 0; i < 2; ++i) {
        Layout part = grad.layout;
        part.sizes[dim] = layout_of(i).sizes[dim];
        if (needs(i)) grads[i] = ViewOf(grad, part);
      }
      break;
    }
    case OpType::kExpand:
      // at::sum_to(grad, self.sizes()): a reduction when a dimension was broadcast.
      grads[0] = SameSizes(grad.layout, layout_of(0)) ? Alias(grad)
                                                       : NewGrad(layout_of(0), grad.dtype);
      break;
    case OpType::kBmm:
      // BmmBackward0: mat2's gradient self^T.bmm(grad) first, then self's.
      if (needs(1)) {
        grads[1] = NewGrad(layout_of(1), grad.dtype);
        CublasWorkspace();
      }
      if (needs(0)) {
        grads[0] = NewGrad(layout_of(0), grad.dtype);
        CublasWorkspace();
      }
      break;
    case OpType::kMulScalar: {
      // grad * scalar: the wrapped scalar (8 B, then the dtype's) around the product.
      const Memory::Wrapped scalar = memory_.WrapScalar(grad.dtype);
      grads[0] = NewGradLike(grad, layout_of(0), grad.dtype);
      memory_.Drop(scalar);
      break;
    }
    case OpType::kMaskedFill:
    case OpType::kMaskedFillInplace:
    case OpType::kSoftmax:
      grads[0] = NewGradLike(grad, layout_of(0), grad.dtype);
      break;
    case OpType::kFusedCausalSoftmax:
      // In place on the incoming gradient (Megatron's fused kernel).
      grads[0] = Alias(grad);
      break;
    case OpType::kNativeDropout:
      // native_dropout_backward: grad * mask * scale, one new tensor (runtime/dropout.h).
    case OpType::kDropout:
      // MulBackward0: grad * noise, one new tensor.
    case OpType::kSafeSoftmax:
      // _softmax_backward_data(grad, result, dim), as softmax's.
      grads[0] = NewGradLike(grad, layout_of(0), grad.dtype);
      break;
    case OpType::kNllLoss:
      // nll_loss_backward: zeros of the log-probabilities' sizes, scattered.
      grads[0] = NewGrad(layout_of(0), grad.dtype);
      break;
    case OpType::kEmbedding:
      // embedding_dense_backward: the whole weight's gradient.
      grads[0] = NewGrad(layout_of(0), dtype_of(0));
      break;
    case OpType::kScatter:
    case OpType::kReduceScatter:
      // The gradient all-gathered along the sequence: a new (B, T, ...) buffer.
      grads[0] = NewGrad(layout_of(0), grad.dtype);
      break;
    case OpType::kGatherLinear: {
      // Megatron's order: the input gathered again, the incoming gradient as rows
      // (B x T, out), the input's whole gradient (B x T, in), all-reduced in place and
      // this rank's tokens copied out; the weight's gradient (its own layout) and the
      // bias's; then the gathered input, the rows and the whole gradient die.
      const int64_t in = layout_of(0).sizes[layout_of(0).ndim - 1];
      const int64_t tokens = NumelOf(grad.layout) / grad.layout.sizes[grad.layout.ndim - 1];
      const int gathered = memory_.Alloc(
          NumelOf(layout_of(0)) * config_.tp * ElementSizeBytes(dtype_of(0)),
          MemoryCategory::kTemporary);
      bool overflow = false;
      const int64_t rows_sizes[] = {tokens, grad.layout.sizes[grad.layout.ndim - 1]};
      const Handle rows = Reshape(grad, Layout::Contiguous(rows_sizes, 2, &overflow));
      const int whole = memory_.Alloc(tokens * in * ElementSizeBytes(grad.dtype),
                                      MemoryCategory::kTemporary);
      CublasWorkspace();  // on CUDA, the input gradient's matmul
      for (size_t i = 0; i < n_inputs; ++i) {
        grads[i] = NewGrad(layout_of(static_cast<int>(i)), grad.dtype);
        if (i == 1) CublasWorkspace();  // and the weight gradient's
      }
      memory_.Unref(gathered);
      memory_.Unref(rows.storage);
      memory_.Unref(whole);
      // A gradient whose input needs none is computed all the same and dropped.
      for (size_t i = 0; i < n_inputs; ++i) {
        if (!needs(static_cast<int>(i))) {
          memory_.Unref(grads[i].storage);
          grads[i] = Handle();
        }
      }
      break;
    }
    case OpType::kVocabParallelEmbedding: {
      // Other ranks' tokens' rows zeroed in a copy of the gradient, then
      // embedding_dense_backward: the weight rows' gradient; the copy dies with the node.
      const int masked =
          memory_.Alloc(NumelOf(grad.layout) * ElementSizeBytes(grad.dtype), MemoryCategory::kTemporary);
      grads[0] = NewGrad(layout_of(0), dtype_of(0));
      memory_.Unref(masked);
      break;
    }
    case OpType::kVocabParallelCrossEntropy: {
      // In place: the kept softmax becomes the logits' gradient.
      grads[0].storage = inst.ids[TensorOf(inst, op.inputs[0]).storage];
      grads[0].layout = layout_of(0);
      grads[0].dtype = dtype_of(0);
      memory_.Ref(grads[0].storage);
      break;
    }
    case OpType::kNativeLayerNorm: {
      // native_layer_norm_backward: dX, dgamma, dbeta, then the CPU kernel's
      // per-thread fp32 partial sums of dgamma and dbeta (a (threads, 2N) buffer).
      if (needs(0)) grads[0] = NewGrad(layout_of(0), grad.dtype);
      if (needs(1)) grads[1] = NewGrad(layout_of(1), dtype_of(1));
      if (needs(2)) grads[2] = NewGrad(layout_of(2), dtype_of(2));
      // Its (2, threads, N) zero-filled buffer in X's dtype, only for dgamma or dbeta.
      const int64_t n = NumelOf(layout_of(1));
      if ((needs(1) || needs(2)) && !memory_.cuda()) {
        memory_.Transient(options_.cpu_threads * 2 * n * ElementSizeBytes(dtype_of(0)));
      }
      break;
    }
    case OpType::kCudaFlashAttention:
    case OpType::kEfficientAttentionMasked:  // the bias needs no gradient: the same
    case OpType::kEfficientAttention: {
      // Both start alike (attention_backward.cu, _flash_attention_backward and
      // _efficient_attention_backward): grad_out.contiguous() in (B, T, H, d) memory, a
      // copy unless it is so already; the gradients of q, k, v empty_like their
      // (B, T, H, d) inputs (flash_api.cpp:954-972); for grouped-query heads k's and v's
      // expanded to the query's heads, summed back after the kernel (flash_api.cpp:
      // 1000-1001, 1057-1058). Then their own buffers. All but the gradients die as the
      // node returns.
      const Layout& q = layout_of(0);  // (B, H, T, d)
      const int64_t b = q.sizes[0], h = q.sizes[1], t = q.sizes[2], d = q.sizes[3];
      std::optional<int> grad_out_copy;
      if (!Transposed(grad.layout, 1, 2).IsContiguous()) {
        grad_out_copy = memory_.Alloc(NumelOf(grad.layout) * ElementSizeBytes(grad.dtype),
                                      MemoryCategory::kTemporary);
      }
      for (int i = 0; i < 3; ++i) {
        grads[i] = NewGrad(Transposed(layout_of(i), 1, 2), dtype_of(i));
        grads[i].layout = Transposed(grads[i].layout, 1, 2);
      }
      std::vector<int> temps;
      if (op.type == OpType::kCudaFlashAttention) {
        // mha_bwd: softmax_d (B, H, T rounded to 128) fp32 (:984), dq_accum (B, T rounded
        // to 128, H, d rounded to 32, or 64 above 128) fp32 (:989).
        const int64_t t128 = (t + 127) / 128 * 128;
        const int64_t rounding = d <= 128 ? 32 : 64;
        const int64_t d_rounded = (d + rounding - 1) / rounding * rounding;
        temps.push_back(memory_.Alloc(b * h * t128 * 4, MemoryCategory::kTemporary));
        temps.push_back(memory_.Alloc(b * t128 * h * d_rounded * 4, MemoryCategory::kTemporary));
      }
      if (layout_of(1).sizes[1] != h) {
        for (int i = 1; i < 3; ++i) {
          temps.push_back(memory_.Alloc(b * t * h * layout_of(i).sizes[3] *
                                            ElementSizeBytes(dtype_of(i)),
                                        MemoryCategory::kTemporary));
        }
      }
      if (op.type != OpType::kCudaFlashAttention) {
        // delta: (B, H, T) fp32 for fp16/bf16 (kernel_backward.h, kKernelComputesDelta);
        // for fp32 (grad_out * out).sum(-1).transpose(-2, -1).contiguous(): the product,
        // the sum, the copy. Not modelled: its fp32 staging workspace (workspace_size())
        // and shared_storage_dqdkdv's single chunk.
        if (grad.dtype == DType::kFloat32) {
          const int product =
              memory_.Alloc(NumelOf(grad.layout) * 4, MemoryCategory::kTemporary);
          const int sum = memory_.Alloc(b * h * t * 4, MemoryCategory::kTemporary);
          temps.push_back(memory_.Alloc(b * h * t * 4, MemoryCategory::kTemporary));
          memory_.Unref(sum);
          memory_.Unref(product);
        } else {
          temps.push_back(memory_.Alloc(b * h * t * 4, MemoryCategory::kTemporary));
        }
      }
      for (auto it = temps.rbegin(); it != temps.rend(); ++it) memory_.Unref(*it);
      if (grad_out_copy) memory_.Unref(*grad_out_copy);
      break;
    }
    case OpType::kCudnnAttention: {
      // _cudnn_attention_backward (attention_backward.cu): dq, dk, dv empty_like q, k, v,
      // then run_cudnn_SDP_bprop. Not modelled: cuDNN's own workspace (MHA.cpp).
      for (int i = 0; i < 3; ++i) {
        grads[i] = NewGrad(layout_of(i), dtype_of(i));
        if (NonOverlappingAndDense(layout_of(i))) grads[i].layout = layout_of(i);
      }
      break;
    }
    case OpType::kFlashAttentionMasked:  // the same buffers (profiled with a mask)
    case OpType::kFlashAttention: {
      // _scaled_dot_product_flash_attention_for_cpu_backward: grad_q, grad_k, grad_v,
      // then per-thread fp32 blocks of scores and their gradients (and a
      // reduced-precision copy), and each thread's row sums in the parallel loop.
      // grad_q/k/v are zeros in (B, T, H, d_head) memory, returned as (B, H, T, d_head)
      // views; the kernel reads grad_out.transpose(1, 2).contiguous() (a copy unless
      // grad_out already has that memory order).
      const Layout& q = layout_of(0);
      for (int i = 0; i < 3; ++i) {
        grads[i] = NewGrad(Transposed(layout_of(i), 1, 2), dtype_of(i));
        grads[i].layout = Transposed(grads[i].layout, 1, 2);
      }
      std::optional<int> grad_out_copy;
      if (!Transposed(grad.layout, 1, 2).IsContiguous()) {
        grad_out_copy = memory_.Alloc(NumelOf(grad.layout) * ElementSizeBytes(grad.dtype),
                                      MemoryCategory::kTemporary);
      }
      const int64_t t = q.sizes[2];
      const FlashSplits splits = FlashSplitsFor(t);
      const int64_t q_split = splits.q, kv_split = splits.kv;
      const int64_t threads = options_.cpu_threads;
      const DType dtype = dtype_of(0);
      const int buf = memory_.Alloc(threads * 2 * q_split * kv_split * 4,
                                    MemoryCategory::kTemporary);
      const int reduced = memory_.Alloc(
          dtype == DType::kFloat32 ? 0 : threads * 2 * q_split * kv_split * ElementSizeBytes(dtype),
          MemoryCategory::kTemporary);
      // parallel_for over B * H rows in one chunk per thread; each chunk allocates its
      // fp32 row sums (q_split).
      std::vector<int> rows;
      const int64_t chunks = std::min<int64_t>(threads, q.sizes[0] * q.sizes[1]);
      for (int64_t i = 0; i < chunks; ++i) {
        rows.push_back(memory_.Alloc(q_split * 4, MemoryCategory::kTemporary));
      }
      for (int row : rows) memory_.Unref(row);
      memory_.Unref(buf);
      memory_.Unref(reduced);
      if (grad_out_copy) memory_.Unref(*grad_out_copy);
      break;
    }
    case OpType::kAllToAll:
      // all_to_all_single_backward: the reverse all-to-all of grad_output.contiguous()
      // into a new tensor of the input's rows (the gradient arrives contiguous).
      grads[0] = NewGrad(layout_of(0), grad.dtype);
      break;
    case OpType::kIndexPutInplace:
      // IndexPutBackward0: values: grad.index(indices), (S, d); self (when it needs a
      // gradient): grad.index_put(indices, zeros_like(values)), a copy of grad.
      if (needs(2)) grads[2] = NewGrad(layout_of(2), grad.dtype);
      if (needs(0)) {
        const int zeros = memory_.Alloc(NumelOf(layout_of(2)) * ElementSizeBytes(grad.dtype),
                                        MemoryCategory::kTemporary);
        grads[0] = NewGrad(grad.layout, grad.dtype);
        memory_.Unref(zeros);
      }
      break;
    case OpType::kIndexAddInplace:
      // self: grad itself; source: grad.index_select(0, index), (n, d).
      if (needs(0)) grads[0] = Alias(grad);
      if (needs(2)) grads[2] = NewGrad(layout_of(2), grad.dtype);
      break;
    case OpType::kTopK:
      // value_selecting_reduction_backward: zeros of the input's sizes, the gradient
      // scattered into them in place (profiled: one allocation).
    case OpType::kIndexRows:
    case OpType::kIndexPair:
      // index_backward: grad.new_zeros(self.sizes()), then _index_put_impl_ in place.
      grads[0] = NewGrad(layout_of(0), grad.dtype);
      break;
    case OpType::kSumDim: {
      // sum_backward: grad (unsqueezed without keepdim) expanded to the input's sizes,
      // a view with stride 0 along the summed dimension.
      const int dim = op.attributes.dim;
      Layout expanded;
      expanded.ndim = layout_of(0).ndim;
      for (int i = 0, j = 0; i < expanded.ndim; ++i) {
        expanded.sizes[i] = layout_of(0).sizes[i];
        if (i == dim) {
          expanded.strides[i] = 0;
          if (op.attributes.keepdim) ++j;
        } else {
          expanded.strides[i] = grad.layout.strides[j++];
        }
      }
      grads[0] = ViewOf(grad, expanded);
      break;
    }
    case OpType::kDivInplace: {
      // DivBackward0 computes other's gradient first, -grad * ((self / other) / other)
      // (FunctionsManual.cpp, div_tensor_other_backward): four tensors of the broadcast
      // shape, three of them temporaries of the expression; then self's, grad / other.
      // validate_outputs then reduces other's to its (N, 1) shape.
      const int64_t bytes = NumelOf(grad.layout) * ElementSizeBytes(grad.dtype);
      std::array<int, 3> temps{};
      if (needs(1)) {
        for (int& t : temps) t = memory_.Alloc(bytes, MemoryCategory::kTemporary);
        grads[1] = NewGradLike(grad, grad.layout, grad.dtype);
        for (int t : temps) memory_.Unref(t);
      }
      if (needs(0)) grads[0] = NewGradLike(grad, grad.layout, grad.dtype);
      break;
    }
    case OpType::kGroupedMm:
      // GroupedMmBackward0, mat2's gradient first (like mat2: a transposed view of the
      // expert weights, as _grouped_mm_mat2_backward transposes its result), then self's.
      if (needs(1)) {
        grads[1] = NewGrad(layout_of(1), grad.dtype);
        if (!layout_of(1).IsContiguous()) grads[1].layout = layout_of(1);
      }
      if (needs(0)) grads[0] = NewGrad(layout_of(0), grad.dtype);
      break;
    default: {
      if (!ViewsBack(op.type)) {
        return Unimplemented(absl::StrCat("the backward of ", OpTypeName(op.type)));
      }
      // A view's (ViewNode's, where the node packs or releases).
      Layout back;
      grads[0] = ViewedBack(op, grad.layout, layout_of(0), &back)
                     ? ViewOf(grad, back)
                     : NewGrad(layout_of(0), grad.dtype);
      break;
    }
  }

  // An unpacked tensor is the formula's local: with the frame's holder emptied on
  // unpack (holder.handles[gid] = None), it dies as the node's apply() returns.
  if (inst.frame.has_value()) {
    for (int s : structure.packed_releases[op_index]) {
      if (inst.ids[s] >= 0) memory_.Release(inst.ids[s]);
    }
  }
  // validate_outputs: a gradient whose shape differs from its input's (a broadcast
  // bias) is reduced with sum_to; one whose dtype differs (autocast's bf16 matmul output
  // met an fp32 tensor) is cast to the input's.
  for (size_t i = 0; i < n_inputs; ++i) {
    if (!grads[i].defined()) continue;
    if (!SameSizes(grads[i].layout, layout_of(i))) {
      Handle reduced = NewGrad(layout_of(i), grads[i].dtype);
      memory_.Unref(grads[i].storage);
      grads[i] = reduced;
    }
    if (grads[i].dtype != dtype_of(i)) {
      Handle cast = NewGradLike(grads[i], grads[i].layout, dtype_of(i));
      memory_.Unref(grads[i].storage);
      grads[i] = cast;
    }
  }
  memory_.Unref(grad.storage);  // the incoming gradient, unless someone else holds it
  // release_variables(), in Functions.h's order; under a non-reentrant checkpoint only
  // what the node held itself, since the forward (and the frame, with its last hook).
  if (inst.frame.has_value()) {
    for (int s : structure.unpacked_releases[op_index]) {
      if (inst.frame->forward_ids[s] >= 0) memory_.Release(inst.frame->forward_ids[s]);
    }
    if (op_index == structure.first_pack_op) FrameDies(inst);
  } else {
    for (int s : structure.releases[op_index]) {
      if (inst.ids[s] >= 0) memory_.Release(inst.ids[s]);
    }
  }
  for (size_t i = 0; i < n_inputs; ++i) {
    if (grads[i].defined()) Route(inst, op.inputs[i], grads[i], buffers, capture_parameters);
  }
  return absl::OkStatus();
}

// ViewNode runs a view's node as Node would, for less: no recompute, release or frame
// event can come between its steps (the view packs and releases nothing). The input's
// gradient is the incoming one viewed back (a reshape the strides refuse copies it), so
// the view takes over the incoming gradient's reference: Node's Ref of it (ViewOf) and
// its Unref once the node is done cancel. validate_outputs then reduces or casts it as
// Node does. Where the input's gradient starts a buffer entry, the output's entry is
// reused for it (Buffers keeps no order).
void Simulation::ViewNode(Instance& inst, const OpDef& op, int op_index, const char* node,
                          Buffers::iterator found, Buffers& buffers, bool capture_parameters) {
  memory_.SetOp(At(inst, op_index, node));
  // The incoming gradient's entry, viewed back in place where it can be.
  Handle& entry = found->second;
  const Layout& input = TensorOf(inst, op.inputs[0]).layout;
  const DType dtype = inst.plan->graph->tensors[op.inputs[0]].dtype;
  bool viewed = true;
  if (op.type == OpType::kT || op.type == OpType::kTranspose) {
    const int d0 = op.type == OpType::kT ? 0 : op.attributes.dim;
    const int d1 = op.type == OpType::kT ? 1 : op.attributes.dim1;
    std::swap(entry.layout.sizes[d0], entry.layout.sizes[d1]);
    std::swap(entry.layout.strides[d0], entry.layout.strides[d1]);
  } else {
    Layout back;
    viewed = ViewedBack(op, entry.layout, input, &back);
    if (viewed) entry.layout = back;
  }
  if (viewed) entry.is_view = true;
  if (!viewed || !SameSizes(entry.layout, input) || entry.dtype != dtype) {
    // A copy, a reduction or a cast: as Node makes them, in its order.
    const Handle grad = entry;  // its storage and dtype as they came
    // borrowed: `entry` is the view, holding grad's storage without a reference of its
    // own (Node's ViewOf would have added one).
    bool borrowed = viewed;
    if (!viewed) entry = NewGrad(input, grad.dtype);
    auto replace = [&](const Handle& by) {
      if (!borrowed) memory_.Unref(entry.storage);
      borrowed = false;
      entry = by;
    };
    if (!SameSizes(entry.layout, input)) replace(NewGrad(input, entry.dtype));
    if (entry.dtype != dtype) replace(NewGradLike(entry, entry.layout, dtype));
    if (!borrowed) memory_.Unref(grad.storage);  // the incoming gradient
  }
  // As Route, but the entry reused where the input starts one.
  const int tensor = RoutedTensor(inst, op.inputs[0]);
  const bool parameter = inst.plan->graph->tensors[tensor].is_parameter && !capture_parameters;
  if (!parameter && buffers.find(tensor) == buffers.end()) {
    found->first = tensor;
    return;
  }
  const Handle out = entry;
  buffers.erase(found);
  Route(inst, tensor, out, buffers, capture_parameters);
}

// SplitBackward is split()'s one node for all its parts. It runs once every part's
// gradient has arrived: at the first part, the last one the backward reaches (the
// others' gradients wait in their buffers). split_backward concatenates them, zeros for
// a part without one, into the input's gradient; then the parts' gradients die.
absl::Status Simulation::SplitBackward(Instance& inst, int op_index, Buffers& buffers,
                                       bool capture_parameters) {
  const SegmentPlan& plan = *inst.plan;
  const SegmentStructure& structure = *plan.structure;
  const BlockGraph& graph = *plan.graph;
  const OpDef& op = graph.ops[op_index];
  // The node runs once, at the first part (the last the backward reaches).
  if (structure.split_first[op_index] != op_index) return absl::OkStatus();
  std::vector<Handle> incoming;
  std::vector<const OpDef*> missing;  // parts no gradient reached
  for (int p : structure.split_parts[op_index]) {
    const OpDef* part = &graph.ops[p];
    if (auto it = buffers.find(part->outputs[0]); it != buffers.end()) {
      incoming.push_back(it->second);
      buffers.erase(it);
    } else {
      missing.push_back(part);
    }
  }
  if (incoming.empty()) return absl::OkStatus();  // no gradient reached the split
  memory_.SetOp(At(inst, op_index, "SplitBackward0"));
  const DType dtype = incoming.front().dtype;
  std::vector<int> zeros;
  for (const OpDef* part : missing) {
    zeros.push_back(memory_.Alloc(
        NumelOf(TensorOf(inst, part->outputs[0]).layout) * ElementSizeBytes(dtype),
        MemoryCategory::kTemporary));
  }
  Handle grad = NewGrad(TensorOf(inst, op.inputs[0]).layout, dtype);
  for (int z : zeros) memory_.Unref(z);
  for (const Handle& h : incoming) memory_.Unref(h.storage);
  Route(inst, op.inputs[0], grad, buffers, capture_parameters);
  return absl::OkStatus();
}

absl::Status Simulation::Backward(Instance& inst, Buffers& buffers, bool capture_parameters) {
  using Kind = SegmentStructure::BackwardStep::Kind;
  for (const SegmentStructure::BackwardStep& step : inst.plan->structure->backward_steps) {
    if (step.kind == Kind::kSplit) {
      if (absl::Status s = SplitBackward(inst, step.op, buffers, capture_parameters);
          !s.ok()) {
        return s;
      }
      continue;
    }
    // The node runs once a gradient reached its output; a view's on its short path.
    auto found = buffers.find(step.output);
    if (found == buffers.end()) continue;
    if (step.kind == Kind::kView) {
      ViewNode(inst, inst.plan->graph->ops[step.op], step.op, step.node, found, buffers,
               capture_parameters);
    } else if (absl::Status s =
                   Node(inst, step.op, step.node, found, buffers, capture_parameters);
               !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

// CheckpointBackward is the reentrant checkpoint's node of a layer (CheckpointFunction,
// checkpoint.py:241-330; runtime/checkpoint.cc): recompute the whole layer with grad on a
// detached input, then torch.autograd.backward over it with the incoming gradient,
// capturing the input's and the parameters' gradients, which the node returns to the
// outer engine.
absl::Status Simulation::CheckpointBackward(Instance& inst, int saved_input, Handle incoming,
                                            Buffers& outer) {
  const SegmentPlan& plan = *inst.plan;
  const BlockGraph& graph = *plan.graph;
  memory_.SetOp(Special(inst.segment, Where::Activity::kCheckpointNode));
  // get_saved_variables() and x.detach(): two more references to the input.
  Handle x;
  x.storage = saved_input;
  x.layout = TensorOf(inst, graph.input).layout;
  x.dtype = graph.tensors[graph.input].dtype;
  memory_.Ref(saved_input);
  memory_.Ref(saved_input);
  Handle y;
  inst.recompute = true;
  Pass pass;
  pass.replay = !variant_.PolicyAt(inst.segment).empty();
  // torch.random.fork_rng keeps the current RNG state while the recompute runs on the
  // forward's (checkpoint.py:303-308).
  const int forked = memory_.HostAlloc(kCpuRngStateBytes, MemoryCategory::kTemporary);
  if (absl::Status s = Forward(inst, &x, pass, &y); !s.ok()) return s;
  ReleaseForwardHolds(/*forward_end=*/false);  // the recompute's autocast scope ends
  memory_.SetOp(Special(inst.segment, Where::Activity::kCheckpointNode));
  memory_.Unref(forked);
  // autograd::grad: the graph root holds the incoming gradient, and so does y's buffer.
  memory_.Ref(incoming.storage);
  Buffers inner;
  inner.emplace(graph.output, Alias(incoming));
  if (absl::Status s = Backward(inst, inner, /*capture_parameters=*/true); !s.ok()) return s;
  inst.recompute = false;
  memory_.SetOp(Special(inst.segment, Where::Activity::kCheckpointNode));
  memory_.Unref(incoming.storage);  // the root
  for (const auto& [storage, id] : inst.cached) memory_.Release(id);  // cache->Clear()
  inst.cached.clear();
  // The node's locals die as its backward returns: y, the detached input, the saved list.
  memory_.Unref(y.storage);
  memory_.Unref(saved_input);
  memory_.Unref(saved_input);
  // Then the outer engine: the incoming gradient dies, the saved input is released, and
  // the captured gradients are routed (the input's, then every parameter's).
  memory_.Unref(incoming.storage);
  memory_.Release(saved_input);
  // CheckpointFunction keeps its RNG state and run_function (the call's bound
  // arguments) on its ctx, which lives as long as the graph: until the loss dies, after
  // the step (checkpoint.py:241-252).
  auto input_grad = inner.find(graph.input);
  if (input_grad != inner.end()) {
    Accumulate(outer, kLayerInputKey, input_grad->second);
    inner.erase(input_grad);
  }
  for (const auto& [tensor, grad] : inner.ByTensor()) {
    const TensorDef& def = graph.tensors[tensor];
    if (!def.is_parameter) continue;
    AccumulateGrad(KeyOf(inst, tensor), TensorOf(inst, tensor).layout, grad);
  }
  return absl::OkStatus();
}

absl::Status Simulation::Recompute(Instance& inst) {
  const SegmentPlan& plan = *inst.plan;
  const BlockGraph& graph = *plan.graph;
  Instance::Frame& frame = *inst.frame;
  frame.recomputed = true;
  memory_.SetOp(Special(inst.segment, Where::Activity::kCheckpointNode));
  // recompute_fn runs under torch.random.fork_rng, which keeps the current RNG state
  // meanwhile (checkpoint.py, _checkpoint_without_reentrant_generator).
  const int forked = memory_.HostAlloc(kCpuRngStateBytes, MemoryCategory::kTemporary);
  // The layer input, unpacked from _NoopSaveInputs (ctx.get_args(ctx.saved_tensors)).
  Handle x;
  x.storage = frame.input;
  x.layout = TensorOf(inst, graph.input).layout;
  x.dtype = graph.tensors[graph.input].dtype;
  Pass pass;
  pass.replay = !variant_.PolicyAt(inst.segment).empty();
  pass.early_stop = true;
  Handle y;
  inst.recompute = true;
  absl::Status status = Forward(inst, &x, pass, &y);
  inst.recompute = false;
  if (!status.ok()) return status;
  if (y.defined()) memory_.Unref(y.storage);  // no early stop: the output is dropped
  ReleaseForwardHolds(/*forward_end=*/false);  // the recompute's autocast scope ends
  memory_.SetOp(Special(inst.segment, Where::Activity::kCheckpointNode));
  memory_.Unref(forked);
  return absl::OkStatus();
}

void Simulation::FrameDies(Instance& inst) {
  Instance::Frame& frame = *inst.frame;
  frame.alive = false;
  memory_.Release(frame.input);
  for (int held : frame.held) memory_.Release(held);
  memory_.Unref(frame.rng_state);
  // The selective cache's entries the recompute never reached (those after the early
  // stop) die with recompute_fn's context.
  for (const auto& [storage, id] : inst.cached) memory_.Release(id);
  inst.cached.clear();
}

}  // namespace memledger::liveness_internal
