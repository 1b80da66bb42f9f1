// The verifier's failure path: with one estimator rule deliberately wrong (a test-only
// RuleTable in which gelu's backward keeps nothing), Verify against the real runtime
// reports exactly the buckets that rule affects, naming them, and the rest stay exact.
#include <gtest/gtest.h>

#include <string>

#include "estimator/spec/config.h"
#include "estimator/graph/rules.h"
#include "tests/status_matchers.h"
#include "verify/verify.h"

namespace memledger {
namespace {

bool NamesBucket(const VerifyReport& report, const std::string& bucket) {
  for (const std::string& failure : report.failures) {
    if (failure.rfind(bucket + ":", 0) == 0) return true;
  }
  return false;
}

TEST(VerifyMismatchTest, AWrongKeepRuleFailsTheBucketsItAffects) {
  // 2 layers, width 16, 2 heads, batch 2, seq 8: 16 tokens. gelu really keeps its input,
  // fc1's output: 16 x 64 x 4 B = 4096 bytes per plain block.
  const ModelConfig config = StudyModel(/*layers=*/2, /*width=*/16, /*heads=*/2,
                                        /*batch=*/2, /*seq=*/8);
  RuleTable wrong = RuleTable::Pinned();
  OpSemantics gelu = wrong.Of(OpType::kGelu);
  gelu.keeps.clear();
  wrong.Set(OpType::kGelu, gelu);

  VerifyOptions options;
  ASSERT_OK_AND_ASSIGN(options.variants,
                       ParseVariants("none,full,every_2,selective", /*every=*/2, "matmul"));
  options.run.skip_timing = true;
  options.rules = &wrong;
  ASSERT_OK_AND_ASSIGN(VerifyReport report, Verify(config, options));

  EXPECT_FALSE(report.Passed());
  // none: both blocks plain, 2 x 4096 bytes missing; every_2: block 1 plain, 4096. The
  // hooks (saved_bytes) and the counting allocator (held_after_forward_bytes) both see
  // the bytes the wrong rule forgets.
  //
  // The step's peak is a third witness. The wrong rule frees fc1's output right after
  // gelu instead of after gelu's backward node, so the predicted curve lies below the
  // measured one by at most the outputs it frees early, and the measured peak happens in
  // a layer's fc2 backward while they are still held: none loses up to 2 x 4096 bytes,
  // every_2 (block 1 plain), full and selective (the block being recomputed: the matmul
  // cache's fc1 output is popped by the recompute, gelu's node its only holder then) up
  // to 4096.
  auto peak_gap = [](int64_t gap, int64_t forgotten) { return gap > 0 && gap <= forgotten; };
  for (const BucketCheck& bucket : report.buckets) {
    if (bucket.name == "saved_bytes.none" || bucket.name == "held_after_forward_bytes.none") {
      EXPECT_EQ(bucket.measured - bucket.predicted, 2 * 4096) << bucket.name;
    } else if (bucket.name == "saved_bytes.every_2" ||
               bucket.name == "held_after_forward_bytes.every_2") {
      EXPECT_EQ(bucket.measured - bucket.predicted, 4096) << bucket.name;
    } else if (bucket.name == "peak_bytes.none") {
      EXPECT_TRUE(peak_gap(bucket.measured - bucket.predicted, 2 * 4096)) << bucket.name;
    } else if (bucket.name == "peak_bytes.every_2" || bucket.name == "peak_bytes.full" ||
               bucket.name == "peak_bytes.selective") {
      EXPECT_TRUE(peak_gap(bucket.measured - bucket.predicted, 4096)) << bucket.name;
    } else {
      // full's and selective's saved bytes walk no keep rules inside checkpointed
      // blocks; the parameter buckets do not depend on rules.
      EXPECT_TRUE(bucket.exact()) << bucket.name;
    }
  }
  EXPECT_TRUE(NamesBucket(report, "peak_bytes.full"));
  EXPECT_TRUE(NamesBucket(report, "peak_bytes.selective"));
  EXPECT_EQ(report.failures.size(), 8u);
}

TEST(VerifyMismatchTest, ThePinnedRulesPassOnTheSameConfig) {
  const ModelConfig config = StudyModel(/*layers=*/2, /*width=*/16, /*heads=*/2,
                                        /*batch=*/2, /*seq=*/8);
  VerifyOptions options;
  options.run.skip_timing = true;
  ASSERT_OK_AND_ASSIGN(VerifyReport report, Verify(config, options));
  EXPECT_TRUE(report.Passed()) << report.failures.front();
}

}  // namespace
}  // namespace memledger
