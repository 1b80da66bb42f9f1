// Each op's steps in the simulation, one row per OpType (op_steps.h). Forward
// temporaries and workspaces were profiled against the pinned torch 2.15.0 (the CPU
// kernels' buffers at one thread and more); backward formulas are derivatives.yaml's
// (line numbers of the wheel's torchgen/packaged/autograd/derivatives.yaml, as
// graph/rules.cc cites them) and FunctionsManual.cpp's, in their order.
#include "estimator/step/op_steps.h"

#include <algorithm>
#include <array>
#include <optional>
#include <vector>

#include "estimator/step/segment_plan.h"

namespace memledger::liveness_internal {

FlashSplits FlashSplitsFor(int64_t t) {
  const int64_t q = t >= 768 ? 256 : (t >= 192 ? 64 : 32);
  return FlashSplits{std::min(q, t), std::min<int64_t>(512, t)};
}

const Layout& OpCall::layout(int input) const {
  return plan_.walk.tensor_layouts[op_.inputs[input]].layout;
}
DType OpCall::dtype(int input) const { return plan_.graph->tensors[op_.inputs[input]].dtype; }
bool OpCall::needs(int input) const {
  return plan_.walk.tensor_layouts[op_.inputs[input]].requires_grad;
}
const Layout& OpCall::output_layout(int output) const {
  return plan_.walk.tensor_layouts[op_.outputs[output]].layout;
}
DType OpCall::output_dtype(int output) const {
  return plan_.graph->tensors[op_.outputs[output]].dtype;
}
int OpCall::StorageOf(int input) const {
  return ids_[plan_.walk.tensor_layouts[op_.inputs[input]].storage];
}

Handle OpCall::Reshape(const Handle& h, const Layout& target) {
  Layout view;
  bool overflow = false;
  if (ViewStrides(h.layout, target.sizes.data(), target.ndim, &view, &overflow)) {
    return ViewOf(h, view);
  }
  return NewGrad(target, h.dtype);
}

Handle OpCall::ScaledPowerGrad(const Layout& layout, DType dtype) {
  const int64_t bytes = NumelOf(layout) * ElementSizeBytes(dtype);
  const int power = Temporary(bytes);
  const Memory::Wrapped scalar = memory_.WrapScalar(dtype);
  const int scaled = Temporary(bytes);
  memory_.Drop(scalar);
  Handle grad = NewGrad(layout, dtype);
  memory_.Unref(power);
  memory_.Unref(scaled);
  return grad;
}

namespace {

constexpr int64_t kFp32 = ElementSizeBytes(DType::kFloat32);
constexpr int64_t kInt64 = ElementSizeBytes(DType::kInt64);
constexpr int64_t kBool = ElementSizeBytes(DType::kBool);

// ---------------------------------------------------------------------------------------
// Forward temporaries, made before the outputs (OpSteps::leading).

// The causal mask is ones(T, T).triu(1): the ones die after triu.
void CausalMaskOnes(OpCall& c, Ids* prelude) {
  prelude->push_back(c.Temporary(NumelOf(c.output_layout(0)) * kBool));
}

// The math SDPA's mask: ones(L, S, bool), its tril (the ones die), then where(tril, 0,
// -inf) with both numbers as 0-dim tensors of the mask's dtype; the tril and the numbers
// die after the where.
void SdpaCausalMaskParts(OpCall& c, Ids* prelude) {
  const int64_t numel = NumelOf(c.output_layout(0));
  const int64_t element = ElementSizeBytes(c.output_dtype(0));
  const int ones = c.Temporary(numel * kBool);
  prelude->push_back(c.Temporary(numel * kBool));
  c.memory().Unref(ones);
  prelude->push_back(c.Temporary(element));
  prelude->push_back(c.Temporary(element));
}

// one_hot's aminmax of the indices: two 0-dim int64 tensors, read and freed.
void OneHotAminmax(OpCall& c, Ids*) {
  const int min = c.Temporary(kInt64);
  const int max = c.Temporary(kInt64);
  c.memory().Unref(min);
  c.memory().Unref(max);
}

// expert_mask.sum(dim=(-1, -2)): (E + 1) int64; greater(., 0): the 0 wrapped as an
// 8-byte tensor, (E + 1) bools; both results die after nonzero.
void ExpertHitsSum(OpCall& c, Ids* prelude) {
  const int64_t classes = c.layout(0).sizes[0];
  prelude->push_back(c.Temporary(classes * kInt64));
  const int zero = c.memory().HostAlloc(ElementSizeBytes(DType::kFloat64),
                                        MemoryCategory::kTemporary);
  prelude->push_back(c.Temporary(classes * kBool));
  c.memory().Unref(zero);
}

// Repeat.cpp: the repeats' index first (repeat_interleave_common: the repeats' cumsum,
// freed on return, and the (R) int64 index it fills), then index_select.
void RepeatInterleaveIndex(OpCall& c, Ids* prelude) {
  const int64_t repeats = NumelOf(c.layout(1));
  const int64_t rows = NumelOf(c.output_layout(0));
  const int cumsum = c.Temporary(repeats * kInt64);
  prelude->push_back(c.Temporary(rows * kInt64));
  c.memory().Unref(cumsum);
}

// expert_idx == self.num_experts: the number wrapped as an 8-byte tensor.
void EqScalarWrapped(OpCall& c, Ids* prelude) {
  prelude->push_back(
      c.memory().HostAlloc(ElementSizeBytes(DType::kFloat64), MemoryCategory::kTemporary));
}

// self + n, self - n with a Python int n: n wrapped in a 0-dim int64 tensor on the host
// (wrapped_scalar_tensor), freed after the op.
void WrappedInt(OpCall& c, Ids* prelude) {
  prelude->push_back(c.memory().HostAlloc(kInt64, MemoryCategory::kTemporary));
}

// scalar_tensor(0) and scalar_tensor(-inf) in the query's dtype, before the where.
void SdpaBoolMaskScalars(OpCall& c, Ids* prelude) {
  const int64_t element = ElementSizeBytes(c.output_dtype(0));
  prelude->push_back(c.Temporary(element));
  prelude->push_back(c.Temporary(element));
}

// ---------------------------------------------------------------------------------------
// Kernel workspaces, after the outputs (OpSteps::workspace). The CPU kernels' are not a
// CUDA step's; the tensor-parallel functions' buffers are device tensors on both.

// A GEMM's cuBLAS workspace, on CUDA (OpCall::CublasWorkspace).
void GemmWorkspace(OpCall& c) { c.CublasWorkspace(); }

// cpu_flash_attention: per-thread fp32 blocks of q x kv scores, row max and sum, and the
// q x d_head output accumulator; a reduced-precision copy of the scores for bf16/fp16
// (empty in fp32).
void CpuFlashBlocks(OpCall& c) {
  if (c.cuda()) return;
  const Layout& q = c.layout(0);  // (B, H, T, d_head)
  const int64_t t = q.sizes[2], head = q.sizes[3];
  const FlashSplits splits = FlashSplitsFor(t);
  const int64_t q_split = splits.q, kv_split = splits.kv;
  const int64_t threads = c.cpu_threads();
  const int64_t per_thread = q_split * kv_split + 2 * q_split + q_split * head;
  const int buf = c.Temporary(threads * per_thread * kFp32);
  const DType out = c.output_dtype(0);
  const int reduced = c.Temporary(
      out == DType::kFloat32 ? 0 : threads * q_split * kv_split * ElementSizeBytes(out));
  c.memory().Unref(buf);
  c.memory().Unref(reduced);
}

// After the softmax: which rows are all -inf (isneginf of the input, a bool per element,
// then all over the last dim, a bool per row) and a 0-dim zero in the output's dtype,
// freed before it returns.
void SafeSoftmaxRows(OpCall& c) {
  if (c.cuda()) return;
  const Layout& x = c.layout(0);
  const int64_t numel = NumelOf(x);
  const int neg_inf = c.Temporary(numel * kBool);
  const int rows = c.Temporary(numel / x.sizes[x.ndim - 1] * kBool);
  c.memory().Transient(ElementSizeBytes(c.output_dtype(0)));
  c.memory().Unref(rows);
  c.memory().Unref(neg_inf);
}

// mean over a dim: sum, then div_ by the count, a wrapped scalar (8 B, then the dtype's
// size).
void MeanDimCount(OpCall& c) {
  if (c.cuda()) return;
  c.memory().ScalarOp(c.output_dtype(0));
}

// mean of everything: sum (with more than one thread, through an 8-byte partial result),
// then a division by the element count, a wrapped double scalar (8 B) converted to the
// tensor's dtype.
void MeanCount(OpCall& c) {
  if (c.cuda()) return;
  if (c.cpu_threads() > 1) c.memory().Transient(ElementSizeBytes(DType::kFloat64));
  c.memory().ScalarOp(c.output_dtype(0));
}

// The CPU sort's scratch copy of the values, after both outputs (profiled: values,
// indices, then a tensor of the input's size, freed before it returns).
void SortScratch(OpCall& c) {
  if (c.cuda()) return;
  c.memory().Transient(NumelOf(c.layout(0)) * ElementSizeBytes(c.dtype(0)));
}

// histogram_histc: its bin edges (bins + 1, fp32) and a (bins) fp32 partial histogram
// next to the output, both freed before it returns (profiled, one thread).
void HistcEdges(OpCall& c) {
  if (c.cuda()) return;
  const int64_t bins = NumelOf(c.output_layout(0));
  const int edges = c.Temporary((bins + 1) * kFp32);
  c.memory().Transient(bins * kFp32);
  c.memory().Unref(edges);
}

// cumsum(dtype=int32): the input converted to int32 first, freed after.
void CumsumInt32(OpCall& c) {
  if (c.cuda()) return;
  c.memory().Transient(NumelOf(c.layout(0)) * ElementSizeBytes(DType::kInt32));
}

// inv[perm] = torch.arange(len): the arange dies with the statement.
void InversePermutationArange(OpCall& c) {
  if (c.cuda()) return;
  c.memory().Transient(NumelOf(c.layout(0)) * kInt64);
}

// The input all-gathered into a (B, T, in) buffer, freed once the matmul is done. On
// CUDA the matmul's cuBLAS workspace joins it.
void GatherLinearBuffer(OpCall& c) {
  const int gathered =
      c.Temporary(NumelOf(c.layout(0)) * c.tp() * ElementSizeBytes(c.dtype(0)));
  c.CublasWorkspace();
  c.memory().Unref(gathered);
}

// In place on the logits (N, V / tp): their row max (N fp32) all-reduced and
// subtracted, then the target logits and the rows' sums of exp (N fp32 each),
// all-reduced, alive until the op returns (its outputs exist by then).
void VocabParallelCrossEntropyRows(OpCall& c) {
  const int64_t rows_bytes = c.layout(0).sizes[0] * kFp32;
  c.memory().Transient(rows_bytes);
  const int target = c.Temporary(rows_bytes);
  const int sums = c.Temporary(rows_bytes);
  c.memory().Unref(sums);
  c.memory().Unref(target);
}

// ---------------------------------------------------------------------------------------
// Views' backward layouts (OpSteps::viewed_back): the gradient of the output, viewed in
// the input's sizes.

// yaml:1407 permute_backwards(grad, dims): the inverse permutation.
bool PermutedBack(const OpDef& op, const Layout& grad, const Layout&, Layout* back) {
  back->ndim = grad.ndim;
  for (int i = 0; i < grad.ndim; ++i) {
    back->sizes[op.attributes.permutation[i]] = grad.sizes[i];
    back->strides[op.attributes.permutation[i]] = grad.strides[i];
  }
  return true;
}
// yaml:1803 transpose: grad.transpose(dim0, dim1).
bool TransposedBack(const OpDef& op, const Layout& grad, const Layout&, Layout* back) {
  *back = Transposed(grad, op.attributes.dim, op.attributes.dim1);
  return true;
}
// yaml:1758 t: grad.t().
bool TBack(const OpDef&, const Layout& grad, const Layout&, Layout* back) {
  *back = Transposed(grad, 0, 1);
  return true;
}
// unsqueeze: grad.squeeze(dim), the unsqueezed dimension dropped.
bool UnsqueezedBack(const OpDef& op, const Layout& grad, const Layout&, Layout* back) {
  back->ndim = grad.ndim - 1;
  for (int i = 0, j = 0; i < grad.ndim; ++i) {
    if (i == op.attributes.dim) continue;
    back->sizes[j] = grad.sizes[i];
    back->strides[j++] = grad.strides[i];
  }
  return true;
}
// yaml:1950 view, yaml:1919 _unsafe_view: grad.reshape(self.sizes()); a reshape that
// copied in the forward has a CloneBackward0 + UnsafeViewBackward0 pair that ends the
// same way. False where that reshape cannot view and copies.
bool ReshapedBack(const OpDef&, const Layout& grad, const Layout& input, Layout* back) {
  bool overflow = false;
  return ViewStrides(grad, input.sizes.data(), input.ndim, back, &overflow);
}

// ---------------------------------------------------------------------------------------
// Backward formulas (OpSteps::backward).

// A view's: the gradient viewed back (a reshape the strides refuse copies it).
void ViewBack(OpCall& c, const Handle& grad, Handle* grads) {
  Layout back;
  grads[0] = StepsOf(c.op().type).viewed_back(c.op(), grad.layout, c.layout(0), &back)
                 ? c.ViewOf(grad, back)
                 : c.NewGrad(c.layout(0), grad.dtype);
}

// grad itself: clone's backward (contiguous), x + eps's, cat's narrow of it all (the
// KV cache), which validate_outputs casts to a promoted input's dtype; Megatron's fused
// causal softmax works in place on it.
void IdentityBack(OpCall& c, const Handle& grad, Handle* grads) { grads[0] = c.Alias(grad); }

// A new gradient of the input's sizes: zeros with the incoming gradient copied or
// scattered into them (select_backward, slice_backward, nll_loss_backward,
// index_backward, value_selecting_reduction_backward), a reduction (the all-gather of a
// sequence-parallel scatter) or a reverse all-to-all into a new tensor.
void NewInputGrad(OpCall& c, const Handle& grad, Handle* grads) {
  grads[0] = c.NewGrad(c.layout(0), grad.dtype);
}

// An elementwise backward of one input: one new tensor laid out like the gradient
// (gelu_backward, silu_backward, neg, _log_softmax_backward_data, tanh_backward(grad,
// result), _softmax_backward_data, masked_fill's grad.masked_fill(mask, 0),
// native_dropout_backward's grad * mask * scale, MulBackward0's grad * noise).
void ElementwiseBack(OpCall& c, const Handle& grad, Handle* grads) {
  grads[0] = c.NewGradLike(grad, c.layout(0), grad.dtype);
}

// yaml add.Tensor: grad to both inputs (the same tensor); validate_outputs reduces a
// broadcast one.
void AddBack(OpCall& c, const Handle& grad, Handle* grads) {
  if (c.needs(0)) grads[0] = c.Alias(grad);
  if (c.needs(1)) grads[1] = c.Alias(grad);
}

// yaml:256 addmm (bias, mat1, mat2): mm_mat1_backward = grad.mm(mat2^T) (contiguous);
// mm_mat2_backward = mat1^T.mm(grad), laid out like mat2 when mat2 is a transposed
// contiguous weight; bias: grad itself, summed by validate_outputs.
void AddmmBack(OpCall& c, const Handle& grad, Handle* grads) {
  if (c.needs(1)) {
    grads[1] = c.NewGrad(c.layout(1), grad.dtype);
    c.CublasWorkspace();
  }
  if (c.needs(2)) {
    grads[2] = c.NewGrad(c.layout(2), grad.dtype);
    if (!c.layout(2).IsContiguous()) grads[2].layout = c.layout(2);
    c.CublasWorkspace();
  }
  if (c.needs(0)) grads[0] = c.Alias(grad);
}

// yaml mm: MmBackward0 computes mat2's gradient (the weight's, laid out like it) first.
void MmBack(OpCall& c, const Handle& grad, Handle* grads) {
  if (c.needs(1)) {
    grads[1] = c.NewGrad(c.layout(1), grad.dtype);
    if (!c.layout(1).IsContiguous()) grads[1].layout = c.layout(1);
    c.CublasWorkspace();
  }
  if (c.needs(0)) {
    grads[0] = c.NewGrad(c.layout(0), grad.dtype);
    c.CublasWorkspace();
  }
}

// yaml:378 bmm: mat2's gradient self^T.bmm(grad) first, then self's grad.bmm(mat2^T).
void BmmBack(OpCall& c, const Handle& grad, Handle* grads) {
  if (c.needs(1)) {
    grads[1] = c.NewGrad(c.layout(1), grad.dtype);
    c.CublasWorkspace();
  }
  if (c.needs(0)) {
    grads[0] = c.NewGrad(c.layout(0), grad.dtype);
    c.CublasWorkspace();
  }
}

// yaml mul.Tensor: MulBackward0 computes other's gradient, grad * self, then self's,
// grad * other (profiled: the copy promoting a bf16 self for other's product is freed
// before self's product is made), each in the broadcast shape; validate_outputs then
// casts and reduces them input by input. Each product is in grad's and the other
// factor's common dtype; a factor of another dtype is copied to it first on the CPU
// (TensorIterator's input promotion).
void MulTensorBack(OpCall& c, const Handle& grad, Handle* grads) {
  auto product = [&](int factor) {
    const DType common = PromoteTypes(grad.dtype, c.dtype(factor));
    std::optional<int> promoted;
    if (c.dtype(factor) != common && !c.cuda()) {
      promoted = c.Temporary(NumelOf(c.layout(factor)) * ElementSizeBytes(common));
    }
    Handle h = c.NewGradLike(grad, grad.layout, common);
    if (promoted) c.memory().Unref(*promoted);
    return h;
  };
  if (c.needs(1)) grads[1] = product(0);
  if (c.needs(0)) grads[0] = product(1);
}

// .to() of the same dtype is the tensor itself; else the gradient is cast back.
void ToDtypeBack(OpCall& c, const Handle& grad, Handle* grads) {
  grads[0] = c.dtype(0) == grad.dtype ? c.Alias(grad) : c.NewGrad(c.layout(0), c.dtype(0));
}

// pow_backward(grad, self, 2) = grad * (2 * self.pow(1)); rsqrt's -0.5 * grad *
// result.pow(3).
void PowerBack(OpCall& c, const Handle& grad, Handle* grads) {
  grads[0] = c.ScaledPowerGrad(c.layout(0), grad.dtype);
}

// mean_backward: grad.expand(self's sizes) / count, the count a wrapped scalar (8 B,
// then the dtype's) around the division.
void MeanBack(OpCall& c, const Handle& grad, Handle* grads) {
  const Memory::Wrapped scalar = c.memory().WrapScalar(grad.dtype);
  grads[0] = c.NewGrad(c.layout(0), grad.dtype);
  c.memory().Drop(scalar);
}

// yaml:1256 mul.Scalar: mul_tensor_backward(grad, other, ...): grad * scalar, the
// wrapped scalar (8 B, then the dtype's) around the product.
void MulScalarBack(OpCall& c, const Handle& grad, Handle* grads) {
  const Memory::Wrapped scalar = c.memory().WrapScalar(grad.dtype);
  grads[0] = c.NewGradLike(grad, c.layout(0), grad.dtype);
  c.memory().Drop(scalar);
}

// MulBackward0's grad * other: the kept wrapped number, converted to grad's dtype for
// the op.
void MulWrappedBack(OpCall& c, const Handle& grad, Handle* grads) {
  const int converted =
      c.memory().HostAlloc(ElementSizeBytes(grad.dtype), MemoryCategory::kTemporary);
  grads[0] = c.NewGradLike(grad, c.layout(0), grad.dtype);
  c.memory().Unref(converted);
}

// cat_tensors_backward: each input's gradient is a narrow view of grad.
void CatBack(OpCall& c, const Handle& grad, Handle* grads) {
  const int dim = c.layout(0).ndim - 1;
  for (int i = 0; i < 2; ++i) {
    Layout part = grad.layout;
    part.sizes[dim] = c.layout(i).sizes[dim];
    if (c.needs(i)) grads[i] = c.ViewOf(grad, part);
  }
}

// yaml:666 expand: at::sum_to(grad, self.sizes()): a reduction when a dimension was
// broadcast.
void ExpandBack(OpCall& c, const Handle& grad, Handle* grads) {
  grads[0] = SameSizes(grad.layout, c.layout(0)) ? c.Alias(grad)
                                                 : c.NewGrad(c.layout(0), grad.dtype);
}

// embedding_dense_backward: the whole weight's gradient.
void EmbeddingBack(OpCall& c, const Handle&, Handle* grads) {
  grads[0] = c.NewGrad(c.layout(0), c.dtype(0));
}

// Megatron's order: the input gathered again, the incoming gradient as rows (B x T,
// out), the input's whole gradient (B x T, in), all-reduced in place and this rank's
// tokens copied out; the weight's gradient (its own layout) and the bias's; then the
// gathered input, the rows and the whole gradient die. A gradient whose input needs
// none is computed all the same and dropped.
void GatherLinearBack(OpCall& c, const Handle& grad, Handle* grads) {
  const size_t n_inputs = c.op().inputs.size();
  const int64_t in = c.layout(0).sizes[c.layout(0).ndim - 1];
  const int64_t out = grad.layout.sizes[grad.layout.ndim - 1];
  const int64_t tokens = NumelOf(grad.layout) / out;
  const int gathered = c.Temporary(NumelOf(c.layout(0)) * c.tp() * ElementSizeBytes(c.dtype(0)));
  bool overflow = false;
  const int64_t rows_sizes[] = {tokens, out};
  const Handle rows = c.Reshape(grad, Layout::Contiguous(rows_sizes, 2, &overflow));
  const int whole = c.Temporary(tokens * in * ElementSizeBytes(grad.dtype));
  c.CublasWorkspace();  // on CUDA, the input gradient's matmul
  for (size_t i = 0; i < n_inputs; ++i) {
    grads[i] = c.NewGrad(c.layout(static_cast<int>(i)), grad.dtype);
    if (i == 1) c.CublasWorkspace();  // and the weight gradient's
  }
  c.memory().Unref(gathered);
  c.memory().Unref(rows.storage);
  c.memory().Unref(whole);
  for (size_t i = 0; i < n_inputs; ++i) {
    if (!c.needs(static_cast<int>(i))) {
      c.memory().Unref(grads[i].storage);
      grads[i] = Handle();
    }
  }
}

// Other ranks' tokens' rows zeroed in a copy of the gradient, then
// embedding_dense_backward: the weight rows' gradient; the copy dies with the node.
void VocabParallelEmbeddingBack(OpCall& c, const Handle& grad, Handle* grads) {
  const int masked = c.Temporary(NumelOf(grad.layout) * ElementSizeBytes(grad.dtype));
  grads[0] = c.NewGrad(c.layout(0), c.dtype(0));
  c.memory().Unref(masked);
}

// In place: the kept softmax becomes the logits' gradient.
void VocabParallelCrossEntropyBack(OpCall& c, const Handle&, Handle* grads) {
  grads[0].storage = c.StorageOf(0);
  grads[0].layout = c.layout(0);
  grads[0].dtype = c.dtype(0);
  c.memory().Ref(grads[0].storage);
}

// yaml:1294 native_layer_norm_backward: dX, dgamma, dbeta, then the CPU kernel's
// (2, threads, N) zero-filled buffer of per-thread partial sums in X's dtype, only for
// dgamma or dbeta.
void NativeLayerNormBack(OpCall& c, const Handle& grad, Handle* grads) {
  if (c.needs(0)) grads[0] = c.NewGrad(c.layout(0), grad.dtype);
  if (c.needs(1)) grads[1] = c.NewGrad(c.layout(1), c.dtype(1));
  if (c.needs(2)) grads[2] = c.NewGrad(c.layout(2), c.dtype(2));
  const int64_t n = NumelOf(c.layout(1));
  if ((c.needs(1) || c.needs(2)) && !c.cuda()) {
    c.memory().Transient(c.cpu_threads() * 2 * n * ElementSizeBytes(c.dtype(0)));
  }
}

// CUDA's flash and memory-efficient kernels' backward. Both start alike
// (attention_backward.cu, _flash_attention_backward and _efficient_attention_backward):
// grad_out.contiguous() in (B, T, H, d) memory, a copy unless it is so already; the
// gradients of q, k, v empty_like their (B, T, H, d) inputs (flash_api.cpp:954-972);
// for grouped-query heads k's and v's expanded to the query's heads, summed back after
// the kernel (flash_api.cpp:1000-1001, 1057-1058). Then their own buffers. All but the
// gradients die as the node returns. (A masked efficient kernel's bias needs no
// gradient: the same.)
void CudaAttentionBack(OpCall& c, const Handle& grad, Handle* grads) {
  const bool flash = c.op().type == OpType::kCudaFlashAttention;
  const Layout& q = c.layout(0);  // (B, H, T, d)
  const int64_t b = q.sizes[0], h = q.sizes[1], t = q.sizes[2], d = q.sizes[3];
  std::optional<int> grad_out_copy;
  if (!Transposed(grad.layout, 1, 2).IsContiguous()) {
    grad_out_copy = c.Temporary(NumelOf(grad.layout) * ElementSizeBytes(grad.dtype));
  }
  for (int i = 0; i < 3; ++i) {
    grads[i] = c.NewGrad(Transposed(c.layout(i), 1, 2), c.dtype(i));
    grads[i].layout = Transposed(grads[i].layout, 1, 2);
  }
  std::vector<int> temps;
  if (flash) {
    // mha_bwd: softmax_d (B, H, T rounded to 128) fp32 (:984), dq_accum (B, T rounded to
    // 128, H, d rounded to 32, or 64 above 128) fp32 (:989).
    const int64_t t128 = (t + 127) / 128 * 128;
    const int64_t rounding = d <= 128 ? 32 : 64;
    const int64_t d_rounded = (d + rounding - 1) / rounding * rounding;
    temps.push_back(c.Temporary(b * h * t128 * kFp32));
    temps.push_back(c.Temporary(b * t128 * h * d_rounded * kFp32));
  }
  if (c.layout(1).sizes[1] != h) {
    for (int i = 1; i < 3; ++i) {
      temps.push_back(c.Temporary(b * t * h * c.layout(i).sizes[3] * ElementSizeBytes(c.dtype(i))));
    }
  }
  if (!flash) {
    // delta: (B, H, T) fp32 for fp16/bf16 (kernel_backward.h, kKernelComputesDelta); for
    // fp32 (grad_out * out).sum(-1).transpose(-2, -1).contiguous(): the product, the
    // sum, the copy. Not modelled: its fp32 staging workspace (workspace_size()) and
    // shared_storage_dqdkdv's single chunk.
    if (grad.dtype == DType::kFloat32) {
      const int product = c.Temporary(NumelOf(grad.layout) * kFp32);
      const int sum = c.Temporary(b * h * t * kFp32);
      temps.push_back(c.Temporary(b * h * t * kFp32));
      c.memory().Unref(sum);
      c.memory().Unref(product);
    } else {
      temps.push_back(c.Temporary(b * h * t * kFp32));
    }
  }
  for (auto it = temps.rbegin(); it != temps.rend(); ++it) c.memory().Unref(*it);
  if (grad_out_copy) c.memory().Unref(*grad_out_copy);
}

// _cudnn_attention_backward (attention_backward.cu): dq, dk, dv empty_like q, k, v, then
// run_cudnn_SDP_bprop. Not modelled: cuDNN's own workspace (MHA.cpp).
void CudnnAttentionBack(OpCall& c, const Handle&, Handle* grads) {
  for (int i = 0; i < 3; ++i) {
    grads[i] = c.NewGrad(c.layout(i), c.dtype(i));
    if (NonOverlappingAndDense(c.layout(i))) grads[i].layout = c.layout(i);
  }
}

// yaml:2943 _scaled_dot_product_flash_attention_for_cpu_backward: grad_q, grad_k,
// grad_v, then per-thread fp32 blocks of scores and their gradients (and a
// reduced-precision copy), and each thread's row sums in the parallel loop. grad_q/k/v
// are zeros in (B, T, H, d_head) memory, returned as (B, H, T, d_head) views; the kernel
// reads grad_out.transpose(1, 2).contiguous() (a copy unless grad_out already has that
// memory order). With a mask, the same buffers (profiled).
void CpuFlashAttentionBack(OpCall& c, const Handle& grad, Handle* grads) {
  const Layout& q = c.layout(0);
  for (int i = 0; i < 3; ++i) {
    grads[i] = c.NewGrad(Transposed(c.layout(i), 1, 2), c.dtype(i));
    grads[i].layout = Transposed(grads[i].layout, 1, 2);
  }
  std::optional<int> grad_out_copy;
  if (!Transposed(grad.layout, 1, 2).IsContiguous()) {
    grad_out_copy = c.Temporary(NumelOf(grad.layout) * ElementSizeBytes(grad.dtype));
  }
  const FlashSplits splits = FlashSplitsFor(q.sizes[2]);
  const int64_t blocks = c.cpu_threads() * 2 * splits.q * splits.kv;
  const DType dtype = c.dtype(0);
  const int buf = c.Temporary(blocks * kFp32);
  const int reduced = c.Temporary(dtype == DType::kFloat32 ? 0 : blocks * ElementSizeBytes(dtype));
  // parallel_for over B * H rows in one chunk per thread; each chunk allocates its fp32
  // row sums (q_split).
  std::vector<int> rows;
  const int64_t chunks = std::min<int64_t>(c.cpu_threads(), q.sizes[0] * q.sizes[1]);
  for (int64_t i = 0; i < chunks; ++i) rows.push_back(c.Temporary(splits.q * kFp32));
  for (int row : rows) c.memory().Unref(row);
  c.memory().Unref(buf);
  c.memory().Unref(reduced);
  if (grad_out_copy) c.memory().Unref(*grad_out_copy);
}

// IndexPutBackward0: values: grad.index(indices), (S, d); self (when it needs a
// gradient): grad.index_put(indices, zeros_like(values)), a copy of grad.
void IndexPutBack(OpCall& c, const Handle& grad, Handle* grads) {
  if (c.needs(2)) grads[2] = c.NewGrad(c.layout(2), grad.dtype);
  if (c.needs(0)) {
    const int zeros = c.Temporary(NumelOf(c.layout(2)) * ElementSizeBytes(grad.dtype));
    grads[0] = c.NewGrad(grad.layout, grad.dtype);
    c.memory().Unref(zeros);
  }
}

// index_add_: self: grad itself; source: grad.index_select(0, index), (n, d).
void IndexAddBack(OpCall& c, const Handle& grad, Handle* grads) {
  if (c.needs(0)) grads[0] = c.Alias(grad);
  if (c.needs(2)) grads[2] = c.NewGrad(c.layout(2), grad.dtype);
}

// sum_backward: grad (unsqueezed without keepdim) expanded to the input's sizes, a view
// with stride 0 along the summed dimension.
void SumDimBack(OpCall& c, const Handle& grad, Handle* grads) {
  const int dim = c.op().attributes.dim;
  Layout expanded;
  expanded.ndim = c.layout(0).ndim;
  for (int i = 0, j = 0; i < expanded.ndim; ++i) {
    expanded.sizes[i] = c.layout(0).sizes[i];
    if (i == dim) {
      expanded.strides[i] = 0;
      if (c.op().attributes.keepdim) ++j;
    } else {
      expanded.strides[i] = grad.layout.strides[j++];
    }
  }
  grads[0] = c.ViewOf(grad, expanded);
}

// DivBackward0 (div_ and div.Tensor) computes other's gradient first, -grad * ((self /
// other) / other) (FunctionsManual.cpp, div_tensor_other_backward): four tensors of the
// broadcast shape, three of them temporaries of the expression; then self's, grad /
// other. validate_outputs then reduces either to its input's shape (the router's (N, 1)
// sums, DoRA's (out) magnitude).
void DivBack(OpCall& c, const Handle& grad, Handle* grads) {
  const int64_t bytes = NumelOf(grad.layout) * ElementSizeBytes(grad.dtype);
  if (c.needs(1)) {
    std::array<int, 3> temps{};
    for (int& t : temps) t = c.Temporary(bytes);
    grads[1] = c.NewGradLike(grad, grad.layout, grad.dtype);
    for (int t : temps) c.memory().Unref(t);
  }
  if (c.needs(0)) grads[0] = c.NewGradLike(grad, grad.layout, grad.dtype);
}

// yaml:1699 sub.Tensor: self's gradient is grad itself, other's -grad (a new tensor);
// validate_outputs reduces a broadcast one.
void SubBack(OpCall& c, const Handle& grad, Handle* grads) {
  if (c.needs(0)) grads[0] = c.Alias(grad);
  if (c.needs(1)) grads[1] = c.NewGradLike(grad, grad.layout, grad.dtype);
}

// GroupedMmBackward0, mat2's gradient first (like mat2: a transposed view of the expert
// weights, as _grouped_mm_mat2_backward transposes its result), then self's.
void GroupedMmBack(OpCall& c, const Handle& grad, Handle* grads) {
  if (c.needs(1)) {
    grads[1] = c.NewGrad(c.layout(1), grad.dtype);
    if (!c.layout(1).IsContiguous()) grads[1].layout = c.layout(1);
  }
  if (c.needs(0)) grads[0] = c.NewGrad(c.layout(0), grad.dtype);
}

// pow.Scalar's base, wrapped and converted to the exponent's dtype, comes and goes after
// the output (the order the simulation's rotary tables have always had; those tables
// are never a step's peak, so no measurement tells the orders apart).
void PowBaseWrapped(OpCall& c) { c.memory().ScalarOp(c.output_dtype(0)); }

// ---------------------------------------------------------------------------------------
// The rows. No `default:`: -Wswitch (an error here) catches a new OpType.

using LeadingRule = void (*)(OpCall&, Ids*);
using WorkspaceRule = void (*)(OpCall&);
using BackwardRule = void (*)(OpCall&, const Handle&, Handle*);
using ViewRule = bool (*)(const OpDef&, const Layout&, const Layout&, Layout*);

constexpr OpSteps Leading(LeadingRule leading) { return OpSteps{leading, nullptr, nullptr}; }
constexpr OpSteps Workspace(WorkspaceRule workspace) {
  return OpSteps{nullptr, workspace, nullptr};
}
constexpr OpSteps Both(WorkspaceRule workspace, BackwardRule backward) {
  return OpSteps{nullptr, workspace, backward};
}
constexpr bool kInert = true;
constexpr OpSteps Backward(BackwardRule backward, bool forward_inert = false) {
  OpSteps row;
  row.backward = backward;
  row.forward_inert = forward_inert;
  return row;
}
// A view op's: its backward views the gradient back; its forward is free.
constexpr OpSteps View(ViewRule viewed_back) {
  OpSteps row = Backward(ViewBack, kInert);
  row.viewed_back = viewed_back;
  return row;
}

constexpr OpSteps RowOf(OpType type) {
  switch (type) {
    case OpType::kView:
    case OpType::kReshape:
    case OpType::kUnsafeView:
      return View(ReshapedBack);
    case OpType::kPermute:
      return View(PermutedBack);
    case OpType::kTranspose:
      return View(TransposedBack);
    case OpType::kT:
      return View(TBack);
    case OpType::kUnsqueeze:
      return View(UnsqueezedBack);
    case OpType::kSelect:   // yaml:1540 select_backward
    case OpType::kSlice:    // slice_backward
      return Backward(NewInputGrad, kInert);
    case OpType::kExpand:
      return Backward(ExpandBack, kInert);
    case OpType::kContiguous:  // clone's backward: grad
      return Backward(IdentityBack, kInert);
    case OpType::kToDtype:
      return Backward(ToDtypeBack, kInert);
    case OpType::kNativeLayerNorm:
      return Backward(NativeLayerNormBack);
    case OpType::kAddmm:
      return Both(GemmWorkspace, AddmmBack);
    case OpType::kMm:
      return Both(GemmWorkspace, MmBack);
    case OpType::kBmm:
      return Both(GemmWorkspace, BmmBack);
    case OpType::kFlashAttention:
    case OpType::kFlashAttentionMasked:
      return Both(CpuFlashBlocks, CpuFlashAttentionBack);
    case OpType::kCudaFlashAttention:
    case OpType::kEfficientAttention:
    case OpType::kEfficientAttentionMasked:
      return Backward(CudaAttentionBack);
    case OpType::kCudnnAttention:
      return Backward(CudnnAttentionBack);
    case OpType::kMulScalar:
      return Backward(MulScalarBack);
    case OpType::kMulWrapped:
      return Backward(MulWrappedBack);
    case OpType::kMulTensor:
      return Backward(MulTensorBack);
    case OpType::kAdd:
      return Backward(AddBack);
    case OpType::kAddScalar:
    case OpType::kKvCacheCat:
    case OpType::kFusedCausalSoftmax:  // in place on the incoming gradient
      return Backward(IdentityBack);
    case OpType::kPow:
    case OpType::kRsqrt:
      return Backward(PowerBack);
    case OpType::kMean:
      return Both(MeanCount, MeanBack);
    case OpType::kMeanDim:
      return Both(MeanDimCount, MeanBack);
    case OpType::kGelu:
    case OpType::kSilu:
    case OpType::kNeg:
    case OpType::kLogSoftmax:
    case OpType::kTanh:
    case OpType::kSoftmax:
    case OpType::kMaskedFill:
    case OpType::kMaskedFillInplace:
    case OpType::kNativeDropout:
    case OpType::kDropout:
      return Backward(ElementwiseBack);
    case OpType::kSafeSoftmax:  // _softmax_backward_data(grad, result, dim), as softmax's
      return Both(SafeSoftmaxRows, ElementwiseBack);
    case OpType::kCat:
      return Backward(CatBack);
    case OpType::kNllLoss:
    case OpType::kScatter:
    case OpType::kReduceScatter:  // the gradient all-gathered along the sequence
    case OpType::kAllToAll:
    case OpType::kTopK:
    case OpType::kIndexRows:
    case OpType::kIndexPair:
      return Backward(NewInputGrad);
    case OpType::kEmbedding:
      return Backward(EmbeddingBack);
    case OpType::kGatherLinear:
      return Both(GatherLinearBuffer, GatherLinearBack);
    case OpType::kVocabParallelEmbedding:
      return Backward(VocabParallelEmbeddingBack);
    case OpType::kVocabParallelCrossEntropy:
      return Both(VocabParallelCrossEntropyRows, VocabParallelCrossEntropyBack);
    case OpType::kIndexPutInplace:
      return Backward(IndexPutBack);
    case OpType::kIndexAddInplace:
      return Backward(IndexAddBack);
    case OpType::kSumDim:
      return Backward(SumDimBack);
    case OpType::kDivInplace:
    case OpType::kDivTensor:
      return Backward(DivBack);
    case OpType::kSub:
      return Backward(SubBack);
    case OpType::kGroupedMm:
      return Backward(GroupedMmBack);
    case OpType::kSort:
      return Workspace(SortScratch);
    case OpType::kHistc:
      return Workspace(HistcEdges);
    case OpType::kCumsum:
      return Workspace(CumsumInt32);
    case OpType::kInversePermutation:
      return Workspace(InversePermutationArange);
    case OpType::kCausalMask:
      return Leading(CausalMaskOnes);
    case OpType::kSdpaCausalMask:
      return Leading(SdpaCausalMaskParts);
    case OpType::kOneHot:
      return Leading(OneHotAminmax);
    case OpType::kExpertHits:
      return Leading(ExpertHitsSum);
    case OpType::kRepeatInterleave:
      return Leading(RepeatInterleaveIndex);
    case OpType::kEqScalar:
      return Leading(EqScalarWrapped);
    case OpType::kSdpaBoolMask:
      return Leading(SdpaBoolMaskScalars);
    case OpType::kAddWrappedInt:  // its backward passes the gradient to self (sub's too)
      return OpSteps{WrappedInt, nullptr, IdentityBack};
    case OpType::kPowScalarBase:
      return Workspace(PowBaseWrapped);
    // The model's own tensors' other ops: no grad, nothing of their own (kDivScalar's
    // wrapped number is Simulation::Forward's, as kMulScalar's).
    case OpType::kDivScalar:
    case OpType::kScalarDivide:
    case OpType::kOuter:
    case OpType::kCos:
    case OpType::kSin:
    case OpType::kOnes:
    case OpType::kGt:
    case OpType::kLe:
    case OpType::kBitwiseAnd:
      return OpSteps{};
    // DoRA's weight norm (dora.py, get_weight_norm): eye()'s zero_ and diagonal fill, and
    // the 2-norm's reduction, allocate nothing of their own on the CPU; never
    // differentiated here (OpDef::no_grad, detached inputs).
    case OpType::kEye:
    case OpType::kLinalgVectorNorm:
      return OpSteps{};
    // Not differentiable here (integer ids, counts, masks) or returning their input
    // itself (add_ of a mask: the gradient passes to the input, SegmentStructure::
    // same_as), with nothing of their own in the forward.
    case OpType::kConstantPad:
    case OpType::kAddInplace:
    case OpType::kFloorDivide:
    case OpType::kZerosLike:
    case OpType::kNonzero:
    case OpType::kZeros:
    case OpType::kOnesLike:
    case OpType::kArange:
    case OpType::kRepeat:
    case OpType::kStack:
    case OpType::kScatterAddInplace:
    case OpType::kGeScalar:
      return OpSteps{};
  }
  return OpSteps{};  // unreachable: every OpType is a case
}

constexpr std::array<OpSteps, kNumOpTypes> kRows = [] {
  std::array<OpSteps, kNumOpTypes> rows{};
  for (int t = 0; t < kNumOpTypes; ++t) rows[t] = RowOf(static_cast<OpType>(t));
  return rows;
}();

}  // namespace

const OpSteps& StepsOf(OpType type) { return kRows[static_cast<int>(type)]; }

}  // namespace memledger::liveness_internal
