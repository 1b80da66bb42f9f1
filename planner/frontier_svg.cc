#include "planner/frontier_svg.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "estimator/report/svg.h"
#include "estimator/report/units.h"

namespace memledger {
namespace {

constexpr int kWidth = 960;
constexpr int kHeight = 460;
constexpr int kLeft = 72;
constexpr int kRight = 150;  // room for the variants' labels
constexpr int kTop = 58;
constexpr int kBottom = 56;
constexpr int kPlotWidth = kWidth - kLeft - kRight;
constexpr int kPlotHeight = kHeight - kTop - kBottom;

// Axis maps bytes and overheads to pixels.
struct Axes {
  double x0, x1;  // bytes
  double y0, y1;  // overhead
  double X(double bytes) const { return kLeft + (bytes - x0) / (x1 - x0) * kPlotWidth; }
  double Y(double overhead) const {
    return kTop + kPlotHeight - (overhead - y0) / (y1 - y0) * kPlotHeight;
  }
};

}  // namespace

std::string FrontierSvg(const std::string& title, const PlanReport& report) {
  const std::vector<FrontierPoint>& frontier = report.frontier;
  // x: from the smallest budget to the largest peak shown, with a margin; the ticks
  // fall on round byte counts (NiceBytesCeiling's step).
  double lo = static_cast<double>(report.smallest_budget_bytes);
  double hi = lo;
  double top = 1;
  for (const FrontierPoint& p : frontier) {
    hi = std::max(hi, static_cast<double>(p.budget_bytes));
    top = std::max(top, p.plan.overhead);
  }
  for (const VariantCost& v : report.variants) {
    if (!v.peak_bytes.has_value()) continue;
    lo = std::min(lo, static_cast<double>(*v.peak_bytes));
    hi = std::max(hi, static_cast<double>(*v.peak_bytes));
    top = std::max(top, v.overhead);
  }
  hi = std::max(hi, static_cast<double>(report.budget_bytes));
  const double margin = std::max(1.0, (hi - lo) * 0.06);
  const double step = static_cast<double>(NiceBytesCeiling(static_cast<int64_t>(hi - lo + 1))) / 4;
  Axes axes{std::max(0.0, lo - margin), hi + margin, 1.0, 1.0 + (top - 1.0) * 1.12 + 1e-3};

  std::string svg = ChartHead(kWidth, kHeight, kLeft, title,
                              "least recompute at each budget (the staircase); points: fixed "
                              "variants at their own peak");
  // Grid and ticks.
  for (double b = std::ceil(axes.x0 / step) * step; b <= axes.x1; b += step) {
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#eee\"/>\n"
                          "<text x=\"%.1f\" y=\"%d\" class=\"tick\" text-anchor=\"middle\">%s</text>\n",
                          axes.X(b), kTop, axes.X(b), kTop + kPlotHeight, axes.X(b),
                          kTop + kPlotHeight + 16, HumanBytes(static_cast<int64_t>(b)));
  }
  for (int k = 0; k <= 4; ++k) {
    const double o = axes.y0 + (axes.y1 - axes.y0) * k / 4;
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#eee\"/>\n"
                          "<text x=\"%d\" y=\"%.1f\" class=\"tick\" text-anchor=\"end\">%.3fx</text>\n",
                          kLeft, axes.Y(o), kLeft + kPlotWidth, axes.Y(o), kLeft - 6,
                          axes.Y(o) + 4, o);
  }
  absl::StrAppendFormat(
      &svg,
      "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"#888\"/>\n"
      "<text x=\"%d\" y=\"%d\" class=\"axis\" text-anchor=\"middle\">memory budget "
      "(predicted step peak)</text>\n"
      "<text x=\"16\" y=\"%d\" class=\"axis\" transform=\"rotate(-90 16 %d)\" "
      "text-anchor=\"middle\">step time / no checkpointing</text>\n",
      kLeft, kTop, kPlotWidth, kPlotHeight, kLeft + kPlotWidth / 2, kHeight - 14,
      kTop + kPlotHeight / 2, kTop + kPlotHeight / 2);
  // The staircase: the best overhead holds from a budget to the next.
  std::string path;
  for (size_t i = 0; i < frontier.size(); ++i) {
    const double x = axes.X(static_cast<double>(frontier[i].budget_bytes));
    const double y = axes.Y(frontier[i].plan.overhead);
    if (i == 0) {
      absl::StrAppendFormat(&path, "M%.1f,%.1f", x, y);
    } else {
      absl::StrAppendFormat(&path, " H%.1f V%.1f", x, y);
    }
  }
  if (!frontier.empty()) absl::StrAppendFormat(&path, " H%.1f", axes.X(axes.x1));
  absl::StrAppendFormat(&svg,
                        "<path class=\"frontier\" d=\"%s\" fill=\"none\" stroke=\"#4e79a7\" "
                        "stroke-width=\"2.5\"/>\n",
                        path);
  // The budget asked for, and the plan under it.
  const double budget_x = axes.X(static_cast<double>(report.budget_bytes));
  absl::StrAppendFormat(
      &svg,
      "<line class=\"budget\" x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#e15759\" "
      "stroke-dasharray=\"5,4\"/>\n"
      "<text x=\"%.1f\" y=\"%d\" class=\"label\" fill=\"#e15759\">budget %s</text>\n"
      "<circle class=\"plan\" cx=\"%.1f\" cy=\"%.1f\" r=\"6\" fill=\"#e15759\"/>\n"
      "<text x=\"%.1f\" y=\"%.1f\" class=\"label\">plan: %.4fx at %s</text>\n",
      budget_x, kTop, budget_x, kTop + kPlotHeight, budget_x + 4, kTop + 14,
      HumanBytes(report.budget_bytes), axes.X(static_cast<double>(report.plan.peak_bytes)),
      axes.Y(report.plan.overhead), axes.X(static_cast<double>(report.plan.peak_bytes)) + 9,
      axes.Y(report.plan.overhead) - 8, report.plan.overhead, HumanBytes(report.plan.peak_bytes));
  for (const VariantCost& v : report.variants) {
    if (!v.peak_bytes.has_value()) continue;
    const double x = axes.X(static_cast<double>(*v.peak_bytes));
    const double y = axes.Y(v.overhead);
    absl::StrAppendFormat(&svg,
                          "<circle class=\"variant\" cx=\"%.1f\" cy=\"%.1f\" r=\"5\" "
                          "fill=\"#f28e2b\"/>\n"
                          "<text x=\"%.1f\" y=\"%.1f\" class=\"label\">%s %.3fx</text>\n",
                          x, y, x + 8, y + 4, SvgEscape(v.name), v.overhead);
  }
  absl::StrAppend(&svg, "</svg>\n");
  return svg;
}

}  // namespace memledger
