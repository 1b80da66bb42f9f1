// CountingAllocator: LibTorch's CPU allocator with a ledger. While a
// ScopedCountingAllocator is alive every CPU tensor allocation goes through it and is
// counted (bytes requested) until its storage is freed, whenever that is; the scope
// reports the bytes allocated since it began that are still alive, and their peak.
// A second witness of what autograd keeps, independent of the saved-tensor hooks: after
// a forward, what is still allocated is what the graph holds (plus what the caller holds).
//
// With Record::kTimeline the scope also keeps every allocation and free in order, the
// phase marks its owner sets (MarkPhase) and, through LibTorch's RecordFunction
// callbacks, the op running at each event: the outermost one (an aten op in the forward,
// the engine's "evaluate_function: <Node>" in the backward) and the innermost one.
//
// Example:
//   ScopedCountingAllocator counting(ScopedCountingAllocator::Record::kTimeline);
//   counting.MarkPhase("forward");
//   at::Tensor loss = Forward(model, input);
//   int64_t held = counting.live_bytes() - loss.storage().nbytes();
//   PeakPoint peak = counting.peak();  // bytes, phase, op
#ifndef RUNTIME_COUNTING_ALLOCATOR_H_
#define RUNTIME_COUNTING_ALLOCATOR_H_

#include <c10/core/Allocator.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace memledger::runtime {

// AllocationEvent is one allocation (bytes > 0) or free (bytes < 0) within a scope.
struct AllocationEvent {
  int64_t bytes = 0;
  // live: the scope's live bytes right after the event.
  int64_t live = 0;
  // op: index into ScopedCountingAllocator::op_names() of the outermost op running
  // when it happened; -1 outside every op (the caller's own allocations).
  int32_t op = -1;
  // inner_op: the innermost op running (the kernel that allocated), -1 outside.
  int32_t inner_op = -1;
};

// PhaseMark: events[first_event...] happen in phase `name`, which began at `live`.
struct PhaseMark {
  std::string name;
  int64_t first_event = 0;
  int64_t live = 0;
};

// PeakPoint is where the scope's live bytes were largest (the first time they were).
struct PeakPoint {
  int64_t bytes = 0;
  std::string phase;     // the last MarkPhase before it; "" when none
  std::string op;        // outermost op running ("" outside every op)
  std::string inner_op;  // innermost op running
  int64_t event = -1;    // its index in events(), -1 before the first event
};

// ScopedCountingAllocator installs the counting allocator for CPU tensors and restores
// the previous one when it ends. Thread-safe counts; one scope at a time.
class ScopedCountingAllocator {
 public:
  enum class Record {
    kCounts,    // live bytes and the peak only
    kTimeline,  // also every event, phase marks and op names (RecordFunction)
  };

  explicit ScopedCountingAllocator(Record record = Record::kCounts);
  ~ScopedCountingAllocator();

  ScopedCountingAllocator(const ScopedCountingAllocator&) = delete;
  ScopedCountingAllocator& operator=(const ScopedCountingAllocator&) = delete;

  // live_bytes: bytes allocated since the scope began and not freed yet.
  int64_t live_bytes() const;
  // peak_bytes: the largest live_bytes seen so far in the scope.
  int64_t peak_bytes() const;
  // peak: peak_bytes and where it happened (phase and op names need Record::kTimeline).
  PeakPoint peak() const;

  // MarkPhase starts phase `name` at the current event.
  void MarkPhase(absl::string_view name);

  // The timeline (empty with Record::kCounts).
  std::vector<AllocationEvent> events() const;
  std::vector<PhaseMark> phases() const;
  std::vector<std::string> op_names() const;

 private:
  c10::Allocator* previous_;
  uint64_t op_callback_ = 0;  // RecordFunction callback handle; 0 when none
};

}  // namespace memledger::runtime

#endif  // RUNTIME_COUNTING_ALLOCATOR_H_
