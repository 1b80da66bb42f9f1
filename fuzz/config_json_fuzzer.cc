// Fuzzes the transformers config.json reader, and Predict on whatever it accepts: any
// bytes must give a model or an InvalidArgument, never a crash, a hang or UB.
#include <cstddef>
#include <cstdint>
#include <string>

#include "estimator/graph/family.h"
#include "estimator/request/model_presets.h"
#include "estimator/predict/predict.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<memledger::ModelConfig> config =
      memledger::ModelFromHfConfigJson(text, "fuzz.json");
  if (!config.ok()) {
    if (config.status().code() != absl::StatusCode::kInvalidArgument) __builtin_trap();
    return 0;
  }
  config->batch = 1;
  config->seq = 8;
  if (memledger::FamilyOf(config->family).learned_positions) config->seq = 1;
  (void)memledger::Predict(*config, {});  // any status; it must return
  return 0;
}
