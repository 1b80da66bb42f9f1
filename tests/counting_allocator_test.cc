// The counting allocator counts exactly the CPU tensors allocated in its scope while they
// live (hand arithmetic), including LibTorch's raw allocations, and restores the previous
// allocator.
#include "runtime/counting_allocator.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace memledger::runtime {
namespace {

TEST(CountingAllocatorTest, CountsLiveBytesAndPeak) {
  at::Tensor before = at::zeros({100});  // allocated outside: never counted
  c10::Allocator* const original = c10::GetAllocator(c10::DeviceType::CPU);
  {
    ScopedCountingAllocator counting;
    EXPECT_EQ(counting.live_bytes(), 0);
    at::Tensor a = at::empty({10, 10});                  // 100 x 4 B = 400
    at::Tensor b = at::empty({3}, at::kDouble);          // 3 x 8 B = 24
    EXPECT_EQ(counting.live_bytes(), 424);
    at::Tensor view = a.view({100});                     // a view allocates nothing
    EXPECT_EQ(counting.live_bytes(), 424);
    a.reset();
    EXPECT_EQ(counting.live_bytes(), 424);               // the view keeps the storage
    view.reset();
    EXPECT_EQ(counting.live_bytes(), 24);
    before.reset();                                      // not ours: no change
    EXPECT_EQ(counting.live_bytes(), 24);
    EXPECT_EQ(counting.peak_bytes(), 424);
    void* raw = c10::GetAllocator(c10::DeviceType::CPU)->raw_allocate(64);
    EXPECT_EQ(counting.live_bytes(), 88);
    c10::GetAllocator(c10::DeviceType::CPU)->raw_deallocate(raw);
    EXPECT_EQ(counting.live_bytes(), 24);
  }
  EXPECT_EQ(c10::GetAllocator(c10::DeviceType::CPU), original);
}

TEST(CountingAllocatorTest, FreesAfterTheScopeAreStillRecorded) {
  at::Tensor kept;
  {
    ScopedCountingAllocator counting;
    kept = at::empty({8});  // 32 B, outlives the scope
  }
  ScopedCountingAllocator next;
  kept.reset();             // freed by the first scope's allocator: the ledger drops it
  EXPECT_EQ(next.live_bytes(), -32);  // relative to this scope's start
}

// The timeline on a tiny graph, by hand: every event with the live bytes after it and
// the op running, the phases, and where the peak was.
TEST(CountingAllocatorTest, TimelineOfATinyGraph) {
  std::vector<AllocationEvent> events;
  std::vector<PhaseMark> phases;
  std::vector<std::string> names;
  PeakPoint peak;
  {
    ScopedCountingAllocator counting(ScopedCountingAllocator::Record::kTimeline);
    counting.MarkPhase("make");
    at::Tensor a = at::empty({10, 10});   // +400 -> 400, in aten::empty
    counting.MarkPhase("use");
    at::Tensor b = at::relu(a);           // +400 -> 800, in aten::relu
    at::Tensor c = b.sum();               // +4 -> 804 (the peak), in aten::sum
    a.reset();                            // -400 -> 404, outside every op
    b.reset();                            // -400 -> 4
    EXPECT_EQ(counting.live_bytes(), 4);
    events = counting.events();
    phases = counting.phases();
    names = counting.op_names();
    peak = counting.peak();
  }
  auto op = [&](const AllocationEvent& e) { return e.op < 0 ? std::string("-") : names[e.op]; };
  ASSERT_EQ(events.size(), 5u);
  const int64_t bytes[] = {400, 400, 4, -400, -400};
  const int64_t live[] = {400, 800, 804, 404, 4};
  const char* ops[] = {"aten::empty", "aten::relu", "aten::sum", "-", "-"};
  for (size_t i = 0; i < events.size(); ++i) {
    EXPECT_EQ(events[i].bytes, bytes[i]) << i;
    EXPECT_EQ(events[i].live, live[i]) << i;
    EXPECT_EQ(op(events[i]), ops[i]) << i;
  }
  ASSERT_EQ(phases.size(), 2u);
  EXPECT_EQ(phases[0].name, "make");
  EXPECT_EQ(phases[0].first_event, 0);
  EXPECT_EQ(phases[1].name, "use");
  EXPECT_EQ(phases[1].first_event, 1);
  EXPECT_EQ(phases[1].live, 400);
  EXPECT_EQ(peak.bytes, 804);
  EXPECT_EQ(peak.event, 2);
  EXPECT_EQ(peak.phase, "use");
  EXPECT_EQ(peak.op, "aten::sum");
}

}  // namespace
}  // namespace memledger::runtime
