// OutputFiles: a run's output files (--json_out, --timeline_svg, --snapshot_out, ...) are
// all written, whole, or none is; and what a path names is replaced only if it is a
// regular file.
//
// Example:
//   memledger::OutputFiles outputs;
//   if (absl::Status s = outputs.Stage("--json_out", path, json); !s.ok()) return ...;
//   if (absl::Status s = memledger::PrintToStdout(json); !s.ok()) return ...;
//   if (absl::Status s = outputs.Commit(); !s.ok()) return ...;
#ifndef ESTIMATOR_CLI_OUTPUT_FILES_H_
#define ESTIMATOR_CLI_OUTPUT_FILES_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace memledger {

class OutputFiles {
 public:
  OutputFiles() = default;
  OutputFiles(const OutputFiles&) = delete;
  OutputFiles& operator=(const OutputFiles&) = delete;
  // What was staged and not committed is removed: the targets stay as they were.
  ~OutputFiles();

  // Stage writes `contents` whole to a temporary file beside the target and syncs it.
  // The target is `path`, or what `path` names if it is a symbolic link (written
  // through: the link stays a link, as a shell's `>` keeps it). InvalidArgument, naming
  // `flag` and the path, where the target exists and is not a regular file (a device, a
  // FIFO, a directory: replacing it would turn it into a plain file), the link dangles,
  // or the file cannot be written (a missing or read-only directory, a full disk, a name
  // too long); nothing is left behind then.
  absl::Status Stage(absl::string_view flag, const std::string& path,
                     absl::string_view contents);
  // Commit renames every staged file over its target, in the order staged.
  absl::Status Commit();

 private:
  struct Staged {
    std::string flag;
    std::string target;
    std::string temp;
  };
  std::vector<Staged> staged_;
};

// WriteOutputFile stages and commits one file (OutputFiles).
absl::Status WriteOutputFile(absl::string_view flag, const std::string& path,
                             absl::string_view contents);

// PrintToStdout writes `text` to standard output and checks every write: InvalidArgument
// ("cannot write to standard output: No space left on device") where one fails.
absl::Status PrintToStdout(absl::string_view text);

}  // namespace memledger

#endif  // ESTIMATOR_CLI_OUTPUT_FILES_H_
