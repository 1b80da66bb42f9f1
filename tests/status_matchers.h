// Test helpers for absl::Status and absl::StatusOr, written once for every test.
#ifndef TESTS_STATUS_MATCHERS_H_
#define TESTS_STATUS_MATCHERS_H_

#include <gtest/gtest.h>

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define MEMLEDGER_CONCAT_INNER_(a, b) a##b
#define MEMLEDGER_CONCAT_(a, b) MEMLEDGER_CONCAT_INNER_(a, b)

// ASSERT_OK_AND_ASSIGN(auto x, StatusOrExpression): fails the test with the status
// message unless the expression is OK, else moves its value into x.
#define ASSERT_OK_AND_ASSIGN(lhs, expr)                                        \
  auto MEMLEDGER_CONCAT_(status_or_, __LINE__) = (expr);                      \
  ASSERT_TRUE(MEMLEDGER_CONCAT_(status_or_, __LINE__).ok())                   \
      << MEMLEDGER_CONCAT_(status_or_, __LINE__).status();                    \
  lhs = std::move(MEMLEDGER_CONCAT_(status_or_, __LINE__)).value()

#define EXPECT_OK(expr) EXPECT_TRUE((expr).ok()) << (expr)
#define ASSERT_OK(expr) ASSERT_TRUE((expr).ok()) << (expr)

namespace memledger::testing {

// StatusOf gives the status of a Status or a StatusOr alike.
inline const absl::Status& StatusOf(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

}  // namespace memledger::testing

// EXPECT_STATUS(expr, code, substring): the status has `code` and its message
// contains `substring`.
#define EXPECT_STATUS(expr, status_code, substring)                                 \
  do {                                                                              \
    const absl::Status memledger_status = ::memledger::testing::StatusOf(expr);    \
    EXPECT_EQ(memledger_status.code(), status_code) << memledger_status;           \
    EXPECT_NE(memledger_status.message().find(substring), absl::string_view::npos) \
        << memledger_status;                                                       \
  } while (0)

#endif  // TESTS_STATUS_MATCHERS_H_
