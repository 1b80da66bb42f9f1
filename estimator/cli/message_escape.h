// EscapeForMessage: what a user typed (a --model path, an output path, a config value),
// made safe to echo in a one-line error. A newline inside it would split the line, and
// an escape sequence would reach the terminal; both are shown as text instead.
//
// Example:
//   std::cerr << "error: " << EscapeForMessage(status.message()) << "\n";
//   // "--json_out=a\nb: ..." prints as "--json_out=a\nb: ..." on one line.
#ifndef ESTIMATOR_CLI_MESSAGE_ESCAPE_H_
#define ESTIMATOR_CLI_MESSAGE_ESCAPE_H_

#include <string>

#include "absl/strings/string_view.h"

namespace memledger {

// EscapeForMessage returns `text` with every control character written out: \n, \r and
// \t as such, any other C0 control or DEL as \xNN (ESC is \x1b), a C1 control (U+0080 to
// U+009F, which some terminals obey like ESC [) as \u00NN, and each byte that is not part
// of valid UTF-8 (a stray continuation byte, an overlong form, a surrogate, a truncated
// sequence) as \xNN. Valid UTF-8 ("é", "→") and a backslash are kept as they are.
std::string EscapeForMessage(absl::string_view text);

}  // namespace memledger

#endif  // ESTIMATOR_CLI_MESSAGE_ESCAPE_H_
