#include "estimator/step/cuda_allocator.h"

#include <algorithm>
#include <cstdint>
#include <iterator>

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
  PoolOf(blocks_[block].small)[KeyOf(blocks_[block])] = block;
}

void CudaAllocatorSim::Uncache(int block) {
  PoolOf(blocks_[block].small).erase(KeyOf(blocks_[block]));
}

int CudaAllocatorSim::FindFree(bool small, int64_t size, int stream) {
  // get_free_block: the smallest cached block of the pool on the request's stream that
  // fits, the lowest address among equals (pool.blocks.lower_bound of a key block of
  // that stream and size; a block of another stream is no match). With expandable
  // segments a block before unmapped space counts as all it could grow to: from there
  // the search moves on while the next block, of the same stream, has a smaller such
  // size.
  FreeSet& pool = PoolOf(small);
  auto it = pool.lower_bound({stream, size, INT64_MIN});
  if (it == pool.end() || blocks_[it->second].stream != stream) return -1;
  if (expandable_) {
    auto expandable_size = [&](int b) {
      const Block& block = blocks_[b];
      return block.size + (block.next >= 0 && !blocks_[block.next].mapped
                               ? blocks_[block.next].size
                               : 0);
    };
    for (auto next = std::next(it);
         next != pool.end() && blocks_[next->second].stream == stream &&
         expandable_size(next->second) < expandable_size(it->second);
         ++next) {
      it = next;
    }
  }
  const int found = it->second;
  pool.erase(it);
  return found;
}

int CudaAllocatorSim::NewSegment(bool small, int64_t size, int stream) {
  // alloc_block: cudaMalloc a segment for the stream; it is reserved until empty_cache().
  Block block;
  block.address = next_address_;
  block.size = size;
  block.stream = stream;
  block.small = small;
  next_address_ += size;
  blocks_.push_back(block);
  stats_.reserved.Add(size);
  ++stats_.segments;
  return static_cast<int>(blocks_.size()) - 1;
}

// kExpandableAddressSpace: an expandable segment's reserved virtual range, more than
// any step maps (the allocator reserves the device's memory and an eighth).
constexpr int64_t kExpandableAddressSpace = int64_t{1} << 46;

void CudaAllocatorSim::MapPages(int unmapped, int64_t size) {
  // map_block: map `size` of the unmapped block, rounded up to whole pages; the rest
  // stays unmapped after it; the mapped pages join a free mapped block before them.
  const int64_t page = blocks_[unmapped].small ? kCudaSmallBuffer : kCudaLargeBuffer;
  const int64_t bytes = std::min(blocks_[unmapped].size, (size + page - 1) / page * page);
  const int rest = Split(unmapped, bytes);
  const std::pair<int, bool> pool{blocks_[unmapped].stream, blocks_[unmapped].small};
  if (rest >= 0) {
    blocks_[rest].mapped = false;
    unmapped_[pool] = rest;
  } else {
    unmapped_[pool] = -1;
  }
  blocks_[unmapped].mapped = true;
  stats_.reserved.Add(bytes);
  Merge(unmapped, blocks_[unmapped].prev);
  Cache(unmapped);
}

int CudaAllocatorSim::GrowExpandable(bool small, int64_t size, int stream) {
  // try_allocate_expandable_block: the pool's unmapped space on the stream (each stream
  // has its own expandable segment: find_expandable_block), with the free mapped block
  // before it if there is one, mapped until it holds `size`: only what the free block
  // lacks (std::min(candidate->size, size) at first).
  auto found = unmapped_.try_emplace({stream, small}, -1).first;
  int& tail = found->second;
  if (tail < 0) {
    Block space;
    space.address = next_address_;
    space.size = kExpandableAddressSpace;
    space.stream = stream;
    space.small = small;
    space.mapped = false;
    next_address_ += kExpandableAddressSpace;
    blocks_.push_back(space);
    tail = static_cast<int>(blocks_.size()) - 1;
    ++stats_.segments;
  }
  int candidate = tail;
  const int before = blocks_[tail].prev;
  if (before >= 0 && !blocks_[before].allocated) {
    candidate = before;
    Uncache(candidate);
  } else {
    MapPages(candidate, size);
    Uncache(candidate);
  }
  while (blocks_[candidate].size < size) {
    const int next = blocks_[candidate].next;  // the unmapped space
    Cache(candidate);  // MapPages merges the mapped pages into it
    MapPages(next, size - blocks_[candidate].size);
    Uncache(next);
    candidate = next;
  }
  return candidate;
}

int CudaAllocatorSim::Split(int block, int64_t size) {
  // The first `size` bytes stay `block`; the rest becomes a new block after it.
  const int64_t remaining = blocks_[block].size - size;
  if (remaining <= 0) return -1;
  Block rest;
  rest.address = blocks_[block].address + size;
  rest.size = remaining;
  rest.stream = blocks_[block].stream;
  rest.small = blocks_[block].small;
  rest.prev = block;
  rest.next = blocks_[block].next;
  blocks_.push_back(rest);
  const int r = static_cast<int>(blocks_.size()) - 1;
  if (blocks_[r].next >= 0) blocks_[blocks_[r].next].prev = r;
  blocks_[block].next = r;
  blocks_[block].size = size;
  return r;
}

int CudaAllocatorSim::Malloc(int64_t bytes, int stream) {
  if (bytes <= 0) return -1;  // malloc of 0 bytes returns no block
  const int64_t size = CudaRoundSize(bytes);
  const bool small = size <= kCudaSmallSize;
  int block = FindFree(small, size, stream);
  if (block < 0) {
    block = expandable_ ? GrowExpandable(small, size, stream)
                        : NewSegment(small, CudaSegmentSize(size), stream);
  }
  // should_split: a small block, or any with expandable segments, splits when at least
  // 512 B remain; a large one when more than 1 MiB does (kSmallSize). The remainder
  // stays cached after the block.
  const int64_t remaining = blocks_[block].size - size;
  if (small || expandable_ ? remaining >= kCudaMinBlockSize : remaining > kCudaSmallSize) {
    Cache(Split(block, size));
  }
  Block& b = blocks_[block];
  b.allocated = true;
  b.requested = bytes;
  stats_.allocated.Add(b.size);
  stats_.requested.Add(bytes);
  return block;
}

void CudaAllocatorSim::Merge(int block, int neighbour) {
  // try_merge_blocks: a free neighbour in the same segment, mapped as the block is,
  // joins it.
  if (neighbour < 0 || blocks_[neighbour].allocated ||
      blocks_[neighbour].mapped != blocks_[block].mapped) {
    return;
  }
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
