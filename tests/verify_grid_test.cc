// The verification suite: on a hand-picked grid of the study's block (layers 1..8,
// widths 32..256, heads 1..8 with d_head from 4 to 64, batch 1..8, seq 1..128, both
// attention modes, every selective policy) and of the decoder families, every bucket
// the runtime measures equals the estimator's prediction exactly, for every variant,
// and every variant's gradients equal `none`'s within 1e-5.
#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "estimator/spec/config.h"
#include "estimator/request/model_presets.h"
#include "tests/status_matchers.h"
#include "verify/verify.h"

namespace memledger {
namespace {

struct GridCase {
  int64_t layers, width, heads, batch, seq;
  AttentionMode attention;
  const char* variants;
  const char* policy;

  friend std::ostream& operator<<(std::ostream& os, const GridCase& c) {
    return os << "L" << c.layers << "_d" << c.width << "_H" << c.heads << "_B" << c.batch
              << "_T" << c.seq << "_" << AttentionModeName(c.attention) << "_" << c.variants
              << "_" << c.policy;
  }
};

constexpr AttentionMode kFlash = AttentionMode::kFlash;
constexpr AttentionMode kMath = AttentionMode::kMath;
constexpr char kStudy[] = "none,full,every_2,selective";

// ExpectEveryBucket: n_params, param/grad/buffer/optimizer-state/AdamW-state bytes, and
// per variant its saved_bytes, the allocator's held_after_forward_bytes and the step's
// peak, each measured (nonzero; the study has no buffers).
void ExpectEveryBucket(const VerifyReport& report, size_t variants) {
  EXPECT_TRUE(report.peak_unavailable.empty()) << report.peak_unavailable;
  ASSERT_EQ(report.buckets.size(), 6 + 3 * variants);
  for (const BucketCheck& bucket : report.buckets) {
    if (bucket.name == "buffer_bytes") continue;
    EXPECT_GT(bucket.measured, 0) << bucket.name;
  }
}

// ExpectExact: every bucket measured == predicted, and the report passed (gradients too).
void ExpectExact(const VerifyReport& report) {
  for (const BucketCheck& bucket : report.buckets) {
    EXPECT_EQ(bucket.measured, bucket.predicted) << bucket.name;
  }
  EXPECT_TRUE(report.Passed()) << (report.failures.empty() ? "" : report.failures.front());
}

// ExpectFourVariantsExact verifies `config` with none, full, every_2 and selective
// (`policy`) in `attention` mode: every bucket measured and equal to its prediction.
// The report goes to `out` when given.
void ExpectFourVariantsExact(const ModelConfig& config, AttentionMode attention,
                             const char* policy, VerifyReport* out = nullptr) {
  VerifyOptions options;
  options.attention = attention;
  ASSERT_OK_AND_ASSIGN(options.variants, ParseVariants("none,full,every_2,selective", 2, policy));
  options.run.skip_timing = true;
  ASSERT_OK_AND_ASSIGN(VerifyReport report, Verify(config, options));
  ExpectEveryBucket(report, options.variants.size());
  ExpectExact(report);
  if (out != nullptr) *out = std::move(report);
}

class VerifyGridTest : public ::testing::TestWithParam<GridCase> {};

TEST_P(VerifyGridTest, MeasuredEqualsPredicted) {
  const GridCase& c = GetParam();
  ModelConfig config =
      StudyModel(/*layers=*/c.layers, /*width=*/c.width, /*heads=*/c.heads,
                 /*batch=*/c.batch, /*seq=*/c.seq);
  VerifyOptions options;
  options.attention = c.attention;
  ASSERT_OK_AND_ASSIGN(options.variants, ParseVariants(c.variants, /*every=*/2, c.policy));
  options.run.skip_timing = true;
  ASSERT_OK_AND_ASSIGN(VerifyReport report, Verify(config, options));

  ExpectEveryBucket(report, options.variants.size());
  for (const runtime::VariantMeasurement& v : report.measurement.variants) {
    EXPECT_LE(v.max_grad_diff, 1e-5) << v.variant.Name();
  }
  ExpectExact(report);
}

INSTANTIATE_TEST_SUITE_P(
    Grid, VerifyGridTest,
    ::testing::Values(
        // One layer, one token.
        GridCase{1, 32, 1, 1, 1, kFlash, kStudy, "matmul"},
        GridCase{2, 32, 2, 2, 8, kMath, kStudy, "matmul"},
        // every_1 == full, every_3, and k larger than layers.
        GridCase{3, 64, 4, 1, 16, kFlash, "none,every_1,every_3,every_7", "matmul"},
        // d_head = 4 with 8 heads.
        GridCase{8, 32, 8, 2, 4, kFlash, kStudy, "matmul"},
        // d_head = 32 with 3 heads, odd sizes.
        GridCase{4, 96, 3, 3, 5, kFlash, kStudy, "matmul"},
        // d_head = 64.
        GridCase{2, 128, 2, 4, 32, kMath, kStudy, "matmul"},
        GridCase{1, 256, 4, 1, 128, kFlash, kStudy, "matmul"},
        GridCase{5, 48, 6, 2, 7, kFlash, "none,every_1,every_3,every_10,selective", "matmul"},
        // One head: every reshape in math attention is a view.
        GridCase{6, 64, 1, 8, 2, kMath, kStudy, "matmul"},
        GridCase{2, 40, 5, 1, 1, kMath, kStudy, "matmul"},
        // Other selective policies.
        GridCase{3, 32, 4, 2, 3, kFlash, "none,selective", "gelu,layer_norm,attention"},
        GridCase{4, 32, 2, 8, 16, kFlash, "none,full,selective", "matmul,gelu"},
        GridCase{2, 64, 4, 3, 64, kMath, "none,selective", "layer_norm"},
        GridCase{7, 64, 8, 1, 9, kFlash, kStudy, ""},
        GridCase{2, 64, 4, 3, 128, kMath, kStudy, "matmul"},
        // d_head = 1 in math mode: the merged heads are a non-contiguous view, so proj's
        // at::linear leaves its fused path and matmul copies them (found by
        // //fuzz:predict_fuzzer as an Internal error before the fix).
        GridCase{2, 4, 4, 2, 3, kMath, kStudy, "matmul"},
        GridCase{3, 8, 8, 3, 5, kMath, kStudy, "matmul,gelu"}));

// The decoder families, embedding to loss: tiny-llama with kv heads < heads (repeat_kv
// copies), == heads, == 1 (repeat_kv's reshape is a view), tied head, q/k/v biases
// (Qwen2), Llama's attention and MLP biases, tiny-qwen3 (q/k norms) and tiny-gpt2; both
// attention modes; every variant and the family's policies.
struct FamilyCase {
  const char* model;
  int64_t kv_heads;  // 0: the preset's
  bool tie_embeddings;
  bool qkv_bias;
  int64_t layers, batch, seq;
  AttentionMode attention;
  const char* policy;
  // Llama's attention_bias adds o_proj's bias to q/k/v's, its mlp_bias gate/up/down's.
  bool o_bias = false;
  bool mlp_bias = false;

