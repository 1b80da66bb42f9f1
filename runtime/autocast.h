// ScopedAutocast: LibTorch's CPU autocast for one scope, as Python's
// torch.autocast("cpu", dtype=...) sets it: enabled with the given lower-precision
// dtype, its weight-cast cache cleared when the outermost scope ends, and the previous
// state restored. The C++ counterpart of the context manager, used around the forward
// and around a checkpointed layer's recompute.
//
// Example:
//   {
//     ScopedAutocast autocast(at::kBFloat16);
//     loss = Forward(model, input);  // matmuls in bf16
//   }
#ifndef RUNTIME_AUTOCAST_H_
#define RUNTIME_AUTOCAST_H_

#include <c10/core/ScalarType.h>

#include <optional>

#include "estimator/spec/config.h"

namespace memledger::runtime {

class ScopedAutocast {
 public:
  // `dtype` nullopt leaves autocast as it is (a no-op scope).
  explicit ScopedAutocast(std::optional<at::ScalarType> dtype);
  ~ScopedAutocast();

  ScopedAutocast(const ScopedAutocast&) = delete;
  ScopedAutocast& operator=(const ScopedAutocast&) = delete;

 private:
  bool active_ = false;
  bool previous_enabled_ = false;
  at::ScalarType previous_dtype_ = at::kBFloat16;
};

// AutocastDtype is the LibTorch dtype of config.amp; nullopt without autocast.
std::optional<at::ScalarType> AutocastDtype(DType amp);

// CurrentAutocast is the CPU autocast dtype in force now; nullopt when disabled.
std::optional<at::ScalarType> CurrentAutocast();

}  // namespace memledger::runtime

#endif  // RUNTIME_AUTOCAST_H_
