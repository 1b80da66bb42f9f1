// The CLIs' exit statuses for each kind of error (docs/verify.md).
#include "estimator/cli/cli_flags.h"

#include <gtest/gtest.h>

#include <string>

#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "estimator/graph/family.h"
#include "estimator/request/model_presets.h"

namespace memledger {
namespace {

// --model's help names every built-in model and every config.json model_type a family
// reads: a new preset or family cannot go unlisted.
TEST(CliFlagsTest, ModelHelpNamesEveryPresetAndModelType) {
  const absl::CommandLineFlag* model = absl::FindCommandLineFlag("model");
  ASSERT_NE(model, nullptr);
  const std::string help = model->Help();
  auto names = [&help](const std::string& name) {  // as a word of the list
    for (const char* before : {" ", "("}) {
      for (const char* after : {",", ")", " "}) {
        if (help.find(before + name + after) != std::string::npos) return true;
      }
    }
    return false;
  };
  for (const std::string& preset : PresetNames()) EXPECT_TRUE(names(preset)) << preset;
  for (const FamilyDef* family : Families()) {
    for (const std::string& type : family->model_types) EXPECT_TRUE(names(type)) << type;
  }
}

TEST(CliFlagsTest, ExitStatusByErrorKind) {
  EXPECT_EQ(ReportError(absl::InvalidArgumentError("--layers must be >= 1")), 2);
  EXPECT_EQ(ReportError(absl::OutOfRangeError("overflow")), 2);
  EXPECT_EQ(ReportError(absl::ResourceExhaustedError("too big")), 2);
  // An op without a CPU kernel in the requested dtype: not the user's mistake, not a bug.
  EXPECT_EQ(ReportError(absl::UnimplementedError("no CPU kernel")), 3);
  EXPECT_EQ(ReportError(absl::InternalError("bug")), 1);
}

}  // namespace
}  // namespace memledger
