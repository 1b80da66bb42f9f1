#include "estimator/cli/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace memledger {
namespace {

absl::Status OsError(absl::string_view what, const std::string& path) {
  return absl::UnavailableError(
      absl::StrCat("cannot ", what, " '", path, "': ", std::strerror(errno)));
}

}  // namespace

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents) {
  if (path.empty()) return absl::InvalidArgumentError("--json_out: empty file name");
  // mkstemp in the target's directory, so rename() stays on one file system.
  std::string temp = absl::StrCat(path, ".tmp.XXXXXX");
  int fd = mkstemp(temp.data());
  if (fd < 0) return OsError("create a temporary file beside", path);
  const char* data = contents.data();
  size_t left = contents.size();
  while (left > 0) {
    ssize_t n = write(fd, data, left);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      absl::Status error = OsError("write", temp);
      close(fd);
      unlink(temp.c_str());
      return error;
    }
    data += n;
    left -= static_cast<size_t>(n);
  }
  // Readable like any file the shell would create (mkstemp makes it 0600).
  (void)fchmod(fd, 0644);
  if (fsync(fd) != 0 || close(fd) != 0) {
    absl::Status error = OsError("flush", temp);
    unlink(temp.c_str());
    return error;
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    absl::Status error = OsError("rename a temporary file to", path);
    unlink(temp.c_str());
    return error;
  }
  return absl::OkStatus();
}

}  // namespace memledger
