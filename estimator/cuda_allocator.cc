#include "estimator/cuda_allocator.h"

#include <cstdint>

namespace memledger {

int64_t CudaRoundSize(int64_t bytes) {
  // round_size: kMinBlockSize * ceil(size / kMinBlockSize), at least kMinBlockSize.
  if (bytes < kCudaMinBlockSize) return kCudaMinBlockSize;
  return (bytes + kCudaMinBlockSize - 1) / kCudaMinBlockSize * kCudaMinBlockSize;
}

int64_t CudaSegmentSize(int64_t rounded) {
  // get_allocation_size: a 2 MiB segment for a small request, 20 MiB for one under
  // 10 MiB, else the request rounded up to 2 MiB.
  if (rounded <= kCudaSmallSize) return kCudaSmallBuffer;
  if (rounded < kCudaMinLargeAlloc) return kCudaLargeBuffer;
  return (rounded + kCudaRoundLarge - 1) / kCudaRoundLarge * kCudaRoundLarge;
}

void CudaAllocatorStat::Add(int64_t bytes) {
  current += bytes;
  if (current > peak) peak = current;
}

void CudaAllocatorSim::Cache(int block) {
  PoolOf(blocks_[block].small)[{blocks_[block].size, blocks_[block].address}] = block;
}

void CudaAllocatorSim::Uncache(int block) {
  PoolOf(blocks_[block].small).erase({blocks_[block].size, blocks_[block].address});
}

int CudaAllocatorSim::FindFree(bool small, int64_t size) {
  // get_free_block: the smallest cached block of the pool that fits, the lowest address
  // among equals (pool.blocks.lower_bound of a key block of that size).
  FreeSet& pool = PoolOf(small);
  auto it = pool.lower_bound({size, INT64_MIN});
  if (it == pool.end()) return -1;
  const int found = it->second;
  pool.erase(it);
  return found;
}

int CudaAllocatorSim::NewSegment(bool small, int64_t size) {
  // alloc_block: cudaMalloc a segment; it is reserved until empty_cache().
  Block block;
  block.address = next_address_;
  block.size = size;
  block.small = small;
  next_address_ += size;
  blocks_.push_back(block);
  stats_.reserved.Add(size);
  ++stats_.segments;
  return static_cast<int>(blocks_.size()) - 1;
}

int CudaAllocatorSim::Malloc(int64_t bytes) {
  if (bytes <= 0) return -1;  // malloc of 0 bytes returns no block
  const int64_t size = CudaRoundSize(bytes);
  const bool small = size <= kCudaSmallSize;
  int block = FindFree(small, size);
  if (block < 0) block = NewSegment(small, CudaSegmentSize(size));
  // should_split: a small block splits when at least 512 B remain, a large one when
  // more than 1 MiB does (kSmallSize); the remainder stays cached after the block.
  const int64_t remaining = blocks_[block].size - size;
  if (small ? remaining >= kCudaMinBlockSize : remaining > kCudaSmallSize) {
    Block rest;
    rest.address = blocks_[block].address + size;
    rest.size = remaining;
    rest.small = small;
    rest.prev = block;
    rest.next = blocks_[block].next;
    blocks_.push_back(rest);
    const int r = static_cast<int>(blocks_.size()) - 1;
    if (blocks_[r].next >= 0) blocks_[blocks_[r].next].prev = r;
    blocks_[block].next = r;
    blocks_[block].size = size;
    Cache(r);
  }
  Block& b = blocks_[block];
  b.allocated = true;
  b.requested = bytes;
  stats_.allocated.Add(b.size);
  stats_.requested.Add(bytes);
  return block;
}

void CudaAllocatorSim::Merge(int block, int neighbour) {
  // try_merge_blocks: a free neighbour in the same segment joins the freed block.
  if (neighbour < 0 || blocks_[neighbour].allocated) return;
  Block& dst = blocks_[block];
  Block& src = blocks_[neighbour];
  Uncache(neighbour);
  if (dst.prev == neighbour) {  // [src dst]
    dst.address = src.address;
    dst.prev = src.prev;
    if (dst.prev >= 0) blocks_[dst.prev].next = block;
  } else {  // [dst src]
    dst.next = src.next;
    if (dst.next >= 0) blocks_[dst.next].prev = block;
  }
  dst.size += src.size;
  src.size = 0;
}

void CudaAllocatorSim::Free(int handle) {
  if (handle < 0) return;
  Block& b = blocks_[handle];
  b.allocated = false;
  stats_.allocated.Add(-b.size);
  stats_.requested.Add(-b.requested);
  // free_block merges with the previous block, then the next.
  Merge(handle, blocks_[handle].prev);
  Merge(handle, blocks_[handle].next);
  Cache(handle);
}

}  // namespace memledger
