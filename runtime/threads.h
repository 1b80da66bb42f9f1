// ConfigureThreads: the study's thread setting, min(4, cores) intra-op threads; and
// UseNativeKernels: ATen's own CPU kernels instead of oneDNN's.
#ifndef RUNTIME_THREADS_H_
#define RUNTIME_THREADS_H_

namespace memledger::runtime {

// ConfigureThreads sets LibTorch's intra-op threads to min(4, hardware threads), as the
// study does (torch.set_num_threads(min(4, os.cpu_count()))). The wheel's MKL and
// OpenMP follow that setting. Returns the intra-op thread count.
int ConfigureThreads();

// UseNativeKernels turns oneDNN off for the process, so bf16/fp16 matmuls run ATen's own
// gemm. oneDNN's allocate a scratchpad per call whose size depends on the CPU's ISA
// (AVX512-BF16, AMX: 8-20 KiB measured here), a CPU-backend artifact no GPU step has and
// no estimate can know; ATen's allocate only their outputs. fp32 matmuls (MKL) and every
// other kernel the models run are the same either way.
void UseNativeKernels();

}  // namespace memledger::runtime

#endif  // RUNTIME_THREADS_H_
