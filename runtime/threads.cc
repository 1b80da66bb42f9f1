#include "runtime/threads.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <algorithm>
#include <thread>

namespace memledger::runtime {

int ConfigureThreads() {
  const int hardware_threads = static_cast<int>(std::thread::hardware_concurrency());
  const int threads = std::max(1, std::min(4, hardware_threads));
  at::set_num_threads(threads);
  // Looked up at run time: with the reference BLAS the symbol does not exist.
  using SetThreads = void (*)(int);
  if (auto set_blas_threads =
          reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    set_blas_threads(1);
  }
  return threads;
}

}  // namespace memledger::runtime
