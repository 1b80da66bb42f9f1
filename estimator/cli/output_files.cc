#include "estimator/cli/output_files.h"

#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace memledger {
namespace {

// PathError is the one-line error of an output: "--json_out=/x/y.json: <what>".
absl::Status PathError(absl::string_view flag, const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(flag, "=", path, ": ", what));
}

absl::Status OsError(absl::string_view flag, const std::string& path, absl::string_view what) {
  return PathError(flag, path, absl::StrCat(what, ": ", std::strerror(errno)));
}

// KindOf names a file type that is not a regular file.
const char* KindOf(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// WriteAll writes `data` to `fd`, retrying short writes and EINTR.
bool WriteAll(int fd, absl::string_view data) {
  const char* p = data.data();
  size_t left = data.size();
  while (left > 0) {
    const ssize_t n = write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    left -= static_cast<size_t>(n);
  }
  return true;
}

// Target: the file an output path names, after a symbolic link. `directory` ends in '/'
// (empty for the working directory); `name` is the last component.
struct Target {
  std::string path;
  std::string directory;
  std::string name;
  bool exists = false;
  mode_t mode = 0;
  OutputFiles::FileIdentity identity;
};

// ResolveTarget finds what `path` names and refuses what must not be replaced: not a
// regular file, a dangling link, a name that cannot be looked up.
absl::StatusOr<Target> ResolveTarget(absl::string_view flag, const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": empty file name"));
  Target target;
  target.path = path;
  struct stat st;
  if (lstat(path.c_str(), &st) == 0) {
    if (S_ISLNK(st.st_mode)) {
      // Through the link to the file it names, which is replaced; the link stays.
      char resolved[PATH_MAX];
      if (realpath(path.c_str(), resolved) == nullptr) {
        return OsError(flag, path, "a symbolic link whose target cannot be resolved");
      }
      target.path = resolved;
      if (stat(target.path.c_str(), &st) != 0) return OsError(flag, path, "cannot read its target");
    }
    if (!S_ISREG(st.st_mode)) {
      return PathError(flag, path,
                       absl::StrCat("is ", KindOf(st.st_mode),
                                    ", not a regular file (only a regular file is replaced)"));
    }
    target.exists = true;
    target.mode = st.st_mode;
    target.identity.exists = true;
    target.identity.device = st.st_dev;
    target.identity.inode = st.st_ino;
  } else if (errno != ENOENT) {
    // ENAMETOOLONG too: a name longer than the file system's longest is refused here.
    return OsError(flag, path, "cannot read what is there");
  }
  const size_t slash = target.path.rfind('/');
  target.directory = slash == std::string::npos ? "" : target.path.substr(0, slash + 1);
  target.name = target.path.substr(slash == std::string::npos ? 0 : slash + 1);
  if (target.name.empty()) {
    return PathError(flag, path, "names a directory (it ends in '/'), not a file");
  }
  if (!target.exists) {
    // Not there yet: the same file as another path where their directories' real paths
    // and their names agree (./a.json and a.json; a name through a linked directory).
    char resolved[PATH_MAX];
    const std::string directory = target.directory.empty() ? "." : target.directory;
    if (realpath(directory.c_str(), resolved) != nullptr) {
      const absl::string_view real = resolved;
      target.identity.canonical =
          absl::StrCat(real, real == "/" ? "" : "/", target.name);
    } else {
      target.identity.canonical = target.path;  // no such directory: Stage says so
    }
  }
  return target;
}

// TempPath is a new name beside `target` for its temporary file: the target's name, cut
// at a character's start where it is needed for ".tmp.XXXXXX" to fit the file system's
// longest name (a valid 255-byte name would not fit with it), and 6 random characters.
std::string TempPath(const Target& target) {
  constexpr absl::string_view kMarker = ".tmp.";
  constexpr size_t kRandomChars = 6;
  const std::string directory = target.directory.empty() ? "." : target.directory;
  long name_max = pathconf(directory.c_str(), _PC_NAME_MAX);
  if (name_max <= 0) name_max = NAME_MAX;
  const size_t limit = static_cast<size_t>(name_max) - kMarker.size() - kRandomChars;
  size_t keep = target.name.size();
  if (keep > limit) {
    keep = limit;
    // Back to the start of a UTF-8 character: no half character in the name.
    while (keep > 0 && (static_cast<unsigned char>(target.name[keep]) & 0xC0) == 0x80) --keep;
  }
  static std::mt19937_64 random(std::random_device{}() ^
                                static_cast<uint64_t>(getpid()) ^
                                static_cast<uint64_t>(std::chrono::steady_clock::now()
                                                          .time_since_epoch()
                                                          .count()));
  static constexpr char kChars[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  std::string suffix;
  for (size_t i = 0; i < kRandomChars; ++i) suffix += kChars[random() % (sizeof(kChars) - 1)];
  return absl::StrCat(target.directory, absl::string_view(target.name).substr(0, keep), kMarker,
                      suffix);
}

// stdout_failure_reported: PrintToStdout has reported standard output's failure, so the
// check at exit stays quiet.
std::atomic<bool> stdout_failure_reported{false};

void CheckStandardOutputNow() {
  if (stdout_failure_reported) return;
  errno = 0;
  std::cout.flush();
  const bool flushed = std::fflush(stdout) == 0;
  if (flushed && !std::ferror(stdout) && !std::cout.bad()) return;
  const int error = errno;
  std::fprintf(stderr, "error: cannot write to standard output: %s\n",
               error != 0 ? std::strerror(error) : "a write failed");
  // The remaining exit handlers would flush standard output again; nothing else is
  // pending (standard error is unbuffered).
  std::_Exit(2);
}

}  // namespace

