// The ATen ops memledger's graphs are made of, and what the pinned PyTorch release does
// with each: which inputs autograd differentiates and which tensors the op's backward
// node keeps (SavedVariable members of the generated
// torch/csrc/autograd/generated/Functions.h, saved under the conditions of
// tools/autograd/derivatives.yaml). Both files ship inside the pinned torch wheel; the
// rules are re-derived from them whenever kTorchRelease changes, and
// //tests:rules_functions_h_test checks every keep rule against the wheel's Functions.h.
//
// Example:
//   const OpSemantics& addmm = RuleTable::Pinned().Of(OpType::kAddmm);
//   for (const KeepRule& rule : addmm.keeps) ...  // mat1_ (if mat2 needs grad), mat2_
#ifndef ESTIMATOR_GRAPH_RULES_H_
#define ESTIMATOR_GRAPH_RULES_H_

#include <array>
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

namespace memledger {

// kTorchRelease is the PyTorch release whose rules this file describes and whose
// LibTorch the runtime measures (third_party/torch_requirements.txt pins the same).
inline constexpr char kTorchRelease[] = "2.15.0";
// kTransformersRelease is the transformers release whose modeling code the families'
// graphs mirror and whose models the real-stack witness trains (verify/witness.py;
// third_party/torch_requirements.txt pins the same).
inline constexpr char kTransformersRelease[] = "5.23.0";

// kCpuRngStateBytes is torch.get_rng_state()'s size on the CPU: the default generator's
// CPUGeneratorImplState as a uint8 tensor (aten/src/ATen/CPUGeneratorImpl.cpp,
// get_state). torch.utils.checkpoint keeps one per checkpointed call from the forward to
// its backward (preserve_rng_state: checkpoint.py:251 reentrant, :1973 non-reentrant),
// and torch.random.fork_rng makes another for the recompute.
inline constexpr int64_t kCpuRngStateBytes = 5056;

// OpType is an ATen op, named as the pinned release names it. Views and copies follow
// ATen's rules; keep rules follow the backward node in the generated Functions.h.
enum class OpType : uint8_t {
  kNativeLayerNorm,  // (input, weight, bias) -> (out, mean, rstd)
  kView,             // view of the input; must be possible without a copy
  kReshape,          // view when ATen's computeStride allows it, else a contiguous copy
  kUnsafeView,       // _unsafe_view: reinterprets a contiguous result, shares storage
  kPermute,
  kTranspose,
  kSelect,
  kExpand,  // same sizes only (as matmul uses it)
  kT,       // 2-D transpose
  kAddmm,   // (bias, mat1, mat2)
  kBmm,     // (self, mat2)
  // (q, k, v) -> (out, logsumexp): what scaled_dot_product_attention(q, k, v,
  // is_causal=true) dispatches to on the CPU.
  kFlashAttention,
  kMulScalar,
  kCausalMask,  // ones(T, T, bool).triu(1): no inputs, not differentiable
  kMaskedFill,  // (self, mask)
  kSoftmax,
  kAdd,
  kGelu,
  kPow,  // pow(self, 2)
  kMean,
  // The decoder families' ops.
  kEmbedding,    // (weight, indices) -> rows of weight
  kMm,           // (self, mat2): a Linear without bias, as matmul folds a 3-D input
  kMulTensor,    // (self, other), broadcasting
  kAddScalar,    // self + eps
  kRsqrt,
  kMeanDim,      // mean over the last dim, keepdim
  kSilu,
  kNeg,
  kSlice,        // narrow along dims[0] from dims[1] to dims[2]: a view
  kCat,          // (a, b) along the last dim
  kUnsqueeze,    // insert a size-1 dim at dims[0]: a view
  kLogSoftmax,   // over the last dim
  kNllLoss,      // (log_probs, target) -> (loss, total_weight), mean over non-ignored
  kConstantPad,  // pad the last dim by (0, 1): labels from input_ids
  kContiguous,   // a view if already contiguous, else a contiguous copy (clone)
  kToDtype,      // .to(dtype): the tensor itself if it has that dtype, else a copy
  kNativeDropout,  // (input) -> (out, mask): training dropout, mask bool
  // Megatron-LM's sequence-parallel collectives and linear (custom autograd Functions,
  // not ATen ops: no Functions.h node):
  kGatherLinear,   // (shard x, weight, bias): all-gather x along T, then x W^T + b
  kReduceScatter,  // (x): sum over ranks, each keeping its T / tp tokens
  kScatter,        // (x): each rank keeps its T / tp tokens (the embeddings' output)
  // Megatron-LM's vocabulary-parallel embedding and cross-entropy, as the runtime's
  // custom Functions run them (runtime/megatron_functions.cc):
  // (weight rows, ids) -> (out, masked ids int64, mask bool): the rank's rows looked
  // up, other ranks' tokens zeroed, all-reduced in place.
  kVocabParallelEmbedding,
  // (logits (N, V / tp) fp32, labels (N)) -> (loss, masked targets int64, target mask
  // bool): the logits turned into their softmax in place.
  kVocabParallelCrossEntropy,
  // Megatron-LM's fused scaled_upper_triang_masked_softmax (after the scale): the causal
  // softmax with no mask tensor, keeping its output; its backward works in place.
  kFusedCausalSoftmax,
  // transformers' Python-level ops (GPT-2's NewGELUActivation):
  kTanh,
  // x * <a Python number>: mul.Tensor with the number wrapped in a 0-dim float64
  // tensor, (self) -> (out, the wrapped number), which MulBackward0 keeps as other_.
  kMulWrapped,
  // What F.dropout runs on a CPU tensor in training (ATen Dropout.cpp, _dropout_impl;
  // native_dropout is for CUDA-like devices only, is_fused_kernel_acceptable):
  // noise = empty_like(input).bernoulli_(1 - p).div_(1 - p), then input * noise.
  // (input) -> (out, noise); MulBackward0 keeps the noise, in the input's dtype.
  kDropout,
  // (self, mask) -> self: add_ of an additive mask in place (the ATen math SDPA's
  // attn.add_(*attn_mask)); the output is the input's storage.
  kAddInplace,
  // The ATen math SDPA's causal mask (attention.cpp, _scaled_dot_product_attention_math):
  // ones(L, S, bool).tril(), then convert_boolean_attn_mask's where(mask, 0, -inf) in
  // the query's dtype. No inputs, not differentiable.
  kSdpaCausalMask,
  // _safe_softmax: softmax, then rows that are all -inf zeroed (SoftMax.cpp).
  kSafeSoftmax,
  // transformers' DynamicLayer.update without a past (cache_utils.py):
  // torch.cat([torch.tensor([]), x], dim=-2), a contiguous copy of the keys or values
  // that the model's DynamicCache holds until its forward returns.
  kKvCacheCat,
  // A sparse MoE block's ops (transformers 5.23's routers and grouped_mm experts):
  // (self) -> (values, indices int64): topk over the last dim, attributes.length = k.
  kTopK,
  // sum over attributes.dim, keepdim or not (attributes.keepdim).
  kSumDim,
  // (self, other) -> (self, the clone of self autograd keeps): div_ in place; its
  // DivBackward0 needs the original self for other's gradient, so VariableType clones it
  // before the kernel runs.
  kDivInplace,
  kSort,          // (self) -> (values, indices int64) along the last dim
  kFloorDivide,   // self // <a Python int>, in self's (integer) dtype
  // (self, indices): self[indices] with one 1-D int64 index on dim 0 (index.Tensor).
  kIndexRows,
  kHistc,         // (self fp32, or int32 on CUDA) -> (E) counts in its dtype; not differentiable
  kCumsum,        // (self) -> cumsum(dtype=int32) along dim 0
  // (self (S, in), mat2 (E, in, out), offs (E) int32) -> (S, out): torch._grouped_mm,
  // rows [offs[e - 1], offs[e]) times mat2[e].
  kGroupedMm,
  // (perm) -> inv: inv = empty_like(perm); inv[perm] = arange(len): int64, not
  // differentiable.
  kInversePermutation,
  // The eager experts' ops (Qwen3MoeExperts.forward, MixtralExperts.forward):
  kZerosLike,      // zeros_like(self): not differentiable
  // (indices (N, k) int64) -> (N, k, E + 1) int64: one_hot(indices, E + 1) (its
  // aminmax's two 0-dim int64 tensors first), under no_grad.
  kOneHot,
  // (mask (E + 1, k, N)) -> (experts hit, 1) int64: greater(mask.sum((-1, -2)), 0)
  // .nonzero(), the sum and the bools dying with the statement; attributes.shape.
  kExpertHits,
  kEqScalar,       // self == <a Python int>: a 0-dim bool
  kNonzero,        // (self) -> (n, ndim) int64, attributes.shape: torch.where(mask)
  // (self, index0, index1): self[index0, index1] (index.Tensor with two 1-D int64
  // indices on dims 0 and 1).
  kIndexPair,
  // (self, index, source) -> self: index_add_(0, index, source) in place.
  kIndexAddInplace,
  // (q, k, v, attn_mask) -> (out, logsumexp): the CPU flash kernel with an additive
  // float mask (a sliding window's), which its backward node keeps too.
  kFlashAttentionMasked,
  // (bool mask) -> the additive mask in the query's dtype: ATen's SDPA
  // convert_boolean_attn_mask, where(mask, 0, -inf) with both numbers 0-dim tensors of
  // that dtype (freed after it). Not differentiable.
  kSdpaBoolMask,
  // (q, k, v) -> (out, logsumexp, rng_state, unused): CUDA's FlashAttention-2 kernel,
  // _scaled_dot_product_flash_attention (grouped-query heads read in place).
  kCudaFlashAttention,
  // (q, k, v) -> (out, log_sumexp, philox_seed, philox_offset): CUDA's memory-efficient
  // kernel, _scaled_dot_product_efficient_attention, with no bias.
  kEfficientAttention,
  // (q, k, v) -> (out, logsumexp, philox_seed, philox_offset): cuDNN's fused attention,
  // _scaled_dot_product_cudnn_attention, with no bias.
  kCudnnAttention,
  // (q, k, v, attn_bias) -> (out, log_sumexp, philox_seed, philox_offset): the
  // memory-efficient kernel with an additive mask (a sliding window's), which its
  // backward node keeps.
  kEfficientAttentionMasked,
  // transformers' expert parallelism (AllToAllEP, distributed/expert_parallel.py):
  kZeros,              // () -> zeros(attributes.shape): not differentiable
  kOnesLike,           // ones_like(self), in the op's dtype: not differentiable
  kArange,             // () -> arange(attributes.shape[0]) in the op's dtype
  kRepeat,             // self.repeat(...) to attributes.shape: integer ids here
  // (self, repeats) -> self.repeat_interleave(repeats, output_size=attributes.shape[0]):
  // the (R) int64 row index first (repeat_interleave of the repeats), then index_select.
  kRepeatInterleave,
  kStack,              // (a, b) -> stack([a, b]) to attributes.shape: integer counts here
  // (self, index, src) -> self: scatter_add_(0, index, src) in place, on integer counts.
  kScatterAddInplace,
  // (self, indices, values) -> self: self[indices] = values (index_put_ in place, one
  // 1-D int64 index).
  kIndexPutInplace,
  // (x) -> the (rows, ...) result of _c10d_functional.all_to_all_single, a new tensor;
  // attributes.shape. Its autograd (torch.library.register_autograd in
  // distributed/_functional_collectives.py) keeps no tensor: backward is the reverse
  // all-to-all of grad_output.contiguous().
  kAllToAll,
  // An expert-parallel grouped_mm experts module's sentinel rows (integrations/moe.py):
  kGeScalar,           // self >= <a Python int>, a bool per element: not differentiable
  kMaskedFillInplace,  // (self, mask) -> self: masked_fill_(mask, <a number>) in place
  // The decoder model's own tensors, made once per forward without grad
  // (ModelGraphs::tensors_before_prologue, tensors_after_prologue): the rotary tables,
  // the position ids and the sliding-window mask. Not differentiable.
  // self + n or self - n with a Python int n: add.Tensor / sub.Tensor with n wrapped in
  // a 0-dim int64 tensor on the host, freed after the op.
  kAddWrappedInt,
  // self / <a Python number>: div.Scalar, the number wrapped (a float64 and its
  // conversion to self's dtype) before the output and freed after it, as kMulScalar.
  kDivScalar,
  // pow(<a Python number>, self): pow.Scalar; the base's wrapping comes and goes after
  // the output.
  kPowScalarBase,
  // <a Python number> / self: empty_like(self).fill_(n).div_(self) (ATen's
  // TensorOperators.h for a Scalar left operand): one new tensor.
  kScalarDivide,
  kOuter,       // (a (n), b (m)) -> (n, m)
  kCos,
  kSin,
  kOnes,        // () -> ones(attributes.shape) in the op's dtype (new_ones)
  kGt,          // self > other, broadcast: a bool per element
  kLe,          // self <= other, broadcast: a bool per element
  kBitwiseAnd,  // self & other, broadcast (bools)
  // peft's DoRA (tuners/lora/dora.py, DoraLinearLayer.forward):
  kEye,  // () -> eye(attributes.shape[0]) in the op's dtype: not differentiable
  // (self (rows, cols)) -> (rows): torch.linalg.norm(self, dim=1), linalg_vector_norm's
  // 2-norm over dim 1 in self's dtype.
  kLinalgVectorNorm,
  kDivTensor,  // (self, other) -> self / other, broadcast (div.Tensor)
  kSub,        // (self, other) -> self - other, broadcast (sub.Tensor, alpha 1)
};
inline constexpr int kNumOpTypes = static_cast<int>(OpType::kSub) + 1;

const char* OpTypeName(OpType type);  // ATen's name: "native_layer_norm", "addmm", ...

// KeepRule says which tensor of an op its backward node saves, and when: LibTorch only
// saves a tensor if the gradient that needs it will be computed (derivatives.yaml).
struct KeepRule {
  bool is_output = false;
  int index = 0;                 // into OpDef::inputs or OpDef::outputs
  int needs_grad_of_input = -1;  // saved only if this input requires grad; -1: always
  std::string_view saved_name;   // the SavedVariable member in Functions.h: "mat1_"
  // wrapped_number: the saved tensor is a wrapped Python number, which SavedVariable
  // stores without calling the saved-tensor hooks (torch/csrc/autograd/
  // saved_variable.cpp: no pack hook for is_wrapped_number()): held, not saved.
  bool wrapped_number = false;
};

struct OpSemantics {
  // Saved tensors of the backward node, as Functions.h lists them.
  std::vector<KeepRule> keeps;
  // Inputs that autograd differentiates (masked_fill's mask is not).
  std::vector<int> differentiable_inputs;
  // The backward nodes the op can create (reshape: a view's or a copy's), empty for an
  // op that never has one; their SavedVariable members are exactly the `keeps` names
  // plus `absent_saved`.
  std::vector<std::string_view> backward_nodes;
  // SavedVariable members for optional inputs the graph never passes, which hold an
  // undefined tensor and no storage (SDPA's attn_mask_).
  std::vector<std::string_view> absent_saved;
  // custom_function: a Python autograd Function of Megatron-LM's (its ctx saves the
  // keeps), not an ATen op: no Functions.h node to check the names against.
  bool custom_function = false;
};

// RuleTable maps every OpType to its semantics. Pinned() is the pinned release's; a
// copy can be changed with Set() to model another release, or a wrong rule in a test
// of the verifier.
class RuleTable {
 public:
  // Pinned returns kTorchRelease's rules; built once, immutable, thread-safe.
  static const RuleTable& Pinned();

  const OpSemantics& Of(OpType type) const { return table_[static_cast<int>(type)]; }
  void Set(OpType type, OpSemantics semantics) {
    table_[static_cast<int>(type)] = std::move(semantics);
  }

 private:
  RuleTable() = default;
  std::array<OpSemantics, kNumOpTypes> table_;
};

}  // namespace memledger

#endif  // ESTIMATOR_GRAPH_RULES_H_
