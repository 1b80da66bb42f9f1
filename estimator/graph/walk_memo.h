// WalkMemo: what the walks of one block graph keep, remembered across predictions.
//
// Which storages a walk keeps (estimator/saved/walker.h) follows from the graph, the walk's
// options and which tensors share a storage: every keep rule is about tensors and their
// storages, never about sizes. Sizes change which tensors share a storage only where a
// layout decides it (a reshape that can or cannot view, a dimension of 1), and that
// sharing is part of the key. So a walk of the same graph at another batch or sequence
// length whose tensors share storages alike keeps the same storages, and reads them
// here instead of applying every op again; only the bytes are its own.
//
// ModelGraphsFor gives each graph it caches a memo (BlockGraph::walk_memo); those graphs
// never change once built. A graph built any other way has none, and its walks apply
// every op.
//
// A walk that records layouts for the step simulation (WalkOptions::record_layouts) also
// reads which tensors require grad and which ops keep each storage, which follow from the
// same: an entry for such walks holds them too.
#ifndef ESTIMATOR_GRAPH_WALK_MEMO_H_
#define ESTIMATOR_GRAPH_WALK_MEMO_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "estimator/spec/config.h"

namespace memledger {

class WalkMemo {
 public:
  // Options: everything a walk's keeps depend on besides the graph and its storages.
  struct Options {
    bool checkpointed = false;
    bool input_requires_grad = true;
    bool input_embeddings_hooked = false;
    bool recompute_core_attention = false;
    bool non_reentrant = false;
    SavePolicy policy;
    bool layouts = false;  // the walk records layouts: the entry holds Facts::requires_grad

    friend bool operator==(const Options& a, const Options& b) = default;
  };
  // Keep flags, per storage.
  enum Flag : uint8_t { kKept = 1, kCached = 2, kHeld = 4 };
  using Flags = std::vector<uint8_t>;
  // Facts are what a walk remembers: its keep flags and, for a walk with layouts, each
  // tensor's requires_grad and each storage's count of keeping nodes (WalkedStorage's).
  struct Facts {
    Flags flags;
    std::vector<char> requires_grad;
    std::vector<int> node_keepers;
  };

  WalkMemo() = default;
  WalkMemo(const WalkMemo&) = delete;
  WalkMemo& operator=(const WalkMemo&) = delete;

  // Find returns the facts of a walk with `options` whose tensor i lives in storage
  // storage_of[i], if one was remembered; null otherwise. It takes no lock: entries
  // are only ever added, each published before the count that covers it, and live as
  // long as the memo.
  const Facts* Find(const Options& options, const std::vector<int>& storage_of) const {
    const size_t n = count_.load(std::memory_order_acquire);
    for (size_t i = 0; i < n; ++i) {
      const Entry& entry = *entries_[i];
      if (entry.options == options && entry.storage_of == storage_of) return &entry.facts;
    }
    return nullptr;
  }

  // Remember stores a walk's facts; past kMaxEntries (a graph walked at sizes that share
  // storages in that many ways) it stops remembering.
  void Remember(const Options& options, const std::vector<int>& storage_of, Facts facts) {
    std::lock_guard<std::mutex> lock(mutex_);  // one writer at a time
    const size_t n = count_.load(std::memory_order_relaxed);
    if (n >= kMaxEntries || Find(options, storage_of) != nullptr) return;
    entries_[n] = std::make_unique<const Entry>(Entry{options, storage_of, std::move(facts)});
    count_.store(n + 1, std::memory_order_release);
  }

  // Size: how many walks it remembers.
  size_t Size() const { return count_.load(std::memory_order_acquire); }

 private:
  static constexpr size_t kMaxEntries = 64;
  struct Entry {
    Options options;
    std::vector<int> storage_of;
    Facts facts;
  };
  std::mutex mutex_;
  std::array<std::unique_ptr<const Entry>, kMaxEntries> entries_;
  std::atomic<size_t> count_{0};
};

}  // namespace memledger

#endif  // ESTIMATOR_GRAPH_WALK_MEMO_H_
