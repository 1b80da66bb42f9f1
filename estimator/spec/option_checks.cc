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

absl::Status CheckZeroStage(int64_t zero) {
  if (zero >= 0 && zero <= 3) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("--zero must be 0, 1, 2 or 3, got ", zero));
}

absl::Status CheckFrontierPoints(int64_t points) {
  if (points == 0 || (points >= 2 && points <= 1000)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--frontier_points must be 0 or between 2 and 1000, got ", points));
}

absl::Status CheckTop(int64_t top) {
  if (top >= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("--top must be >= 0, got ", top));
}

absl::StatusOr<int64_t> GibFlagBytes(absl::string_view flag, double gib,
                                     absl::string_view zero) {
  if (!zero.empty() && gib == 0) return 0;
  // NaN and infinities are no number of GiB (a NaN compared false and turned guards off).
  if (std::optional<int64_t> bytes = GibToBytes(gib); bytes.has_value()) {
    // Rounded down to 0 it would read as "no budget", or be refused by a layer below
    // that does not know the flag.
    if (*bytes == 0) {
      return absl::InvalidArgumentError(absl::StrCat(flag, " ", gib, " is less than one byte"));
    }
    return *bytes;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      flag, " must be ", zero.empty() ? "" : absl::StrCat("0 (", zero, ") or "),
      "a positive number of GiB below 2^33, got ", gib));
}

absl::StatusOr<int64_t> BudgetBytes(double gib, bool zero_is_none) {
  return GibFlagBytes("--budget_gib", gib, zero_is_none ? "no budget" : "");
}

absl::Status CheckTimelineLayers(int64_t layers) {
  if (layers <= kMaxTimelineLayers) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "a step timeline (--timeline_svg, --snapshot_out) records every allocation: at most ",
      kMaxTimelineLayers, " layers, got --layers ", layers));
}

}  // namespace memledger
