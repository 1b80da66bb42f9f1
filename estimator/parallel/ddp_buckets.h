// DdpBucketBytes: the buckets torch's DistributedDataParallel keeps for the whole run,
// as its Reducer lays them out (torch 2.15.0, torch/csrc/distributed/c10d/reducer.cpp).
//
// DDP's constructor puts every parameter in one bucket (with find_unused_parameters
// False it buckets with the limit sys.maxsize, distributed.py,
// _BucketCapacityConfig.compute_bucket_size_limits); after the first iteration's
// backward, the second forward rebuilds them (Reducer::rebuild_buckets, called from
// _pre_forward) in the order the gradients became ready, with the limits
// {first_bucket_bytes_cap, bucket_bytes_cap}. Each bucket is one tensor of its
// parameters' elements (initialize_buckets: bucket.gradients = at::empty({offset})),
// held until DDP is destroyed.
//
// Example: torch's defaults, three fp32 gradients of 512 KiB, 1 MiB and 1 MiB ready in
// that order:
//   DdpBucketBytes({524288, 1048576, 1048576}, std::nullopt)
//   // {1572864, 1048576}: the first bucket closes once it reaches its 1 MiB cap, the
//   // rest fills the 25 MiB bucket.
#ifndef ESTIMATOR_PARALLEL_DDP_BUCKETS_H_
#define ESTIMATOR_PARALLEL_DDP_BUCKETS_H_

#include <cstdint>
#include <optional>
#include <vector>

namespace memledger {

// DdpBucketCaps: {first bucket's cap, every later bucket's} in bytes, for bucket_cap_mb
// (unset: torch's default of 25 MiB, the first 1 MiB, dist._DEFAULT_FIRST_BUCKET_BYTES;
// given: that cap for all, int(bucket_cap_mb * 2^20) as _BucketCapacityConfig.create
// truncates it).
struct DdpBucketCaps {
  int64_t first = 0;
  int64_t rest = 0;
};
DdpBucketCaps DdpBucketCapsOf(std::optional<double> bucket_cap_mb);

// DdpBucketBytes: each rebuilt bucket's bytes, in order, for gradients of
// `grad_bytes_in_ready_order` (one dtype and device, as a model's parameters are):
// compute_bucket_assignment_by_size adds each gradient to the open bucket and closes
// it once its size reaches the current limit (size >= limit), then moves to the next
// limit; what remains is the last bucket.
std::vector<int64_t> DdpBucketBytes(const std::vector<int64_t>& grad_bytes_in_ready_order,
                                    std::optional<double> bucket_cap_mb);

}  // namespace memledger

#endif  // ESTIMATOR_PARALLEL_DDP_BUCKETS_H_
