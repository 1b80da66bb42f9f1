// CudaAllocatorSim: PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp
// of the pinned release) replayed on a stream of allocations and frees, one device and
// one stream, to give what torch.cuda.max_memory_allocated() and max_memory_reserved()
// report for it: every request rounded to a block, blocks carved from 2 MiB and 20 MiB
// (or larger) segments, split and merged as the allocator does, segments kept cached.
// Each segment belongs to the stream that was current when it was made, and a block is
// reused only by requests on its stream (BlockComparatorSize orders a pool by stream
// first; get_free_block takes no block of another stream).
//
// Example:
//   CudaAllocatorSim sim;
//   const int a = sim.Malloc(1000);  // a 1,024-B block in a new 2 MiB small segment
//   sim.Free(a);
//   sim.stats().allocated.peak;      // 1024
//   sim.stats().reserved.peak;       // 2097152
//
// What it leaves out: record_stream and the events it waits for, the out-of-memory
// path (freeing cached blocks to retry cudaMalloc), garbage
// collection thresholds and PYTORCH_CUDA_ALLOC_CONF's max_split_size_mb and
// roundup_power2_divisions (the defaults: none of them). Expandable segments are a
// constructor option.
#ifndef ESTIMATOR_STEP_CUDA_ALLOCATOR_H_
#define ESTIMATOR_STEP_CUDA_ALLOCATOR_H_

#include <cstdint>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

namespace memledger {

// The allocator's constants (CUDACachingAllocator.cpp / CUDAAllocatorConfig.h).
inline constexpr int64_t kCudaMinBlockSize = 512;        // every block a multiple of this
inline constexpr int64_t kCudaSmallSize = 1 << 20;       // largest "small" request: 1 MiB
inline constexpr int64_t kCudaSmallBuffer = 2 << 20;     // a small pool's segment: 2 MiB
inline constexpr int64_t kCudaLargeBuffer = 20 << 20;    // a large segment under 10 MiB
inline constexpr int64_t kCudaMinLargeAlloc = 10 << 20;  // from here, segments fit requests
inline constexpr int64_t kCudaRoundLarge = 2 << 20;      // ... rounded up to 2 MiB

// CudaRoundSize is the block size a request of `bytes` gets (round_size): at least 512 B,
// a multiple of 512 B. 0 bytes allocates nothing (the allocator returns no block).
int64_t CudaRoundSize(int64_t bytes);
// CudaSegmentSize is the segment cudaMalloc'd for a rounded request that no cached block
// fits (get_allocation_size).
int64_t CudaSegmentSize(int64_t rounded);

struct CudaAllocatorStat {
  int64_t current = 0;
  int64_t peak = 0;
  void Add(int64_t bytes);
};

struct CudaAllocatorStats {
  CudaAllocatorStat allocated;  // blocks handed out: max_memory_allocated()
  CudaAllocatorStat reserved;   // segments: max_memory_reserved()
  CudaAllocatorStat requested;  // the requests' own sizes
  int64_t segments = 0;         // cudaMalloc calls
};

class CudaAllocatorSim {
 public:
  // expandable_segments: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. Each pool is
  // then one segment of reserved address space whose pages (2 MiB small, 20 MiB large)
  // are mapped as requests need them, and every block splits at 512 B.
  explicit CudaAllocatorSim(bool expandable_segments = false)
      : expandable_(expandable_segments) {}

  // Malloc allocates `bytes` on `stream` (0: the default stream; any other number
  // another stream) and returns its handle (-1 for 0 bytes: no block).
  int Malloc(int64_t bytes, int stream = 0);
  // Free returns the block of a handle Malloc gave (-1 is ignored).
  void Free(int handle);

  // BlockSize: the bytes of a handle's block, as allocated_bytes counts it.
  int64_t BlockSize(int handle) const { return blocks_[handle].size; }
  const CudaAllocatorStats& stats() const { return stats_; }

 private:
  struct Block {
    int64_t address = 0;
    int64_t size = 0;
    int64_t requested = 0;
    int stream = 0;      // its segment's
    bool small = false;  // its pool
    bool allocated = false;
    bool mapped = true;  // false: an expandable segment's unmapped address space
    int prev = -1, next = -1;  // neighbours in its segment
  };
  // A pool's cached blocks by (stream, size, address), the allocator's
  // BlockComparatorSize order.
  using FreeSet = std::map<std::tuple<int, int64_t, int64_t>, int>;
  static std::tuple<int, int64_t, int64_t> KeyOf(const Block& b) {
    return {b.stream, b.size, b.address};
  }

  FreeSet& PoolOf(bool small) { return small ? small_free_ : large_free_; }
  void Cache(int block);
  void Uncache(int block);
  int FindFree(bool small, int64_t size, int stream);
  int NewSegment(bool small, int64_t size, int stream);
  int GrowExpandable(bool small, int64_t size, int stream);
  void MapPages(int unmapped, int64_t size);
  int Split(int block, int64_t size);
  void Merge(int block, int neighbour);

  bool expandable_ = false;
  std::vector<Block> blocks_;  // every block ever made; merged ones stay, unreferenced
  FreeSet small_free_, large_free_;
  // Each expandable segment's unmapped tail, by (stream, small pool).
  std::map<std::pair<int, bool>, int> unmapped_;
  int64_t next_address_ = 0;
  CudaAllocatorStats stats_;
};

}  // namespace memledger

#endif  // ESTIMATOR_STEP_CUDA_ALLOCATOR_H_
