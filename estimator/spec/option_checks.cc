#include "estimator/spec/option_checks.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "estimator/spec/checked_math.h"

namespace memledger {

absl::Status CheckCpuThreads(int64_t threads) {
  if (threads >= 1 && threads <= 1024) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--cpu_threads must be between 1 and 1024, got ", threads));
}

absl::StatusOr<int64_t> BudgetBytes(double gib, bool zero_is_none) {
  if (zero_is_none && gib == 0) return 0;
  if (std::optional<int64_t> bytes = GibToBytes(gib); bytes.has_value()) return *bytes;
  return absl::InvalidArgumentError(absl::StrCat(
      "--budget_gib must be ", zero_is_none ? "0 (no budget) or " : "",
      "a positive number of GiB below 2^33, got ", gib));
}

absl::Status CheckTimelineLayers(int64_t layers) {
  if (layers <= kMaxTimelineLayers) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "a step timeline (--timeline_svg, --snapshot_out) records every allocation: at most ",
      kMaxTimelineLayers, " layers, got --layers ", layers));
}

}  // namespace memledger
