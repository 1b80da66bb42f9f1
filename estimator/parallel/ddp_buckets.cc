#include "estimator/parallel/ddp_buckets.h"

namespace memledger {

DdpBucketCaps DdpBucketCapsOf(std::optional<double> bucket_cap_mb) {
  constexpr int64_t kMib = int64_t{1} << 20;
  // distributed.py: _DEFAULT_BUCKET_CAP_MB = 25; reducer.hpp: kDefaultFirstBucketBytes
  // = 1024 * 1024.
  if (!bucket_cap_mb.has_value()) return {kMib, 25 * kMib};
  const auto cap = static_cast<int64_t>(*bucket_cap_mb * static_cast<double>(kMib));
  return {cap, cap};
}

std::vector<int64_t> DdpBucketBytes(const std::vector<int64_t>& grad_bytes_in_ready_order,
                                    std::optional<double> bucket_cap_mb) {
  const DdpBucketCaps caps = DdpBucketCapsOf(bucket_cap_mb);
  std::vector<int64_t> buckets;
  int64_t open = 0;
  bool any = false;
  for (const int64_t bytes : grad_bytes_in_ready_order) {
    open += bytes;
    any = true;
    // bucket.size >= bucket_size_limit: the limit iterator starts at the first cap and
    // advances once per closed bucket, staying on the last.
    if (open >= (buckets.empty() ? caps.first : caps.rest)) {
      buckets.push_back(open);
      open = 0;
      any = false;
    }
  }
  if (any) buckets.push_back(open);
  return buckets;
}

}  // namespace memledger
