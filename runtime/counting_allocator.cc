#include "runtime/counting_allocator.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace memledger::runtime {
namespace {

// The ops running on this thread, outermost first (RecordFunction names, which stay valid
// until the op's end callback).
thread_local std::vector<const char*> op_stack;

std::unique_ptr<at::ObserverContext> OpStart(const at::RecordFunction& fn) {
  op_stack.push_back(fn.name());
  return nullptr;
}

void OpEnd(const at::RecordFunction& /*fn*/, at::ObserverContext* /*context*/) {
  if (!op_stack.empty()) op_stack.pop_back();
}

class CountingAllocator final : public c10::Allocator {
 public:
  // The allocator every counted allocation really comes from.
  c10::Allocator* underlying = nullptr;

  // The data pointer is its own context, as LibTorch's raw_allocate() requires of a
  // CPU allocator; the real allocation and its size wait in a table until the free.
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr real = underlying->allocate(n);
    void* data = real.get();
    const c10::Device device = real.device();
    const int64_t bytes = static_cast<int64_t>(n);
    std::lock_guard<std::mutex> lock(mutex_);
    allocations_.emplace(data, Allocation{std::move(real), bytes});
    RecordLocked(bytes);
    return c10::DataPtr(data, data, &Delete, device);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &Delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void Free(void* data) {
    Allocation allocation;
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = allocations_.find(data);
    if (it == allocations_.end()) return;  // zero-size allocations share nullptr
    allocation = std::move(it->second);
    allocations_.erase(it);
    RecordLocked(-allocation.bytes);
    // `allocation.real` frees the memory as it goes out of scope (under the lock, which
    // the underlying allocator never re-enters).
  }

  // Begin starts a scope: counts relative to now, timeline empty.
  void Begin(bool timeline) {
    std::lock_guard<std::mutex> lock(mutex_);
    in_scope_ = true;
    timeline_ = timeline;
    baseline_ = live_;
    peak_ = PeakPoint();
    events_.clear();
    phases_.clear();
    op_names_.clear();
    op_index_.clear();
  }

  void End() {
    std::lock_guard<std::mutex> lock(mutex_);
    in_scope_ = false;
  }

  void MarkPhase(absl::string_view name) {
    std::lock_guard<std::mutex> lock(mutex_);
    phases_.push_back(PhaseMark{std::string(name), static_cast<int64_t>(events_.size()),
                                live_ - baseline_});
  }

  int64_t live_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return live_ - baseline_;
  }
  PeakPoint peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    return peak_;
  }
  std::vector<AllocationEvent> events() {
    std::lock_guard<std::mutex> lock(mutex_);
    return events_;
  }
  std::vector<PhaseMark> phases() {
    std::lock_guard<std::mutex> lock(mutex_);
    return phases_;
  }
  std::vector<std::string> op_names() {
    std::lock_guard<std::mutex> lock(mutex_);
    return op_names_;
  }

 private:
  struct Allocation {
    c10::DataPtr real;
    int64_t bytes = 0;
  };

  static void Delete(void* data);

  // RecordLocked applies one allocation or free to the ledger; within a scope it also
  // keeps the peak and, with a timeline, the event.
  void RecordLocked(int64_t bytes) {
    live_ += bytes;
    if (!in_scope_) return;
    const int64_t live = live_ - baseline_;
    if (timeline_) {
      const int32_t op = op_stack.empty() ? -1 : InternLocked(op_stack.front());
      const int32_t inner_op = op_stack.empty() ? -1 : InternLocked(op_stack.back());
      events_.push_back(AllocationEvent{bytes, live, op, inner_op});
    }
    if (live > peak_.bytes) {
      peak_.bytes = live;
      peak_.event = static_cast<int64_t>(events_.size()) - 1;
      if (timeline_) {
        peak_.phase = phases_.empty() ? "" : phases_.back().name;
        peak_.op = op_stack.empty() ? "" : op_stack.front();
        peak_.inner_op = op_stack.empty() ? "" : op_stack.back();
      }
    }
  }

  int32_t InternLocked(const char* name) {
    auto [it, inserted] =
        op_index_.emplace(name, static_cast<int32_t>(op_names_.size()));
    if (inserted) op_names_.push_back(it->first);
    return it->second;
  }

  std::mutex mutex_;
  std::unordered_map<void*, Allocation> allocations_;
  int64_t live_ = 0;  // absolute: every allocation still in the table
  bool in_scope_ = false;
  bool timeline_ = false;
  int64_t baseline_ = 0;
  PeakPoint peak_;
  std::vector<AllocationEvent> events_;
  std::vector<PhaseMark> phases_;
  std::vector<std::string> op_names_;
  std::unordered_map<std::string, int32_t> op_index_;
};

// Leaked: storages counted by it may be freed at any later time, even at exit.
CountingAllocator& Counter() {
  static auto* const counter = new CountingAllocator();
  return *counter;
}

void CountingAllocator::Delete(void* data) { Counter().Free(data); }

std::atomic<bool> installed{false};

}  // namespace

ScopedCountingAllocator::ScopedCountingAllocator(Record record) {
  bool expected = false;
  TORCH_CHECK(installed.compare_exchange_strong(expected, true),
              "ScopedCountingAllocator: another counting scope is alive");
  CountingAllocator& counter = Counter();
  previous_ = c10::GetAllocator(c10::DeviceType::CPU);
  counter.underlying = previous_;
  const bool timeline = record == Record::kTimeline;
  counter.Begin(timeline);
  if (timeline) {
    op_stack.clear();
    op_callback_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&OpStart, &OpEnd)
            .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION,
                     at::RecordScope::USER_SCOPE}));
  }
  c10::SetAllocator(c10::DeviceType::CPU, &counter);
}

ScopedCountingAllocator::~ScopedCountingAllocator() {
  c10::SetAllocator(c10::DeviceType::CPU, previous_);
  if (op_callback_ != 0) at::removeCallback(op_callback_);
  Counter().End();
  installed.store(false);
}

int64_t ScopedCountingAllocator::live_bytes() const { return Counter().live_bytes(); }

int64_t ScopedCountingAllocator::peak_bytes() const { return Counter().peak().bytes; }

PeakPoint ScopedCountingAllocator::peak() const { return Counter().peak(); }

void ScopedCountingAllocator::MarkPhase(absl::string_view name) { Counter().MarkPhase(name); }

std::vector<AllocationEvent> ScopedCountingAllocator::events() const {
  return Counter().events();
}

std::vector<PhaseMark> ScopedCountingAllocator::phases() const { return Counter().phases(); }

std::vector<std::string> ScopedCountingAllocator::op_names() const {
  return Counter().op_names();
}

}  // namespace memledger::runtime
