#include "runtime/autocast.h"

#include <ATen/autocast_mode.h>

namespace memledger::runtime {

ScopedAutocast::ScopedAutocast(std::optional<at::ScalarType> dtype) {
  if (!dtype.has_value()) return;
  active_ = true;
  previous_enabled_ = at::autocast::is_autocast_enabled(at::kCPU);
  previous_dtype_ = at::autocast::get_autocast_dtype(at::kCPU);
  at::autocast::set_autocast_enabled(at::kCPU, true);
  at::autocast::set_autocast_dtype(at::kCPU, *dtype);
  at::autocast::increment_nesting();
}

ScopedAutocast::~ScopedAutocast() {
  if (!active_) return;
  // As torch.autocast's __exit__: the cast cache lives until the outermost scope ends.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(at::kCPU, previous_enabled_);
  at::autocast::set_autocast_dtype(at::kCPU, previous_dtype_);
}

std::optional<at::ScalarType> AutocastDtype(DType amp) {
  switch (amp) {
    case DType::kBFloat16:
      return at::kBFloat16;
    case DType::kFloat16:
      return at::kHalf;
    default:
      return std::nullopt;
  }
}

std::optional<at::ScalarType> CurrentAutocast() {
  if (!at::autocast::is_autocast_enabled(at::kCPU)) return std::nullopt;
  return at::autocast::get_autocast_dtype(at::kCPU);
}

}  // namespace memledger::runtime