  friend std::ostream& operator<<(std::ostream& os, const FamilyCase& c) {
    return os << c.model << "_kv" << c.kv_heads << (c.tie_embeddings ? "_tied" : "")
              << (c.qkv_bias ? "_bias" : "") << (c.o_bias ? "_obias" : "")
              << (c.mlp_bias ? "_mlpbias" : "") << "_L" << c.layers << "_B" << c.batch << "_T"
              << c.seq << "_" << AttentionModeName(c.attention) << "_" << c.policy;
  }
};

class VerifyFamilyTest : public ::testing::TestWithParam<FamilyCase> {};

TEST_P(VerifyFamilyTest, MeasuredEqualsPredicted) {
  const FamilyCase& c = GetParam();
  ASSERT_OK_AND_ASSIGN(ModelConfig config, ModelFromPreset(c.model));
  if (c.kv_heads > 0) config.kv_heads = c.kv_heads;
  config.tie_embeddings = config.tie_embeddings || c.tie_embeddings;
  config.qkv_bias = c.qkv_bias;
  config.o_bias = c.o_bias;
  config.mlp_bias = c.mlp_bias;
  config.layers = c.layers;
  config.batch = c.batch;
  config.seq = c.seq;
  VerifyOptions options;
  options.attention = c.attention;
  ASSERT_OK_AND_ASSIGN(options.variants,
                       ParseVariants("none,full,every_2,every_3,selective", 2, c.policy));
  options.run.skip_timing = true;
  ASSERT_OK_AND_ASSIGN(VerifyReport report, Verify(config, options));
  ExpectEveryBucket(report, options.variants.size());
  ExpectExact(report);
}

// Precision and optimizers: the study's block, tiny-llama and tiny-gpt2 in bf16 and fp16
// (PyTorch keeps SDPA's logsumexp, RMSNorm's upcast and the loss's logits in fp32) and
// under bf16 / fp16 autocast, with each optimizer in each of torch.optim's
// implementations (for-loop, foreach, fused), with and without fp32 master weights;
// the step's peak too where it is simulated. Recompute is deterministic in low precision
// too, so gradients must still agree to 1e-5 (they agree exactly here).
struct PrecisionCase {
  const char* model;
  DType dtype;
  DType amp;
  OptimizerKind optimizer;
  double momentum;
  bool master_weights;
  AttentionMode attention;
  const char* policy;
  // torch.optim's implementation, as the runtime's OptimizerRunner runs it.
  OptimizerImpl impl = OptimizerImpl::kForLoop;

