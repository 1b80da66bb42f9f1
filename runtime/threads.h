// ConfigureThreads: the study's thread setting, min(4, cores) intra-op threads.
#ifndef RUNTIME_THREADS_H_
#define RUNTIME_THREADS_H_

namespace memledger::runtime {

// ConfigureThreads sets LibTorch's intra-op threads to min(4, hardware threads), as the
// study does (torch.set_num_threads(min(4, os.cpu_count()))). The wheel's MKL and
// OpenMP follow that setting. Returns the intra-op thread count.
int ConfigureThreads();

}  // namespace memledger::runtime

#endif  // RUNTIME_THREADS_H_
