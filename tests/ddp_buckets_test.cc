// DDP's bucket split (estimator/parallel/ddp_buckets.h) against hand arithmetic of
// torch 2.15.0's compute_bucket_assignment_by_size (reducer.cpp) and
// _BucketCapacityConfig (distributed.py).
#include "estimator/parallel/ddp_buckets.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace memledger {
namespace {

constexpr int64_t kMib = 1 << 20;

TEST(DdpBucketsTest, CapsFollowBucketCapMb) {
  // Unset: _DEFAULT_BUCKET_CAP_MB = 25 and dist._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB.
  EXPECT_EQ(DdpBucketCapsOf(std::nullopt).first, kMib);
  EXPECT_EQ(DdpBucketCapsOf(std::nullopt).rest, 25 * kMib);
  // Given (even 25): that cap for the first bucket too; int(0.1 * 2^20) = 104,857.
  EXPECT_EQ(DdpBucketCapsOf(25.0).first, 25 * kMib);
  EXPECT_EQ(DdpBucketCapsOf(0.1).first, 104857);
  EXPECT_EQ(DdpBucketCapsOf(0.1).rest, 104857);
}

TEST(DdpBucketsTest, ABucketClosesOnceItReachesItsCap) {
  // The header's example: 512 KiB + 1 MiB reaches the first 1 MiB cap; the last 1 MiB
  // stays below 25 MiB and is the remainder.
  EXPECT_EQ(DdpBucketBytes({kMib / 2, kMib, kMib}, std::nullopt),
            (std::vector<int64_t>{3 * kMib / 2, kMib}));
  // A gradient exactly at the cap closes its bucket (size >= limit), and the next cap
  // is the later buckets' from then on.
  EXPECT_EQ(DdpBucketBytes({kMib, 10 * kMib, 15 * kMib, kMib}, std::nullopt),
            (std::vector<int64_t>{kMib, 25 * kMib, kMib}));
  // Under one cap every gradient is a bucket of its own once each reaches it.
  EXPECT_EQ(DdpBucketBytes({200000, 100, 200000}, 0.1),
            (std::vector<int64_t>{200000, 200100}));
  EXPECT_TRUE(DdpBucketBytes({}, std::nullopt).empty());
}

TEST(DdpBucketsTest, TheIssuesLlamaUnderTheDefaultCapsIsTwoBuckets) {
  // The issue's Llama in the backward's order: lm_head 32,768 x 4 = 131,072 B, the norm
  // 256 B, then layer 1's and layer 0's 43,136 x 4 = 172,544 B each, the embedding
  // 131,072 B. 131,072 + 256 + 172,544 + 172,544 = 476,416 < 1 MiB, so all of them
  // fill the first bucket: one bucket of 607,488 B.
  EXPECT_EQ(DdpBucketBytes({131072, 256, 172544, 172544, 131072}, std::nullopt),
            (std::vector<int64_t>{607488}));
}

}  // namespace
}  // namespace memledger
