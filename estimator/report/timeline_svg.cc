#include "estimator/report/timeline_svg.h"

#include <algorithm>
#include <array>
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
constexpr int kLeft = 84;    // room for the y axis' labels
constexpr int kRight = 24;
constexpr int kPlotWidth = kWidth - kLeft - kRight;
constexpr int kTitleHeight = 64;  // title and legend
constexpr int kPanelHeight = 236;
constexpr int kPanelTop = 34;     // panel title and peak label above the plot
constexpr int kPlotHeight = 164;

// Stacked bottom to top: what exists before the step, then what the step makes.
constexpr std::array<MemoryCategory, kNumMemoryCategories> kStackOrder = {
    MemoryCategory::kParameter, MemoryCategory::kBuffer,         MemoryCategory::kOptimizerState,
    MemoryCategory::kCommunication, MemoryCategory::kInput,      MemoryCategory::kGradient,
    MemoryCategory::kActivation, MemoryCategory::kTemporary};

const char* Color(MemoryCategory category) {
  switch (category) {
    case MemoryCategory::kParameter: return "#4e79a7";
    case MemoryCategory::kGradient: return "#59a14f";
    case MemoryCategory::kOptimizerState: return "#76b7b2";
    case MemoryCategory::kActivation: return "#f28e2b";
    case MemoryCategory::kTemporary: return "#e15759";
    case MemoryCategory::kInput: return "#bab0ac";
    case MemoryCategory::kBuffer: return "#9c755f";
    case MemoryCategory::kCommunication: return "#b07aa1";
  }
  return "#000000";
}

const char* Label(MemoryCategory category) {
  return category == MemoryCategory::kOptimizerState ? "optimizer state"
                                                     : MemoryCategoryName(category);
}

// PhaseColumns maps a step's events to pixel columns: phase p owns columns
// [begin[p], begin[p + 1]), in proportion to the predicted events of each phase (at
// least a tenth of the width for a phase that has any), so that predicted and measured
// steps line up phase by phase.
struct PhaseColumns {
  std::array<int, kNumStepPhases + 1> begin{};

  static PhaseColumns For(const std::array<int64_t, kNumStepPhases>& counts) {
    // The optimizer's per-parameter steps are many small events but little memory: it
    // gets a fixed eighth; forward and backward share the rest by their events.
    std::array<double, kNumStepPhases> share{};
    const int optimizer = static_cast<int>(StepPhase::kOptimizer);
    const double rest = counts[optimizer] > 0 ? 0.875 : 1.0;
    const int64_t events = counts[0] + counts[1];
    for (int p = 0; p < optimizer; ++p) {
      share[p] = events > 0 ? rest * static_cast<double>(counts[p]) / static_cast<double>(events)
                            : 0;
    }
    share[optimizer] = 1.0 - rest;
    PhaseColumns columns;
    double x = 0;
    for (int p = 0; p < kNumStepPhases; ++p) {
      columns.begin[p] = static_cast<int>(x * kPlotWidth + 0.5);
      x += share[p];
    }
    columns.begin[kNumStepPhases] = kPlotWidth;
    return columns;
  }

  // Column of the i-th of n events of phase p.
  int Of(int p, int64_t i, int64_t n) const {
    const int width = std::max(1, begin[p + 1] - begin[p]);
    const int column = begin[p] + static_cast<int>(static_cast<double>(i) / std::max<int64_t>(n, 1) * width);
    return std::min(column, kPlotWidth - 1);
  }
};

// AppendPoints writes (x0 + c, y[c]) for each column, in order (or reversed), leaving out
// the inside points of horizontal runs, which do not change the drawing.
void AppendPoints(const std::vector<double>& y, bool reversed, std::string* points) {
  const int n = static_cast<int>(y.size());
  for (int k = 0; k < n; ++k) {
    const int c = reversed ? n - 1 - k : k;
    const bool inside = k > 0 && k < n - 1 && y[c] == y[reversed ? c + 1 : c - 1] &&
                        y[c] == y[reversed ? c - 1 : c + 1];
    if (!inside) absl::StrAppendFormat(points, "%d,%.1f ", kLeft + c, y[c]);
  }
}

