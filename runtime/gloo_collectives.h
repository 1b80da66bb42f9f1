// Gloo process groups and the collectives the rank runtime runs on them, each waited
// for until Gloo lets go of its tensors (a counted step must see them freed).
#ifndef RUNTIME_GLOO_COLLECTIVES_H_
#define RUNTIME_GLOO_COLLECTIVES_H_

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace memledger::runtime::distributed_internal {

using GroupPtr = c10::intrusive_ptr<c10d::ProcessGroupGloo>;

// MakeGroup: a Gloo group over 127.0.0.1 of `size` ranks, its keys under `prefix` in
// `store`.
GroupPtr MakeGroup(const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix,
                   int64_t rank, int64_t size, std::chrono::milliseconds timeout);

// Complete waits for a collective and then for Gloo's worker thread to drop its
// reference to it: the work holds the tensors it was given, and a counted step must
// see them freed when the caller lets go of them, not whenever that thread gets to it.
void Complete(const c10::intrusive_ptr<c10d::Work>& work);

// AllReduce reduces `t` over `group` in place.
void AllReduce(c10d::ProcessGroupGloo* group, at::Tensor& t,
               c10d::ReduceOp op = c10d::ReduceOp::SUM);

}  // namespace memledger::runtime::distributed_internal

#endif  // RUNTIME_GLOO_COLLECTIVES_H_
