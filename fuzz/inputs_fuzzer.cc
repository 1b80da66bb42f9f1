// Fuzzes the small readers a command line hands its text to: --plan (a plan document or
// inline runs), --sweep's grammar and a --routing file. Any bytes must give a value or an
// InvalidArgument, never a crash, a hang or UB (a plan document nested 120,000 levels
// deep overflowed the parser's stack).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "estimator/graph/family.h"
#include "estimator/predict/sweep.h"
#include "estimator/request/model_presets.h"
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
  absl::StatusOr<std::vector<std::vector<int64_t>>> routing =
      memledger::ParseRouting(text, "fuzz.json");
  MustBeValueOrBadInput(routing);
  if (routing.ok()) {
    // The rows against a model, whose check sums them (a count near INT64_MAX overflowed
    // it, estimator/families/llama/llama.cc, found by UBSan outside the fuzzer).
    absl::StatusOr<memledger::ModelConfig> moe = memledger::ModelFromPreset("tiny-qwen3-moe");
    if (!moe.ok()) __builtin_trap();
    moe->batch = 2;
    moe->seq = 4;
    moe->moe.impl = memledger::ExpertsImpl::kEager;
    moe->moe.routing = memledger::RoutingSource::kGiven;
    moe->moe.routing_rows = *routing;
    const absl::Status valid = memledger::ValidateConfig(*moe);
    if (!valid.ok() && valid.code() != absl::StatusCode::kInvalidArgument) __builtin_trap();
  }
  return 0;
}
