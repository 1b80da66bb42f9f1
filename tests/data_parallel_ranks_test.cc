// Per-rank memory of the data-parallel strategies as torch runs them
// (estimator/predict/ranks.h): DistributedDataParallel's buckets and FSDP2's shards of
// the issue's Llama, against the real stack's witnesses on Gloo ranks
// (tests/ddp_witness_test.py, tests/fsdp2_witness_test.py) and hand arithmetic.
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "estimator/predict/predict.h"
#include "estimator/predict/ranks.h"
#include "estimator/request/parallel_spec.h"
#include "estimator/request/run_request.h"
#include "estimator/spec/config.h"
#include "estimator/step/liveness.h"
#include "tests/rank_configs.h"
#include "tests/status_matchers.h"

namespace memledger {
namespace {

using rank_configs::IssueLlama;
using rank_configs::TinyLlama;
using rank_configs::Variants;

// torch's DistributedDataParallel on 2 Gloo ranks of the real stack (transformers
// 5.23.0, torch 2.15.0; tests/ddp_witness_test.py measures and pins these numbers):
// every rank of the issue's Llama peaks at 3,503,004 B, of which the Reducer's buckets
// are 607,488 B (151,872 fp32 parameters), the single process's peak phase, whatever
// bucket_cap_mb (25, 0.1) and gradient_as_bucket_view (off, on).
TEST(PredictRanksTest, DdpPeaksAsTorchsDistributedDataParallel) {
  PredictOptions options = Variants("none");
  options.peak = true;
  options.optimizer.impl = OptimizerImpl::kForLoop;
  ASSERT_OK_AND_ASSIGN(Prediction alone, Predict(IssueLlama(), options));
  ASSERT_TRUE(alone.variants[0].peak.has_value());
  for (const std::optional<double> cap : {std::optional<double>(), std::optional<double>(0.1)}) {
    int64_t totals[2] = {0, 0};
    for (const bool view : {false, true}) {
      SCOPED_TRACE(absl::StrCat(cap.value_or(25), view ? " view" : ""));
      ParallelSpec parallel;
      parallel.dp = 2;
      parallel.ddp.bucket_cap_mb = cap;
      parallel.ddp.gradient_as_bucket_view = view;
      ASSERT_OK_AND_ASSIGN(RanksPrediction ranks, PredictRanks(IssueLlama(), parallel, options));
      ASSERT_EQ(ranks.kinds.size(), 1u);
      const RankKind& rank = ranks.kinds[0];
      EXPECT_EQ(rank.communication_bytes, 607488);
      ASSERT_TRUE(rank.variants[0].held.peak.has_value()) << rank.variants[0].held.peak_unavailable;
      const StepPeak& peak = *rank.variants[0].held.peak;
      EXPECT_EQ(peak.bytes, 3503004);
      EXPECT_EQ(peak.by_category[static_cast<int>(MemoryCategory::kCommunication)], 607488);
      EXPECT_EQ(peak.phase, alone.variants[0].peak->phase);
      // As views the .grads hold none of their own after the backward: the rank's total
      // (what it holds then) is 607,488 B less.
      totals[view] = rank.Total(0);
    }
    EXPECT_EQ(totals[false] - totals[true], 607488);
  }
}

// DDP with what trains only in its buckets (the Reducer registers the parameters that
// require grad; tests/ddp_witness_test.py's DdpFineTuningTest measures and pins these
// numbers), each rank the single process's step beside them:
// - peft's LoRA, r 8 on q_proj (64 -> 64) and v_proj (64 -> 32): (8 x 64 + 64 x 8) +
//   (8 x 64 + 32 x 8) = 1,792 fp32 parameters a layer, 3,584 in 2 layers: 14,336 B of
//   buckets; the rank peaks at 1,516,424 B in the backward;
// - the embeddings and the head frozen (2 x 512 x 64 x 4 = 262,144 B), full
//   checkpointing, buckets of 0.1 MiB: 607,488 - 262,144 = 345,344 B of buckets; the rank
//   peaks at 2,278,484 B in the backward.
TEST(PredictRanksTest, DdpBucketsOnlyWhatTrains) {
  struct Case {
    const char* name;
    ModelConfig config;
    const char* variant;
    std::optional<double> cap;
    int64_t buckets, peak;
  };
  ModelConfig lora = IssueLlama();
  lora.lora.rank = 8;
  lora.lora.alpha = 16;
  ModelConfig frozen = IssueLlama();
  frozen.freeze.embeddings = true;
  frozen.freeze.lm_head = true;
  for (const Case& c : {Case{"lora", lora, "none", std::nullopt, 14336, 1516424},
                        Case{"frozen", frozen, "full", 0.1, 345344, 2278484}}) {
    SCOPED_TRACE(c.name);
    PredictOptions options = Variants(c.variant);
    options.peak = true;
    options.optimizer.impl = OptimizerImpl::kForLoop;
    ParallelSpec parallel;
    parallel.dp = 2;
    parallel.ddp.bucket_cap_mb = c.cap;
    ASSERT_OK_AND_ASSIGN(RanksPrediction ranks, PredictRanks(c.config, parallel, options));
    ASSERT_EQ(ranks.kinds.size(), 1u);
    const RankKind& rank = ranks.kinds[0];
    EXPECT_EQ(rank.communication_bytes, c.buckets);
    EXPECT_EQ(rank.grad_bytes, c.buckets);
    ASSERT_TRUE(rank.variants[0].held.peak.has_value()) << rank.variants[0].held.peak_unavailable;
    EXPECT_EQ(rank.variants[0].held.peak->bytes, c.peak);
    EXPECT_EQ(rank.variants[0].held.peak->phase, StepPhase::kBackward);
  }
}

// torch's FSDP2 on 2 Gloo ranks of the real stack (tests/fsdp2_witness_test.py measures
// and pins these numbers): fully_shard on each layer and the root of the issue's Llama.
// A rank holds half of every parameter (every dim 0 even: 151,872 / 2 elements, 303,744
// B), its gradient likewise, AdamW's two moments of it and 21 steps (607,572 B); its step
// peaks at 2,419,740 B in layer 1's backward with reshard_after_forward, and at 2,634,284
// B in the forward without (every unit's unsharded parameters kept).
TEST(PredictRanksTest, FsdpPeaksAsTorchsFullyShard) {
  PredictOptions options = Variants("none");
  options.peak = true;
  options.optimizer.impl = OptimizerImpl::kForLoop;
  struct Case {
    bool reshard;
    int64_t peak;
    StepPhase phase;
  };
  for (const Case& c : {Case{true, 2419740, StepPhase::kBackward},
                        Case{false, 2634284, StepPhase::kForward}}) {
    SCOPED_TRACE(c.reshard);
    ParallelSpec parallel;
    parallel.dp = 2;
    parallel.fsdp.enabled = true;
    parallel.fsdp.reshard_after_forward = c.reshard;
    ASSERT_OK_AND_ASSIGN(RanksPrediction ranks, PredictRanks(IssueLlama(), parallel, options));
    ASSERT_OK_AND_ASSIGN(
        RanksPrediction checkpointed,
        PredictRanks(IssueLlama(), parallel, [&] {
          PredictOptions with = options;
          with.variants = *ParseVariants("full,selective", /*every=*/2, "matmul");
          return with;
        }()));
    // Under transformers' checkpointing (the witness's Fsdp2CheckpointingTest): full
    // peaks at 2,198,492 B in the backward either way; selective at 2,297,500 B in the
    // backward, or at 2,346,668 B in the forward without resharding.
    const std::vector<RankVariant>& held = checkpointed.kinds[0].variants;
    ASSERT_TRUE(held[0].held.peak.has_value()) << held[0].held.peak_unavailable;
    ASSERT_TRUE(held[1].held.peak.has_value()) << held[1].held.peak_unavailable;
    EXPECT_EQ(held[0].held.peak->bytes, 2198492);
    EXPECT_EQ(held[1].held.peak->bytes, c.reshard ? 2297500 : 2346668);
    EXPECT_EQ(held[1].held.peak->phase, c.reshard ? StepPhase::kBackward : StepPhase::kForward);
    ASSERT_EQ(ranks.kinds.size(), 1u);
    const RankKind& rank = ranks.kinds[0];
    EXPECT_EQ(rank.param_bytes, 303744);
    EXPECT_EQ(rank.grad_bytes, 303744);
    EXPECT_EQ(rank.optimizer_state_bytes, 2 * 303744 + 21 * 4);
    EXPECT_EQ(rank.communication_bytes, 0);
    ASSERT_TRUE(rank.variants[0].held.peak.has_value()) << rank.variants[0].held.peak_unavailable;
    EXPECT_EQ(rank.variants[0].held.peak->bytes, c.peak);
    EXPECT_EQ(rank.variants[0].held.peak->phase, c.phase);
  }
}

// ExpectFsdpRank: an FSDP2 rank of the issue's Llama under `parallel`, one variant, with
// AdamW's for-loop (the witness's): its fp32 shards (`shard_bytes`, the parameters'; the
// state two moments of them and 21 four-byte steps) and its step's peak as the witness
// measured it.
void ExpectFsdpRank(const ParallelSpec& parallel, const char* variant, int64_t shard_bytes,
                    int64_t peak, StepPhase phase) {
  PredictOptions options = Variants(variant);
  options.peak = true;
  options.optimizer.impl = OptimizerImpl::kForLoop;
  ASSERT_OK_AND_ASSIGN(RanksPrediction ranks, PredictRanks(IssueLlama(), parallel, options));
  const RankKind& rank = ranks.kinds[0];
  EXPECT_EQ(rank.param_bytes, shard_bytes);
  EXPECT_EQ(rank.optimizer_state_bytes, 2 * shard_bytes + 21 * 4);
  ASSERT_TRUE(rank.variants[0].held.peak.has_value()) << rank.variants[0].held.peak_unavailable;
  EXPECT_EQ(rank.variants[0].held.peak->bytes, peak);
  EXPECT_EQ(rank.variants[0].held.peak->phase, phase);
}

// fully_shard's default, reshard_after_forward=None (--reshard_after_forward=auto): the
// root keeps its parameters from its forward to its backward, where it gathers them at
// once otherwise; the step's peak, later in the backward, is the same 2,419,740 B
// (tests/fsdp2_witness_test.py measures it, and what the forward leaves: the root's
// 262,400 B more).
TEST(PredictRanksTest, FsdpAutoKeepsTheRootsParameters) {
  ParallelSpec parallel;
  parallel.dp = 2;
  parallel.fsdp.enabled = true;
  parallel.fsdp.reshard_after_forward_auto = true;
  EXPECT_EQ(parallel.fsdp.RootPostForwardRanks(2), 1);
  EXPECT_EQ(parallel.fsdp.PostForwardRanks(2), 2);
  ExpectFsdpRank(parallel, "none", /*shard_bytes=*/303744, 2419740, StepPhase::kBackward);
}

// reshard_after_forward=2 over 4 ranks (tests/fsdp2_witness_test.py,
// Fsdp2PostForwardMeshTest measures these): after its forward each unit keeps half of its
// unsharded parameters (a post-forward mesh of 2 ranks), so the forward leaves 303,744 B
// (half the issue Llama's 607,488) more than with True and that much less than with
// False, and the backward gathers over 2 ranks. A rank's shard is a quarter: 151,872 B.
TEST(PredictRanksTest, FsdpReshardsToAPostForwardMesh) {
  struct Case {
    const char* variant;
    int64_t reshard;  // 0: True, -1: False, else the int
    bool mixed_precision;
    int64_t peak;
    StepPhase phase;
  };
  for (const Case& c : {Case{"none", 0, false, 1964124, StepPhase::kBackward},
                        Case{"none", -1, false, 2178668, StepPhase::kForward},
                        Case{"none", 2, false, 2136156, StepPhase::kBackward},
                        Case{"full", 2, false, 1764316, StepPhase::kBackward},
                        Case{"selective", 2, false, 1928156, StepPhase::kBackward},
                        Case{"none", 2, true, 1535452, StepPhase::kBackward}}) {
    SCOPED_TRACE(absl::StrCat(c.variant, " reshard ", c.reshard, c.mixed_precision ? " bf16" : ""));
    ParallelSpec parallel;
    parallel.dp = 4;
    parallel.fsdp.enabled = true;
    parallel.fsdp.reshard_after_forward = c.reshard >= 0;
    parallel.fsdp.reshard_after_forward_ranks = std::max<int64_t>(c.reshard, 0);
    if (c.mixed_precision) {
      parallel.fsdp.param_dtype = DType::kBFloat16;
      parallel.fsdp.reduce_dtype = DType::kFloat32;
    }
    ExpectFsdpRank(parallel, c.variant, /*shard_bytes=*/151872, c.peak, c.phase);
  }
}

// FSDP2 under MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), as the witness
// measures it (Fsdp2MixedPrecisionTest): the shards, their gradients and AdamW's state
// stay fp32 (the same bytes as without), the step peaks lower.
TEST(PredictRanksTest, FsdpMixedPrecisionAsTorchsPolicy) {
  struct Case {
    const char* variant;
    bool reshard;
    int64_t peak;
    StepPhase phase;
  };
  for (const Case& c : {Case{"none", true, 1904796, StepPhase::kBackward},
                        Case{"none", false, 2012844, StepPhase::kForward},
                        Case{"full", true, 1712604, StepPhase::kBackward},
                        Case{"full", false, 1712604, StepPhase::kBackward},
                        Case{"selective", true, 1731868, StepPhase::kBackward},
                        Case{"selective", false, 1839916, StepPhase::kForward}}) {
    SCOPED_TRACE(absl::StrCat(c.variant, c.reshard ? " resharded" : " kept"));
    ParallelSpec parallel;
    parallel.dp = 2;
    parallel.fsdp.enabled = true;
    parallel.fsdp.reshard_after_forward = c.reshard;
    parallel.fsdp.param_dtype = DType::kBFloat16;
    parallel.fsdp.reduce_dtype = DType::kFloat32;
    ExpectFsdpRank(parallel, c.variant, /*shard_bytes=*/303744, c.peak, c.phase);
  }
}

// FSDP2's Shard(0) pads each parameter's rows to a multiple of the ranks: tiny-llama over
// 3 ranks, by hand (rank 0's, the fullest: ceil(rows / 3) rows each). A layer: q and o
// 32 x 32 -> 11 x 32 = 352 each, k and v 16 x 32 -> 6 x 32 = 192 each, gate and up
// 64 x 32 -> 22 x 32 = 704 each, down 32 x 64 -> 11 x 64 = 704, two norms of 32 -> 11
// each: 3,222. The root: the embedding and lm_head 96 x 32 -> 32 x 32 = 1,024 each, the
// final norm 11: 2,059. Two layers and the root: 8,503 elements, 34,012 B. The real
// stack's rank 0 (tests/fsdp2_witness_test.py, Fsdp2PaddedShardsTest) peaks at 330,284 B
// in the backward with reshard_after_forward, where torch._chunk_cat pads each gradient
// of uneven rows for the reduce-scatter, and at 332,668 B in the forward without.
TEST(PredictRanksTest, FsdpPadsEachParametersRowsByHand) {
  for (const bool reshard : {true, false}) {
    ParallelSpec parallel;
    parallel.dp = 3;
    parallel.fsdp.enabled = true;
    parallel.fsdp.reshard_after_forward = reshard;
    PredictOptions options = Variants("none");
    options.peak = true;
    options.optimizer.impl = OptimizerImpl::kForLoop;
    ASSERT_OK_AND_ASSIGN(RanksPrediction ranks, PredictRanks(TinyLlama(2), parallel, options));
    EXPECT_EQ(ranks.kinds[0].param_bytes, 34012);
    EXPECT_EQ(ranks.kinds[0].grad_bytes, 34012);
    EXPECT_EQ(ranks.kinds[0].optimizer_state_bytes, 2 * 34012 + 21 * 4);
    EXPECT_EQ(ranks.kinds[0].n_params, 2 * 9280 + 3072 + 3104);
    ASSERT_TRUE(ranks.kinds[0].variants[0].held.peak.has_value());
    EXPECT_EQ(ranks.kinds[0].variants[0].held.peak->bytes, reshard ? 330284 : 332668);
  }
}

}  // namespace
}  // namespace memledger
