// The CLIs' exit statuses for each kind of error (README, "Verifying a prediction").
#include "estimator/cli_flags.h"

#include <gtest/gtest.h>

#include "absl/status/status.h"

namespace memledger {
namespace {

TEST(CliFlagsTest, ExitStatusByErrorKind) {
  EXPECT_EQ(ReportError(absl::InvalidArgumentError("--layers must be >= 1")), 2);
  EXPECT_EQ(ReportError(absl::OutOfRangeError("overflow")), 2);
  EXPECT_EQ(ReportError(absl::ResourceExhaustedError("too big")), 2);
  // An op without a CPU kernel in the requested dtype: not the user's mistake, not a bug.
  EXPECT_EQ(ReportError(absl::UnimplementedError("no CPU kernel")), 3);
  EXPECT_EQ(ReportError(absl::InternalError("bug")), 1);
}

}  // namespace
}  // namespace memledger
