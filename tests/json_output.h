// JsonOutput: a command-line tool's run (RunCommand) that must succeed with JSON on
// stdout, parsed, for tests that then read its fields.
#ifndef TESTS_JSON_OUTPUT_H_
#define TESTS_JSON_OUTPUT_H_

#include <gtest/gtest.h>
#include "rapidjson/document.h"

#include "tests/subprocess.h"

namespace memledger::testing {

// JsonOutput parses `run`'s output into `doc`: a failure naming the exit code or the
// text when the tool did not exit 0 or did not print JSON. Use as
// ASSERT_TRUE(JsonOutput(r, &doc)).
inline ::testing::AssertionResult JsonOutput(const CommandResult& run, rapidjson::Document* doc) {
  if (run.exit_code != 0) {
    return ::testing::AssertionFailure() << "exit code " << run.exit_code << ": " << run.output;
  }
  doc->Parse(run.output.c_str());
  if (doc->HasParseError()) return ::testing::AssertionFailure() << "not JSON: " << run.output;
  return ::testing::AssertionSuccess();
}

}  // namespace memledger::testing

#endif  // TESTS_JSON_OUTPUT_H_
