#include "estimator/report/svg.h"

#include <cstdint>
#include <string>

#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"

namespace memledger {

std::string SvgEscape(const std::string& text) {
  return absl::StrReplaceAll(text, {{"&", "&amp;"}, {"<", "&lt;"}, {">", "&gt;"}});
}

std::string ChartHead(int width, int height, int left, const std::string& title,
                      const std::string& note) {
  return absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
      "viewBox=\"0 0 %d %d\" font-family=\"Helvetica, Arial, sans-serif\">\n"
      "<style>.title{font-size:16px;font-weight:bold}.tick{font-size:11px;fill:#444}"
      ".axis{font-size:12px;fill:#222}.label{font-size:12px}.note{font-size:11px;fill:#444}"
      "</style>\n<rect width=\"%d\" height=\"%d\" fill=\"#ffffff\"/>\n"
      "<text x=\"%d\" y=\"24\" class=\"title\">%s</text>\n"
      "<text x=\"%d\" y=\"44\" class=\"note\">%s</text>\n",
      width, height, width, height, width, height, left, SvgEscape(title), left,
      SvgEscape(note));
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
