// Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
// Models", reproduced by the graph walk: with Megatron's ops (--model=megatron-gpt: fp16,
// dropout p = 0.1 with 1-byte masks, the fused causal softmax, math attention) and
// Megatron's tensor parallelism, the activations a GPU holds match the paper's formulas
// for its 22B, 175B, 530B and 1T models.
//
// The paper's per-layer activation bytes (its section 4), s sequence, b micro-batch,
// h width, a heads, t tensor-parallel ranks:
//   no parallelism:               s b h (34 + 5 a s / h)
//   tensor parallel:              s b h (10 + 24 / t + 5 a s / (h t))
//   tensor + sequence parallel:   s b h (34 / t + 5 a s / (h t))
//   selective recompute (of the core attention: Megatron's default):
//                                 s b h (10 + 24 / t), s b h 34 / t with sequence
//                                 parallelism
//   full recompute:               2 s b h (the layer's input), 2 s b h / t with sequence
//                                 parallelism
// With 1F1B pipelining the first stage holds p micro-batches of L / p layers: L layers'
// worth, so a GPU's activations are L times the per-layer bytes (Table 2). These are
// computed here from the formulas, not taken from the walk, and the walk's layer bytes
// must come within 2% (the walk adds each LayerNorm's mean and rstd).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include "estimator/spec/config.h"
#include "estimator/request/model_presets.h"
#include "estimator/predict/predict.h"
#include "tests/status_matchers.h"

