// Tests for runtime/runtime (Measure) on small configs. Expected bytes are hand
// arithmetic from docs/DESIGN.md's contract, never copied from the code's output.
//
// Per block and token, `none` with flash attention keeps 16d + 4 + H fp32 elements:
// x (d), ln1 mean+rstd (2), ln1 out (d), qkv (3d), attention out (d), lse (H),
// x after the residual (d), ln2 mean+rstd (2), ln2 out (d), fc1 out (4d), gelu out (4d);
// the loss keeps the final output (d). A checkpointed block keeps its input (d).
#include "estimator/graph/family.h"
#include "runtime/runtime.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "estimator/spec/config.h"
#include "estimator/graph/rules.h"

namespace memledger::runtime {
namespace {

// Layers 3, width 16, heads 2, batch 2, seq 8: BT = 16 tokens, 4 * BT = 64 B/element.
ModelConfig SmallConfig() {
  ModelConfig config = StudyModel(/*layers=*/3, /*width=*/16, /*heads=*/2,
                                  /*batch=*/2, /*seq=*/8);
  return config;
}

Variant MakeVariant(VariantKind kind, int64_t every = 2,
                    SavePolicy policy = StudyPolicy()) {
  Variant variant;
  variant.kind = kind;
  variant.every = every;
  variant.policy = policy;
  return variant;
}

std::vector<Variant> StudyVariants() {
  return {MakeVariant(VariantKind::kNone), MakeVariant(VariantKind::kFull),
          MakeVariant(VariantKind::kEveryK, /*every=*/2),
          MakeVariant(VariantKind::kSelective)};
}

RunOptions NoTiming() {
  RunOptions options;
  options.skip_timing = true;
  return options;
}

Measurement MeasureOrDie(const ModelConfig& config, AttentionMode mode,
                         const std::vector<Variant>& variants) {
  absl::StatusOr<Measurement> m = Measure(config, mode, variants, NoTiming());
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *m : Measurement();
}

TEST(MeasureTest, FlashSavedBytesMatchHandArithmetic) {
  Measurement m = MeasureOrDie(SmallConfig(), AttentionMode::kFlash, StudyVariants());
  ASSERT_EQ(m.variants.size(), 4u);
  // none: 64 B x (3 layers x (16*16 + 4 + 2) + 16) = 64 x 802 = 51,328.
  EXPECT_EQ(m.variants[0].saved_bytes, 51328);
  // full: 64 B x 16 x (3 block inputs + the loss's input) = 4,096. Block 0's input is
  // the model input, which does not require grad: it counts all the same.
  EXPECT_EQ(m.variants[1].saved_bytes, 4096);
  // every_2: blocks 0 and 2 keep their inputs (16 each), block 1 keeps 262, loss 16:
  // 64 B x 310 = 19,840.
  EXPECT_EQ(m.variants[2].saved_bytes, 19840);
  // selective (matmul): full + 3 layers x 64 B x 9 x 16 (qkv 3d, proj d, fc1 4d, fc2 d)
  // = 4,096 + 27,648 = 31,744, of which the cache is 27,648.
  EXPECT_EQ(m.variants[3].saved_bytes, 31744);
  EXPECT_EQ(m.variants[3].cache_bytes, 27648);
  EXPECT_EQ(m.variants[3].hooked_bytes, 4096);
}

TEST(MeasureTest, NoneIsMeasuredAsTheReferenceEvenWhenNotRequested) {
  Measurement m = MeasureOrDie(SmallConfig(), AttentionMode::kFlash,
                               {MakeVariant(VariantKind::kFull)});
  ASSERT_EQ(m.variants.size(), 1u);
  // none's 51,328 bytes (see above), measured by the gradient-reference run.
  EXPECT_EQ(m.reference_saved_bytes, 51328);
}

TEST(MeasureTest, RuntimeLinksThePinnedTorch) {
  // The estimator's rules describe kTorchRelease; the runtime must measure that release.
  EXPECT_EQ(TorchVersion(), kTorchRelease);
  Measurement m = MeasureOrDie(SmallConfig(), AttentionMode::kFlash,
                               {MakeVariant(VariantKind::kNone)});
  EXPECT_EQ(m.torch_version, kTorchRelease);
}

TEST(MeasureTest, MathSavedBytesAddTheAttentionMatrices) {
  Measurement m = MeasureOrDie(SmallConfig(), AttentionMode::kMath,
                               {MakeVariant(VariantKind::kNone),
                                MakeVariant(VariantKind::kFull)});
  // Per block math keeps the softmax output B*H*T*T*4 = 2*2*8*8*4 = 1,024 B and the
  // bool mask T*T = 64 B, and no lse (H x BT x 4 = 2*16*4 = 128 B); the q, k, v copies
  // made inside matmul replace the qkv storage byte for byte.
  // none: 51,328 + 3 x (1,024 + 64 - 128) = 54,208.
  EXPECT_EQ(m.variants[0].saved_bytes, 54208);
  EXPECT_EQ(m.variants[1].saved_bytes, 4096);
}

TEST(MeasureTest, OneLayerOneHeadToy) {
  // L=1, d=8, H=1, B=1, T=2: BT = 2. none = 4 B x 2 x ((16*8 + 4 + 1) + 8) = 1,128.
  ModelConfig config = StudyModel(/*layers=*/1, /*width=*/8, /*heads=*/1,
                                  /*batch=*/1, /*seq=*/2);
  Measurement m = MeasureOrDie(config, AttentionMode::kFlash,
                               {MakeVariant(VariantKind::kNone)});
  EXPECT_EQ(m.variants[0].saved_bytes, 1128);
  // n_params = 12*64 + 13*8 = 872; params, grads and each of AdamW's two moments are
  // 872 x 4 B = 3,488.
  EXPECT_EQ(m.n_params, 872);
  EXPECT_EQ(m.param_bytes, 3488);
  EXPECT_EQ(m.grad_bytes, 3488);
  EXPECT_EQ(m.adamw_state_bytes, 2 * 3488);
}

TEST(MeasureTest, SelectivePoliciesCacheTheirOps) {
  const SavePolicy all = {OpKind::kMatmul, OpKind::kAttention, OpKind::kLayerNorm,
                         OpKind::kGelu};
  Measurement m = MeasureOrDie(SmallConfig(), AttentionMode::kFlash,
                               {MakeVariant(VariantKind::kSelective, 2, all)});
  // Per block, x 64 B per element: matmul 9d = 144, attention out d + lse H = 18,
  // two layer norms 2 x (d + 2) = 36, gelu 4d = 64: 262 elements, i.e. every saved
  // tensor of `none` except the block input x. 3 x 64 x 262 = 50,304 cached, plus
  // full's 4,096 hooked.
  EXPECT_EQ(m.variants[0].cache_bytes, 50304);
  EXPECT_EQ(m.variants[0].saved_bytes, 54400);
  EXPECT_LE(m.variants[0].max_grad_diff, 1e-5);
}

TEST(MeasureTest, EveryVariantMatchesNoneGradientsInBothModes) {
  for (AttentionMode mode : {AttentionMode::kFlash, AttentionMode::kMath}) {
    std::vector<Variant> variants = StudyVariants();  // selective: matmul
    variants.push_back(MakeVariant(VariantKind::kEveryK, /*every=*/3));
    Measurement m = MeasureOrDie(SmallConfig(), mode, variants);
    ASSERT_EQ(m.variants.size(), variants.size());
    for (const VariantMeasurement& vm : m.variants) {
      EXPECT_LE(vm.max_grad_diff, 1e-5)
          << AttentionModeName(mode) << " " << vm.variant.Name();
    }
    EXPECT_LE(m.max_grad_diff, 1e-5);
  }
}

TEST(MeasureTest, EverySelectivePolicyMatchesNoneGradients) {
  for (AttentionMode mode : {AttentionMode::kFlash, AttentionMode::kMath}) {
    for (const char* names : {"", "attention", "layer_norm", "gelu", "matmul,gelu",
                              "matmul,layer_norm,gelu", "matmul,attention,layer_norm,gelu"}) {
      absl::StatusOr<SavePolicy> policy = ParseSavePolicy(names);
      ASSERT_TRUE(policy.ok()) << policy.status();
      if (!ValidatePolicy(*policy, mode, SmallConfig()).ok()) continue;  // attention is flash-only
      Measurement m = MeasureOrDie(SmallConfig(), mode,
                                   {MakeVariant(VariantKind::kSelective, 2, *policy)});
      ASSERT_EQ(m.variants.size(), 1u);
      EXPECT_LE(m.variants[0].max_grad_diff, 1e-5) << AttentionModeName(mode) << " "
                                                    << names;
    }
  }
}

TEST(MeasureTest, IsDeterministicAndTimesWhenAsked) {
  RunOptions options;
  options.timing_repetitions = 2;
  std::vector<std::string> progress;
  options.progress = [&](absl::string_view what) { progress.emplace_back(what); };
  const std::vector<Variant> variants = {MakeVariant(VariantKind::kNone),
                                         MakeVariant(VariantKind::kFull)};
  absl::StatusOr<Measurement> a = Measure(SmallConfig(), AttentionMode::kFlash, variants,
                                          options);
  absl::StatusOr<Measurement> b = Measure(SmallConfig(), AttentionMode::kFlash, variants,
                                          NoTiming());
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(progress,
            (std::vector<std::string>{"none", "full", "none (step)", "full (step)"}));
  for (size_t i = 0; i < variants.size(); ++i) {
    EXPECT_EQ(a->variants[i].saved_bytes, b->variants[i].saved_bytes);
    EXPECT_EQ(a->variants[i].step.peak_bytes, b->variants[i].step.peak_bytes);
    EXPECT_EQ(a->variants[i].max_grad_diff, b->variants[i].max_grad_diff);
    ASSERT_TRUE(a->variants[i].time_s.has_value());
    EXPECT_GT(*a->variants[i].time_s, 0.0);
    EXPECT_FALSE(b->variants[i].time_s.has_value());
  }
}

TEST(MeasureTest, LibTorchErrorBecomesAStatus) {
  // The input alone would be 2^45 x 1 x 8 floats = 1 PiB, beyond the 128 TiB address
  // space even with memory overcommit: LibTorch's allocator throws a
  // c10::Error, which must come back as a Status, not an exception.
  ModelConfig huge = StudyModel(/*layers=*/1, /*width=*/8, /*heads=*/1,
                                /*batch=*/int64_t{1} << 45, /*seq=*/1);
  absl::StatusOr<Measurement> m = Measure(huge, AttentionMode::kFlash, StudyVariants(),
                                          NoTiming());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInternal) << m.status();
  EXPECT_NE(m.status().message().find("LibTorch"), absl::string_view::npos) << m.status();
}

// The whole step of one tiny block (width 8, 2 heads, batch 1, seq 4; SGD without
// momentum), measured by the counting allocator: the peak that liveness_test derives by
// hand, 3616 resident bytes (parameters 3488, input 128) + 4104, in qkv's backward.
TEST(MeasureTest, TinyBlockStepPeakByHand) {
  const ModelConfig tiny = StudyModel(/*layers=*/1, /*width=*/8, /*heads=*/2,
                                      /*batch=*/1, /*seq=*/4);
  RunOptions options = NoTiming();
  options.optimizer.kind = OptimizerKind::kSgd;
  absl::StatusOr<Measurement> m =
      Measure(tiny, AttentionMode::kFlash, {MakeVariant(VariantKind::kNone)}, options);
  ASSERT_TRUE(m.ok()) << m.status();
  const StepMemory& step = m->variants[0].step;
  EXPECT_EQ(step.resident_bytes, 3616);
  EXPECT_EQ(step.peak_bytes, 3616 + 4104);
  EXPECT_EQ(step.peak.phase, "backward");
  EXPECT_EQ(step.peak.op, "autograd::engine::evaluate_function: AddmmBackward0");
  // The phases, in order, and the step's own bytes back to gradients (3488) + loss (4).
  ASSERT_EQ(step.phases.size(), 3u);
  EXPECT_EQ(step.phases[0].name, "forward");
  EXPECT_EQ(step.phases[1].name, "backward");
  EXPECT_EQ(step.phases[2].name, "optimizer");
  EXPECT_EQ(step.phases[1].live, 2148);  // held after the forward, loss included
  ASSERT_FALSE(step.events.empty());
  EXPECT_EQ(step.events.back().live, 3488 + 4);
}

TEST(MeasureTest, BadInputIsInvalidArgument) {
  ModelConfig bad = SmallConfig();
  bad.width = 15;  // not divisible by 2 heads
  EXPECT_EQ(Measure(bad, AttentionMode::kFlash, StudyVariants(), NoTiming()).status().code(),
            absl::StatusCode::kInvalidArgument);
  const SavePolicy attention = {OpKind::kAttention};
  EXPECT_EQ(Measure(SmallConfig(), AttentionMode::kMath,
                    {MakeVariant(VariantKind::kSelective, 2, attention)}, NoTiming())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Measure(SmallConfig(), AttentionMode::kFlash, {}, NoTiming()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Measure(SmallConfig(), AttentionMode::kFlash,
                    {MakeVariant(VariantKind::kFull), MakeVariant(VariantKind::kFull)},
                    NoTiming())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace memledger::runtime
