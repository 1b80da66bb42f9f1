// The study's family: a stack of pre-LN blocks on a (B, T, d) input, loss x.pow(2).mean()
// (../shared/seed/22_memory_accounting.py).
#include <optional>
#include <string>
#include <vector>

#include "estimator/graph/family.h"
#include "estimator/spec/checked_math.h"
#include "estimator/graph/graph_builder.h"

namespace memledger {
namespace {

// The study's Block.forward, op by op (see runtime/ for the same model in LibTorch).
BlockGraph BuildStudyBlock(const ModelConfig& config, AttentionMode mode) {
  GraphBuilder g(config);
  int x = g.Input("x", {kB, kT, kD});
  int qkv = g.Linear("qkv", g.LayerNorm("ln1", x), kD, 3 * kD);
  int heads = g.Op1(OpType::kView, "qkv.split_heads", {qkv}, {.shape = {kB, kT, Sym(3), kH, kDHead}});
  int qkv_first = g.Op1(OpType::kPermute, "qkv.permute", {heads}, {.permutation = {2, 0, 3, 1, 4}});
  int q = g.Op1(OpType::kSelect, "q", {qkv_first}, {.dim = 0, .index = 0});
  int k = g.Op1(OpType::kSelect, "k", {qkv_first}, {.dim = 0, .index = 1});
  int v = g.Op1(OpType::kSelect, "v", {qkv_first}, {.dim = 0, .index = 2});
  int attention = g.CausalAttention(mode, q, k, v);
  int merged = g.Op1(OpType::kReshape, "attention.merge_heads",
                     {g.Op1(OpType::kTranspose, "attention.transpose", {attention},
                            {.dim = 1, .dim1 = 2})},
                     {.shape = {kB, kT, kD}});
  int x1 = g.Op1(OpType::kAdd, "residual1", {x, g.Linear("proj", merged, kD, kD)});
  int fc1 = g.Linear("fc1", g.LayerNorm("ln2", x1), kD, 4 * kD);
  int gelu = g.Op1(OpType::kGelu, "gelu", {fc1}, {}, OpKind::kGelu);
  int x2 = g.Op1(OpType::kAdd, "residual2", {x1, g.Linear("fc2", gelu, 4 * kD, kD)});
  return g.Finish(x2);
}

BlockGraph BuildStudyLoss(const ModelConfig& config) {
  GraphBuilder g(config);
  int y = g.Input("y", {kB, kT, kD});
  int squared = g.Op1(OpType::kPow, "loss.pow", {y});
  return g.Finish(g.Op1(OpType::kMean, "loss.mean", {squared}));
}

}  // namespace

// StudyFamily: the reference study's pre-LN block stack, input (B, T, d), loss
// x.pow(2).mean().
const FamilyDef& StudyFamily() {
  static const FamilyDef kDef = {
      .id = Family::kStudy,
      .name = "study",
      .fused_qkv = true,
      .graphs = [](const ModelConfig& config, AttentionMode mode) {
        ModelGraphs graphs;
        graphs.layer_kinds.push_back(BuildStudyBlock(config, mode));
        graphs.epilogue = BuildStudyLoss(config);
        return graphs;
      },
      // Per block 2 LayerNorms (2d each), QKV (3d^2 + 3d), proj (d^2 + d), fc1 (4d^2 + 4d),
      // fc2 (4d^2 + d).
      .expected_parameters = [](const ModelConfig& config) -> std::optional<int64_t> {
        const int64_t d = config.width;
        const CheckedInt64 n =
            CheckedInt64(config.layers) * (CheckedInt64(12) * d * d + CheckedInt64(13) * d);
        if (n.overflowed()) return std::nullopt;
        return n.value();
      },
      .presets = {{"study", ModelArchitecture()}},  // the study's defaults: 6 x 128, 4 heads
  };
  return kDef;
}

}  // namespace memledger
