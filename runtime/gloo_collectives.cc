#include "runtime/gloo_collectives.h"

#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

namespace memledger::runtime::distributed_internal {

GroupPtr MakeGroup(const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix,
                   int64_t rank, int64_t size, std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(
      c10::make_intrusive<c10d::PrefixStore>(prefix, store), static_cast<int>(rank),
      static_cast<int>(size), options);
}

void Complete(const c10::intrusive_ptr<c10d::Work>& work) {
  work->wait();
  while (work.use_count() > 1) std::this_thread::yield();
}

void AllReduce(c10d::ProcessGroupGloo* group, at::Tensor& t, c10d::ReduceOp op) {
  std::vector<at::Tensor> buffer = {t};
  c10d::AllreduceOptions options;
  options.reduceOp = op;
  Complete(group->allreduce(buffer, options));
}

}  // namespace memledger::runtime::distributed_internal
