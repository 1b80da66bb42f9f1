#include "estimator/rules.h"

#include <utility>

namespace memledger {
namespace {

KeepRule In(int index, std::string_view saved_name, int needs_grad_of_input = -1) {
  return KeepRule{false, index, needs_grad_of_input, saved_name};
}
KeepRule Out(int index, std::string_view saved_name) {
  return KeepRule{true, index, -1, saved_name};
}

// A view op: output 0 shares input 0's storage; the backward node keeps sizes only.
OpSemantics View(std::string_view backward_node) {
  return OpSemantics{{}, {0}, {0}, {backward_node}, {}};
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
              {-1, -1, -1},
              {"NativeLayerNormBackward0"},
              {}};
    case OpType::kView:
      return View("ViewBackward0");  // yaml:1950 view: grad.reshape_symint(self.sym_sizes())
    case OpType::kReshape:
      // reshape is composite (yaml:1505): view() when strides allow, else
      // _unsafe_view(clone(contiguous)); neither node keeps a tensor.
      return OpSemantics{
          {}, {0}, {0}, {"ViewBackward0", "CloneBackward0", "UnsafeViewBackward0"}, {}};
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
              {-1},
              {"AddmmBackward0"},
              {}};
    case OpType::kBmm:
      // yaml:378 bmm: self: grad.bmm(mat2.transpose(1, 2).conj()),
      // mat2: self.transpose(1, 2).conj().bmm(grad).
      return {{In(0, "self_", 1), In(1, "mat2_", 0)}, {0, 1}, {-1}, {"BmmBackward0"}, {}};
    case OpType::kFlashAttention:
      // yaml:2943 _scaled_dot_product_flash_attention_for_cpu: query, key, value:
      // ..._backward(grad, query, key, value, output, logsumexp, dropout_p, is_causal,
      // attn_mask, scale). attn_mask is None here: an undefined SavedVariable.
      return {{In(0, "query_"), In(1, "key_"), In(2, "value_"), Out(0, "output_"),
               Out(1, "logsumexp_")},
              {0, 1, 2},
              {-1, -1},
              {"ScaledDotProductFlashAttentionForCpuBackward0"},
              {"attn_mask_"}};
    case OpType::kMulScalar:
      // yaml:1256 mul.Scalar: mul_tensor_backward(grad, other, self.scalar_type()).
      return {{}, {0}, {-1}, {"MulBackward1"}, {}};
    case OpType::kCausalMask:
      return {{}, {}, {-1}, {}, {}};  // a bool constant: never has a backward node
    case OpType::kMaskedFill:
      // yaml:1098 masked_fill.Scalar: self: grad.masked_fill(mask, 0); mask:
      // non_differentiable.
      return {{In(1, "mask_")}, {0}, {-1}, {"MaskedFillBackward0"}, {}};
    case OpType::kSoftmax:
      // yaml:2239 _softmax: _softmax_backward_data(grad, result, dim, ...).
      return {{Out(0, "result_")}, {0}, {-1}, {"SoftmaxBackward0"}, {}};
    case OpType::kAdd:
      // yaml:229 add.Tensor: grad, maybe_multiply(grad, alpha): no tensor.
      return {{}, {0, 1}, {-1}, {"AddBackward0"}, {}};
    case OpType::kGelu:
      // yaml:2162 gelu: gelu_backward(grad, self, approximate).
      return {{In(0, "self_")}, {0}, {-1}, {"GeluBackward0"}, {}};
    case OpType::kPow:
      // yaml:1415 pow.Tensor_Scalar: pow_backward(grad, self, exponent).
      return {{In(0, "self_")}, {0}, {-1}, {"PowBackward0"}, {}};
    case OpType::kMean:
      // yaml:1159 mean: grad.expand_symint(self.sym_sizes()) / self.sym_numel().
      return {{}, {0}, {-1}, {"MeanBackward0"}, {}};
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
