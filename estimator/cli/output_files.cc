#include "estimator/cli/output_files.h"

#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>

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

}  // namespace

OutputFiles::~OutputFiles() {
  for (const Staged& s : staged_) unlink(s.temp.c_str());
}

absl::Status OutputFiles::Stage(absl::string_view flag, const std::string& path,
                                absl::string_view contents) {
  if (path.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": empty file name"));
  std::string target = path;
  struct stat st;
  if (lstat(path.c_str(), &st) == 0) {
    if (S_ISLNK(st.st_mode)) {
      // Through the link to the file it names, which is replaced; the link stays.
      char resolved[PATH_MAX];
      if (realpath(path.c_str(), resolved) == nullptr) {
        return OsError(flag, path, "a symbolic link whose target cannot be resolved");
      }
      target = resolved;
      if (stat(target.c_str(), &st) != 0) return OsError(flag, path, "cannot read its target");
    }
    if (!S_ISREG(st.st_mode)) {
      return PathError(flag, path,
                       absl::StrCat("is ", KindOf(st.st_mode),
                                    ", not a regular file (only a regular file is replaced)"));
    }
  } else if (errno != ENOENT) {
    return OsError(flag, path, "cannot read what is there");
  }
  // mkstemp in the target's directory, so the rename stays on one file system.
  std::string temp = absl::StrCat(target, ".tmp.XXXXXX");
  const int fd = mkstemp(temp.data());
  if (fd < 0) return OsError(flag, path, "cannot create a temporary file beside it");
  const bool written = WriteAll(fd, contents);
  const int write_errno = errno;
  // Readable like any file the shell would create (mkstemp makes it 0600).
  (void)fchmod(fd, 0644);
  const bool synced = written && fsync(fd) == 0;
  const int sync_errno = errno;
  const bool closed = close(fd) == 0;
  if (!written || !synced || !closed) {
    errno = !written ? write_errno : !synced ? sync_errno : errno;
    absl::Status error = OsError(flag, path, "cannot write it");
    unlink(temp.c_str());
    return error;
  }
  staged_.push_back(Staged{std::string(flag), std::move(target), std::move(temp)});
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
    return absl::InvalidArgumentError(
        absl::StrCat("cannot write to standard output: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace memledger
