// Plans verified in LibTorch: the planner's plans along its frontier and hand-mixed
// ones run layer by layer in the runtime (each layer its own checkpointing and
// selective cache), and every bucket, the step's peak included, is measured equal to
// the prediction; the planner's own composed peak equals the measured one too.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "estimator/spec/config.h"
#include "estimator/request/model_presets.h"
#include "planner/planner.h"
#include "tests/status_matchers.h"
#include "verify/verify.h"

namespace memledger {
namespace {

struct PlanCase {
  const char* name;
  ModelConfig config;
  AttentionMode attention;
  std::vector<const char*> mixed;  // a hand-made plan, one choice per layer
};

ModelConfig Family(const char* preset) {
  absl::StatusOr<ModelConfig> config = ModelFromPreset(preset);
  EXPECT_TRUE(config.ok()) << config.status();
  config->layers = 4;
  config->batch = 2;
  config->seq = 16;
  return *config;
}

std::vector<PlanCase> Cases() {
  return {
      {"study flash", StudyModel(4, 32, 2, 2, 16), AttentionMode::kFlash,
       {"selective:matmul,gelu", "none", "full", "selective:attention,layer_norm"}},
      {"tiny-llama flash", Family("tiny-llama"), AttentionMode::kFlash,
       {"selective:silu", "full", "none", "selective:matmul,attention"}},
      {"tiny-gpt2 math", Family("tiny-gpt2"), AttentionMode::kMath,
       {"selective:layer_norm", "none", "selective:matmul,layer_norm", "full"}},
  };
}

// VerifyPlan runs {none, plan} and expects every bucket exact; returns the measured
// peak of the plan.
int64_t VerifyPlan(const PlanCase& c, const std::vector<LayerChoice>& layers) {
  VerifyOptions options;
  options.attention = c.attention;
  options.variants = {Variant(), PlanVariant(layers)};
  options.run.skip_timing = true;
  absl::StatusOr<VerifyReport> report = Verify(c.config, options);
  EXPECT_TRUE(report.ok()) << report.status();
  if (!report.ok()) return -1;
  EXPECT_TRUE(report->peak_unavailable.empty()) << report->peak_unavailable;
  EXPECT_EQ(report->buckets.size(), 6u + 3 * 2);
  int64_t peak = -1;
  for (const BucketCheck& bucket : report->buckets) {
    // The study has no buffers; the others are all measured.
    if (bucket.name != "buffer_bytes") {
      EXPECT_GT(bucket.measured, 0) << c.name << " " << bucket.name;
    }
    EXPECT_EQ(bucket.measured, bucket.predicted) << c.name << " " << bucket.name;
    if (bucket.name == "peak_bytes.plan") peak = bucket.measured;
  }
  EXPECT_TRUE(report->Passed()) << c.name << ": "
                                << (report->failures.empty() ? "" : report->failures.front());
  return peak;
}

TEST(VerifyPlanTest, HandMixedPlansAreExact) {
  for (const PlanCase& c : Cases()) {
    std::vector<LayerChoice> layers;
    for (const char* name : c.mixed) {
      ASSERT_OK_AND_ASSIGN(LayerChoice choice, ParseLayerChoice(name));
      layers.push_back(choice);
    }
    EXPECT_GT(VerifyPlan(c, layers), 0) << c.name;
  }
}

TEST(VerifyPlanTest, TheFrontiersPlansMeasureAsPlanned) {
  int mixed = 0;
  for (const PlanCase& c : Cases()) {
    PlannerOptions options;
    options.attention = c.attention;
    ASSERT_OK_AND_ASSIGN(Planner planner, Planner::Create(c.config, options));
    ASSERT_OK_AND_ASSIGN(std::vector<FrontierPoint> frontier, planner.Frontier(4));
    for (const FrontierPoint& point : frontier) {
      const std::vector<LayerChoice>& layers = point.plan.layers;
      bool differ = false;
      for (const LayerChoice& choice : layers) differ = differ || !(choice == layers[0]);
      mixed += differ ? 1 : 0;
      // The planner's composed peak, LibTorch's counting allocator and the budget.
      const int64_t measured = VerifyPlan(c, layers);
      EXPECT_EQ(point.plan.peak_bytes, measured) << c.name;
      EXPECT_LE(measured, point.budget_bytes) << c.name;
    }
  }
  EXPECT_GE(mixed, 3);  // plans that differ layer by layer, not only uniform ones
}

}  // namespace
}  // namespace memledger
