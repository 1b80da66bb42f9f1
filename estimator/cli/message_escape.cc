#include "estimator/cli/message_escape.h"

#include <cstdint>

#include "absl/strings/str_format.h"

namespace memledger {
namespace {

// Utf8Length: the length of the valid UTF-8 sequence at the start of `s` (1 to 4), or 0
// where it is not one (RFC 3629: no overlong forms, no surrogates, nothing past U+10FFFF).
size_t Utf8Length(absl::string_view s) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  const uint8_t b0 = byte(0);
  if (b0 < 0x80) return 1;
  size_t length;
  uint8_t low = 0x80, high = 0xBF;  // the second byte's range
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    length = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    length = 3;
    if (b0 == 0xE0) low = 0xA0;   // overlong below U+0800
    if (b0 == 0xED) high = 0x9F;  // U+D800 to U+DFFF, the surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    length = 4;
    if (b0 == 0xF0) low = 0x90;   // overlong below U+10000
    if (b0 == 0xF4) high = 0x8F;  // past U+10FFFF
  } else {
    return 0;  // a continuation byte, C0/C1 (overlong ASCII) or F5 to FF
  }
  if (s.size() < length || byte(1) < low || byte(1) > high) return 0;
  for (size_t i = 2; i < length; ++i) {
    if (byte(i) < 0x80 || byte(i) > 0xBF) return 0;
  }
  return length;
}

}  // namespace

std::string EscapeForMessage(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  while (!text.empty()) {
    const uint8_t b = static_cast<uint8_t>(text[0]);
    const size_t length = Utf8Length(text);
    if (length == 0) {
      absl::StrAppendFormat(&out, "\\x%02x", b);
      text.remove_prefix(1);
      continue;
    }
    if (b == '\n') {
      out += "\\n";
    } else if (b == '\r') {
      out += "\\r";
    } else if (b == '\t') {
      out += "\\t";
    } else if (b < 0x20 || b == 0x7F) {
      absl::StrAppendFormat(&out, "\\x%02x", b);
    } else if (b == 0xC2 && static_cast<uint8_t>(text[1]) <= 0x9F) {
      // U+0080 to U+009F: C1 controls (U+009B is CSI, ESC [ in one character).
      absl::StrAppendFormat(&out, "\\u%04x", static_cast<uint8_t>(text[1]));
    } else {
      out.append(text.data(), length);
    }
    text.remove_prefix(length);
  }
  return out;
}

}  // namespace memledger
