#include "estimator/svg.h"

#include <cstdint>
#include <string>

#include "absl/strings/str_replace.h"

namespace memledger {

std::string SvgEscape(const std::string& text) {
  return absl::StrReplaceAll(text, {{"&", "&amp;"}, {"<", "&lt;"}, {">", "&gt;"}});
}

int64_t NiceBytesCeiling(int64_t bytes) {
  double unit = 1;
  while (bytes / unit >= 1024 && unit < static_cast<double>(int64_t{1} << 40)) unit *= 1024;
  const double step = static_cast<double>(bytes) / unit / 4;
  double magnitude = 1;
  while (magnitude * 10 <= step) magnitude *= 10;
  while (magnitude > step) magnitude /= 10;
  for (double factor : {1.0, 2.0, 2.5, 5.0, 10.0}) {
    if (factor * magnitude >= step) return static_cast<int64_t>(4 * factor * magnitude * unit);
  }
  return bytes;
}

}  // namespace memledger
