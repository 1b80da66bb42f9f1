// ConfigureThreads: the study's thread setting, min(4, cores) intra-op threads, without
// oversubscribing the CPU.
#ifndef RUNTIME_THREADS_H_
#define RUNTIME_THREADS_H_

namespace memledger::runtime {

// ConfigureThreads sets LibTorch's intra-op threads to min(4, hardware threads) and, when
// the system BLAS is OpenBLAS, makes it single-threaded. Debian's OpenBLAS (pthreads
// build) keeps its own busy-waiting pool next to LibTorch's OpenMP pool; with both at
// two threads on two cores a forward+backward of the study's config took 2.3x longer
// (0.31 s vs 0.135 s). Returns the intra-op thread count.
int ConfigureThreads();

}  // namespace memledger::runtime

#endif  // RUNTIME_THREADS_H_
