// The timeline chart is valid SVG that a real renderer (librsvg's rsvg-convert, which
// ./bazelw installs) turns into a PNG, with one panel per variant, the phases, the
// legend and the peak's label.
#include "estimator/report/timeline_svg.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "estimator/predict/predict.h"
#include "tests/status_matchers.h"

namespace memledger {
namespace {

int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// On CUDA the title names the device and each panel its reserved peak, dashed.
TEST(TimelineSvgTest, OnCudaItShowsTheReservedPeak) {
  ModelConfig config;
  config.device = Device::kCuda;
  PredictOptions options;
  options.timeline = true;
  options.variants = {Variant()};
  ASSERT_OK_AND_ASSIGN(Prediction p, Predict(config, options));
  ASSERT_OK_AND_ASSIGN(std::string svg,
                       PredictedTimelineSvg(PredictedStepTitle(config.device), p.variants));
  EXPECT_NE(svg.find("predicted step on cuda"), std::string::npos);
  EXPECT_EQ(Count(svg, "class=\"reserved\""), 1);
  EXPECT_NE(svg.find(absl::StrCat("peak_reserved_bytes ", p.variants[0].peak_reserved_bytes)),
            std::string::npos);
  EXPECT_GE(p.variants[0].peak_reserved_bytes, p.variants[0].peak->bytes);
  // The CUDA context, outside the allocator: PR #86509's 287,047,680 B by default.
  EXPECT_NE(svg.find("outside the allocator 273.75 MiB"), std::string::npos);
}

TEST(TimelineSvgTest, RendersEveryVariantWithItsPeak) {
  PredictOptions options;
  options.timeline = true;
  ASSERT_OK_AND_ASSIGN(Prediction p, Predict(ModelConfig(), options));
  std::vector<TimelinePanel> panels;
  for (const VariantPrediction& v : p.variants) {
    ASSERT_NE(v.timeline, nullptr) << v.peak_unavailable;
    panels.push_back({v.variant.Name(), v.timeline.get(), std::nullopt});
  }
  // A measured line over the first panel: a flat step at its predicted peak.
  MeasuredLine line;
  line.live = {p.variants[0].peak->bytes, p.variants[0].peak->bytes};
  line.phase_start = {0, 1, 2};
  line.peak_bytes = p.variants[0].peak->bytes;
  panels[0].measured = line;
  const std::string svg = TimelineSvg("study <default> & co", panels);

  EXPECT_EQ(svg.rfind("<svg ", 0), 0u);
  EXPECT_NE(svg.find("study &lt;default&gt; &amp; co"), std::string::npos);
  EXPECT_EQ(Count(svg, "class=\"panel\""), 4);
  EXPECT_EQ(Count(svg, "class=\"peak\""), 4);
  EXPECT_EQ(Count(svg, "class=\"measured\""), 2);  // the legend's and the line
  EXPECT_EQ(Count(svg, ">backward</text>"), 4);
  for (const VariantPrediction& v : p.variants) {
    EXPECT_NE(svg.find(absl::StrCat("(", v.peak->bytes, " B)")), std::string::npos);
  }
  EXPECT_NE(svg.find("(exact)"), std::string::npos);

  const std::string dir = std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp";
  const std::string svg_path = dir + "/timeline.svg", png_path = dir + "/timeline.png";
  std::ofstream(svg_path) << svg;
  const std::string command =
      absl::StrCat("rsvg-convert --format=png -o '", png_path, "' '", svg_path, "'");
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  std::ifstream png(png_path, std::ios::binary);
  std::string magic(8, '\0');
  png.read(magic.data(), 8);
  EXPECT_EQ(magic, std::string("\x89PNG\r\n\x1a\n", 8));
}

// A pipeline rank's forwards and backwards alternate: they are drawn in one span, in
// time order. Here by hand: forward +100 B, backward -100 B, forward +200 B (the second
// micro-batch, after the first's backward), backward -200 B; the peak is the third
// event's 200 B over the 10 resident.
TEST(TimelineSvgTest, AlternatingPhasesShareOneSpanInTimeOrder) {
  StepTimeline t;
  t.resident[static_cast<int>(MemoryCategory::kParameter)] = 10;
  t.resident_bytes = 10;
  t.op_labels = {"op"};
  for (const auto& [bytes, phase] :
       std::vector<std::pair<int64_t, StepPhase>>{{100, StepPhase::kForward},
                                                  {-100, StepPhase::kBackward},
                                                  {200, StepPhase::kForward},
                                                  {-200, StepPhase::kBackward}}) {
    t.events.push_back(TimelineEvent{bytes, MemoryCategory::kActivation, phase, 0, false});
  }
  t.peak.bytes = 210;
  t.peak.phase = StepPhase::kForward;
  t.peak.op = "op";
  t.peak.event = 2;
  const std::string svg = TimelineSvg("rank", {{"none", &t, std::nullopt}});
  EXPECT_EQ(Count(svg, ">forward and backward (the schedule's micro-batches)</text>"), 1);
  EXPECT_EQ(Count(svg, ">backward</text>"), 0);
  EXPECT_NE(svg.find("(210 B)"), std::string::npos);
}

}  // namespace
}  // namespace memledger