bool OutputFiles::FileIdentity::SameFile(const FileIdentity& other) const {
  if (exists && other.exists) return device == other.device && inode == other.inode;
  return !exists && !other.exists && canonical == other.canonical;
}

OutputFiles::~OutputFiles() {
  for (const Staged& s : staged_) unlink(s.temp.c_str());
}

void OutputFiles::Protect(absl::string_view flag, const std::string& path) {
  struct stat st;
  if (path.empty() || stat(path.c_str(), &st) != 0) return;
  Named input{std::string(flag), path, FileIdentity()};
  input.identity.exists = true;
  input.identity.device = st.st_dev;
  input.identity.inode = st.st_ino;
  inputs_.push_back(std::move(input));
}

absl::Status OutputFiles::Claim(absl::string_view flag, const std::string& path) {
  absl::StatusOr<Target> target = ResolveTarget(flag, path);
  if (!target.ok()) return target.status();
  for (const Named& input : inputs_) {
    if (input.identity.SameFile(target->identity)) {
      return PathError(flag, path, absl::StrCat("is the same file as ", input.flag, "=",
                                                input.path, ", which the run reads"));
    }
  }
  for (const Named& claim : claims_) {
    if (claim.flag == flag) continue;  // claimed before it is staged
    if (claim.identity.SameFile(target->identity)) {
      return PathError(flag, path,
                       absl::StrCat("is the same file as ", claim.flag, "=", claim.path));
    }
  }
  for (const Named& claim : claims_) {
    if (claim.flag == flag && claim.path == path) return absl::OkStatus();
  }
  claims_.push_back(Named{std::string(flag), path, std::move(target->identity)});
  return absl::OkStatus();
}

absl::Status OutputFiles::Stage(absl::string_view flag, const std::string& path,
                                absl::string_view contents) {
  if (absl::Status s = Claim(flag, path); !s.ok()) return s;
  absl::StatusOr<Target> target = ResolveTarget(flag, path);
  if (!target.ok()) return target.status();
  // In the target's directory, so the rename stays on one file system. open() applies
  // the umask to 0666, as the shell's `>` does for a new file.
  std::string temp;
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    temp = TempPath(*target);
    fd = open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) return OsError(flag, path, "cannot create a temporary file beside it");
  // An existing target keeps its permission bits (a 0600 file stays private).
  if (target->exists) (void)fchmod(fd, target->mode & 07777);
  const bool written = WriteAll(fd, contents);
  const int write_errno = errno;
  const bool synced = written && fsync(fd) == 0;
  const int sync_errno = errno;
  const bool closed = close(fd) == 0;
  if (!written || !synced || !closed) {
    errno = !written ? write_errno : !synced ? sync_errno : errno;
    absl::Status error = OsError(flag, path, "cannot write it");
    unlink(temp.c_str());
    return error;
  }
  staged_.push_back(Staged{std::string(flag), std::move(target->path), std::move(temp)});
  return absl::OkStatus();
}

absl::Status OutputFiles::Commit() {
  for (size_t i = 0; i < staged_.size(); ++i) {
    const Staged& s = staged_[i];
    if (std::rename(s.temp.c_str(), s.target.c_str()) != 0) {
      absl::Status error = OsError(s.flag, s.target, "cannot rename a temporary file over it");
      staged_.erase(staged_.begin(), staged_.begin() + static_cast<std::ptrdiff_t>(i));
      return error;  // the destructor removes the rest
    }
  }
  staged_.clear();
  return absl::OkStatus();
}

absl::Status WriteOutputFile(absl::string_view flag, const std::string& path,
                             absl::string_view contents) {
  OutputFiles outputs;
  if (absl::Status s = outputs.Stage(flag, path, contents); !s.ok()) return s;
  return outputs.Commit();
}

absl::Status PrintToStdout(absl::string_view text) {
  std::cout.flush();  // what an earlier line left in the stream's buffer goes first
  if (!std::cout.good() || !WriteAll(STDOUT_FILENO, text)) {
    stdout_failure_reported = true;
    return absl::InvalidArgumentError(
        absl::StrCat("cannot write to standard output: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

void CheckStandardOutputAtExit() {
  static const bool installed = std::atexit(CheckStandardOutputNow) == 0;
  (void)installed;
}

}  // namespace memledger
