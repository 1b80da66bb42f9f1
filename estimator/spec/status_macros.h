// MEMLEDGER_ASSIGN_OR_RETURN(lhs, expr): lhs = *expr, or return expr's error from the
// enclosing function (which returns an absl::Status or an absl::StatusOr).
//
// Example:
//   MEMLEDGER_ASSIGN_OR_RETURN(spec.config.dtype, ParseModelDType(request.dtype));
#ifndef ESTIMATOR_SPEC_STATUS_MACROS_H_
#define ESTIMATOR_SPEC_STATUS_MACROS_H_

#include <utility>

// One statement (do ... while (0)), so that it stays whole under an unbraced if; `lhs` is
// an existing variable or member, assigned only on success.
#define MEMLEDGER_ASSIGN_OR_RETURN(lhs, expr)     \
  do {                                            \
    auto memledger_result_ = (expr);              \
    if (!memledger_result_.ok()) return memledger_result_.status(); \
    lhs = *std::move(memledger_result_);          \
  } while (0)

#endif  // ESTIMATOR_SPEC_STATUS_MACROS_H_
