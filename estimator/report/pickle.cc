#include "estimator/report/pickle.h"

#include <cstdint>
#include <string>
#include <utility>

namespace memledger {
namespace {

// Protocol 2 opcodes (CPython's Lib/pickle.py).
constexpr char kProto = '\x80';
constexpr char kEmptyDict = '}';
constexpr char kEmptyList = ']';
constexpr char kMark = '(';
constexpr char kSetItems = 'u';
constexpr char kAppends = 'e';
constexpr char kBinUnicode = 'X';  // 4-byte little-endian length, UTF-8
constexpr char kBinInt = 'J';      // 4-byte little-endian signed
constexpr char kLong1 = '\x8a';    // 1-byte length, little-endian two's complement
constexpr char kNone = 'N';
constexpr char kNewTrue = '\x88';
constexpr char kNewFalse = '\x89';
constexpr char kStop = '.';

void LittleEndian(std::string* out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

}  // namespace

PickleWriter::PickleWriter() {
  out_.push_back(kProto);
  out_.push_back('\x02');
}

// An empty container, then MARK; its End pops the items after the mark into it.
void PickleWriter::BeginDict() {
  out_.push_back(kEmptyDict);
  out_.push_back(kMark);
}
void PickleWriter::EndDict() { out_.push_back(kSetItems); }
void PickleWriter::BeginList() {
  out_.push_back(kEmptyList);
  out_.push_back(kMark);
}
void PickleWriter::EndList() { out_.push_back(kAppends); }

void PickleWriter::Str(absl::string_view utf8) {
  out_.push_back(kBinUnicode);
  LittleEndian(&out_, utf8.size(), 4);
  out_.append(utf8.data(), utf8.size());
}

void PickleWriter::Int(int64_t value) {
  if (value >= INT32_MIN && value <= INT32_MAX) {
    out_.push_back(kBinInt);
    LittleEndian(&out_, static_cast<uint32_t>(static_cast<int32_t>(value)), 4);
    return;
  }
  out_.push_back(kLong1);
  out_.push_back('\x08');
  LittleEndian(&out_, static_cast<uint64_t>(value), 8);
}

void PickleWriter::Bool(bool value) { out_.push_back(value ? kNewTrue : kNewFalse); }
void PickleWriter::None() { out_.push_back(kNone); }

std::string PickleWriter::Finish() {
  out_.push_back(kStop);
  return std::move(out_);
}

}  // namespace memledger
