// WriteFileAtomically: a file is either its complete new contents or untouched.
#ifndef ESTIMATOR_CLI_ATOMIC_FILE_H_
#define ESTIMATOR_CLI_ATOMIC_FILE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace memledger {

// WriteFileAtomically writes `contents` to a temporary file beside `path`, flushes it
// and renames it over `path`; an interrupted run leaves no half-written file. Errors
// name the path and the OS reason.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents);

}  // namespace memledger

#endif  // ESTIMATOR_CLI_ATOMIC_FILE_H_