// Column holds, for one pixel column, the stacked bytes at its largest total.
struct Column {
  bool set = false;
  int64_t total = -1;
  std::array<int64_t, kNumMemoryCategories> by_category{};
};

void DrawPanel(const TimelinePanel& panel, int top, int64_t y_max, std::string* svg) {
  const StepTimeline& t = *panel.predicted;
  // A pipeline rank's schedule interleaves its micro-batches' forwards and backwards:
  // then both share one span, in time order ("forward and backward"), before the
  // optimizer's.
  bool interleaved = false;
  int latest = 0;
  for (const TimelineEvent& e : t.events) {
    const int p = static_cast<int>(e.phase);
    interleaved = interleaved || p < latest;
    latest = std::max(latest, p);
  }
  auto span_of = [&](StepPhase phase) {
    return interleaved && phase == StepPhase::kBackward ? static_cast<int>(StepPhase::kForward)
                                                        : static_cast<int>(phase);
  };
  // Columns advance with allocations and frees; category changes (relabels) only
  // restack, as the measured allocator never sees them.
  std::array<int64_t, kNumStepPhases> counts{};
  for (const TimelineEvent& e : t.events) {
    if (!e.relabel) ++counts[span_of(e.phase)];
  }
  const PhaseColumns columns = PhaseColumns::For(counts);
  const int plot_top = top + kPanelTop;
  auto y_of = [&](int64_t bytes) {
    return plot_top + kPlotHeight -
           static_cast<double>(bytes) / static_cast<double>(y_max) * kPlotHeight;
  };

  // Predicted: the stack at each column's largest moment (the peak is never averaged
  // away).
  std::vector<Column> stack(kPlotWidth);
  std::array<int64_t, kNumMemoryCategories> live = t.resident;
  int64_t total = t.resident_bytes;
  std::array<int64_t, kNumStepPhases> seen{};
  int peak_column = 0;
  stack[0] = Column{true, total, live};
  for (size_t i = 0; i < t.events.size(); ++i) {
    const TimelineEvent& e = t.events[i];
    live[static_cast<int>(e.category)] += e.bytes;
    total += e.bytes;
    const int p = span_of(e.phase);
    const int c = columns.Of(p, e.relabel ? seen[p] : seen[p]++, counts[p]);
    if (!stack[c].set || total > stack[c].total) stack[c] = Column{true, total, live};
    if (static_cast<int64_t>(i) == t.peak.event) peak_column = c;
  }
  for (int c = 1; c < kPlotWidth; ++c) {
    if (!stack[c].set) stack[c] = Column{true, stack[c - 1].total, stack[c - 1].by_category};
  }

  absl::StrAppendFormat(svg, "<text x=\"%d\" y=\"%d\" class=\"panel\">%s</text>\n", kLeft,
                        top + 14, SvgEscape(panel.title));
  // Areas, bottom to top.
  std::vector<double> lower(kPlotWidth, static_cast<double>(plot_top + kPlotHeight));
  std::vector<int64_t> cumulative(kPlotWidth, 0);
  for (MemoryCategory category : kStackOrder) {
    std::string points;
    std::vector<double> upper(kPlotWidth);
    // Rounded to the drawing's resolution, so equal heights compare equal.

    bool any = false;
    for (int c = 0; c < kPlotWidth; ++c) {
      const int64_t bytes = stack[c].by_category[static_cast<int>(category)];
      any = any || bytes > 0;
      cumulative[c] += bytes;
      upper[c] = std::round(y_of(cumulative[c]) * 10) / 10;
    }
    if (!any) continue;
    AppendPoints(upper, /*reversed=*/false, &points);
    AppendPoints(lower, /*reversed=*/true, &points);
    absl::StrAppendFormat(svg, "<polygon fill=\"%s\" points=\"%s\"><title>%s</title></polygon>\n",
                          Color(category), points, Label(category));
    lower = upper;
  }

  // Axes: bytes on the left, phases along the bottom.
  for (int tick = 0; tick <= 4; ++tick) {
    const int64_t bytes = y_max / 4 * tick;
    const double y = y_of(bytes);
    absl::StrAppendFormat(svg,
                          "<line x1=\"%d\" x2=\"%d\" y1=\"%.1f\" y2=\"%.1f\" class=\"grid\"/>"
                          "<text x=\"%d\" y=\"%.1f\" class=\"tick\">%s</text>\n",
                          kLeft, kLeft + kPlotWidth, y, y, kLeft - 6, y + 4, HumanBytes(bytes));
  }
  for (int p = 0; p < kNumStepPhases; ++p) {
    if (counts[p] == 0) continue;
    const int x0 = kLeft + columns.begin[p], x1 = kLeft + columns.begin[p + 1];
    absl::StrAppendFormat(svg,
                          "<line x1=\"%d\" x2=\"%d\" y1=\"%d\" y2=\"%d\" class=\"phase\"/>"
                          "<text x=\"%d\" y=\"%d\" class=\"phasename\">%s</text>\n",
                          x0, x0, plot_top, plot_top + kPlotHeight + 4, (x0 + x1) / 2,
                          plot_top + kPlotHeight + 18,
                          interleaved && p == static_cast<int>(StepPhase::kForward)
                              ? "forward and backward (the schedule's micro-batches)"
                              : StepPhaseName(static_cast<StepPhase>(p)));
  }

  // The measured step, phase by phase on the same columns (a single process's, whose
  // phases follow one another).
  if (panel.measured.has_value() && !interleaved) {
    const MeasuredLine& m = *panel.measured;
    std::vector<int64_t> line(kPlotWidth, -1);
    const int64_t n = static_cast<int64_t>(m.live.size());
    for (int p = 0; p < kNumStepPhases; ++p) {
      const int64_t begin = m.phase_start[p];
      const int64_t end = p + 1 < kNumStepPhases ? m.phase_start[p + 1] : n;
      for (int64_t i = begin; i < end && i < n; ++i) {
        const int c = columns.Of(p, i - begin, end - begin);
        line[c] = std::max(line[c], m.live[i]);
      }
    }
    std::string points;
    for (int c = 0; c < kPlotWidth; ++c) {
      if (line[c] < 0) continue;
      absl::StrAppendFormat(&points, "%d,%.1f ", kLeft + c, y_of(line[c]));
    }
    absl::StrAppendFormat(svg, "<polyline class=\"measured\" points=\"%s\"/>\n", points);
  }

  // The peak.
  const double peak_x = kLeft + peak_column, peak_y = y_of(t.peak.bytes);
  std::string label = absl::StrCat("peak ", HumanBytes(t.peak.bytes), " (", t.peak.bytes,
                                   " B), ", StepPhaseName(t.peak.phase), ": ", t.peak.op);
  if (panel.measured.has_value()) {
    absl::StrAppend(&label, " | measured ", HumanBytes(panel.measured->peak_bytes),
                    panel.measured->peak_bytes == t.peak.bytes ? " (exact)" : "");
  }
  if (t.peak_reserved_bytes > 0) {
    // On CUDA: the allocator's segments at most, a dashed line.
    absl::StrAppend(&label, " | reserved ", HumanBytes(t.peak_reserved_bytes),
                    " | outside the allocator ", HumanBytes(t.outside_allocator_bytes));
    const double reserved_y = y_of(t.peak_reserved_bytes);
    absl::StrAppendFormat(svg,
                          "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" "
                          "class=\"reserved\"><title>peak_reserved_bytes %d</title></line>\n",
                          kLeft, reserved_y, kWidth - kRight, reserved_y,
                          t.peak_reserved_bytes);
  }
  absl::StrAppendFormat(svg,
                        "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4\" class=\"peak\"/>"
                        "<text x=\"%d\" y=\"%d\" class=\"peaklabel\">%s</text>\n",
                        peak_x, peak_y, kLeft, top + 30, SvgEscape(label));
}

}  // namespace

