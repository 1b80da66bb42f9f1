// PredictMany: a batch of predict requests in one call, spread over threads, its results
// as plain structs. memledger_predict_many (api/memledger.h) writes them as JSON; the
// Python module's predict_many builds its dicts from them directly, so no JSON is parsed
// on the way back.
//
// Example:
//   absl::StatusOr<std::vector<memledger::ManyResult>> results = memledger::PredictMany(
//       R"([{"batch": 2}, {"model": "tiny-llama", "seq": 64}])", {.peak = false});
//   (*results)[0].variants[1].saved_bytes  // the study's `full` at batch 2
#ifndef API_PREDICT_MANY_H_
#define API_PREDICT_MANY_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "rapidjson/document.h"

namespace memledger {

// ManyOptions are a batch's settings.
struct ManyOptions {
  bool peak = true;  // simulate each variant's step (false: the buckets only)
  int threads = 0;   // 0: the machine's cores
};

// ManyVariant is one variant's result in a batch: its name as predict names it, its
// saved bytes and, with ManyOptions::peak, its step's peak (nullopt where the step is
// not simulated).
struct ManyVariant {
  std::string name;
  int64_t saved_bytes = 0;
  std::optional<int64_t> peak_bytes;
};

// ManyResult is one request's compact result: predict's JSON keys of the same names.
struct ManyResult {
  int64_t n_params = 0;
  int64_t param_bytes = 0;
  int64_t grad_bytes = 0;
  int64_t optimizer_state_bytes = 0;
  std::vector<ManyVariant> variants;  // in the request's order
};

// PredictMany parses `requests_json`, a JSON array of request objects (predict's keys
// but "explain", "dp" and "pp"), once, and predicts them on `threads` threads, in the
// requests' order. The first bad request fails the batch: InvalidArgument (or
// OutOfRange), "requests[i]: <predict's message>".
absl::StatusOr<std::vector<ManyResult>> PredictMany(const char* requests_json,
                                                    const ManyOptions& many);
// PredictMany of requests already in a JSON document (the Python module builds it from
// its dicts, without a JSON text): `requests` must be an array, as above.
absl::StatusOr<std::vector<ManyResult>> PredictMany(const rapidjson::Value& requests,
                                                    const ManyOptions& many);

}  // namespace memledger

#endif  // API_PREDICT_MANY_H_
