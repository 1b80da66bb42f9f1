// Fuzzes the small readers a command line hands its text to: --plan (a plan document or
// inline runs), --sweep's grammar and a --routing file. Any bytes must give a value or an
// InvalidArgument, never a crash, a hang or UB (a plan document nested 120,000 levels
// deep overflowed the parser's stack).
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "estimator/predict/sweep.h"
#include "estimator/request/plan_file.h"
#include "estimator/request/run_request.h"

namespace {

template <typename T>
void MustBeValueOrBadInput(const absl::StatusOr<T>& result) {
  if (!result.ok() && result.status().code() != absl::StatusCode::kInvalidArgument) {
    __builtin_trap();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  MustBeValueOrBadInput(memledger::ParsePlanJson(text));
  MustBeValueOrBadInput(memledger::ParsePlanRuns(text));
  MustBeValueOrBadInput(memledger::ParseSweep(text));
  MustBeValueOrBadInput(memledger::ParseRouting(text, "fuzz.json"));
  return 0;
}
