// RunCommand: runs a shell command in the test's runfiles directory and captures its
// exit code and output, for tests of the command-line tools.
#ifndef TESTS_SUBPROCESS_H_
#define TESTS_SUBPROCESS_H_

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

namespace memledger::testing {

struct CommandResult {
  int exit_code = -1;  // -1 if it did not exit normally
  std::string output;  // stdout, then stderr if requested
};

// RunCommand runs `command` through the shell. With merge_stderr, stderr goes into
// `output` too (2>&1); else stderr is left to the test log.
inline CommandResult RunCommand(const std::string& command, bool merge_stderr = true) {
  CommandResult result;
  FILE* pipe = popen((command + (merge_stderr ? " 2>&1" : "")).c_str(), "r");
  if (pipe == nullptr) return result;
  std::array<char, 4096> buffer;
  size_t n;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) {
    result.output.append(buffer.data(), n);
  }
  int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

// RunWithClosedStdout runs `command` with standard output a pipe whose reader has gone
// (`true` exits while the command waits 0.5 s), as `predict | head -c 1` after head
// exits: its exit code, and in `output` what it wrote to stderr. `scratch` is a
// directory for the status and stderr files, which are left there.
inline CommandResult RunWithClosedStdout(const std::string& command, const std::string& scratch) {
  CommandResult result;
  const CommandResult shell = RunCommand("(sleep 0.5; " + command + " 2>" + scratch +
                                         "/stderr; echo $? > " + scratch + "/status) | true");
  if (shell.exit_code != 0) return result;
  std::ifstream status(scratch + "/status"), stderr_file(scratch + "/stderr");
  std::stringstream stderr_text;
  stderr_text << stderr_file.rdbuf();
  if (!(status >> result.exit_code)) result.exit_code = -1;
  result.output = stderr_text.str();
  return result;
}

}  // namespace memledger::testing

#endif  // TESTS_SUBPROCESS_H_
