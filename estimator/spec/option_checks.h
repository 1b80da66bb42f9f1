// The options beside a run's (RunRequest's), each checked once, with the one message the
// CLIs, the C ABI and Python give for a bad value.
//
// Example:
//   absl::StatusOr<int64_t> budget = BudgetBytes(absl::GetFlag(FLAGS_budget_gib));
//   if (!budget.ok()) return ReportError(budget.status());
#ifndef ESTIMATOR_SPEC_OPTION_CHECKS_H_
#define ESTIMATOR_SPEC_OPTION_CHECKS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace memledger {

// CheckCpuThreads: --cpu_threads, LibTorch's intra-op threads, from 1 to 1024.
absl::Status CheckCpuThreads(int64_t threads);
// BudgetBytes: --budget_gib in bytes, a positive number of GiB below 2^33 (rounded down
// to a byte; less than one byte is refused, naming the flag and the value); with
// `zero_is_none` (a sweep's, where 0 asks for no budget column) 0 too.
absl::StatusOr<int64_t> BudgetBytes(double gib, bool zero_is_none = false);
// GibFlagBytes: `flag`'s value in GiB as bytes, as BudgetBytes; where `zero` is given, 0
// too, which means `zero` ("half the available memory").
absl::StatusOr<int64_t> GibFlagBytes(absl::string_view flag, double gib,
                                     absl::string_view zero = "");
// CheckZeroStage: --zero, ZeRO's stage, 0 to 3 (predict, the planner and the search).
absl::Status CheckZeroStage(int64_t zero);
// CheckFrontierPoints: --frontier_points, the planner's frontier: 0 (none) or 2 to 1000.
absl::Status CheckFrontierPoints(int64_t points);
// CheckTop: --top, the search's table rows: 0 (every layout) or more.
absl::Status CheckTop(int64_t top);
// kMaxTimelineLayers bounds the layers of a step whose every allocation is recorded (a
// timeline: --timeline_svg, --snapshot_out, a "svg" answer): 4,096 of tiny-llama's layers
// make a 430 MB snapshot in 2.6 s here; 100,000 ran out of memory.
inline constexpr int64_t kMaxTimelineLayers = 4096;
// CheckTimelineLayers: a timeline of `layers` layers is at most kMaxTimelineLayers.
absl::Status CheckTimelineLayers(int64_t layers);

}  // namespace memledger

#endif  // ESTIMATOR_SPEC_OPTION_CHECKS_H_
