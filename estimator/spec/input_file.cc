#include "estimator/spec/input_file.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace memledger {

absl::StatusOr<std::string> ReadInputFile(const std::string& path, absl::string_view flag,
                                          int64_t max_bytes) {
  struct stat info;
  if (stat(path.c_str(), &info) != 0) {
    const std::string reason = std::strerror(errno);
    if (errno == ENOENT) {
      return absl::NotFoundError(absl::StrCat(flag, ": '", path, "': ", reason));
    }
    return absl::InvalidArgumentError(absl::StrCat(flag, ": '", path, "': ", reason));
  }
  if (S_ISDIR(info.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": '", path, "' is a directory, not a file"));
  }
  if (!S_ISREG(info.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, ": '", path, "' is not a regular file (a device, pipe or socket)"));
  }
  if (info.st_size > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": '", path, "' has ", info.st_size,
                                                   " bytes, more than the ", max_bytes,
                                                   " a JSON input may have"));
  }
  std::ifstream file(path, std::ios::binary);
  std::stringstream text;
  if (file) text << file.rdbuf();
  if (!file || file.bad()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": '", path, "' cannot be read"));
  }
  return text.str();
}

absl::Status CheckJsonNesting(absl::string_view text) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // the escaped character
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxJsonDepth) {
        return absl::InvalidArgumentError(
            absl::StrCat("nests arrays and objects deeper than ", kMaxJsonDepth,
                         " levels (at offset ", i, ")"));
      }
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return absl::OkStatus();
}

}  // namespace memledger
