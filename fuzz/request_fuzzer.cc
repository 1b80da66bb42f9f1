// Fuzzes the C ABI's JSON request (every flag, the spec parser and its validation, then
// Predict) and the --sweep grammar: any bytes give a prediction or an error code with a
// message, never a crash.
#include <cstddef>
#include <cstdint>
#include <string>

#include "api/memledger.h"
#include "estimator/sweep.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  char* response = nullptr;
  char* error = nullptr;
  const int code = memledger_predict(text.c_str(), &response, &error);
  if ((code == MEMLEDGER_OK) != (response != nullptr) ||
      (code == MEMLEDGER_OK) == (error != nullptr)) {
    __builtin_trap();  // exactly one of response and error
  }
  memledger_free(response);
  memledger_free(error);
  (void)memledger::ParseSweep(text);
  return 0;
}
