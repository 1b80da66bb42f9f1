#include "runtime/counting_allocator.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace memledger::runtime {
namespace {

class CountingAllocator final : public c10::Allocator {
 public:
  // The allocator every counted allocation really comes from, and the ledger.
  c10::Allocator* underlying = nullptr;
  std::atomic<int64_t> live{0};
  std::atomic<int64_t> peak{0};

  // The data pointer is its own context, as LibTorch's raw_allocate() requires of a
  // CPU allocator; the real allocation and its size wait in a table until the free.
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr real = underlying->allocate(n);
    void* data = real.get();
    const c10::Device device = real.device();
    const int64_t bytes = static_cast<int64_t>(n);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      allocations_.emplace(data, Allocation{std::move(real), bytes});
    }
    const int64_t now = live.fetch_add(bytes) + bytes;
    int64_t seen = peak.load();
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {
    }
    return c10::DataPtr(data, data, &Delete, device);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &Delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void Free(void* data) {
    Allocation allocation;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = allocations_.find(data);
      if (it == allocations_.end()) return;  // zero-size allocations share nullptr
      allocation = std::move(it->second);
      allocations_.erase(it);
    }
    live.fetch_sub(allocation.bytes);
    // `allocation.real` frees the memory as it goes out of scope.
  }

 private:
  struct Allocation {
    c10::DataPtr real;
    int64_t bytes = 0;
  };

  static void Delete(void* data);

  std::mutex mutex_;
  std::unordered_map<void*, Allocation> allocations_;
};

// Leaked: storages counted by it may be freed at any later time, even at exit.
CountingAllocator& Counter() {
  static auto* const counter = new CountingAllocator();
  return *counter;
}

void CountingAllocator::Delete(void* data) { Counter().Free(data); }

std::atomic<bool> installed{false};

}  // namespace

ScopedCountingAllocator::ScopedCountingAllocator() {
  bool expected = false;
  TORCH_CHECK(installed.compare_exchange_strong(expected, true),
              "ScopedCountingAllocator: another counting scope is alive");
  CountingAllocator& counter = Counter();
  previous_ = c10::GetAllocator(c10::DeviceType::CPU);
  counter.underlying = previous_;
  baseline_ = counter.live.load();
  counter.peak.store(baseline_);
  c10::SetAllocator(c10::DeviceType::CPU, &counter);
}

ScopedCountingAllocator::~ScopedCountingAllocator() {
  c10::SetAllocator(c10::DeviceType::CPU, previous_);
  installed.store(false);
}

int64_t ScopedCountingAllocator::live_bytes() const { return Counter().live.load() - baseline_; }

int64_t ScopedCountingAllocator::peak_bytes() const {
  return std::max<int64_t>(0, Counter().peak.load() - baseline_);
}

}  // namespace memledger::runtime
