// CountingAllocator: LibTorch's CPU allocator with a ledger. While a
// ScopedCountingAllocator is alive every CPU tensor allocation goes through it and is
// counted (bytes requested) until its storage is freed, whenever that is; the scope
// reports the bytes allocated since it began that are still alive, and their peak.
// A second witness of what autograd keeps, independent of the saved-tensor hooks: after
// a forward, what is still allocated is what the graph holds (plus what the caller holds).
//
// Example:
//   ScopedCountingAllocator counting;
//   at::Tensor loss = Forward(model, input);
//   int64_t held = counting.live_bytes() - loss.storage().nbytes();
#ifndef RUNTIME_COUNTING_ALLOCATOR_H_
#define RUNTIME_COUNTING_ALLOCATOR_H_

#include <c10/core/Allocator.h>

#include <cstdint>

namespace memledger::runtime {

// ScopedCountingAllocator installs the counting allocator for CPU tensors and restores
// the previous one when it ends. Thread-safe counts; one scope at a time.
class ScopedCountingAllocator {
 public:
  ScopedCountingAllocator();
  ~ScopedCountingAllocator();

  ScopedCountingAllocator(const ScopedCountingAllocator&) = delete;
  ScopedCountingAllocator& operator=(const ScopedCountingAllocator&) = delete;

  // live_bytes: bytes allocated since the scope began and not freed yet.
  int64_t live_bytes() const;
  // peak_bytes: the largest live_bytes seen so far in the scope.
  int64_t peak_bytes() const;

 private:
  c10::Allocator* previous_;
  int64_t baseline_;
};

}  // namespace memledger::runtime

#endif  // RUNTIME_COUNTING_ALLOCATOR_H_