namespace memledger {
namespace {

struct PaperModel {
  const char* name;
  int64_t heads, width, layers, batch;  // a, h, L, b (s = 2048, t = 8)
};

// The paper's Table 3 configurations; the 22B model's micro-batch of 4, the others' 1.
constexpr PaperModel kModels[] = {
    {"22B", 64, 6144, 48, 4},
    {"175B", 96, 12288, 96, 1},
    {"530B", 128, 20480, 105, 1},
    {"1T", 160, 25600, 128, 1},
};
constexpr int64_t kSeq = 2048;
constexpr int64_t kTensorParallel = 8;

ModelConfig Megatron(const PaperModel& m, int64_t tp, bool sp = false) {
  absl::StatusOr<ModelConfig> config = ModelFromPreset("megatron-gpt");
  EXPECT_TRUE(config.ok()) << config.status();
  config->layers = m.layers;
  config->width = m.width;
  config->heads = m.heads;
  config->kv_heads = m.heads;
  config->head_dim = m.width / m.heads;
  config->intermediate = 4 * m.width;
  config->batch = m.batch;
  config->seq = kSeq;
  config->dtype = DType::kFloat16;
  config->shard.tp = tp;
  config->shard.sp = sp;
  return *config;
}

// LayerBytes is the walk's activation bytes of all L layers under `variant`.
int64_t LayerBytes(const ModelConfig& config, const char* variant) {
  PredictOptions options;
  options.attention = AttentionMode::kMath;
  options.peak = false;
  absl::StatusOr<std::vector<Variant>> variants = ParseVariants(variant, 2, "");
  EXPECT_TRUE(variants.ok()) << variants.status();
  options.variants = *variants;
  absl::StatusOr<Prediction> p = Predict(config, options);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? p->variants[0].layers_bytes : -1;
}

TEST(KorthikantiTest, PerGpuActivationsMatchThePaper) {
  std::printf("%-6s %-16s %14s %14s %10s\n", "model", "setup", "paper (GiB)", "walk (GiB)",
              "ratio");
  for (const PaperModel& m : kModels) {
    const double sbh = static_cast<double>(kSeq) * m.batch * m.width;
    const double t = kTensorParallel;
    const double attention = 5.0 * m.heads * kSeq / m.width;  // 5 a s / h
    struct Setup {
      const char* name;
      int64_t tp;
      bool sp;
      const char* variant;
      double per_layer;  // the paper's bytes per layer
    };
    const Setup setups[] = {
        {"no parallelism", 1, false, "none", sbh * (34 + attention)},
        {"tensor parallel", kTensorParallel, false, "none", sbh * (10 + 24 / t + attention / t)},
        {"tensor+sequence", kTensorParallel, true, "none", sbh * (34 / t + attention / t)},
        {"selective", kTensorParallel, false, "core_attention", sbh * (10 + 24 / t)},
        {"selective+seq", kTensorParallel, true, "core_attention", sbh * 34 / t},
        {"full recompute", kTensorParallel, false, "full", 2 * sbh},
        {"full, sequence", kTensorParallel, true, "full", 2 * sbh / t},
    };
    for (const Setup& setup : setups) {
      const double paper = setup.per_layer * m.layers;
      const int64_t walk = LayerBytes(Megatron(m, setup.tp, setup.sp), setup.variant);
      const double ratio = static_cast<double>(walk) / paper;
      std::printf("%-6s %-16s %14.2f %14.2f %10.6f\n", m.name, setup.name,
                  paper / (1 << 30), static_cast<double>(walk) / (1 << 30), ratio);
      EXPECT_NEAR(ratio, 1.0, 0.02) << m.name << " " << setup.name;
    }
  }
}

// The 22B model's layer by hand, fp16 (2 B), one rank of 8: s b h = 2048 x 4 x 6144.
// Replicated: the inputs of both LayerNorms, of c_attn and of c_fc (4 x 2 B) and two
// residual dropout masks (2 x 1 B) = 10 B per s b h; sharded: q, k, v copies (3 x 2 B),
// the merged heads c_proj reads (2 B), c_fc's output GELU keeps (4 x 2 B) and GELU's
// output c_proj keeps (4 x 2 B) = 24 B / 8; attention: softmax output (2 B), its dropout
// mask (1 B) and the dropped-out probabilities (2 B) per a/t x s x s x b; and the
// LayerNorms' mean and rstd, 2 x 2 x 2 B per token (in the model's dtype, as LibTorch's
// CPU layer norm returns them for an fp16 model; verify_grid_test measures that).
TEST(KorthikantiTest, OneTensorParallelRankByHand) {
  const PaperModel& m = kModels[0];
  const int64_t tokens = kSeq * m.batch;
  const int64_t sbh = tokens * m.width;
  const int64_t per_layer = 10 * sbh + 24 * sbh / 8 +
                            5 * (m.heads / 8) * kSeq * kSeq * m.batch + 8 * tokens;
  EXPECT_EQ(LayerBytes(Megatron(m, kTensorParallel), "none"), m.layers * per_layer);
}

// One rank's parameters (22B, t = 8) by hand, h = 6144: per layer c_attn h x 3h/8 +
// 3h/8, c_proj h/8 x h + h (its bias whole on every rank), c_fc h x 4h/8 + 4h/8,
// mlp.c_proj 4h/8 x h + h, two LayerNorms 2 x 2h; once: wte 51200/8 x h (tied to the
// head), wpe 2048 x h, ln_f 2h.
TEST(KorthikantiTest, OneRanksParametersByHand) {
  const ModelConfig config = Megatron(kModels[0], kTensorParallel);
  const int64_t h = 6144;
  const int64_t per_layer = h * 3 * h / 8 + 3 * h / 8 + h / 8 * h + h + h * 4 * h / 8 +
                            4 * h / 8 + 4 * h / 8 * h + h + 2 * 2 * h;
  const int64_t once = 51200 / 8 * h + 2048 * h + 2 * h;
  PredictOptions options;
  options.attention = AttentionMode::kMath;
  options.peak = false;
  ASSERT_OK_AND_ASSIGN(Prediction p, Predict(config, options));
  EXPECT_EQ(p.n_params, 48 * per_layer + once);
  EXPECT_EQ(p.param_bytes, 2 * p.n_params);  // fp16
}

TEST(KorthikantiTest, TensorParallelInputIsChecked) {
  ModelConfig config = Megatron(kModels[0], 5);  // 64 heads do not split 5 ways
  PredictOptions options;
  options.attention = AttentionMode::kMath;
  EXPECT_STATUS(Predict(config, options), absl::StatusCode::kInvalidArgument,
                "--heads 64 is not divisible by --tp 5");
  config.shard.tp = 8;
  options.attention = AttentionMode::kFlash;
  EXPECT_STATUS(Predict(config, options), absl::StatusCode::kInvalidArgument,
                "megatron-gpt needs --attention=math");
  ModelConfig study;
  study.shard.tp = 2;
  EXPECT_STATUS(Predict(study, PredictOptions()), absl::StatusCode::kInvalidArgument,
                "not the study family");
  ModelConfig sp = Megatron(kModels[0], 1, /*sp=*/true);
  options.attention = AttentionMode::kMath;
  EXPECT_STATUS(Predict(sp, options), absl::StatusCode::kInvalidArgument,
                "--sp (sequence parallelism) needs --tp >= 2 and a llama, gpt2, ");
}

}  // namespace
}  // namespace memledger
