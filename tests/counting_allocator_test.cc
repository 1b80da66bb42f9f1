// The counting allocator counts exactly the CPU tensors allocated in its scope while they
// live (hand arithmetic), including LibTorch's raw allocations, and restores the previous
// allocator.
#include "runtime/counting_allocator.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace memledger::runtime
