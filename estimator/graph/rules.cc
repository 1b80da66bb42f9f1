#include "estimator/graph/rules.h"

#include <utility>

namespace memledger {
namespace {

KeepRule In(int index, std::string_view saved_name, int needs_grad_of_input = -1) {
  return KeepRule{false, index, needs_grad_of_input, saved_name};
}
KeepRule Out(int index, std::string_view saved_name) {
  return KeepRule{true, index, -1, saved_name};
}

// A view op's rule: its backward node keeps sizes only. (Which outputs are views, and
// when reshape copies, is ATen's layout logic, in the walker.)
OpSemantics View(std::string_view backward_node) {
  return OpSemantics{{}, {0}, {backward_node}, {}};
}

// PinnedSemantics is torch 2.15.0's rule for `type`. Line numbers are those of the
// wheel's torchgen/packaged/autograd/derivatives.yaml; saved names are the members of
// the backward node in torch/csrc/autograd/generated/Functions.h. A derivative formula
// that uses a tensor only for one input's gradient saves it only when that input
// requires grad. No `default:` so that -Wswitch (an error here) catches a new OpType.
OpSemantics PinnedSemantics(OpType type) {
  switch (type) {
    case OpType::kNativeLayerNorm:
      // yaml:1294 native_layer_norm: input, weight, bias: native_layer_norm_backward(
      // grad, input, normalized_shape, result1, result2, weight, bias, grad_input_mask).
      return {{In(0, "input_"), In(1, "weight_"), In(2, "bias_"), Out(1, "result1_"),
               Out(2, "result2_")},
              {0, 1, 2},
              {"NativeLayerNormBackward0"},
              {}};
    case OpType::kView:
      return View("ViewBackward0");  // yaml:1950 view: grad.reshape_symint(self.sym_sizes())
    case OpType::kReshape:
      // reshape is composite (yaml:1505): view() when strides allow, else
      // _unsafe_view(clone(contiguous)); neither node keeps a tensor.
      return OpSemantics{
          {}, {0}, {"ViewBackward0", "CloneBackward0", "UnsafeViewBackward0"}, {}};
    case OpType::kUnsafeView:
      return View("UnsafeViewBackward0");  // yaml:1919
    case OpType::kPermute:
      return View("PermuteBackward0");  // yaml:1407: permute_backwards(grad, dims)
    case OpType::kTranspose:
      return View("TransposeBackward0");  // yaml:1803: grad.transpose(dim0, dim1)
    case OpType::kSelect:
      return View("SelectBackward0");  // yaml:1540: select_backward(grad, sizes, dim, index)
    case OpType::kExpand:
      return View("ExpandBackward0");  // yaml:666: at::sum_to(grad, self.sym_sizes())
    case OpType::kT:
      return View("TBackward0");  // yaml:1758: grad.t()
    case OpType::kAddmm:
      // yaml:256 addmm: mat1: mm_mat1_backward(grad, mat2, ...), mat2:
      // mm_mat2_backward(grad, mat1, ...): mat1 for mat2's gradient and vice versa.
      return {{In(1, "mat1_", /*needs_grad_of_input=*/2), In(2, "mat2_", 1)},
              {0, 1, 2},
              {"AddmmBackward0"},
              {}};
    case OpType::kBmm:
      // yaml:378 bmm: self: grad.bmm(mat2.transpose(1, 2).conj()),
      // mat2: self.transpose(1, 2).conj().bmm(grad).
      return {{In(0, "self_", 1), In(1, "mat2_", 0)}, {0, 1}, {"BmmBackward0"}, {}};
    case OpType::kFlashAttention:
      // yaml:2943 _scaled_dot_product_flash_attention_for_cpu: query, key, value:
      // ..._backward(grad, query, key, value, output, logsumexp, dropout_p, is_causal,
      // attn_mask, scale). attn_mask is None here: an undefined SavedVariable.
      return {{In(0, "query_"), In(1, "key_"), In(2, "value_"), Out(0, "output_"),
               Out(1, "logsumexp_")},
              {0, 1, 2},
              {"ScaledDotProductFlashAttentionForCpuBackward0"},
              {"attn_mask_"}};
    case OpType::kMulScalar:
      // yaml:1256 mul.Scalar: mul_tensor_backward(grad, other, self.scalar_type()).
      return {{}, {0}, {"MulBackward1"}, {}};
    case OpType::kCausalMask:
      return {{}, {}, {}, {}};  // a bool constant: never has a backward node
    case OpType::kMaskedFill:
    case OpType::kMaskedFillInplace:
      // yaml:1098 masked_fill.Scalar (masked_fill_ too): self: grad.masked_fill(mask, 0);
      // mask: non_differentiable.
      return {{In(1, "mask_")}, {0}, {"MaskedFillBackward0"}, {}};
    case OpType::kSoftmax:
      // yaml:2239 _softmax: _softmax_backward_data(grad, result, dim, ...).
      return {{Out(0, "result_")}, {0}, {"SoftmaxBackward0"}, {}};
    case OpType::kAdd:
      // yaml:229 add.Tensor: grad, maybe_multiply(grad, alpha): no tensor.
      return {{}, {0, 1}, {"AddBackward0"}, {}};
    case OpType::kGelu:
      // yaml:2162 gelu: gelu_backward(grad, self, approximate).
      return {{In(0, "self_")}, {0}, {"GeluBackward0"}, {}};
    case OpType::kPow:
      // yaml:1415 pow.Tensor_Scalar: pow_backward(grad, self, exponent).
      return {{In(0, "self_")}, {0}, {"PowBackward0"}, {}};
    case OpType::kMean:
      // yaml:1159 mean: grad.expand_symint(self.sym_sizes()) / self.sym_numel().
      return {{}, {0}, {"MeanBackward0"}, {}};
    case OpType::kEmbedding:
      // yaml:2060 embedding: indices: non_differentiable; weight:
      // embedding_backward_symint(grad, indices, ...). (1.13 also kept weight_.)
      return {{In(1, "indices_")}, {0}, {"EmbeddingBackward0"}, {}};
    case OpType::kMm:
      // yaml:1238 mm: self: mm_mat1_backward(grad, mat2, ...), mat2:
      // mm_mat2_backward(grad, self, ...).
      return {{In(0, "self_", 1), In(1, "mat2_", 0)}, {0, 1}, {"MmBackward0"}, {}};
    case OpType::kMulTensor:
      // yaml:1251 mul.Tensor: self: mul_tensor_backward(grad, other, ...), other:
      // mul_tensor_backward(grad, self, ...).
      return {{In(0, "self_", 1), In(1, "other_", 0)}, {0, 1}, {"MulBackward0"}, {}};
    case OpType::kAddScalar:
      // yaml:234 add.Scalar: handle_r_to_c(self.scalar_type(), grad). Python's `x + eps`
      // is add.Tensor with the number wrapped (yaml:229): AddBackward0 keeps nothing
      // either.
      return {{}, {0}, {"AddBackward1", "AddBackward0"}, {}};
    case OpType::kRsqrt:
      // yaml:1519 rsqrt: -0.5 * grad * result.pow(3).conj().
      return {{Out(0, "result_")}, {0}, {"RsqrtBackward0"}, {}};
    case OpType::kMeanDim:
      // yaml:1169 mean.dim: mean_backward(grad, self.sym_sizes(), dim, self.sym_numel(),
      // keepdim). (1.13 kept self_.)
      return {{}, {0}, {"MeanBackward1"}, {}};
    case OpType::kSilu:
      // yaml:2138 silu: ...silu_backward(grad, self).
      return {{In(0, "self_")}, {0}, {"SiluBackward0"}, {}};
    case OpType::kNeg:
      return {{}, {0}, {"NegBackward0"}, {}};  // yaml:1324 neg: grad.neg()
    case OpType::kSlice:
      // yaml:1583 slice.Tensor: slice_backward_wrapper(grad, sizes, ...); split.Tensor
      // (yaml:1632) is the same view with a node that keeps no tensor either.
      return OpSemantics{{}, {0}, {"SliceBackward0", "SplitBackward0"}, {}};
    case OpType::kCat:
      // yaml:386 cat: cat_tensors_backward(grad, sizes, scalar types, dim).
      return {{}, {0, 1}, {"CatBackward0"}, {}};
    case OpType::kUnsqueeze:
      return View("UnsqueezeBackward0");  // yaml:1931 unsqueeze: grad.squeeze(dim)
    case OpType::kLogSoftmax:
      // yaml:2203 _log_softmax: _log_softmax_backward_data(grad, result, dim, ...).
      return {{Out(0, "result_")}, {0}, {"LogSoftmaxBackward0"}, {}};
    case OpType::kNllLoss:
      // yaml:2110 nll_loss_forward: self: nll_loss_backward_symint(grad, self, target,
      // weight, reduction, ignore_index, total_weight); target: non_differentiable.
      // weight is None: an undefined SavedVariable.
      return {{In(0, "self_"), In(1, "target_"), Out(1, "total_weight_")},
              {0},
              {"NllLossBackward0"},
              {"weight_"}};
    case OpType::kConstantPad:
      // yaml:2032 constant_pad_nd: constant_pad_nd_backward(grad, pad); labels are int64
      // and never require grad.
      return {{}, {0}, {"ConstantPadNdBackward0"}, {}};
    case OpType::kContiguous:
      // contiguous() is clone(memory_format) when a copy is needed (yaml:451 clone: grad).
      return OpSemantics{{}, {0}, {"CloneBackward0"}, {}};
    case OpType::kToDtype:
      // .to(dtype) is _to_copy when it converts (yaml:_to_copy: _to_copy_backward(grad,
      // self.options())): no tensor kept.
      return OpSemantics{{}, {0}, {"ToCopyBackward0"}, {}};
    case OpType::kNativeDropout:
      // yaml:620 native_dropout: input: native_dropout_backward(grad, result1, scale):
      // the bool mask only.
      return {{Out(1, "result1_")}, {0}, {"NativeDropoutBackward0"}, {}};
    case OpType::kGatherLinear:
      // Megatron's LinearWithGradAccumulationAndAsyncCommunication with sequence
      // parallelism: ctx.save_for_backward(input, weight), the input before its
      // all-gather (backward gathers it again).
      return {{In(0, "input"), In(1, "weight")}, {0, 1, 2}, {"LinearWithGradAccumulation"},
              {}, /*custom_function=*/true};
    case OpType::kReduceScatter:
      // _ReduceScatterToSequenceParallelRegion: backward all-gathers; nothing saved.
      return {{}, {0}, {"ReduceScatterToSequenceParallelRegion"}, {}, true};
    case OpType::kScatter:
      // _ScatterToSequenceParallelRegion: backward all-gathers; nothing saved.
      return {{}, {0}, {"ScatterToSequenceParallelRegion"}, {}, true};
    case OpType::kVocabParallelEmbedding:
      // Megatron's VocabParallelEmbedding: embedding keeps the masked ids and the
      // zeroing of other ranks' rows the mask (here one Function saves both).
      return {{Out(1, "masked_input"), Out(2, "input_mask")},
              {0},
              {"VocabParallelEmbedding"},
              {},
              true};
    case OpType::kFusedCausalSoftmax:
      // ScaledUpperTriangMaskedSoftmax: ctx.save_for_backward(softmax_results).
      return {{Out(0, "softmax_results")}, {0}, {"ScaledUpperTriangMaskedSoftmax"}, {}, true};
    case OpType::kTanh:
      // yaml:1790 tanh: tanh_backward(grad, result).
      return {{Out(0, "result_")}, {0}, {"TanhBackward0"}, {}};
    case OpType::kMulWrapped:
      // yaml:1251 mul.Tensor: self: mul_tensor_backward(grad, other, ...): the wrapped
      // number (output 1 here), kept when self requires grad; self_ would be kept for
      // other's gradient, which a number has not.
      return {{KeepRule{true, 1, 0, "other_", /*wrapped_number=*/true}},
              {0},
              {"MulBackward0"},
              {"self_"}};
    case OpType::kDropout:
      // yaml:1251 mul.Tensor (input * noise): self: mul_tensor_backward(grad, other,
      // ...): the noise, kept when the input requires grad; self_ would be kept for the
      // noise's gradient, which it never needs.
      return {{KeepRule{true, 1, 0, "other_"}}, {0}, {"MulBackward0"}, {"self_"}};
    case OpType::kAddInplace:
      // yaml:229 add.Tensor (add_ too): grad to self, the mask non-differentiable here
      // (a constant): no tensor kept.
      return {{}, {0}, {"AddBackward0"}, {}};
    case OpType::kSdpaCausalMask:
      return {{}, {}, {}, {}};  // a constant: never has a backward node
    case OpType::kSafeSoftmax:
      // yaml:2931 _safe_softmax: self: _softmax_backward_data(grad, result, dim, ...).
      return {{Out(0, "result_")}, {0}, {"SafeSoftmaxBackward0"}, {}};
    case OpType::kKvCacheCat:
      // yaml:386 cat: cat_tensors_backward: the gradient's narrow view; no tensor.
      return {{}, {0}, {"CatBackward0"}, {}};
    case OpType::kTopK:
      // yaml:1794 topk: self: value_selecting_reduction_backward_symint(grad, dim,
      // indices, self.sym_sizes(), true); the indices are not differentiable.
      return {{Out(1, "indices_")}, {0}, {"TopkBackward0"}, {}};
    case OpType::kSumDim:
      // yaml:1727 sum.dim_IntList: sum_backward(grad, self.sym_sizes(), dim, keepdim).
      return {{}, {0}, {"SumBackward1"}, {}};
    case OpType::kDivInplace:
      // yaml:589 div.Tensor: self: div_tensor_self_backward(grad, other, ...), other:
      // div_tensor_other_backward(grad, self, other): other for both, the original self
      // (the clone, output 1) for other's.
      return {{KeepRule{true, 1, 1, "self_"}, In(1, "other_")},
              {0, 1},
              {"DivBackward0"},
              {}};
    case OpType::kSort:
      // yaml:1622 sort: value_selecting_reduction_backward_symint(grad, dim, indices, ...);
      // never differentiated here (the routed expert ids are int64).
      return {{Out(1, "indices_")}, {0}, {"SortBackward0"}, {}};
    case OpType::kGeScalar:
    case OpType::kZeros:
    case OpType::kOnesLike:
    case OpType::kArange:
    case OpType::kRepeat:
    case OpType::kRepeatInterleave:
    case OpType::kStack:
    case OpType::kScatterAddInplace:
    case OpType::kFloorDivide:
    case OpType::kHistc:  // yaml:805 histc: output_differentiability: [False]
    case OpType::kCumsum:
    case OpType::kInversePermutation:
    case OpType::kZerosLike:
    case OpType::kOneHot:
    case OpType::kExpertHits:
    case OpType::kEqScalar:
    case OpType::kNonzero:
      return {{}, {}, {}, {}};  // integer tensors: never a backward node
    case OpType::kAddWrappedInt:
      // yaml:229 add.Tensor, yaml:1699 sub.Tensor with the number wrapped: grad (negated
      // for sub's other, a number): no tensor. The model's own tensors make it under
      // no_grad; DoRA's `mag_norm_scale - 1` with grad.
      return {{}, {0}, {"AddBackward0", "SubBackward0"}, {}};
    // The model's own tensors, made under no_grad (its position ids, rotary tables and
    // masks): never a backward node.
    case OpType::kDivScalar:
    case OpType::kPowScalarBase:
    case OpType::kScalarDivide:
    case OpType::kOuter:
    case OpType::kCos:
    case OpType::kSin:
    case OpType::kOnes:
    case OpType::kGt:
    case OpType::kLe:
    case OpType::kBitwiseAnd:
    case OpType::kEye:
      return {{}, {}, {}, {}};
    case OpType::kLinalgVectorNorm:
      // yaml:1363 linalg_vector_norm: self: linalg_vector_norm_backward(grad, self, ord,
      // result, dim, keepdim). Never differentiated here: DoRA's weight norm is of
      // detached tensors (its step row has no backward).
      return {{In(0, "self_"), Out(0, "result_")}, {0}, {"LinalgVectorNormBackward0"}, {}};
    case OpType::kDivTensor:
      // yaml:589 div.Tensor: self: div_tensor_self_backward(grad, other, ...), other:
      // div_tensor_other_backward(grad, self, other): other for either, self for other's.
      return {{In(0, "self_", 1), In(1, "other_")}, {0, 1}, {"DivBackward0"}, {}};
    case OpType::kSub:
      // yaml:1699 sub.Tensor: self: grad, other: -grad * alpha: no tensor.
      return {{}, {0, 1}, {"SubBackward0"}, {}};
    case OpType::kIndexRows:
      // yaml:847 index.Tensor: self: index_backward(grad.new_zeros(self.sizes()), indices,
      // grad); indices: non-differentiable.
      return {{In(1, "indices_")}, {0}, {"IndexBackward0"}, {}};
    case OpType::kFlashAttentionMasked:
      // yaml:2943 _scaled_dot_product_flash_attention_for_cpu with attn_mask given.
      return {{In(0, "query_"), In(1, "key_"), In(2, "value_"), Out(0, "output_"),
               Out(1, "logsumexp_"), In(3, "attn_mask_")},
              {0, 1, 2},
              {"ScaledDotProductFlashAttentionForCpuBackward0"},
              {}};
    case OpType::kSdpaBoolMask:
      return {{}, {}, {}, {}};  // from a bool mask: never has a backward node
    case OpType::kCudaFlashAttention:
      // derivatives.yaml:2939-2941, _scaled_dot_product_flash_attention: query, key, value:
      // _scaled_dot_product_flash_attention_backward_symint(grad, query, key, value,
      // output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
      // rng_state, unused, scale). cum_seq_q and cum_seq_k are undefined outputs
      // without nested inputs; the meta kernel makes rng_state (2,) and unused () uint64
      // (torch/_meta_registrations.py, meta__scaled_dot_product_flash_attention).
      return {{In(0, "query_"), In(1, "key_"), In(2, "value_"), Out(0, "output_"),
               Out(1, "logsumexp_"), Out(2, "rng_state_"), Out(3, "unused_")},
              {0, 1, 2},
              {"ScaledDotProductFlashAttentionBackward0"},
              {"cum_seq_q_", "cum_seq_k_"}};
    case OpType::kEfficientAttention:
      // derivatives.yaml:2935-2937, _scaled_dot_product_efficient_attention: query, key, value,
      // attn_bias: _scaled_dot_product_efficient_attention_backward(grad, query, key,
      // value, attn_bias, output, log_sumexp, philox_seed, philox_offset, dropout_p,
      // grad_input_mask, is_causal, scale). attn_bias is None here.
      return {{In(0, "query_"), In(1, "key_"), In(2, "value_"), Out(0, "output_"),
               Out(1, "log_sumexp_"), Out(2, "philox_seed_"), Out(3, "philox_offset_")},
              {0, 1, 2},
              {"ScaledDotProductEfficientAttentionBackward0"},
              {"attn_bias_"}};
    case OpType::kEfficientAttentionMasked:
      // derivatives.yaml:2935-2937 with attn_bias given: the expanded additive mask, kept.
      return {{In(0, "query_"), In(1, "key_"), In(2, "value_"), In(3, "attn_bias_"),
               Out(0, "output_"), Out(1, "log_sumexp_"), Out(2, "philox_seed_"),
               Out(3, "philox_offset_")},
              {0, 1, 2},
              {"ScaledDotProductEfficientAttentionBackward0"},
              {}};
    case OpType::kCudnnAttention:
      // derivatives.yaml:2959-2961, _scaled_dot_product_cudnn_attention: query, key,
      // value: _scaled_dot_product_cudnn_attention_backward_symint(grad, query, key,
      // value, output, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q,
      // cum_seq_k, max_q, max_k, dropout_p, is_causal, scale). attn_bias is None and
      // cum_seq_q, cum_seq_k undefined without nested inputs.
      return {{In(0, "query_"), In(1, "key_"), In(2, "value_"), Out(0, "output_"),
               Out(1, "logsumexp_"), Out(2, "philox_seed_"), Out(3, "philox_offset_")},
              {0, 1, 2},
              {"ScaledDotProductCudnnAttentionBackward0"},
              {"attn_bias_", "cum_seq_q_", "cum_seq_k_"}};
    case OpType::kIndexPair:
      // yaml:847 index.Tensor, with two indices (one SavedVariable list).
      return {{In(1, "indices_"), In(2, "indices_")}, {0}, {"IndexBackward0"}, {}};
    case OpType::kIndexPutInplace:
      // yaml index_put_: self: grad.index_put(indices, zeros_like(values), accumulate),
      // values: grad.index(indices): the indices only (probed: IndexPutBackward0's
      // _saved_indices is the index tensor itself).
      return {{In(1, "indices_")}, {0, 2}, {"IndexPutBackward0"}, {}};
    case OpType::kAllToAll:
      // all_to_all_single_setup_context keeps the split sizes and the group's name.
      return {{}, {0}, {"AllToAllSingle"}, {}, /*custom_function=*/true};
    case OpType::kIndexAddInplace:
      // yaml:866 index_add: self: grad; source: maybe_multiply(grad.index_select(dim,
      // index).expand_as(source), alpha): index and source for source's gradient.
      return {{In(1, "index_", 2), In(2, "source_", 2)}, {0, 2}, {"IndexAddBackward0"}, {}};
    case OpType::kGroupedMm:
      // yaml:1243 _grouped_mm: self: _grouped_mm_mat1_backward(grad, mat2, ..., offs),
      // mat2: _grouped_mm_mat2_backward(grad, self, ..., offs).
      return {{In(0, "self_", 1), In(1, "mat2_", 0), In(2, "offs_")},
              {0, 1},
              {"GroupedMmBackward0"},
              {}};
    case OpType::kVocabParallelCrossEntropy:
      // _VocabParallelCrossEntropy: ctx.save_for_backward(exp_logits, target_mask,
      // masked_target_1d), exp_logits being the logits themselves, turned into the
      // softmax in place.
      return {{In(0, "exp_logits"), Out(2, "target_mask"), Out(1, "masked_target_1d")},
              {0},
              {"VocabParallelCrossEntropy"},
              {},
              true};
  }
  return {};  // unreachable: every case returns
}

}  // namespace

const char* OpTypeName(OpType type) {
  switch (type) {
    case OpType::kNativeLayerNorm: return "native_layer_norm";
    case OpType::kView: return "view";
    case OpType::kReshape: return "reshape";
    case OpType::kUnsafeView: return "_unsafe_view";
    case OpType::kPermute: return "permute";
    case OpType::kTranspose: return "transpose";
    case OpType::kSelect: return "select";
    case OpType::kExpand: return "expand";
    case OpType::kT: return "t";
    case OpType::kAddmm: return "addmm";
    case OpType::kBmm: return "bmm";
    case OpType::kFlashAttention: return "_scaled_dot_product_flash_attention_for_cpu";
    case OpType::kMulScalar: return "mul";
    case OpType::kCausalMask: return "triu";
    case OpType::kMaskedFill: return "masked_fill";
    case OpType::kSoftmax: return "_softmax";
    case OpType::kAdd: return "add";
    case OpType::kGelu: return "gelu";
    case OpType::kPow: return "pow";
    case OpType::kMean: return "mean";
    case OpType::kEmbedding: return "embedding";
    case OpType::kMm: return "mm";
    case OpType::kMulTensor: return "mul";
    case OpType::kAddScalar: return "add";
    case OpType::kRsqrt: return "rsqrt";
    case OpType::kMeanDim: return "mean.dim";
    case OpType::kSilu: return "silu";
    case OpType::kNeg: return "neg";
    case OpType::kSlice: return "slice";
    case OpType::kCat: return "cat";
    case OpType::kUnsqueeze: return "unsqueeze";
    case OpType::kLogSoftmax: return "_log_softmax";
    case OpType::kNllLoss: return "nll_loss_forward";
    case OpType::kConstantPad: return "constant_pad_nd";
    case OpType::kContiguous: return "contiguous";
    case OpType::kToDtype: return "to";
    case OpType::kNativeDropout: return "native_dropout";
    case OpType::kGatherLinear: return "megatron_gather_linear";
    case OpType::kReduceScatter: return "megatron_reduce_scatter";
    case OpType::kScatter: return "megatron_scatter";
    case OpType::kVocabParallelEmbedding: return "megatron_vocab_parallel_embedding";
    case OpType::kVocabParallelCrossEntropy: return "megatron_vocab_parallel_cross_entropy";
    case OpType::kFusedCausalSoftmax: return "megatron_scaled_upper_triang_masked_softmax";
    case OpType::kTanh: return "tanh";
    case OpType::kMulWrapped: return "mul";
    case OpType::kDropout: return "dropout";
    case OpType::kAddInplace: return "add_";
    case OpType::kSdpaCausalMask: return "sdpa_causal_mask";
    case OpType::kSafeSoftmax: return "_safe_softmax";
    case OpType::kKvCacheCat: return "cat";
    case OpType::kTopK: return "topk";
    case OpType::kSumDim: return "sum.dim_IntList";
    case OpType::kDivInplace: return "div_";
    case OpType::kSort: return "sort";
    case OpType::kFloorDivide: return "floor_divide";
    case OpType::kIndexRows: return "index";
    case OpType::kHistc: return "histc";
    case OpType::kCumsum: return "cumsum";
    case OpType::kGroupedMm: return "_grouped_mm";
    case OpType::kInversePermutation: return "index_put_";
    case OpType::kZerosLike: return "zeros_like";
    case OpType::kOneHot: return "one_hot";
    case OpType::kExpertHits: return "nonzero";
    case OpType::kEqScalar: return "eq";
    case OpType::kNonzero: return "nonzero";
    case OpType::kIndexPair: return "index";
    case OpType::kIndexAddInplace: return "index_add_";
    case OpType::kFlashAttentionMasked: return "_scaled_dot_product_flash_attention_for_cpu";
    case OpType::kSdpaBoolMask: return "where";
    case OpType::kCudaFlashAttention: return "_scaled_dot_product_flash_attention";
    case OpType::kEfficientAttention: return "_scaled_dot_product_efficient_attention";
    case OpType::kCudnnAttention: return "_scaled_dot_product_cudnn_attention";
    case OpType::kEfficientAttentionMasked: return "_scaled_dot_product_efficient_attention";
    case OpType::kZeros: return "zeros";
    case OpType::kOnesLike: return "ones_like";
    case OpType::kArange: return "arange";
    case OpType::kRepeat: return "repeat";
    case OpType::kRepeatInterleave: return "repeat_interleave";
    case OpType::kStack: return "stack";
    case OpType::kScatterAddInplace: return "scatter_add_";
    case OpType::kIndexPutInplace: return "index_put_";
    case OpType::kAllToAll: return "_c10d_functional::all_to_all_single";
    case OpType::kGeScalar: return "ge";
    case OpType::kMaskedFillInplace: return "masked_fill_";
    case OpType::kAddWrappedInt: return "add";
    case OpType::kDivScalar: return "div";
    case OpType::kPowScalarBase: return "pow";
    case OpType::kScalarDivide: return "div_";
    case OpType::kOuter: return "outer";
    case OpType::kCos: return "cos";
    case OpType::kSin: return "sin";
    case OpType::kOnes: return "ones";
    case OpType::kGt: return "gt";
    case OpType::kLe: return "le";
    case OpType::kBitwiseAnd: return "bitwise_and";
    case OpType::kEye: return "eye";
    case OpType::kLinalgVectorNorm: return "linalg_vector_norm";
    case OpType::kDivTensor: return "div";
    case OpType::kSub: return "sub";
  }
  return "?";
}

const RuleTable& RuleTable::Pinned() {
  static const RuleTable* const kPinned = [] {
    auto* table = new RuleTable();
    for (int i = 0; i < kNumOpTypes; ++i) {
      table->Set(static_cast<OpType>(i), PinnedSemantics(static_cast<OpType>(i)));
    }
    return table;
  }();
  return *kPinned;
}

}  // namespace memledger
