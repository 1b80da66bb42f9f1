// A report with a mismatch says which bucket and variant failed, in JSON and table.
#include "verify/verify_report.h"

#include <gtest/gtest.h>

#include <string>

#include "rapidjson/document.h"
#include "estimator/report/report.h"
#include "verify/verify.h"

namespace memledger {
namespace {

VerifyReport FailingReport() {
  VerifyReport report;
  report.grad_tolerance = 1e-5;
  report.measurement.config = ModelConfig{};
  runtime::VariantMeasurement none;
  none.saved_bytes = 1000;
  runtime::VariantMeasurement full;
  full.variant.kind = VariantKind::kFull;
  full.saved_bytes = 250;
  full.max_grad_diff = 0.5;
  report.measurement.variants = {none, full};
  report.measurement.reference_saved_bytes = 1000;
  report.measurement.torch_version = "2.15.0";
  report.measurement.max_grad_diff = 0.5;
  report.prediction.korthikanti_saved_bytes_none = 800;
  report.measured_over_korthikanti = 1000.0 / 800.0;
  report.buckets = {{"saved_bytes.none", 1000, 1000, 1.0}, {"saved_bytes.full", 200, 250, 1.25}};
  report.failures = {"saved_bytes.full: measured 250, predicted 200 (ratio 1.250000)",
                     "max_grad_diff of full is 0.5 > tolerance 1e-05"};
  return report;
}

TEST(VerifyReportTest, JsonSaysWhatFailed) {
  rapidjson::Document doc;
  doc.Parse(JsonString(VerifyJson(FailingReport())).c_str());
  ASSERT_FALSE(doc.HasParseError());
  EXPECT_FALSE(doc["passed"].GetBool());
  ASSERT_EQ(doc["failures"].Size(), 2u);
  EXPECT_DOUBLE_EQ(doc["ratio"]["saved_bytes"]["full"].GetDouble(), 1.25);  // 250 / 200
  EXPECT_EQ(doc["predicted"]["saved_bytes"]["full"].GetInt64(), 200);
  EXPECT_DOUBLE_EQ(doc["saved_ratio_vs_none"]["full"].GetDouble(), 0.25);  // 250 / 1000
  EXPECT_DOUBLE_EQ(doc["measured_over_predicted"].GetDouble(), 1.25);      // 1000 / 800
  EXPECT_DOUBLE_EQ(doc["max_grad_diff"].GetDouble(), 0.5);
}

// The recompute overhead: measured time over none's beside the FLOP model's number.
TEST(VerifyReportTest, RecomputeOverheadSitsBesideTheMeasuredTimeRatio) {
  VerifyReport report = FailingReport();
  report.measurement.variants[0].time_s = 0.020;
  report.measurement.variants[1].time_s = 0.025;
  report.predicted_overhead = {1.0, 1.33};
  rapidjson::Document doc;
  doc.Parse(JsonString(VerifyJson(report)).c_str());
  ASSERT_FALSE(doc.HasParseError());
  EXPECT_DOUBLE_EQ(doc["recompute_overhead"]["full"]["measured"].GetDouble(), 1.25);  // 25/20
  EXPECT_DOUBLE_EQ(doc["recompute_overhead"]["full"]["predicted"].GetDouble(), 1.33);
  const std::string table = VerifyTable(report);
  EXPECT_NE(table.find("time/none"), std::string::npos) << table;
  EXPECT_NE(table.find("1.250        1.330"), std::string::npos) << table;
  // Without timing the measured ratio is null.
  report.measurement.variants[0].time_s.reset();
  doc.Parse(JsonString(VerifyJson(report)).c_str());
  EXPECT_TRUE(doc["recompute_overhead"]["full"]["measured"].IsNull());
}

TEST(VerifyReportTest, RatiosUseTheMeasuredReferenceWithoutNoneRequested) {
  VerifyReport report = FailingReport();
  // Only `full` was requested; `none` still ran (the gradient reference) and measured
  // 1200 bytes, while the prediction for none says 1000.
  report.measurement.variants.erase(report.measurement.variants.begin());
  report.measurement.reference_saved_bytes = 1200;
  report.prediction.saved_bytes_none = 1000;
  report.measured_over_korthikanti = 1200.0 / 800.0;
  rapidjson::Document doc;
  doc.Parse(JsonString(VerifyJson(report)).c_str());
  ASSERT_FALSE(doc.HasParseError());
  EXPECT_FALSE(doc["saved_bytes"].HasMember("none"));
  // 250 / 1200 = 0.20833 -> 0.2083 (measured over measured, not 250 / 1000).
  EXPECT_DOUBLE_EQ(doc["saved_ratio_vs_none"]["full"].GetDouble(), 0.2083);
  EXPECT_DOUBLE_EQ(doc["measured_over_predicted"].GetDouble(), 1.5);  // 1200 / 800
}

TEST(VerifyReportTest, TableMarksTheMismatch) {
  const std::string table = VerifyTable(FailingReport());
  EXPECT_NE(table.find("MISMATCH"), std::string::npos) << table;
  EXPECT_NE(table.find("FAILED"), std::string::npos) << table;
  EXPECT_NE(table.find("max_grad_diff of full"), std::string::npos) << table;
  EXPECT_EQ(table.find("OK:"), std::string::npos) << table;
}

}  // namespace
}  // namespace memledger
