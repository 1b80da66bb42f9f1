// Sweeps: the grid syntax, its errors, and the rows (hand arithmetic from predict_test).
#include "estimator/predict/sweep.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "tests/status_matchers.h"

namespace memledger {
namespace {

TEST(SweepTest, RangesDoubleAndListsAreTaken) {
  ASSERT_OK_AND_ASSIGN(SweepGrid grid, ParseSweep("batch:1..64,seq:1024|3000"));
  ASSERT_EQ(grid.axes.size(), 2u);
  EXPECT_EQ(grid.axes[0].values, (std::vector<int64_t>{1, 2, 4, 8, 16, 32, 64}));
  EXPECT_EQ(grid.axes[1].values, (std::vector<int64_t>{1024, 3000}));
  EXPECT_EQ(grid.size(), 14);
  // A range whose top is not a doubling stops below it.
  ASSERT_OK_AND_ASSIGN(SweepGrid uneven, ParseSweep("layers:3..20"));
  EXPECT_EQ(uneven.axes[0].values, (std::vector<int64_t>{3, 6, 12}));
}

TEST(SweepTest, BadGridsNameTheProblem) {
  EXPECT_STATUS(ParseSweep(""), absl::StatusCode::kInvalidArgument, "names no axis");
  EXPECT_STATUS(ParseSweep("width:1..2"), absl::StatusCode::kInvalidArgument,
                "unknown axis 'width'");
  EXPECT_STATUS(ParseSweep("batch:1..2,batch:4"), absl::StatusCode::kInvalidArgument,
                "'batch' twice");
  EXPECT_STATUS(ParseSweep("batch:8..2"), absl::StatusCode::kInvalidArgument,
                "runs backwards");
  EXPECT_STATUS(ParseSweep("batch:x"), absl::StatusCode::kInvalidArgument,
                "'x' is not a whole number >= 1");
  EXPECT_STATUS(ParseSweep("batch:"), absl::StatusCode::kInvalidArgument, "has no values");
  // 41 doublings of seq x 41 of batch x 60 layer counts = 100,860 points.
  std::string layers = "layers:1";
  for (int i = 2; i <= 60; ++i) layers += "|" + std::to_string(i);
  EXPECT_STATUS(ParseSweep("seq:1..1099511627776,batch:1..1099511627776," + layers),
                absl::StatusCode::kInvalidArgument, "more than 100000 points");
}

TEST(SweepTest, RowsAreThePredictionsAgainstTheBudget) {
  // The study at batch 1 and 2, variant none: saved 4 B x 64 tokens x 12,464 = 3,190,784
  // per sequence (predict_test's 51,052,544 / 16); parameters and gradients 4,758,528
  // each, AdamW's moments 9,517,056 and its 72 step tensors 288 (9,517,344): sums
  // 22,225,184 and 25,415,968.
  RunRequest request;
  request.variants = "none";
  ASSERT_OK_AND_ASSIGN(SweepGrid grid, ParseSweep("batch:1|2"));
  ASSERT_OK_AND_ASSIGN(std::string csv, RunSweep(request, grid, /*budget_bytes=*/0,
                                                 SweepFormat::kCsv));
  std::vector<std::string> lines = absl::StrSplit(csv, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0],
            "model,layers,batch,seq,variant,param_bytes,grad_bytes,optimizer_state_bytes,"
            "saved_bytes,sum_bytes,peak_bytes,fits");
  EXPECT_EQ(lines[1].rfind("study,6,1,64,none,4758528,4758528,9517344,3190784,22225184,", 0),
            0u)
      << lines[1];
  EXPECT_EQ(lines[2].rfind("study,6,2,64,none,4758528,4758528,9517344,6381568,25415968,", 0),
            0u)
      << lines[2];
  ASSERT_OK_AND_ASSIGN(std::string jsonl, RunSweep(request, grid, 0, SweepFormat::kJsonLines));
  EXPECT_NE(jsonl.find("\"sum_bytes\":22225184,\"peak_bytes\":"), std::string::npos) << jsonl;
  EXPECT_NE(jsonl.find("\"fits\":null}"), std::string::npos) << jsonl;
}

// The budget is checked against the step's peak, not the sum of buckets. At the
// study's default batch 16 the peak of `none` is 67,688,232 bytes (measured by verify's
// counting allocator, docs/step_peak.md) while the buckets sum to 4,758,528 x 2 + 9,517,344 +
// 51,052,544 = 70,086,944: gradients and activations are never all alive together.
TEST(SweepTest, TheBudgetIsCheckedAgainstThePeak) {
  RunRequest request;
  request.variants = "none";
  ASSERT_OK_AND_ASSIGN(SweepGrid grid, ParseSweep("batch:16"));
  ASSERT_OK_AND_ASSIGN(std::string fits, RunSweep(request, grid, 67688232, SweepFormat::kCsv));
  EXPECT_NE(fits.find(",51052544,70086944,67688232,true\n"), std::string::npos) << fits;
  ASSERT_OK_AND_ASSIGN(std::string over, RunSweep(request, grid, 67688231, SweepFormat::kCsv));
  EXPECT_NE(over.find(",70086944,67688232,false\n"), std::string::npos) << over;
}

TEST(SweepTest, APointTheModelCannotTakeIsNamed) {
  RunRequest request;
  request.model = "tiny-gpt2";  // 128 learned positions
  ASSERT_OK_AND_ASSIGN(SweepGrid grid, ParseSweep("seq:64..256"));
  EXPECT_STATUS(RunSweep(request, grid, 0, SweepFormat::kCsv),
                absl::StatusCode::kInvalidArgument,
                "--sweep at seq 256: --seq 256 exceeds the model's 128 learned positions");
}

}  // namespace
}  // namespace memledger
