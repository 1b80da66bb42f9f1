// OutputFiles: a run's output files (--json_out, --timeline_svg, --snapshot_out, ...) are
// all written, whole, or none is; what a path names is replaced only if it is a regular
// file; and no output replaces another output or a file the run reads.
//
// Example:
//   memledger::OutputFiles outputs;
//   outputs.Protect("--model", model_path);
//   if (absl::Status s = outputs.Claim("--json_out", path); !s.ok()) return ...;
//   ... the run's work ...
//   if (absl::Status s = outputs.Stage("--json_out", path, json); !s.ok()) return ...;
//   if (absl::Status s = memledger::PrintToStdout(json); !s.ok()) return ...;
//   if (absl::Status s = outputs.Commit(); !s.ok()) return ...;
#ifndef ESTIMATOR_CLI_OUTPUT_FILES_H_
#define ESTIMATOR_CLI_OUTPUT_FILES_H_

#include <sys/types.h>

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

  // Protect registers the file `path` names (following links) as one the run reads,
  // given by `flag` (--model's config.json, --plan's file): an output that is the same
  // file is refused. A path that names no file is not one the run reads, and is skipped.
  void Protect(absl::string_view flag, const std::string& path);

  // Claim checks, before the run's work, what Stage would refuse about `path` itself:
  // InvalidArgument, naming `flag` and the path, where its target is not a regular file,
  // a link dangles, the name is longer than its file system takes, or the target is the
  // same file as a protected input or another flag's claimed output ("--timeline_svg=a:
  // is the same file as --json_out=./a"). Two paths are the same file when they name
  // one (device, inode); where the file does not exist yet, when the real path of the
  // directory and the name agree.
  absl::Status Claim(absl::string_view flag, const std::string& path);

  // Stage claims `path` for `flag` (Claim), then writes `contents` whole to a temporary
  // file beside the target and syncs it. The target is `path`, or what `path` names if
  // it is a symbolic link (written through: the link stays a link, as a shell's `>`
  // keeps it). The file gets the target's permission bits where it exists, else 0666
  // less the umask, as a shell's `>` leaves them. The temporary file's name is the
  // target's name, shortened to fit the file system's longest name, and ".tmp.XXXXXX".
  // InvalidArgument, naming `flag` and the path, for what Claim refuses and where the
  // file cannot be written (a missing or read-only directory, a full disk); nothing is
  // left behind then.
  absl::Status Stage(absl::string_view flag, const std::string& path,
                     absl::string_view contents);
  // Commit renames every staged file over its target, in the order staged.
  absl::Status Commit();

  // FileIdentity: which file a path names, to tell two names of one file apart from two
  // files: its (device, inode) where it exists, else the real path of its directory
  // followed by its name.
  struct FileIdentity {
    bool exists = false;
    dev_t device = 0;
    ino_t inode = 0;
    std::string canonical;
    bool SameFile(const FileIdentity& other) const;
  };

 private:
  struct Named {
    std::string flag;
    std::string path;
    FileIdentity identity;
  };
  struct Staged {
    std::string flag;
    std::string target;
    std::string temp;
  };
  std::vector<Named> inputs_;
  std::vector<Named> claims_;
  std::vector<Staged> staged_;
};

// WriteOutputFile stages and commits one file (OutputFiles).
absl::Status WriteOutputFile(absl::string_view flag, const std::string& path,
                             absl::string_view contents);

// PrintToStdout writes `text` to standard output and checks every write: InvalidArgument
// ("cannot write to standard output: No space left on device", "...: Broken pipe") where
// one fails. A closed pipe is an error here, not SIGPIPE, where the program ignores
// SIGPIPE (ParseCommandLineOrExit does).
absl::Status PrintToStdout(absl::string_view text);

// CheckStandardOutputAtExit makes the process's exit check what it left in standard
// output's buffers (Abseil's --version, --helpfull): where that cannot be written, one
// line ("error: cannot write to standard output: No space left on device") and exit
// status 2 instead of 0. Once PrintToStdout has reported a failure, it says nothing more.
void CheckStandardOutputAtExit();

}  // namespace memledger

#endif  // ESTIMATOR_CLI_OUTPUT_FILES_H_
