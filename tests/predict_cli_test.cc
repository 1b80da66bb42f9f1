// The predict binary as a user runs it: exit codes, one-line errors naming the flag,
// JSON on stdout, atomic --json_out.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "rapidjson/document.h"
#include "tests/subprocess.h"

namespace {

using memledger::testing::CommandResult;

CommandResult Predict(const std::string& args) {
  return memledger::testing::RunCommand("estimator/predict " + args);
}

TEST(PredictCliTest, DefaultJson) {
  CommandResult r = Predict("");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  rapidjson::Document doc;
  doc.Parse(r.output.c_str());
  ASSERT_FALSE(doc.HasParseError()) << r.output;
  EXPECT_EQ(doc["saved_bytes"]["none"].GetInt64(), 51052544);  // see predict_test
  EXPECT_STREQ(doc["torch"].GetString(), "2.15.0");
}

TEST(PredictCliTest, BadInputExitsTwoNamingTheFlag) {
  for (const auto& [args, flag] : std::initializer_list<std::pair<const char*, const char*>>{
           {"--layers=0", "--layers"},
           {"--width=-8", "--width"},
           {"--width=130", "--width 130 is not divisible by --heads 4"},
           {"--batch=0", "--batch"},
           {"--seq=-1", "--seq"},
           {"--heads=0", "--heads"},
           {"--variants=none,fast", "--variants"},
           {"--policy=softmax", "--policy"},
           {"--every=0", "--every"},
           {"--attention=sparse", "--attention"},
           {"--format=xml", "--format"},
           {"--batch=1099511627776 --seq=1073741824", "overflow"},
           {"stray", "unexpected argument"}}) {
    CommandResult r = Predict(args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.output;
    EXPECT_NE(r.output.find(flag), std::string::npos) << args << ": " << r.output;
    // One line.
    EXPECT_EQ(r.output.find('\n'), r.output.size() - 1) << args << ": " << r.output;
  }
}

TEST(PredictCliTest, TableAndExplain) {
  CommandResult r = Predict("--format=table --explain --layers=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("MiB"), std::string::npos);
  EXPECT_NE(r.output.find("kept by"), std::string::npos);
  // The release whose rules the numbers follow, in the table and in the breakdown.
  EXPECT_NE(r.output.find("torch 2.15.0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("follows PyTorch 2.15.0"), std::string::npos) << r.output;
}

TEST(PredictCliTest, HelpNamesTheTorchRelease) {
  CommandResult r = Predict("--help");
  EXPECT_NE(r.output.find("as LibTorch 2.15.0 keeps them"), std::string::npos) << r.output;
}

TEST(PredictCliTest, JsonOutWritesTheSameJson) {
  const std::string path = std::string(getenv("TEST_TMPDIR")) + "/prediction.json";
  CommandResult r = Predict("--json_out=" + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream file(path);
  std::stringstream contents;
  contents << file.rdbuf();
  EXPECT_EQ(contents.str(), r.output);
  // A directory that does not exist: an error, exit 1, nothing written.
  CommandResult bad = Predict("--json_out=/nonexistent-dir/p.json");
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_NE(bad.output.find("/nonexistent-dir/p.json"), std::string::npos) << bad.output;
}

}  // namespace
