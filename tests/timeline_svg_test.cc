// The timeline chart is valid SVG that a real renderer (librsvg's rsvg-convert, which
// ./bazelw installs) turns into a PNG, with one panel per variant, the phases, the
// legend and the peak's label.
#include "estimator/timeline_svg.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "estimator/predict.h"
#include "tests/status_matchers.h"

namespace memledger {
namespace {

int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
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

}  // namespace
}  // namespace memledger
