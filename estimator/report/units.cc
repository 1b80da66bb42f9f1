#include "estimator/report/units.h"

#include <cmath>
#include <cstdint>
#include <string>

#include "absl/strings/str_format.h"

namespace memledger {

std::string HumanBytes(int64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return absl::StrFormat("%d B", bytes);
  double value = static_cast<double>(bytes);
  int unit = -1;
  while (value >= 1024 && unit < 5) {
    value /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.2f %s", value, kUnits[unit]);
}

double RoundTo4(double x) { return std::round(x * 1e4) / 1e4; }

}  // namespace memledger
