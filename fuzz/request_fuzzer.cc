// Fuzzes the C ABI's JSON request (every flag, the spec parser and its validation, then
// Predict, the same request's memory snapshot, and predict_many's request array: the
// bytes as the array, and as its one request) and the --sweep grammar: any bytes give a
// prediction (a snapshot, a list) or an error code with a message, never a crash.
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "api/memledger.h"
#include "estimator/predict/sweep.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  char* response = nullptr;
  char* error = nullptr;
  // A request with a "sweep" predicts up to 100,000 points, far past a fuzz input's time
  // limit; the sweep's grammar is fuzzed below (ParseSweep) and its rows by sweep_test.
  if (text.find("sweep") == std::string::npos) {
    const int code = memledger_predict(text.c_str(), &response, &error);
    if ((code == MEMLEDGER_OK) != (response != nullptr) ||
        (code == MEMLEDGER_OK) == (error != nullptr)) {
      __builtin_trap();  // exactly one of response and error
    }
    memledger_free(response);
    memledger_free(error);
  }
  // The same request as a snapshot: a pickle of its size, or an error, never both.
  char* snapshot = nullptr;
  size_t snapshot_size = 0;
  error = nullptr;
  const int snapshot_code = memledger_snapshot(text.c_str(), &snapshot, &snapshot_size, &error);
  if ((snapshot_code == MEMLEDGER_OK) != (snapshot != nullptr && snapshot_size > 0) ||
      (snapshot_code == MEMLEDGER_OK) == (error != nullptr)) {
    __builtin_trap();
  }
  memledger_free(snapshot);
  memledger_free(error);
  // predict_many: the bytes as its array (on two threads, with peaks), then as the one
  // request of an array (without peaks: predict above ran the step).
  for (const auto& [requests, peak] :
       {std::pair<std::string, int>{text, 1}, std::pair<std::string, int>{"[" + text + "]", 0}}) {
    response = nullptr;
    error = nullptr;
    const int many_code = memledger_predict_many(requests.c_str(), peak, /*threads=*/2,
                                                 &response, &error);
    if ((many_code == MEMLEDGER_OK) != (response != nullptr) ||
        (many_code == MEMLEDGER_OK) == (error != nullptr)) {
      __builtin_trap();
    }
    memledger_free(response);
    memledger_free(error);
  }
  (void)memledger::ParseSweep(text);
  return 0;
}