  friend std::ostream& operator<<(std::ostream& os, const PrecisionCase& c) {
    return os << c.model << "_" << ModelDTypeName(c.dtype) << "_amp" << AmpName(c.amp) << "_"
              << OptimizerName(c.optimizer) << "_" << OptimizerImplName(c.impl)
              << "_m" << c.momentum << (c.master_weights ? "_master" : "") << "_"
              << AttentionModeName(c.attention) << "_" << c.policy;
  }
};

class VerifyPrecisionTest : public ::testing::TestWithParam<PrecisionCase> {};

TEST_P(VerifyPrecisionTest, MeasuredEqualsPredicted) {
  const PrecisionCase& c = GetParam();
  ASSERT_OK_AND_ASSIGN(ModelConfig config, ModelFromPreset(c.model));
  config.dtype = c.dtype;
  config.amp = c.amp;
  config.batch = 2;
  config.seq = 12;
  VerifyOptions options;
  options.attention = c.attention;
  options.optimizer = {c.optimizer, c.momentum, c.master_weights, c.impl};
  ASSERT_OK_AND_ASSIGN(options.variants,
                       ParseVariants("none,full,every_2,selective", 2, c.policy));
  options.run.skip_timing = true;
  ASSERT_OK_AND_ASSIGN(VerifyReport report, Verify(config, options));
  // Every variant's step peak is measured and compared too.
  int peaks = 0;
  for (const BucketCheck& bucket : report.buckets) {
    peaks += absl::StartsWith(bucket.name, "peak_bytes.") && bucket.measured > 0;
  }
  EXPECT_TRUE(report.peak_unavailable.empty()) << report.peak_unavailable;
  EXPECT_EQ(peaks, static_cast<int>(options.variants.size()));
  ExpectExact(report);
}

constexpr DType kFp32 = DType::kFloat32;
constexpr DType kBf16 = DType::kBFloat16;
constexpr DType kFp16 = DType::kFloat16;
constexpr OptimizerKind kAdamW = OptimizerKind::kAdamW;
constexpr OptimizerKind kAdam = OptimizerKind::kAdam;
constexpr OptimizerKind kSgd = OptimizerKind::kSgd;
constexpr OptimizerImpl kForeach = OptimizerImpl::kForeach;
constexpr OptimizerImpl kFused = OptimizerImpl::kFused;

INSTANTIATE_TEST_SUITE_P(
    Precision, VerifyPrecisionTest,
    ::testing::Values(
        PrecisionCase{"study", kBf16, kFp32, kAdamW, 0, false, kFlash, "matmul"},
        PrecisionCase{"study", kBf16, kFp32, kAdam, 0, true, kMath, "matmul,gelu", kForeach},
        PrecisionCase{"study", kFp16, kFp32, kSgd, 0.9, true, kFlash, "attention,layer_norm", kFused},
        PrecisionCase{"study", kFp32, kFp32, kSgd, 0, false, kFlash, "matmul"},
        PrecisionCase{"study", kFp32, kFp32, kAdam, 0, false, kMath, "matmul", kFused},
        PrecisionCase{"tiny-llama", kBf16, kFp32, kAdamW, 0, false, kFlash, "matmul,silu", kForeach},
        PrecisionCase{"tiny-llama", kBf16, kFp32, kSgd, 0.9, false, kMath, "matmul", kForeach},
        PrecisionCase{"tiny-llama", kFp16, kFp32, kAdam, 0, true, kFlash, "attention"},
        PrecisionCase{"tiny-llama", kFp32, kFp32, kSgd, 0.5, false, kFlash, "matmul", kFused},
        PrecisionCase{"tiny-gpt2", kBf16, kFp32, kAdamW, 0, true, kFlash, "matmul,layer_norm", kFused},
        PrecisionCase{"tiny-gpt2", kFp16, kFp32, kSgd, 0, false, kMath, "layer_norm"},
        PrecisionCase{"tiny-gpt2", kFp32, kFp32, kAdam, 0, false, kFlash, "attention"},
        // Autocast over fp32 models: cast copies of inputs and weights kept by matmuls.
        PrecisionCase{"study", kFp32, kBf16, kAdamW, 0, false, kFlash, "matmul", kForeach},
        PrecisionCase{"study", kFp32, kBf16, kSgd, 0.9, false, kMath, "matmul,gelu"},
        PrecisionCase{"study", kFp32, kFp16, kAdam, 0, false, kFlash, "attention,layer_norm"},
        PrecisionCase{"tiny-llama", kFp32, kBf16, kAdamW, 0, false, kFlash, "matmul,attention,silu"},
        PrecisionCase{"tiny-llama", kFp32, kBf16, kAdamW, 0, false, kMath, "matmul", kFused},
        PrecisionCase{"tiny-llama", kFp32, kFp16, kSgd, 0, false, kFlash, "silu"},
        PrecisionCase{"tiny-gpt2", kFp32, kBf16, kAdam, 0, false, kFlash, "matmul,layer_norm"},
        PrecisionCase{"tiny-gpt2", kFp32, kFp16, kAdamW, 0, false, kMath, "layer_norm"},
        // Qwen3's q/k norms upcast each head's q and k to fp32 in low precision.
        PrecisionCase{"tiny-qwen3", kBf16, kFp32, kAdamW, 0, false, kFlash, "matmul,silu"},
        PrecisionCase{"tiny-qwen3", kFp16, kFp32, kSgd, 0.9, true, kMath, "matmul", kForeach},
        PrecisionCase{"tiny-qwen3", kFp32, kBf16, kAdamW, 0, false, kFlash, "matmul,attention"},
        PrecisionCase{"tiny-qwen3", kFp32, kFp16, kAdam, 0, false, kMath, "silu", kFused}));

INSTANTIATE_TEST_SUITE_P(
    Families, VerifyFamilyTest,
    ::testing::Values(
        FamilyCase{"tiny-llama", 0, false, false, 2, 16, 64, kFlash, "matmul"},
        FamilyCase{"tiny-llama", 0, false, false, 2, 16, 64, kMath, "matmul"},
        FamilyCase{"tiny-llama", 4, false, false, 3, 2, 9, kFlash, "attention,silu"},
        FamilyCase{"tiny-llama", 4, false, false, 3, 2, 9, kMath, "silu"},
        FamilyCase{"tiny-llama", 1, false, false, 2, 3, 5, kFlash, "matmul,attention"},
        FamilyCase{"tiny-llama", 1, false, false, 2, 3, 5, kMath, "matmul"},
        FamilyCase{"tiny-llama", 0, true, false, 4, 1, 17, kFlash, "matmul,silu"},
        FamilyCase{"tiny-llama", 0, true, false, 4, 1, 17, kMath, ""},
        FamilyCase{"tiny-llama", 0, false, true, 2, 2, 8, kFlash, "matmul,attention,silu"},
        FamilyCase{"tiny-llama", 0, false, true, 2, 2, 8, kMath, "matmul"},
        // Llama's attention_bias and mlp_bias: every projection an addmm with its bias.
        FamilyCase{"tiny-llama", 0, false, true, 2, 2, 8, kFlash, "matmul,attention,silu",
                   /*o_bias=*/true, /*mlp_bias=*/true},
        FamilyCase{"tiny-llama", 1, true, false, 3, 2, 9, kMath, "silu",
                   /*o_bias=*/false, /*mlp_bias=*/true},
        FamilyCase{"tiny-qwen3", 0, false, true, 2, 3, 5, kFlash, "matmul",
                   /*o_bias=*/true},
        // RoPE's output keeps the transposed projection's (B, T, H, d) memory order
        // (TensorIterator), so the scores' matmul copies q for its bmm; with matmul and
        // silu must-saved that copy is in the recompute's peak.
        FamilyCase{"tiny-llama", 0, false, false, 1, 16, 64, kMath, "matmul,silu"},
        FamilyCase{"tiny-gpt2", 0, false, false, 2, 16, 64, kFlash, "matmul"},
        FamilyCase{"tiny-gpt2", 0, false, false, 2, 16, 64, kMath, "matmul"},
        FamilyCase{"tiny-gpt2", 0, false, false, 3, 2, 11, kFlash,
                   "matmul,attention,layer_norm"},
        FamilyCase{"tiny-gpt2", 0, false, false, 3, 2, 11, kMath, "layer_norm"},
        // The step peaks in the recompute's split backward (one node for q, k and v).
        FamilyCase{"tiny-gpt2", 0, false, false, 1, 2, 16, kFlash, "matmul"},
        // Qwen3: q/k norms per head, 4 heads of 16 on a 32-wide model; grouped, MHA, MQA
        // and tied.
        FamilyCase{"tiny-qwen3", 0, false, false, 2, 16, 64, kFlash, "matmul"},
        FamilyCase{"tiny-qwen3", 0, false, false, 2, 16, 64, kMath, "matmul,silu"},
        FamilyCase{"tiny-qwen3", 4, false, false, 3, 2, 9, kFlash, "attention,silu"},
        FamilyCase{"tiny-qwen3", 1, true, false, 2, 3, 5, kFlash, "matmul,attention"},
        FamilyCase{"tiny-qwen3", 1, true, false, 2, 3, 5, kMath, ""}));

// Sparse mixtures of experts (the grouped_mm experts), from tiny-qwen3-moe (4 experts of
// width 32, 2 per token): Qwen3-MoE's block and Mixtral's (fp32 top-k weights, experts as
// wide as the dense MLP, no q/k norms), with and without a dense first layer, in each
// dtype and under autocast, both attention modes, the matmul and silu policies.
// The eager experts (a loop over the experts hit) size every expert's tensors by its
// tokens: verify predicts them with the routing its own step measured.
struct SparseCase {
  MoeBlock block;
  bool dense_first;
  DType dtype, amp;
  AttentionMode attention;
  const char* policy;
  ExpertsImpl impl = ExpertsImpl::kGroupedMm;