std::string TimelineSvg(const std::string& title, const std::vector<TimelinePanel>& panels) {
  int64_t y_max = 1;
  bool any_measured = false;
  for (const TimelinePanel& panel : panels) {
    y_max = std::max({y_max, panel.predicted->peak.bytes,
                      panel.predicted->peak_reserved_bytes});
    if (panel.measured.has_value()) {
      any_measured = true;
      y_max = std::max(y_max, panel.measured->peak_bytes);
    }
  }
  y_max = NiceBytesCeiling(y_max + y_max / 12);  // headroom for the peak's marker
  const int height = kTitleHeight + kPanelHeight * static_cast<int>(panels.size()) + 8;
  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
      "viewBox=\"0 0 %d %d\" font-family=\"Helvetica, Arial, sans-serif\">\n"
      "<style>.title{font-size:16px;font-weight:bold}.panel{font-size:14px;font-weight:bold}"
      ".tick{font-size:10px;text-anchor:end;fill:#444}.legend{font-size:12px}"
      ".phasename{font-size:11px;text-anchor:middle;fill:#444}"
      ".grid{stroke:#ddd;stroke-width:1}.phase{stroke:#555;stroke-width:1;stroke-dasharray:3,3}"
      ".peak{fill:#000}.peaklabel{font-size:11px}"
      ".reserved{stroke:#555;stroke-width:1;stroke-dasharray:4 3}"
      ".measured{fill:none;stroke:#000;stroke-width:1.2}</style>\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"#ffffff\"/>\n"
      "<text x=\"%d\" y=\"22\" class=\"title\">%s</text>\n",
      kWidth, height, kWidth, height, kLeft, SvgEscape(title));
  // The legend, in stacking order (bottom first), above every panel.
  int x = kLeft;
  for (MemoryCategory category : kStackOrder) {
    absl::StrAppendFormat(&svg,
                          "<rect x=\"%d\" y=\"36\" width=\"12\" height=\"12\" fill=\"%s\"/>"
                          "<text x=\"%d\" y=\"46\" class=\"legend\">%s</text>\n",
                          x, Color(category), x + 16, Label(category));
    x += 30 + 7 * static_cast<int>(std::string(Label(category)).size());
  }
  if (any_measured) {
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%d\" x2=\"%d\" y1=\"42\" y2=\"42\" class=\"measured\"/>"
                          "<text x=\"%d\" y=\"46\" class=\"legend\">measured</text>\n",
                          x, x + 14, x + 18);
  }
  for (size_t i = 0; i < panels.size(); ++i) {
    DrawPanel(panels[i], kTitleHeight + kPanelHeight * static_cast<int>(i), y_max, &svg);
  }
  svg += "</svg>\n";
  return svg;
}

std::string PredictedStepTitle(Device device) {
  // Short enough that a plan's (": the plan") fits the chart's width.
  return absl::StrCat("memledger: predicted step on ", DeviceName(device), " (torch ",
                      kTorchRelease, device == Device::kCuda ? ", allocator blocks)" : ")");
}

absl::StatusOr<std::string> RankTimelineSvg(const RankKind& rank) {
  std::vector<VariantPrediction> variants;
  for (const RankVariant& v : rank.variants) variants.push_back(v.held);
  return PredictedTimelineSvg(
      absl::StrCat("memledger: the most loaded rank's step, predicted (stage ", rank.stage,
                   ", torch ", kTorchRelease, ")"),
      variants);
}

absl::StatusOr<std::string> PredictedTimelineSvg(
    const std::string& title, const std::vector<VariantPrediction>& variants) {
  std::vector<TimelinePanel> panels;
  for (const VariantPrediction& v : variants) {
    if (v.timeline == nullptr) {
      return absl::UnimplementedError(v.peak_unavailable);
    }
    panels.push_back({v.variant.Name(), v.timeline.get(), std::nullopt});
  }
  return TimelineSvg(title, panels);
}

}  // namespace memledger
