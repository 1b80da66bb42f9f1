#include "estimator/report/memory_snapshot.h"

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/report/pickle.h"

namespace memledger {
namespace {

constexpr int64_t kBaseAddress = int64_t{0x7f00} << 32;  // looks like a heap address
constexpr int64_t kAlignment = 512;                      // as CUDA's allocator rounds

struct Block {
  int64_t addr = 0;
  int64_t size = 0;
  std::string label;  // the op (or the category before the step)
  std::string phase;
  const char* category = "";
};

void Frames(PickleWriter& w, const Block& b) {
  // Innermost first, as torch records Python frames: the op, then the step's phase.
  w.BeginList();
  w.BeginDict();
  w.Str("name");
  w.Str(b.label);
  w.Str("filename");
  w.Str(absl::StrCat("memledger ", b.phase));
  w.Str("line");
  w.Int(0);
  w.EndDict();
  w.EndList();
}

void TraceEntry(PickleWriter& w, const char* action, const Block& b, int64_t time) {
  w.BeginDict();
  w.Str("action");
  w.Str(action);
  w.Str("addr");
  w.Int(b.addr);
  w.Str("size");
  w.Int(b.size);
  w.Str("stream");
  w.Int(0);
  w.Str("time_us");
  w.Int(time);
  w.Str("category");
  w.Str(b.category);
  w.Str("frames");
  Frames(w, b);
  w.EndDict();
}

}  // namespace

absl::StatusOr<std::string> MemorySnapshotPickle(const StepTimeline& timeline) {
  if (timeline.events.empty()) {
    return absl::InvalidArgumentError("memory snapshot: the timeline has no events");
  }
  int64_t next = kBaseAddress;
  auto place = [&](int64_t size) {
    const int64_t addr = next;
    next += (size + kAlignment - 1) / kAlignment * kAlignment;
    return addr;
  };
  PickleWriter w;
  w.BeginDict();
  w.Str("device_traces");
  w.BeginList();
  w.BeginList();  // device 0
  int64_t time = 0;
  // What exists before the step: the parameters and the optimizer's state tensor by
  // tensor where known, the rest (buffers, the input) one allocation per category.
  std::vector<Block> before;
  std::array<bool, kNumMemoryCategories> listed{};
  for (const ResidentTensor& t : timeline.resident_tensors) {
    listed[static_cast<int>(t.category)] = true;
    before.push_back(Block{place(t.bytes), t.bytes, t.name, "before the step",
                           MemoryCategoryName(t.category)});
    TraceEntry(w, "alloc", before.back(), time++);
  }
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    const int64_t bytes = timeline.resident[c];
    if (bytes <= 0 || listed[c]) continue;
    const char* category = MemoryCategoryName(static_cast<MemoryCategory>(c));
    before.push_back(Block{place(bytes), bytes, absl::StrCat(category, " (before the step)"),
                           "before the step", category});
    TraceEntry(w, "alloc", before.back(), time++);
  }
  std::map<int32_t, Block> live;  // by the timeline's storage id
  for (const TimelineEvent& e : timeline.events) {
    if (e.relabel) continue;  // a category change: the allocator sees nothing
    if (e.bytes > 0) {
      Block b{place(e.bytes), e.bytes, timeline.op_labels[e.op], StepPhaseName(e.phase),
              MemoryCategoryName(e.category)};
      TraceEntry(w, "alloc", b, time++);
      live[e.storage] = std::move(b);
      continue;
    }
    auto it = live.find(e.storage);
    if (it == live.end() || it->second.size != -e.bytes) {
      return absl::InternalError(absl::StrCat("memory snapshot: a free of ", -e.bytes,
                                              " bytes matches no allocation"));
    }
    TraceEntry(w, "free_requested", it->second, time);
    TraceEntry(w, "free_completed", it->second, time++);
    live.erase(it);
  }
  w.EndList();
  w.EndList();
  // The state at the end of the step: one segment of the blocks still allocated, in
  // address order, the freed ranges between them inactive.
  std::map<int64_t, const Block*> blocks;
  for (const Block& b : before) blocks[b.addr] = &b;
  for (const auto& [id, b] : live) blocks[b.addr] = &b;
  int64_t allocated = 0;
  for (const auto& [addr, b] : blocks) allocated += b->size;
  w.Str("segments");
  w.BeginList();
  w.BeginDict();
  w.Str("device");
  w.Int(0);
  w.Str("address");
  w.Int(kBaseAddress);
  w.Str("total_size");
  w.Int(next - kBaseAddress);
  w.Str("allocated_size");
  w.Int(allocated);
  w.Str("active_size");
  w.Int(allocated);
  w.Str("requested_size");
  w.Int(allocated);
  w.Str("stream");
  w.Int(0);
  w.Str("segment_type");
  w.Str("large");
  w.Str("is_expandable");
  w.Bool(false);
  w.Str("frames");
  w.BeginList();
  w.EndList();
  w.Str("blocks");
  w.BeginList();
  int64_t at = kBaseAddress;
  auto block = [&](int64_t size, const char* state, const Block* b) {
    w.BeginDict();
    w.Str("address");
    w.Int(at);
    w.Str("size");
    w.Int(size);
    w.Str("requested_size");
    w.Int(b != nullptr ? b->size : size);
    w.Str("state");
    w.Str(state);
    if (b != nullptr) {
      w.Str("frames");
      Frames(w, *b);
    }
    w.EndDict();
    at += size;
  };
  for (const auto& [addr, b] : blocks) {
    if (addr > at) block(addr - at, "inactive", nullptr);
    block(b->size, "active_allocated", b);
  }
  if (next > at) block(next - at, "inactive", nullptr);
  w.EndList();
  w.EndDict();
  w.EndList();
  w.EndDict();
  return w.Finish();
}

}  // namespace memledger
