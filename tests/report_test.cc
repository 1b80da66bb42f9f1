// The JSON report carries the study's keys with the study's types; the table is
// readable; the breakdown lists each kept storage.
#include "estimator/report/report.h"

#include <gtest/gtest.h>

#include <string>

#include "estimator/predict/predict.h"
#include "rapidjson/document.h"
#include "tests/status_matchers.h"

namespace memledger {
namespace {

TEST(ReportTest, JsonHasStudyKeysAndTypes) {
  ASSERT_OK_AND_ASSIGN(Prediction p, Predict(ModelConfig{}, {}));
  rapidjson::Document doc;
  doc.Parse(JsonString(PredictionJson(p)).c_str());
  ASSERT_FALSE(doc.HasParseError());
  ASSERT_TRUE(doc["config"].IsObject());
  for (const char* key : {"layers", "width", "heads", "batch", "seq"}) {
    EXPECT_TRUE(doc["config"][key].IsInt64()) << key;
  }
  EXPECT_EQ(doc["config"]["width"].GetInt64(), 128);
  for (const char* key : {"n_params", "param_bytes", "grad_bytes", "adamw_state_bytes",
                          "predicted_saved_bytes_none"}) {
    ASSERT_TRUE(doc.HasMember(key)) << key;
    EXPECT_TRUE(doc[key].IsInt64()) << key;
  }
  ASSERT_TRUE(doc["saved_bytes"].IsObject());
  ASSERT_TRUE(doc["saved_ratio_vs_none"].IsObject());
  for (const char* variant : {"none", "full", "every_2", "selective"}) {
    EXPECT_TRUE(doc["saved_bytes"][variant].IsInt64()) << variant;
    EXPECT_TRUE(doc["saved_ratio_vs_none"][variant].IsNumber()) << variant;
  }
  EXPECT_EQ(doc["saved_bytes"]["none"].GetInt64(), 51052544);  // see predict_test
  // Rounded to 4 places like the study: 3670016 / 51052544 = 0.07189 -> 0.0719.
  EXPECT_DOUBLE_EQ(doc["saved_ratio_vs_none"]["full"].GetDouble(), 0.0719);
  // 51052544 / 50331648 = 1.01432 -> 1.0143.
  EXPECT_DOUBLE_EQ(doc["measured_over_predicted"].GetDouble(), 1.0143);
  EXPECT_STREQ(doc["attention"].GetString(), "flash");
  // The releases third_party/torch_requirements.txt pins.
  EXPECT_STREQ(doc["torch"].GetString(), "2.15.0");
  EXPECT_STREQ(doc["transformers"].GetString(), "5.23.0");
  EXPECT_FALSE(doc.HasMember("breakdown"));  // only on request
}

TEST(ReportTest, BreakdownListsKeptStorages) {
  PredictOptions options;
  options.breakdown = true;
  ASSERT_OK_AND_ASSIGN(Prediction p, Predict(ModelConfig{}, options));
  rapidjson::Document doc;
  doc.Parse(JsonString(PredictionJson(p)).c_str());
  ASSERT_TRUE(doc["breakdown"]["none"].IsArray());
  // none: block 0, the 5 other blocks, the loss.
  const auto& kinds = doc["breakdown"]["none"];
  ASSERT_EQ(kinds.Size(), 3u);
  EXPECT_EQ(kinds[1]["count"].GetInt64(), 5);
  // 13 storages per plain flash block (see predict_test's list); their bytes add up to
  // 4 x 1024 x 2056 = 8421376.
  const auto& storages = kinds[1]["storages"];
  ASSERT_EQ(storages.Size(), 13u);
  int64_t sum = 0;
  for (const auto& s : storages.GetArray()) sum += s["storage_bytes"].GetInt64();
  EXPECT_EQ(sum, 8421376);
  const std::string text = BreakdownText(p);
  EXPECT_NE(text.find("attention (_scaled_dot_product_flash_attention_for_cpu)"),
            std::string::npos);
  EXPECT_NE(text.find("follows PyTorch 2.15.0"), std::string::npos);
  EXPECT_NE(text.find("(16, 4, 64, 32)"), std::string::npos);
}

TEST(ReportTest, TableShowsHumanUnits) {
  ASSERT_OK_AND_ASSIGN(Prediction p, Predict(ModelConfig{}, {}));
  const std::string table = PredictionTable(p);
  // 51052544 B = 48.69 MiB; 4758528 B = 4.54 MiB.
  EXPECT_NE(table.find("48.69 MiB"), std::string::npos) << table;
  EXPECT_NE(table.find("4.54 MiB"), std::string::npos) << table;
  EXPECT_NE(table.find("every_2"), std::string::npos) << table;
  EXPECT_NE(table.find("1.0143"), std::string::npos) << table;
}

}  // namespace
}  // namespace memledger
