// ReadInputFile reads a file a user names on the command line (--model's config.json,
// --plan's JSON): a regular file of at most `max_bytes`, so that a device (/dev/zero), a
// pipe or a huge file is refused in one line instead of read forever.
//
// Example:
//   absl::StatusOr<std::string> text = ReadInputFile("config.json", "--model", kMaxJsonBytes);
#ifndef ESTIMATOR_SPEC_INPUT_FILE_H_
#define ESTIMATOR_SPEC_INPUT_FILE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace memledger {

// kMaxJsonBytes: the largest JSON input accepted (a config.json is a few KiB).
inline constexpr int64_t kMaxJsonBytes = int64_t{16} << 20;

// ReadInputFile returns the file's contents. NotFound when there is no such file;
// InvalidArgument, naming `flag` and the path, for a directory, anything that is not a
// regular file, a file larger than `max_bytes`, or one that cannot be read.
absl::StatusOr<std::string> ReadInputFile(const std::string& path, absl::string_view flag,
                                          int64_t max_bytes);

// kMaxJsonDepth: the deepest nesting of arrays and objects a JSON input may have. A
// config.json nests 3 levels, a routing file 4; RapidJSON's parser, its values'
// destructors and the readers recurse once per level, so a text of 120,000 '[' would
// overflow the stack.
inline constexpr int kMaxJsonDepth = 64;

// CheckJsonNesting scans `text` (without parsing it) and says, in the caller's words,
// where its arrays and objects nest deeper than kMaxJsonDepth: InvalidArgument
// ("nests arrays and objects deeper than 64 levels (at offset 64)"). Brackets inside
// strings do not count.
absl::Status CheckJsonNesting(absl::string_view text);

}  // namespace memledger

#endif  // ESTIMATOR_SPEC_INPUT_FILE_H_
