// Small helpers for the SVG charts (the step timeline, the planner's frontier): text
// escaping and byte axes that read in round human units.
//
// Example:
//   absl::StrAppend(&svg, "<text>", SvgEscape(title), "</text>");
//   const int64_t top = NiceBytesCeiling(peak_bytes);  // 4 ticks of 16 MiB, ...
#ifndef ESTIMATOR_REPORT_SVG_H_
#define ESTIMATOR_REPORT_SVG_H_

#include <cstdint>
#include <string>

namespace memledger {

// SvgEscape escapes &, < and > for SVG text.
std::string SvgEscape(const std::string& text);

// ChartHead opens a chart: the <svg> element of width x height, the charts' shared
// styles (title, tick, axis, label, note), a white background, and the title and one
// note line at x = left (both escaped).
std::string ChartHead(int width, int height, int left, const std::string& title,
                      const std::string& note);

// NiceBytesCeiling rounds up to 4 ticks of 1, 2, 2.5 or 5 x 10^k of the unit (B, KiB,
// MiB, GiB, TiB) the bytes are shown in, so the axis reads 0, 16 MiB, 32 MiB, ...
int64_t NiceBytesCeiling(int64_t bytes);

}  // namespace memledger

#endif  // ESTIMATOR_REPORT_SVG_H_
