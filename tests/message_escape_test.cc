// EscapeForMessage: what a user typed, echoed in a one-line error, stays one line and
// sends the terminal no escape sequence.
#include "estimator/cli/message_escape.h"

#include <gtest/gtest.h>

#include <string>

namespace memledger {
namespace {

TEST(MessageEscapeTest, ControlCharactersAreWrittenOut) {
  EXPECT_EQ(EscapeForMessage("a\nb"), "a\\nb");
  EXPECT_EQ(EscapeForMessage("a\rb\tc"), "a\\rb\\tc");
  EXPECT_EQ(EscapeForMessage("\x1b[31mred"), "\\x1b[31mred");
  EXPECT_EQ(EscapeForMessage(std::string("nul\0end", 7)), "nul\\x00end");
  EXPECT_EQ(EscapeForMessage("del\x7f"), "del\\x7f");
  // U+009B, CSI: ESC [ in one character (C2 9B in UTF-8).
  EXPECT_EQ(EscapeForMessage("\xc2\x9b" "31m"), "\\u009b31m");
}

TEST(MessageEscapeTest, ValidUtf8AndPrintableAsciiAreKept) {
  EXPECT_EQ(EscapeForMessage("--model=caf\xc3\xa9.json"), "--model=caf\xc3\xa9.json");
  EXPECT_EQ(EscapeForMessage("\xe2\x86\x92 \xf0\x9f\x98\x80"), "\xe2\x86\x92 \xf0\x9f\x98\x80");
  EXPECT_EQ(EscapeForMessage("C:\\dir ~!@#$%^&*()"), "C:\\dir ~!@#$%^&*()");
  EXPECT_EQ(EscapeForMessage(""), "");
}

TEST(MessageEscapeTest, InvalidUtf8IsShownByteByByte) {
  EXPECT_EQ(EscapeForMessage("a\xff" "b"), "a\\xffb");
  // A continuation byte alone, and a sequence cut short at the end.
  EXPECT_EQ(EscapeForMessage("\x80"), "\\x80");
  EXPECT_EQ(EscapeForMessage("\xc3"), "\\xc3");
  EXPECT_EQ(EscapeForMessage("\xe2\x86"), "\\xe2\\x86");
  // An overlong '/' (C0 AF), a surrogate (ED A0 80), past U+10FFFF (F4 90 80 80).
  EXPECT_EQ(EscapeForMessage("\xc0\xaf"), "\\xc0\\xaf");
  EXPECT_EQ(EscapeForMessage("\xed\xa0\x80"), "\\xed\\xa0\\x80");
  EXPECT_EQ(EscapeForMessage("\xf4\x90\x80\x80"), "\\xf4\\x90\\x80\\x80");
  // A bad byte does not swallow the valid character after it.
  EXPECT_EQ(EscapeForMessage("\xe2\xc3\xa9"), "\\xe2\xc3\xa9");
}

}  // namespace
}  // namespace memledger
