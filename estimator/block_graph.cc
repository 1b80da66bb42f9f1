#include "estimator/block_graph.h"

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace memledger {
namespace {

// GraphBuilder appends tensors and ops in execution order. Composite helpers expand a
// torch::nn call into the ATen ops the pinned PyTorch runs for it.
class GraphBuilder {
 public:
  int Input(std::string name, std::vector<SymDim> shape) {
    graph_.input = AddTensor(std::move(name), DType::kFloat32, false, std::move(shape));
    return graph_.input;
  }

  int Param(std::string name, std::vector<SymDim> shape) {
    return AddTensor(std::move(name), DType::kFloat32, true, std::move(shape));
  }

  std::vector<int> Op(OpType type, std::string name, std::vector<int> inputs,
                      std::vector<std::string> output_names, std::vector<SymDim> shape = {},
                      std::vector<int> dims = {},
                      std::optional<OpKind> policy_kind = std::nullopt,
                      DType dtype = DType::kFloat32) {
    OpDef op;
    op.type = type;
    op.name = name;
    op.inputs = std::move(inputs);
    for (std::string& output : output_names) {
      // A single "out" is named after its op ("qkv"); several get suffixes ("ln1.mean").
      std::string tensor_name =
          output_names.size() == 1 && output == "out" ? name : absl::StrCat(name, ".", output);
      op.outputs.push_back(AddTensor(std::move(tensor_name), dtype, false, {}));
    }
    op.shape = std::move(shape);
    op.dims = std::move(dims);
    op.policy_kind = policy_kind;
    graph_.ops.push_back(std::move(op));
    return graph_.ops.back().outputs;
  }

  int Op1(OpType type, std::string name, std::vector<int> inputs,
          std::vector<SymDim> shape = {}, std::vector<int> dims = {},
          std::optional<OpKind> policy_kind = std::nullopt) {
    return Op(type, std::move(name), std::move(inputs), {"out"}, std::move(shape),
              std::move(dims), policy_kind)[0];
  }

  // LayerNorm: torch::nn::LayerNorm -> at::layer_norm -> native_layer_norm.
  int LayerNorm(const std::string& name, int x) {
    int weight = Param(name + ".weight", {kD});
    int bias = Param(name + ".bias", {kD});
    return Op(OpType::kNativeLayerNorm, name, {x, weight, bias}, {"out", "mean", "rstd"},
              {}, {}, OpKind::kLayerNorm)[0];
  }

  // Linear on a contiguous (B, T, in) input: at::linear's fused path,
  // addmm(bias, x.view(B*T, in), weight.t()).view(B, T, out).
  int Linear(const std::string& name, int x, SymDim in, SymDim out) {
    int weight = Param(name + ".weight", {out, in});
    int bias = Param(name + ".bias", {out});
    int flat = Op1(OpType::kView, name + ".flatten", {x}, {kB * kT, in});
    int weight_t = Op1(OpType::kT, name + ".weight_t", {weight});
    int mm = Op1(OpType::kAddmm, name, {bias, flat, weight_t}, {}, {}, OpKind::kMatmul);
    return Op1(OpType::kView, name + ".unflatten", {mm}, {kB, kT, out});
  }

  // Matmul of (B, H, n, m) by (B, H, m, p) as at::matmul runs it (the batched case of
  // ATen's composite matmul): expand both to the broadcast batch, reshape to
  // (B*H, ., .) (a copy unless it can be a view), bmm, and _unsafe_view the result back
  // to (B, H, n, p).
  int BatchedMatmul(const std::string& name, int a, std::vector<SymDim> a_shape, int b,
                    std::vector<SymDim> b_shape) {
    int a3 = Op1(OpType::kReshape, name + ".reshape_self",
                 {Op1(OpType::kExpand, name + ".expand_self", {a}, a_shape)},
                 {kB * kH, a_shape[2], a_shape[3]});
    int b3 = Op1(OpType::kReshape, name + ".reshape_mat2",
                 {Op1(OpType::kExpand, name + ".expand_mat2", {b}, b_shape)},
                 {kB * kH, b_shape[2], b_shape[3]});
    int bmm = Op1(OpType::kBmm, name, {a3, b3});
    return Op1(OpType::kUnsafeView, name + ".unflatten", {bmm},
               {kB, kH, a_shape[2], b_shape[3]});
  }

  BlockGraph Finish(int output) {
    graph_.output = output;
    return std::move(graph_);
  }

 private:
  int AddTensor(std::string name, DType dtype, bool is_parameter,
                std::vector<SymDim> shape) {
    graph_.tensors.push_back(TensorDef{std::move(name), dtype, is_parameter,
                                       std::move(shape)});
    return static_cast<int>(graph_.tensors.size()) - 1;
  }

  BlockGraph graph_;
};

// The study's Block.forward, op by op (see runtime/ for the same model in LibTorch).
BlockGraph BuildBlock(AttentionMode mode) {
  GraphBuilder g;
  int x = g.Input("x", {kB, kT, kD});
  int qkv = g.Linear("qkv", g.LayerNorm("ln1", x), kD, 3 * kD);
  int heads = g.Op1(OpType::kView, "qkv.split_heads", {qkv}, {kB, kT, Sym(3), kH, kDHead});
  int qkv_first = g.Op1(OpType::kPermute, "qkv.permute", {heads}, {}, {2, 0, 3, 1, 4});
  int q = g.Op1(OpType::kSelect, "q", {qkv_first}, {}, {0, 0});
  int k = g.Op1(OpType::kSelect, "k", {qkv_first}, {}, {0, 1});
  int v = g.Op1(OpType::kSelect, "v", {qkv_first}, {}, {0, 2});
  const std::vector<SymDim> bhtd = {kB, kH, kT, kDHead};

  int attention = 0;
  if (mode == AttentionMode::kFlash) {
    attention = g.Op(OpType::kFlashAttention, "attention", {q, k, v}, {"out", "logsumexp"},
                     {}, {}, OpKind::kAttention)[0];
  } else {
    int k_t = g.Op1(OpType::kTranspose, "attention.k_t", {k}, {}, {2, 3});
    int scores = g.BatchedMatmul("attention.scores", q, bhtd, k_t, {kB, kH, kDHead, kT});
    int scaled = g.Op1(OpType::kMulScalar, "attention.scale", {scores});
    int mask = g.Op(OpType::kCausalMask, "attention.causal_mask", {}, {"out"}, {kT, kT}, {},
                    std::nullopt, DType::kBool)[0];
    int masked = g.Op1(OpType::kMaskedFill, "attention.mask_fill", {scaled, mask});
    int probs = g.Op1(OpType::kSoftmax, "attention.softmax", {masked});
    attention = g.BatchedMatmul("attention.values", probs, {kB, kH, kT, kT}, v, bhtd);
  }
  int merged = g.Op1(OpType::kReshape, "attention.merge_heads",
                     {g.Op1(OpType::kTranspose, "attention.transpose", {attention}, {},
                            {1, 2})},
                     {kB, kT, kD});
  int x1 = g.Op1(OpType::kAdd, "residual1", {x, g.Linear("proj", merged, kD, kD)});
  int fc1 = g.Linear("fc1", g.LayerNorm("ln2", x1), kD, 4 * kD);
  int gelu = g.Op1(OpType::kGelu, "gelu", {fc1}, {}, {}, OpKind::kGelu);
  int x2 = g.Op1(OpType::kAdd, "residual2", {x1, g.Linear("fc2", gelu, 4 * kD, kD)});
  return g.Finish(x2);
}

BlockGraph BuildLoss() {
  GraphBuilder g;
  int y = g.Input("y", {kB, kT, kD});
  int squared = g.Op1(OpType::kPow, "loss.pow", {y});
  return g.Finish(g.Op1(OpType::kMean, "loss.mean", {squared}));
}

}  // namespace

const BlockGraph& BlockGraphFor(AttentionMode mode) {
  static const BlockGraph* const kFlash = new BlockGraph(BuildBlock(AttentionMode::kFlash));
  static const BlockGraph* const kMath = new BlockGraph(BuildBlock(AttentionMode::kMath));
  return mode == AttentionMode::kFlash ? *kFlash : *kMath;
}

const BlockGraph& LossGraph() {
  static const BlockGraph* const kLoss = new BlockGraph(BuildLoss());
  return *kLoss;
}

}  // namespace memledger
