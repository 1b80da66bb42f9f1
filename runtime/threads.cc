#include "runtime/threads.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <thread>

namespace memledger::runtime {

int ConfigureThreads() {
  const int hardware_threads = static_cast<int>(std::thread::hardware_concurrency());
  const int threads = std::max(1, std::min(4, hardware_threads));
  at::set_num_threads(threads);
  return threads;
}

void UseNativeKernels() { at::globalContext().setUserEnabledMkldnn(false); }

}  // namespace memledger::runtime