  friend std::ostream& operator<<(std::ostream& os, const SparseCase& c) {
    return os << (c.block == MoeBlock::kMixtral ? "mixtral" : "qwen3_moe")
              << (c.dense_first ? "_dense_first" : "") << "_" << DTypeName(c.dtype) << "_amp"
              << DTypeName(c.amp) << "_" << AttentionModeName(c.attention) << "_" << c.policy
              << (c.impl == ExpertsImpl::kEager ? "_eager" : "");
  }
};

class VerifySparseTest : public ::testing::TestWithParam<SparseCase> {};

TEST_P(VerifySparseTest, MeasuredEqualsPredicted) {
  const SparseCase& c = GetParam();
  ASSERT_OK_AND_ASSIGN(ModelConfig config, ModelFromPreset("tiny-qwen3-moe"));
  config.moe.block = c.block;
  if (c.block == MoeBlock::kMixtral) {
    config.qk_norm = false;
    config.moe.intermediate = config.Intermediate();
  }
  config.layers = c.dense_first ? 3 : 2;
  if (c.dense_first) config.moe.sparse_layers = {false, true, true};
  config.dtype = c.dtype;
  config.amp = c.amp;
  config.batch = 2;
  config.seq = 12;
  config.moe.impl = c.impl;
  VerifyReport report;
  ExpectFourVariantsExact(config, c.attention, c.policy, &report);
  if (c.impl == ExpertsImpl::kGroupedMm) return;
  // Predicted with the measured step's routing: a row per sparse layer, each its B x T
  // x k = 2 x 12 x 2 = 48 (token, expert) pairs over the 4 experts.
  const MoeSpec& moe = report.prediction.config.moe;
  EXPECT_EQ(moe.routing, RoutingSource::kGiven);
  ASSERT_EQ(moe.routing_rows.size(), 2u);  // 2 layers, or 3 with the first dense
  for (const std::vector<int64_t>& row : moe.routing_rows) {
    ASSERT_EQ(row.size(), 4u);
    EXPECT_EQ(row[0] + row[1] + row[2] + row[3], 48);
  }
  EXPECT_EQ(report.measurement.routing, moe.routing_rows);
  // Each variant's whole step routes on its own parameters (the steps before it moved
  // them), and its peak was predicted with that routing.
  for (const runtime::VariantMeasurement& v : report.measurement.variants) {
    ASSERT_EQ(v.step.routing.size(), 2u) << v.variant.Name();
    for (const std::vector<int64_t>& row : v.step.routing) {
      EXPECT_EQ(row[0] + row[1] + row[2] + row[3], 48) << v.variant.Name();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Sparse, VerifySparseTest,
    ::testing::Values(
        SparseCase{MoeBlock::kQwen3Moe, false, kFp32, kFp32, kFlash, "matmul"},
        SparseCase{MoeBlock::kQwen3Moe, true, kFp32, kFp32, kMath, "matmul,silu"},
        SparseCase{MoeBlock::kQwen3Moe, false, kBf16, kFp32, kFlash, "silu"},
        SparseCase{MoeBlock::kQwen3Moe, true, kFp32, kBf16, kFlash, "matmul,attention"},
        SparseCase{MoeBlock::kMixtral, false, kFp32, kFp32, kFlash, "matmul,silu"},
        SparseCase{MoeBlock::kMixtral, true, kBf16, kFp32, kMath, "matmul"},
        SparseCase{MoeBlock::kMixtral, false, kFp32, kBf16, kFlash, "attention,silu"},
        SparseCase{MoeBlock::kQwen3Moe, false, kFp32, kFp32, kFlash, "matmul,silu",
                   ExpertsImpl::kEager},
        SparseCase{MoeBlock::kQwen3Moe, true, kBf16, kFp32, kMath, "matmul",
                   ExpertsImpl::kEager},
        SparseCase{MoeBlock::kMixtral, false, kFp32, kBf16, kFlash, "silu",
                   ExpertsImpl::kEager},
        SparseCase{MoeBlock::kMixtral, true, kFp32, kFp32, kFlash, "attention",
                   ExpertsImpl::kEager}));

// Gemma 3's text model, from tiny-gemma3 (6 layers, 5 sliding-window : 1 global, width
// 32, 4 heads and 2 kv heads of 16): below its 512 window (no mask) in both attention
// modes, and with a window of 8 under seq 16 (the sliding layers' mask: repeat_kv
// copies, the additive mask kept, the attention policy's masked flash op); each dtype
// and autocast, the gelu, matmul and attention policies.
struct GemmaCase {
  int64_t window;
  DType dtype, amp;
  AttentionMode attention;
  const char* policy;

  friend std::ostream& operator<<(std::ostream& os, const GemmaCase& c) {
    return os << "window" << c.window << "_" << DTypeName(c.dtype) << "_amp"
              << DTypeName(c.amp) << "_" << AttentionModeName(c.attention) << "_" << c.policy;
  }
};

class VerifyGemmaTest : public ::testing::TestWithParam<GemmaCase> {};

TEST_P(VerifyGemmaTest, MeasuredEqualsPredicted) {
  const GemmaCase& c = GetParam();
  ASSERT_OK_AND_ASSIGN(ModelConfig config, ModelFromPreset("tiny-gemma3"));
  config.sliding_window = c.window;
  config.dtype = c.dtype;
  config.amp = c.amp;
  config.batch = 2;
  config.seq = 16;
  ExpectFourVariantsExact(config, c.attention, c.policy);
}

INSTANTIATE_TEST_SUITE_P(
    Gemma, VerifyGemmaTest,
    ::testing::Values(GemmaCase{512, kFp32, kFp32, kFlash, "matmul"},
                      GemmaCase{512, kFp32, kFp32, kMath, "matmul,gelu"},
                      GemmaCase{512, kBf16, kFp32, kFlash, "gelu"},
                      GemmaCase{512, kFp32, kBf16, kFlash, "matmul,attention"},
                      GemmaCase{8, kFp32, kFp32, kFlash, "attention"},
                      GemmaCase{8, kBf16, kFp32, kFlash, "matmul,gelu"},
                      GemmaCase{8, kFp32, kBf16, kFlash, "attention,gelu"}));

// Every selective policy, i.e. every subset of the op kinds the attention mode has:
// 16 subsets with flash attention, 8 with math (which has no flash op to must-save).
class VerifyPolicyTest : public ::testing::TestWithParam<std::tuple<AttentionMode, int>> {};

TEST_P(VerifyPolicyTest, MeasuredEqualsPredicted) {
  const auto& [attention, subset] = GetParam();
  std::string policy;
  const char* kinds[] = {"matmul", "attention", "layer_norm", "gelu"};
  for (int bit = 0; bit < 4; ++bit) {
    if ((subset & (1 << bit)) == 0) continue;
    if (attention == AttentionMode::kMath && bit == 1) GTEST_SKIP() << "no flash op in math";
    policy += std::string(policy.empty() ? "" : ",") + kinds[bit];
  }
  const ModelConfig config = StudyModel(/*layers=*/3, /*width=*/24, /*heads=*/3,
                                        /*batch=*/2, /*seq=*/5);
  VerifyOptions options;
  options.attention = attention;
  ASSERT_OK_AND_ASSIGN(options.variants, ParseVariants("none,every_2,selective", 2, policy));
  options.run.skip_timing = true;
  ASSERT_OK_AND_ASSIGN(VerifyReport report, Verify(config, options));
  SCOPED_TRACE("policy '" + policy + "'");
  ExpectExact(report);
}

INSTANTIATE_TEST_SUITE_P(Policies, VerifyPolicyTest,
                         ::testing::Combine(::testing::Values(kFlash, kMath),
                                            ::testing::Range(0, 16)));

// The optimizer's step as the peak: two wide layers on four tokens hold little activation,
// so AdamW's and Adam's per-parameter temporaries (the sqrt and the division, twice the
// largest parameter) make the peak; SGD's (none, or a momentum scalar) leave it in the
// backward. Exact either way.
TEST(VerifyOptimizerTest, OptimizerStepPeaksAreExact) {
  const ModelConfig config = StudyModel(/*layers=*/2, /*width=*/256,
                                        /*heads=*/4, /*batch=*/1, /*seq=*/4);
  struct Case {
    OptimizerKind kind;
    double momentum;
    const char* peak_phase;
  };
  for (const Case& c : {Case{OptimizerKind::kAdamW, 0, "optimizer"},
                        Case{OptimizerKind::kAdam, 0, "optimizer"},
                        Case{OptimizerKind::kSgd, 0.9, "backward"},
                        Case{OptimizerKind::kSgd, 0, "backward"}}) {
    VerifyOptions options;
    options.optimizer.kind = c.kind;
    options.optimizer.momentum = c.momentum;
    options.run.skip_timing = true;
    ASSERT_OK_AND_ASSIGN(VerifyReport report, Verify(config, options));
    ExpectExact(report);
    for (const runtime::VariantMeasurement& v : report.measurement.variants) {
      EXPECT_EQ(v.step.peak.phase, c.peak_phase)
          << OptimizerName(c.kind) << " " << v.variant.Name();
    }
  }
}

// A denser sweep of small configs: layers x heads (d_head 8 or 24) x (batch, seq) x
// attention, every variant of the study plus every_3. 3 x 4 x 4 x 2 = 96 configs.
class VerifySweepTest
    : public ::testing::TestWithParam<
          std::tuple<int64_t, std::pair<int64_t, int64_t>, std::pair<int64_t, int64_t>,
                     AttentionMode>> {};

TEST_P(VerifySweepTest, MeasuredEqualsPredicted) {
  const auto& [layers, width_heads, batch_seq, attention] = GetParam();
  ModelConfig config =
      StudyModel(/*layers=*/layers, /*width=*/width_heads.first,
                 /*heads=*/width_heads.second, /*batch=*/batch_seq.first,
                 /*seq=*/batch_seq.second);
  VerifyOptions options;
  options.attention = attention;
  ASSERT_OK_AND_ASSIGN(options.variants,
                       ParseVariants("none,full,every_2,every_3,selective", 2, "matmul"));
  options.run.skip_timing = true;
  ASSERT_OK_AND_ASSIGN(VerifyReport report, Verify(config, options));
  ExpectExact(report);
}

INSTANTIATE_TEST_SUITE_P(
    Sweep, VerifySweepTest,
    ::testing::Combine(::testing::Values(1, 2, 4),
                       ::testing::Values(std::make_pair(8, 1), std::make_pair(16, 2),
                                         std::make_pair(72, 3), std::make_pair(64, 8)),
                       ::testing::Values(std::make_pair(1, 1), std::make_pair(1, 6),
                                         std::make_pair(3, 1), std::make_pair(2, 17)),
                       ::testing::Values(kFlash, kMath)));

// The reentrant CheckpointFunction keeps each checkpoint's RNG state and bound call
// arguments on its ctx until the loss dies, after the optimizer's step: the runtime's
// checkpoint does the same, and the simulation predicts it exactly (tiny-llama holds cos
// and sin; the study nothing besides its states). Selective checkpointing needs the
// non-reentrant implementation, so it is left out.
class VerifyReentrantTest : public ::testing::TestWithParam<const char*> {};

TEST_P(VerifyReentrantTest, MeasuredEqualsPredicted) {
  ASSERT_OK_AND_ASSIGN(ModelConfig config, ModelFromPreset(GetParam()));
  config.layers = 3;
  config.batch = 2;
  config.seq = 12;
  config.checkpoint_impl = CheckpointImpl::kReentrant;
  VerifyOptions options;
  ASSERT_OK_AND_ASSIGN(options.variants, ParseVariants("none,full,every_2", 2, ""));
  options.run.skip_timing = true;
  ASSERT_OK_AND_ASSIGN(VerifyReport report, Verify(config, options));
  ExpectEveryBucket(report, options.variants.size());
  ExpectExact(report);
}

INSTANTIATE_TEST_SUITE_P(Reentrant, VerifyReentrantTest,
                         ::testing::Values("study", "tiny-llama", "tiny-gpt2", "tiny-qwen3",
                                           "tiny-qwen3-moe", "tiny-gemma3"));

}  // namespace
}  // namespace memledger
