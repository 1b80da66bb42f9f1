// Overflow-checked int64 arithmetic for byte counts. Rather than wrapping, a
// CheckedInt64 remembers that it overflowed, so a long computation can run without a
// branch per step and be checked once at the end.
//
// Example:
//   CheckedInt64 bytes = CheckedInt64(batch) * seq * width * 4;
//   if (bytes.overflowed()) return absl::OutOfRangeError("...");
#ifndef ESTIMATOR_SPEC_CHECKED_MATH_H_
#define ESTIMATOR_SPEC_CHECKED_MATH_H_

#include <cstdint>
#include <optional>

namespace memledger {

class CheckedInt64 {
 public:
  constexpr CheckedInt64() = default;
  constexpr CheckedInt64(int64_t value) : value_(value) {}  // NOLINT: implicit on purpose

  int64_t value() const { return value_; }
  bool overflowed() const { return overflowed_; }

  friend CheckedInt64 operator*(CheckedInt64 a, CheckedInt64 b) {
    CheckedInt64 r;
    r.overflowed_ = a.overflowed_ || b.overflowed_ ||
                    __builtin_mul_overflow(a.value_, b.value_, &r.value_);
    return r;
  }
  friend CheckedInt64 operator+(CheckedInt64 a, CheckedInt64 b) {
    CheckedInt64 r;
    r.overflowed_ = a.overflowed_ || b.overflowed_ ||
                    __builtin_add_overflow(a.value_, b.value_, &r.value_);
    return r;
  }
  // DividedBy truncates like integer division; an overflow stays sticky.
  CheckedInt64 DividedBy(int64_t divisor) const {
    CheckedInt64 r = *this;
    r.value_ /= divisor;
    return r;
  }
  CheckedInt64& operator*=(CheckedInt64 b) { return *this = *this * b; }
  CheckedInt64& operator+=(CheckedInt64 b) { return *this = *this + b; }

 private:
  int64_t value_ = 0;
  bool overflowed_ = false;
};

// GibToBytes is `gib` GiB (2^30 bytes) in bytes, rounded down; nullopt unless gib > 0
// and the bytes fit int64 (below 2^33 GiB). NaN is nullopt.
inline std::optional<int64_t> GibToBytes(double gib) {
  const double bytes = gib * static_cast<double>(int64_t{1} << 30);
  if (!(gib > 0) || !(bytes < 9.2e18)) return std::nullopt;
  return static_cast<int64_t>(bytes);
}

}  // namespace memledger

#endif  // ESTIMATOR_SPEC_CHECKED_MATH_H_
