// The symbolic graph of one pre-LN Transformer block (and of the loss) as LibTorch 1.13
// executes it: every ATen op the forward runs, with symbolic shapes in (B, T, d, H),
// which outputs are views of an input, and what each op's backward node keeps.
//
// Example:
//   const BlockGraph& block = BlockGraphFor(AttentionMode::kFlash);
//   for (const OpDef& op : block.ops) ...  // in execution order
#ifndef ESTIMATOR_BLOCK_GRAPH_H_
#define ESTIMATOR_BLOCK_GRAPH_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "estimator/config.h"
#include "estimator/shape.h"

namespace memledger {

// OpType is an ATen op, named as LibTorch 1.13 names it. Views and copies follow
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
  kFlashAttention,  // (q, k, v) -> (out, logsumexp), PyTorch 2.x CPU flash contract
  kMulScalar,
  kCausalMask,  // ones(T, T, bool).triu(1): no inputs, not differentiable
  kMaskedFill,  // (self, mask)
  kSoftmax,
  kAdd,
  kGelu,
  kPow,  // pow(self, 2)
  kMean,
};

const char* OpTypeName(OpType type);  // ATen's name: "native_layer_norm", "addmm", ...

// TensorDef is one tensor of the graph; its layout is derived during a walk.
struct TensorDef {
  std::string name;  // "ln1.out", "qkv.weight"
  DType dtype = DType::kFloat32;
  bool is_parameter = false;
  std::vector<SymDim> shape;  // parameters and the graph input only
};

// OpDef is one op in execution order.
struct OpDef {
  OpType type;
  std::string name;  // where it sits in the block: "qkv", "attention.scores"
  std::vector<int> inputs;
  std::vector<int> outputs;
  std::vector<SymDim> shape;  // target shape of view/reshape/_unsafe_view/expand
  std::vector<int> dims;      // permute order; transpose (dim0, dim1); select (dim, index)
  // policy_kind says which selective-checkpointing op kind this op belongs to.
  std::optional<OpKind> policy_kind;
};

// KeepRule says which tensor of an op its backward node saves, and when: LibTorch only
// saves a tensor if the gradient that needs it will be computed (derivatives.yaml).
struct KeepRule {
  bool is_output = false;
  int index = 0;                    // into OpDef::inputs or OpDef::outputs
  int needs_grad_of_input = -1;     // saved only if this input requires grad; -1: always
};

struct OpSemantics {
  // Saved tensors of the backward node, as Functions.h lists them.
  std::vector<KeepRule> keeps;
  // Inputs that autograd differentiates (masked_fill's mask is not).
  std::vector<int> differentiable_inputs;
  // Output i is a view of input `view_of[i]` (shares its storage); -1 if new storage.
  // kReshape decides at walk time.
  std::vector<int> view_of;
};

const OpSemantics& SemanticsOf(OpType type);

// BlockGraph is one block (input x of shape (B, T, d) -> output) or the loss.
struct BlockGraph {
  std::vector<TensorDef> tensors;
  std::vector<OpDef> ops;
  int input = 0;
  int output = 0;
};

// BlockGraphFor returns the block graph for `mode`; built once, immutable, thread-safe.
const BlockGraph& BlockGraphFor(AttentionMode mode);
// LossGraph returns x.pow(2).mean() on the last block's output.
const BlockGraph& LossGraph();

}  // namespace memledger

#endif  // ESTIMATOR_BLOCK_GRAPH_H_
