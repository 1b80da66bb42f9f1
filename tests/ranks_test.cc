// Per-rank memory of distributed runs (estimator/predict/ranks.h): pipeline stages' parameters
// and held activations, ZeRO's shards and the schedules' micro-batches in flight, each
// against hand arithmetic or the whole model's prediction.
#include "estimator/predict/ranks.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/spec/config.h"
#include "estimator/step/liveness.h"
#include "estimator/request/model_presets.h"
#include "estimator/request/parallel_spec.h"
#include "estimator/request/run_request.h"
#include "estimator/predict/predict.h"
#include "tests/rank_configs.h"
#include "tests/status_matchers.h"

namespace memledger {
namespace {

using rank_configs::TinyLlama;
using rank_configs::Variants;

// tiny-llama (width 32, 4 heads of 8, 2 kv heads, MLP 64, vocab 96, untied) has, by hand,
// per layer q 32x32 + k 32x16 + v 32x16 + o 32x32 + gate, up, down 3 x 32x64 + two norms
// 2 x 32 = 9,280 parameters; the embedding 96 x 32 = 3,072; the head its norm 32 and
// lm_head 96 x 32: 3,104.
TEST(PredictStageTest, StageParametersByHand) {
  const ModelConfig config = TinyLlama(4);
  const PredictOptions options = Variants("none");
  ASSERT_OK_AND_ASSIGN(StagePrediction first,
                       PredictStage(config, options, StageRange{0, 2, true, false}));
  ASSERT_OK_AND_ASSIGN(StagePrediction last,
                       PredictStage(config, options, StageRange{2, 2, false, true}));
  EXPECT_EQ(first.n_params, 2 * 9280 + 3072);
  EXPECT_EQ(last.n_params, 2 * 9280 + 3104);
  ASSERT_OK_AND_ASSIGN(Prediction whole, Predict(config, options));
  EXPECT_EQ(whole.n_params, first.n_params + last.n_params);

  // Tied embeddings: the last stage keeps its own copy of the embedding's weight (as
  // Megatron does), 96 x 32 more; the model counts it once.
  ModelConfig tied = config;
  tied.tie_embeddings = true;
  ASSERT_OK_AND_ASSIGN(StagePrediction tied_last,
                       PredictStage(tied, options, StageRange{2, 2, false, true}));
  EXPECT_EQ(tied_last.n_params, 2 * 9280 + 32 + 3072);
  ASSERT_OK_AND_ASSIGN(Prediction tied_whole, Predict(tied, options));
  EXPECT_EQ(tied_whole.n_params, 4 * 9280 + 3072 + 32);
}

// The whole model as one stage is the model's prediction, field by field.
TEST(PredictStageTest, TheWholeModelAsOneStageIsThePrediction) {
  for (const char* model : {"tiny-llama", "tiny-gpt2"}) {
    ModelConfig config = *ModelFromPreset(model);
    config.layers = 5;
    config.use_cache = false;  // a stage keeps no DynamicCache (PredictStage)
    const PredictOptions options = Variants("none,full,every_2,selective");
    ASSERT_OK_AND_ASSIGN(Prediction whole, Predict(config, options));
    ASSERT_OK_AND_ASSIGN(StagePrediction stage,
                         PredictStage(config, options, WholeModel(config)));
    EXPECT_EQ(stage.n_params, whole.n_params);
    ASSERT_EQ(stage.variants.size(), whole.variants.size());
    for (size_t v = 0; v < whole.variants.size(); ++v) {
      const VariantPrediction& a = whole.variants[v];
      const VariantPrediction& b = stage.variants[v];
      EXPECT_EQ(a.saved_bytes, b.saved_bytes) << model << " " << a.variant.Name();
      EXPECT_EQ(a.embedding_bytes, b.embedding_bytes);
      EXPECT_EQ(a.layers_bytes, b.layers_bytes);
      EXPECT_EQ(a.head_loss_bytes, b.head_loss_bytes);
      EXPECT_EQ(a.saved_by_dtype, b.saved_by_dtype);
      EXPECT_EQ(a.input_bytes_kept, b.input_bytes_kept);
    }
  }
}

// Two stages keep what the model keeps, plus what each must hold for itself. A Llama
// layer keeps its input (RMSNorm's pow) and not its output, so the hidden states between
// the stages are kept once, by the second stage (its received input). Both stages'
// layers save RoPE's cos and sin tables, each computing its own: 2 x T 8 x d_head 8 x
// 4 B = 512 B more, for every variant with a layer whose rotary mul saves them in each
// stage (none; every_2 leaves layers 1 and 3 plain). Checkpointed layers only hold them
// (transformers binds them into the call), so full and selective save no more.
TEST(PredictStageTest, TwoStagesKeepTheModelsBytesAndTheirOwnRopeTables) {
  const ModelConfig config = TinyLlama(4);
  const PredictOptions options = Variants("none,full,every_2,selective");
  ASSERT_OK_AND_ASSIGN(Prediction whole, Predict(config, options));
  ASSERT_OK_AND_ASSIGN(StagePrediction first,
                       PredictStage(config, options, StageRange{0, 2, true, false}));
  ASSERT_OK_AND_ASSIGN(StagePrediction last,
                       PredictStage(config, options, StageRange{2, 2, false, true}));
  for (size_t v = 0; v < whole.variants.size(); ++v) {
    const VariantKind kind = whole.variants[v].variant.kind;
    const bool saves_tables = kind == VariantKind::kNone || kind == VariantKind::kEveryK;
    EXPECT_EQ(first.variants[v].saved_bytes + last.variants[v].saved_bytes,
              whole.variants[v].saved_bytes + (saves_tables ? 512 : 0))
        << whole.variants[v].variant.Name();
    EXPECT_EQ(first.variants[v].head_loss_bytes, 0);
    EXPECT_EQ(last.variants[v].embedding_bytes, 0);
  }
}

// ZeRO over dp = 3 shards a stage's n parameters' elements into ceil(n / 3): the last of
// two stages above (21,664 parameters) holds 7,222 of each. fp32 AdamW: 4 B per
// parameter and gradient, 8 B of moments, and a 4-byte step per stepped tensor: the
// stage's 2 layers x 9 + the final norm and the head = 20 tensors, or ZeRO's one shard.
TEST(PredictRanksTest, ZeroShardsByHand) {
  const ModelConfig config = TinyLlama(4);
  const PredictOptions options = Variants("none");
  for (int zero : {0, 1, 2, 3}) {
    ParallelSpec parallel;
    parallel.dp = 3;
    parallel.pp = 2;
    parallel.zero = zero;
    ASSERT_OK_AND_ASSIGN(RanksPrediction ranks, PredictRanks(config, parallel, options));
    ASSERT_EQ(ranks.kinds.size(), 2u);
    const RankKind& last = ranks.kinds[0].stage == 1 ? ranks.kinds[0] : ranks.kinds[1];
    EXPECT_EQ(last.n_params, 21664);
    EXPECT_EQ(last.ranks, 3);
    EXPECT_EQ(last.adamw_state_bytes, (zero >= 1 ? 7222 : 21664) * 8) << zero;
    EXPECT_EQ(last.optimizer_state_bytes, last.adamw_state_bytes + (zero >= 1 ? 1 : 20) * 4)
        << zero;
    EXPECT_EQ(last.grad_bytes, (zero >= 2 ? 7222 : 21664) * 4) << zero;
    EXPECT_EQ(last.param_bytes, (zero >= 3 ? 7222 : 21664) * 4) << zero;
  }
}

// 1F1B: stage s runs pp - s - 1 warm-up forwards, then one more before its first
// backward: it holds min(pp - s, micro_batches) micro-batches.
TEST(PredictRanksTest, OneFOneBHoldsPpMinusStageMicroBatches) {
  const ModelConfig config = TinyLlama(8);
  const PredictOptions options = Variants("none,full");
  ASSERT_OK_AND_ASSIGN(StagePrediction middle,
                       PredictStage(config, options, StageRange{2, 2, false, false}));
  for (int64_t micro_batches : {8, 2}) {
    ParallelSpec parallel;
    parallel.pp = 4;
    parallel.micro_batches = micro_batches;
    ASSERT_OK_AND_ASSIGN(RanksPrediction ranks, PredictRanks(config, parallel, options));
    ASSERT_EQ(ranks.kinds.size(), 4u);
    for (const RankKind& kind : ranks.kinds) {
      const int64_t expected = std::min<int64_t>(4 - kind.stage, micro_batches);
      for (const RankVariant& v : kind.variants) EXPECT_EQ(v.in_flight, expected);
      if (kind.stage == 1) {
        ASSERT_EQ(kind.chunks.size(), 1u);
        EXPECT_EQ(kind.chunks[0].first_layer, 2);
        for (size_t v = 0; v < 2; ++v) {
          EXPECT_EQ(kind.variants[v].held.saved_bytes,
                    expected * middle.variants[v].saved_bytes);
        }
      }
    }
    // The most loaded first.
    for (size_t i = 1; i < ranks.kinds.size(); ++i) {
      EXPECT_GE(ranks.kinds[i - 1].Total(0), ranks.kinds[i].Total(0));
    }
  }
}

// Interleaving, pp 2, 2 chunks per rank, 4 micro-batches (8 chunk forwards per rank).
// Forward k runs chunk (k mod 4) / 2, backward k chunk 1 - (k mod 4) / 2; held counts
// are (chunk 0, chunk 1).
// Rank 0: (2 - 0 - 1) x 2 + (2 - 1) x 2 = 4 warm-up forwards (chunks 0 0 1 1): (2, 2).
// Then F4 (chunk 0): (3, 2); B0 (chunk 1); F5 (chunk 0): (4, 1); B1 (chunk 1); F6
// (chunk 1): (4, 1); B2 (chunk 0); F7 (chunk 1): (3, 2); then only backwards. 5 in
// flight at most, as Megatron's estimate (1 + (pp - 1) / (pp v)) x pp micro-batches of
// the rank's 2 chunks = 1.25 x 4 = 5 chunks; the fuller mix is (4, 1) when chunk 0 (with
// the embedding, which keeps the token ids) holds more than chunk 1.
// Rank 1: 2 warm-up forwards (chunks 0 0): (2, 0); F2 (chunk 1): (2, 1); B0 (chunk 1);
// F3 (chunk 1): (2, 1); B1 (chunk 1); F4 (chunk 0): (3, 0); B2 (chunk 0); F5 (chunk 0):
// (3, 0); ... 3 in flight, (2, 1) or (3, 0), whichever holds more.
TEST(PredictRanksTest, InterleavedScheduleByHand) {
  const ModelConfig config = TinyLlama(8);
  const PredictOptions options = Variants("none");
  ParallelSpec parallel;
  parallel.pp = 2;
  parallel.virtual_stages = 2;
  parallel.micro_batches = 4;
  parallel.schedule = PipelineSchedule::kInterleaved;
  ASSERT_OK_AND_ASSIGN(RanksPrediction ranks, PredictRanks(config, parallel, options));
  ASSERT_EQ(ranks.kinds.size(), 2u);
  for (const RankKind& kind : ranks.kinds) {
    ASSERT_EQ(kind.chunks.size(), 2u);
    std::vector<int64_t> saved;
    for (const StageRange& chunk : kind.chunks) {
      ASSERT_OK_AND_ASSIGN(StagePrediction p, PredictStage(config, options, chunk));
      saved.push_back(p.variants[0].saved_bytes);
    }
    if (kind.stage == 0) {
      EXPECT_EQ(kind.chunks[0].first_layer, 0);  // chunks 0 and 2 of 4: layers 0-1, 4-5
      EXPECT_EQ(kind.chunks[1].first_layer, 4);
      EXPECT_EQ(kind.variants[0].in_flight, 5);
      EXPECT_GT(saved[0], saved[1]);
      EXPECT_EQ(kind.variants[0].held.saved_bytes, 4 * saved[0] + saved[1]);
    } else {
      EXPECT_EQ(kind.chunks[1].first_layer, 6);
      EXPECT_TRUE(kind.chunks[1].head);
      EXPECT_EQ(kind.variants[0].in_flight, 3);
      EXPECT_EQ(kind.variants[0].held.saved_bytes,
                std::max(2 * saved[0] + saved[1], 3 * saved[0]));
    }
  }
}

// Without events the interleaved schedule is replayed for the fewest micro-batches
// whose steady state repeats (two groups of pp x v steps after the warm-up): its peak
// must equal the whole schedule's, replayed with every event, stage by stage, under
// every variant, ZeRO stage and autocast.
TEST(PredictRanksTest, InterleavedPeakOfManyMicroBatchesEqualsTheWholeReplay) {
  struct Case {
    int64_t pp, micro_batches, dp, zero;
    DType amp;
  };
  for (const Case& c : {Case{2, 8, 1, 0, DType::kFloat32}, Case{2, 16, 2, 1, DType::kFloat32},
                        Case{2, 10, 2, 3, DType::kFloat32}, Case{4, 20, 1, 0, DType::kFloat32},
                        Case{4, 24, 2, 2, DType::kFloat32}, Case{2, 12, 2, 0, DType::kBFloat16}}) {
    SCOPED_TRACE(::testing::Message() << "pp " << c.pp << " m " << c.micro_batches << " dp "
                                    << c.dp << " zero " << c.zero);
    ModelConfig config = TinyLlama(8);
    config.amp = c.amp;
    PredictOptions options = Variants("none,full,every_2,selective");
    options.peak = true;
    ParallelSpec parallel;
    parallel.pp = c.pp;
    parallel.virtual_stages = 2;
    parallel.micro_batches = c.micro_batches;
    parallel.dp = c.dp;
    parallel.zero = c.zero;
    parallel.schedule = PipelineSchedule::kInterleaved;
    ASSERT_OK_AND_ASSIGN(RanksPrediction reduced, PredictRanks(config, parallel, options));
    options.timeline = true;  // every event: the whole schedule
    ASSERT_OK_AND_ASSIGN(RanksPrediction whole, PredictRanks(config, parallel, options));
    ASSERT_EQ(reduced.kinds.size(), whole.kinds.size());
    for (size_t k = 0; k < whole.kinds.size(); ++k) {
      ASSERT_EQ(reduced.kinds[k].stage, whole.kinds[k].stage);
      for (size_t v = 0; v < whole.kinds[k].variants.size(); ++v) {
        const VariantPrediction& w = whole.kinds[k].variants[v].held;
        const VariantPrediction& r = reduced.kinds[k].variants[v].held;
        ASSERT_TRUE(w.peak.has_value()) << w.peak_unavailable;
        ASSERT_TRUE(r.peak.has_value()) << r.peak_unavailable;
        EXPECT_EQ(r.peak->bytes, w.peak->bytes)
            << "stage " << whole.kinds[k].stage << " " << w.variant.Name();
        EXPECT_EQ(r.peak->by_category, w.peak->by_category);
      }
    }
  }
}

// A rank's step without events is composed from its chunks replayed short (2k + 1
// layers for every_k, 3 otherwise), pass by pass, and the real rank's reduction; with
// events (a timeline) it is replayed whole. The two peaks agree in bytes, categories,
// phase and op over the families, data parallelism with ZeRO 0-3, micro-batches, 1F1B
// and interleaved stages, the variants, autocast, master weights and the optimizers'
// implementations.
TEST(PredictRanksTest, ComposedRankPeakEqualsTheWholeReplay) {
  struct Case {
    const char* model;
    int64_t layers, pp, micro_batches, dp, zero;
    DType dtype, amp;
    OptimizerSpec optimizer;
    int64_t virtual_stages = 1;  // above 1: the interleaved schedule
    int64_t tp = 1;
    bool sp = false;
    int64_t ep = 1;  // above 1: eager experts over ep ranks, each rank routing its own way
  };
  OptimizerSpec adamw, foreach_adamw, masters, sgd;
  foreach_adamw.impl = OptimizerImpl::kForeach;
  masters.master_weights = true;
  sgd.kind = OptimizerKind::kSgd;
  sgd.momentum = 0.9;
  const DType fp32 = DType::kFloat32, bf16 = DType::kBFloat16;
  int compared = 0;
  for (const Case& c : {
           Case{"tiny-llama", 12, 1, 1, 2, 1, fp32, fp32, adamw},
           Case{"tiny-llama", 13, 1, 3, 1, 0, fp32, bf16, adamw},
           Case{"tiny-llama", 24, 2, 4, 2, 2, fp32, bf16, foreach_adamw},
           Case{"tiny-llama", 30, 3, 5, 2, 1, bf16, fp32, masters},
           Case{"tiny-llama", 40, 4, 8, 1, 0, fp32, fp32, sgd},
           Case{"tiny-llama", 27, 3, 2, 3, 2, bf16, fp32, masters},
           Case{"tiny-gpt2", 16, 2, 3, 2, 0, fp32, fp32, foreach_adamw},
           Case{"tiny-gpt2", 21, 1, 2, 2, 1, fp32, bf16, adamw},
           Case{"tiny-qwen3", 18, 2, 4, 2, 1, fp32, fp32, adamw},
           Case{"tiny-llama", 20, 1, 2, 2, 3, fp32, fp32, adamw},
           Case{"tiny-llama", 24, 2, 3, 2, 3, fp32, bf16, foreach_adamw},
           Case{"tiny-gpt2", 30, 1, 4, 4, 3, bf16, fp32, masters},  // tied: one stage
           Case{"tiny-llama", 40, 2, 8, 2, 1, fp32, bf16, adamw, 2},
           Case{"tiny-llama", 48, 2, 12, 2, 3, fp32, fp32, sgd, 2},
           // Stages 1 and 2 (and the interleaved ranks 1 and 2) copy their passes from
           // the first stage that replayed a chunk of their shape.
           Case{"tiny-llama", 48, 4, 8, 2, 3, fp32, bf16, adamw},
           Case{"tiny-llama", 48, 4, 8, 2, 1, fp32, bf16, adamw, 2},
           Case{"tiny-llama", 48, 4, 8, 2, 3, fp32, fp32, sgd, 2},
           Case{"tiny-llama", 40, 4, 2, 1, 0, fp32, fp32, adamw},  // fewer than pp
           Case{"tiny-qwen3", 32, 4, 3, 2, 2, bf16, fp32, masters},
           Case{"tiny-llama", 32, 4, 4, 1, 0, bf16, fp32, sgd, 1, 2, true},  // tp 2, sp
           Case{"tiny-gemma3", 48, 4, 6, 1, 0, bf16, fp32, sgd},
           Case{"tiny-qwen3-moe", 16, 4, 4, 1, 0, fp32, fp32, adamw},
           // Expert parallelism: a kind per stage and expert-parallel rank.
           Case{"tiny-qwen3-moe", 16, 4, 4, 2, 0, fp32, fp32, adamw, 1, 1, false, 2},
           Case{"tiny-qwen3-moe", 12, 1, 3, 4, 0, bf16, fp32, sgd, 1, 1, false, 2},
       }) {
    SCOPED_TRACE(::testing::Message() << c.model << " L" << c.layers << " pp " << c.pp << " m "
                                      << c.micro_batches << " dp " << c.dp << " zero "
                                      << c.zero);
    ASSERT_OK_AND_ASSIGN(ModelConfig config, ModelFromPreset(c.model));
    config.layers = c.layers;
    config.batch = 2;
    config.seq = 8;
    config.dtype = c.dtype;
    config.amp = c.amp;
    if (c.ep > 1) {
      // Every rank's own routing of the 2 x 8 tokens' 32 pairs over the 4 experts: an
      // even split with 1 + l % 3 + 2 r tokens moved from one expert to the next.
      config.moe.impl = ExpertsImpl::kEager;
      config.moe.routing = RoutingSource::kGiven;
      for (int64_t r = 0; r < c.ep; ++r) {
        for (int64_t l = 0; l < c.layers; ++l) {
          std::vector<int64_t> row(4, 8);
          row[l % 4] -= 1 + l % 3 + 2 * r;
          row[(l + 1) % 4] += 1 + l % 3 + 2 * r;
          config.moe.routing_rows.push_back(row);
        }
      }
    }
    PredictOptions options = Variants("none,full,every_2,selective");
    Variant every3;
    every3.kind = VariantKind::kEveryK;
    every3.every = 3;
    options.variants.push_back(every3);
    options.optimizer = c.optimizer;
    options.peak = true;
    ParallelSpec parallel;
    parallel.pp = c.pp;
    parallel.micro_batches = c.micro_batches;
    parallel.dp = c.dp;
    parallel.zero = c.zero;
    parallel.virtual_stages = c.virtual_stages;
    if (c.virtual_stages > 1) parallel.schedule = PipelineSchedule::kInterleaved;
    parallel.tp = c.tp;
    parallel.sp = c.sp;
    parallel.ep = c.ep;
    config.shard = ShardOf(parallel);
    ASSERT_OK_AND_ASSIGN(RanksPrediction composed, PredictRanks(config, parallel, options));
    options.timeline = true;  // every event: the whole step replayed
    ASSERT_OK_AND_ASSIGN(RanksPrediction whole, PredictRanks(config, parallel, options));
    ASSERT_EQ(composed.kinds.size(), whole.kinds.size());
    for (size_t k = 0; k < whole.kinds.size(); ++k) {
      for (size_t v = 0; v < whole.kinds[k].variants.size(); ++v) {
        const VariantPrediction& w = whole.kinds[k].variants[v].held;
        const VariantPrediction& r = composed.kinds[k].variants[v].held;
        ASSERT_TRUE(w.peak.has_value()) << w.peak_unavailable;
        ASSERT_TRUE(r.peak.has_value()) << r.peak_unavailable;
        const std::string what =
            absl::StrCat("stage ", whole.kinds[k].stage, " ", w.variant.Name());
        EXPECT_EQ(r.peak->bytes, w.peak->bytes) << what;
        EXPECT_EQ(r.peak->by_category, w.peak->by_category) << what;
        EXPECT_EQ(r.peak->phase, w.peak->phase) << what;
        EXPECT_EQ(r.peak->op, w.peak->op) << what;
        ++compared;
      }
    }
  }
  // 59 stages' kinds (one per stage), 8 of the first expert-parallel case (4 stages x 2
  // expert-parallel ranks) and 2 of the second, x 5 variants.
  EXPECT_EQ(compared, 345);
}

// Korthikanti et al.'s per-GPU activations assume the first 1F1B stage holds p
// micro-batches of L / p layers: the model's layers once. With GPT-2's block (each layer
// keeps its input, nothing model-level) that is exact: the first of 4 stages' layers
// bytes with 8 micro-batches equal the whole model's for one.
TEST(PredictRanksTest, TheFirstStageHoldsTheModelsLayersOnce) {
  ModelConfig config = *ModelFromPreset("tiny-gpt2");
  config.layers = 8;
  config.use_cache = false;  // ranks keep no DynamicCache (PredictRanks)
  const PredictOptions options = Variants("none,full,selective");
  ASSERT_OK_AND_ASSIGN(Prediction whole, Predict(config, options));
  ParallelSpec parallel;
  parallel.pp = 4;
  parallel.micro_batches = 8;
  ASSERT_OK_AND_ASSIGN(RanksPrediction ranks, PredictRanks(config, parallel, options));
  const RankKind* first = nullptr;
  for (const RankKind& kind : ranks.kinds) first = kind.stage == 0 ? &kind : first;
  ASSERT_NE(first, nullptr);
  for (size_t v = 0; v < whole.variants.size(); ++v) {
    EXPECT_EQ(first->variants[v].held.layers_bytes, whole.variants[v].layers_bytes)
        << whole.variants[v].variant.Name();
    EXPECT_EQ(first->variants[v].held.embedding_bytes, 4 * whole.variants[v].embedding_bytes);
  }
}

// The study's block at L = 2, d = 32, H = 2, batch 2, seq 8 over dp ranks.
ModelConfig SmallStudy(int64_t batch) {
  ModelConfig config;
  config.layers = 2;
  config.width = 32;
  config.heads = 2;
  config.batch = batch;
  config.seq = 8;
  return config;
}

// A data-parallel rank's whole step (RankStepModelled) peaks in the gradients'
// reduction, where it holds, by hand (fp32, 25,408 parameters: 101,632 B of each of
// parameters P, .grads G and the bucket B they are copied into; AdamW's moments 2 x 4 B
// per stepped element and a 4-byte step per stepped tensor, the 24 parameters' or the
// one flat shard's; the input 2 x 8 x 32 x 4 = 2,048 B; the loss 4 B; the bucket's
// division by dp wraps its scalar as 8 + 4 B):
//   ZeRO 1: P + 101,632 + 4 (a 12,704-element shard's) + G + B + 2,048 + 4 + 12 = 408,596
//   ZeRO 2: ZeRO 1's + the shard copied out of the bucket (50,816 B) = 459,412
// Without ZeRO the ranks run torch's DDP, whose buckets B are resident and reduced in the
// backward: the peak is AdamW's for_loop step at fc2's weight (4,096 elements), after
// fc1's bias (128): P + B + G + 203,264 + 96 (AdamW's state of all) + 2,048 + 4 + fc1
// bias's denom 512 + fc2 weight's root and denom 2 x 16,384 + its divisor's 8 + 4
//   = 543,600.
// verify_ranks_test measures the same numbers on Gloo ranks.
TEST(PredictRanksTest, DataParallelPeakByHand) {
  const ModelConfig config = SmallStudy(2);
  PredictOptions options = Variants("none,full");
  options.peak = true;
  struct Case {
    int zero;
    int64_t peak;
  };
  for (const Case& c : {Case{0, 543600}, Case{1, 408596}, Case{2, 459412}}) {
    SCOPED_TRACE(c.zero);
    ParallelSpec parallel;
    parallel.dp = 2;
    parallel.zero = c.zero;
    ASSERT_OK_AND_ASSIGN(RanksPrediction ranks, PredictRanks(config, parallel, options));
    ASSERT_EQ(ranks.kinds.size(), 1u);
    for (const RankVariant& v : ranks.kinds[0].variants) {
      ASSERT_TRUE(v.held.peak.has_value()) << v.held.peak_unavailable;
      EXPECT_EQ(v.held.peak->bytes, c.peak) << v.held.variant.Name();
      EXPECT_EQ(v.held.peak->phase, StepPhase::kOptimizer);
      EXPECT_EQ(v.held.peak->by_category[static_cast<int>(MemoryCategory::kInput)], 2048);
    }
  }
  // dp = 3 pads the 25,408 elements to 3 x 8,470 = 25,410: the flat parameters and the
  // bucket are 101,640 B each; ZeRO 2 at batch 1 (input 1,024 B) then peaks at
  // 101,640 + 67,760 (moments) + 101,632 (G) + 101,640 (B) + 33,880 (the shard copy)
  // + the shard's step 4 + 1,024 + 4 + 12 = 407,596.
  ParallelSpec padded;
  padded.dp = 3;
  padded.zero = 2;
  ASSERT_OK_AND_ASSIGN(RanksPrediction ranks, PredictRanks(SmallStudy(1), padded, options));
  ASSERT_TRUE(ranks.kinds[0].variants[0].held.peak.has_value());
  EXPECT_EQ(ranks.kinds[0].variants[0].held.peak->bytes, 407596);
  // Three micro-batches accumulated under ZeRO 1: their inputs are resident and their
  // losses summed into the first (4 B), so the reduction holds 2 x 2,048 B more than
  // one micro-batch's 408,596.
  ParallelSpec accumulated;
  accumulated.dp = 2;
  accumulated.zero = 1;
  accumulated.micro_batches = 3;
  ASSERT_OK_AND_ASSIGN(ranks, PredictRanks(config, accumulated, options));
  ASSERT_TRUE(ranks.kinds[0].variants[0].held.peak.has_value());
  EXPECT_EQ(ranks.kinds[0].variants[0].held.peak->bytes, 408596 + 2 * 2048);
}

// A tensor-parallel rank reduces its own shard: tiny-llama over tp 2 holds 12,448
// parameters per rank (verify_ranks_test counts them by hand), 49,792 B; with dp 2 and
// ZeRO 1 (an even count: no padding) it peaks in the reduction at P 49,792 + the
// moments of a 6,224-element shard 49,792 and its step 4 + G 49,792 + the bucket 49,792
// + the token ids 2 x 8 x 8 = 128 + the loss 4 + the division's scalar 8 + 4 + the
// model's two rotary buffers, d_head 8 / 2 fp32 each (32 B) = 199,348 B.
TEST(PredictRanksTest, TensorParallelPeakByHand) {
  ModelConfig config = TinyLlama(2);
  PredictOptions options = Variants("none,full");
  options.peak = true;
  ParallelSpec parallel;
  parallel.tp = 2;
  parallel.dp = 2;
  parallel.zero = 1;
  config.shard = ShardOf(parallel);
  ASSERT_OK_AND_ASSIGN(RanksPrediction ranks, PredictRanks(config, parallel, options));
  ASSERT_EQ(ranks.kinds.size(), 1u);
  EXPECT_EQ(ranks.kinds[0].n_params, 12448);
  for (const RankVariant& v : ranks.kinds[0].variants) {
    ASSERT_TRUE(v.held.peak.has_value()) << v.held.peak_unavailable;
    EXPECT_EQ(v.held.peak->bytes, 199348) << v.held.variant.Name();
    EXPECT_EQ(v.held.peak->phase, StepPhase::kOptimizer);
  }
}

// ZeRO-3 on the study's 2 layers (width 32): one layer is 12 d^2 + 13 d = 12,704
// elements, 50,816 B; the stage's 25,408 split over dp 2 is a 12,704-element shard. The
// rank holds its shard (50,816) and the shard's AdamW moments (101,632) and step (4 B)
// and its input (2 x 8 x 32 x 4 = 2,048). The first layer reads the model input (no gradient), so its
// gradients are reduce-scattered when the backward returns: then the loss (4 B), its
// gathered parameters, its .grads and the bucket they are flattened into (50,816 each)
// and the shard's gradient made at layer 1's reduction (50,816) are alive:
// 7 x 50,816 + 4 + 2,048 + 4 = 357,768 B, the peak, in the backward.
TEST(PredictRanksTest, ZeroThreePeakByHand) {
  PredictOptions options = Variants("none,full");
  options.peak = true;
  ParallelSpec parallel;
  parallel.dp = 2;
  parallel.zero = 3;
  ASSERT_OK_AND_ASSIGN(RanksPrediction ranks, PredictRanks(SmallStudy(2), parallel, options));
  ASSERT_EQ(ranks.kinds.size(), 1u);
  for (const RankVariant& v : ranks.kinds[0].variants) {
    ASSERT_TRUE(v.held.peak.has_value()) << v.held.peak_unavailable;
    EXPECT_EQ(v.held.peak->bytes, 357768) << v.held.variant.Name();
    EXPECT_EQ(v.held.peak->phase, StepPhase::kBackward);
    EXPECT_EQ(v.held.peak->op, "layer 0 gradients' reduce-scatter (ZeRO-3)");
    EXPECT_EQ(v.held.peak->by_category[static_cast<int>(MemoryCategory::kParameter)],
              2 * 50816);
  }
}

// A layout's prediction validates its config and its layout once, at its entry: its
// stages, expert-parallel ranks and step simulations take the proof (ValidConfig). Before,
// PredictRanks checked the config again per kind of rank and per stage (ValidateRun in
// PredictStage): 2 pipeline stages of 2 variants made 5 ValidateConfig calls.
TEST(PredictRanksTest, ValidatesTheConfigAndTheLayoutOnce) {
  struct Case {
    const char* preset;
    ParallelSpec parallel;
  };
  ParallelSpec pipeline;
  pipeline.dp = 2;
  pipeline.pp = 2;
  pipeline.micro_batches = 4;
  ParallelSpec experts;
  experts.dp = 2;
  experts.ep = 2;
  ParallelSpec fsdp;
  fsdp.dp = 2;
  fsdp.fsdp.enabled = true;
  fsdp.fsdp.param_dtype = DType::kBFloat16;
  fsdp.fsdp.reduce_dtype = DType::kFloat32;
  for (const Case& c : {Case{"tiny-llama", pipeline}, Case{"tiny-qwen3-moe", experts},
                        Case{"tiny-llama", fsdp}}) {
    SCOPED_TRACE(c.preset);
    ASSERT_OK_AND_ASSIGN(ModelConfig config, ModelFromPreset(c.preset));
    config.shard = ShardOf(c.parallel);
    PredictOptions options = Variants("none,full");
    options.peak = true;
    const int64_t configs = ValidateConfigCalls(), layouts = ValidateParallelCalls();
    ASSERT_OK_AND_ASSIGN(RanksPrediction ranks, PredictRanks(config, c.parallel, options));
    EXPECT_EQ(ValidateConfigCalls() - configs, 1);
    EXPECT_EQ(ValidateParallelCalls() - layouts, 1);
    EXPECT_TRUE(ranks.kinds[0].variants[1].held.peak.has_value());
    // The distributed prediction (predict's --dp): the whole model's and the ranks'.
    const int64_t configs_before = ValidateConfigCalls(), layouts_before = ValidateParallelCalls();
    ASSERT_OK_AND_ASSIGN(DistributedPrediction distributed,
                         PredictDistributed(config, c.parallel, options));
    EXPECT_EQ(ValidateConfigCalls() - configs_before, 1);
    EXPECT_EQ(ValidateParallelCalls() - layouts_before, 1);
    EXPECT_EQ(distributed.ranks.kinds.size(), ranks.kinds.size());
  }
}

// Where the rank's step is not simulated, each variant says what is missing.
TEST(PredictRanksTest, PeakUnavailableNamesWhatIsNotModelled) {
  PredictOptions options = Variants("none");
  options.peak = true;
  ParallelSpec zero3;
  zero3.dp = 2;
  zero3.zero = 3;
  zero3.pp = 2;
  zero3.micro_batches = 2;
  struct Case {
    ModelConfig config;
    ParallelSpec parallel;
    const char* missing;
  };
  ModelConfig tied = *ModelFromPreset("tiny-gpt2");
  ParallelSpec fsdp;
  fsdp.dp = 2;
  fsdp.fsdp.enabled = true;
  ParallelSpec fsdp_accumulating = fsdp;
  fsdp_accumulating.micro_batches = 2;
  for (const Case& c :
       {Case{tied, zero3, "--zero=3 and a tied embedding over pipeline"},
        Case{TinyLlama(2), fsdp_accumulating, "--fsdp and --micro_batches"}}) {
    SCOPED_TRACE(c.missing);
    ASSERT_OK_AND_ASSIGN(RanksPrediction ranks, PredictRanks(c.config, c.parallel, options));
    for (const RankKind& kind : ranks.kinds) {
      EXPECT_FALSE(kind.variants[0].held.peak.has_value());
      EXPECT_NE(kind.variants[0].held.peak_unavailable.find(c.missing), std::string::npos)
          << kind.variants[0].held.peak_unavailable;
    }
  }
}

// LoRA and --freeze are one process's (ValidateParallel): its one rank (the layout the
// search lists on one GPU) holds what predict does. tiny-llama's adapters at r 8 on
// q_proj (A 8 x 32, B 32 x 8) and v_proj (A 8 x 32, B 16 x 8): 896 a layer, 1,792 in
// 2 layers, in fp32 (autocast_adapter_dtype): 7,168 B of gradients and 1,792 x 8 B of
// AdamW's moments with, on the CPU, a 4 B step for each of the 8 adapter tensors; the
// frozen 24,736 (2 x 9,280 + 3,072 + 3,104) in bf16: 49,472 B. The whole model's peak
// is predict's, whose LoRA step the real stack measures (real_stack_test,
// fake_cuda_step_test). The ranks once counted every parameter as training: the bound
// kept the search from simulating the layout, and on CUDA the peak was refused.
TEST(PredictRanksTest, LoraOnOneProcessHoldsWhatPredictDoes) {
  for (const Device device : {Device::kCpu, Device::kCuda}) {
    SCOPED_TRACE(device == Device::kCuda ? "cuda" : "cpu");
    ModelConfig config = TinyLlama(2);
    config.dtype = DType::kBFloat16;
    config.device = device;
    config.lora.rank = 8;
    config.freeze.lm_head = true;  // already frozen under LoRA: no change
    PredictOptions options = Variants("none,full");
    options.peak = true;
    ASSERT_OK_AND_ASSIGN(RanksPrediction ranks, PredictRanks(config, ParallelSpec(), options));
    ASSERT_EQ(ranks.kinds.size(), 1u);
    const RankKind& rank = ranks.kinds[0];
    EXPECT_EQ(rank.n_params, 24736 + 1792);
    EXPECT_EQ(rank.param_bytes, 49472 + 7168);
    EXPECT_EQ(rank.grad_bytes, 7168);
    EXPECT_EQ(rank.adamw_state_bytes, 1792 * 8);
    // On CUDA each `step` is a host tensor (not capturable, not fused: adam.py's
    // _init_group), outside the device's bytes.
    EXPECT_EQ(rank.optimizer_state_bytes, 1792 * 8 + (device == Device::kCpu ? 8 * 4 : 0));
    EXPECT_EQ(rank.communication_bytes, 0);
    ASSERT_OK_AND_ASSIGN(Prediction whole, Predict(config, options));
    ASSERT_EQ(rank.variants.size(), whole.variants.size());
    for (size_t v = 0; v < whole.variants.size(); ++v) {
      const VariantPrediction& held = rank.variants[v].held;
      ASSERT_TRUE(held.peak.has_value()) << held.peak_unavailable;
      ASSERT_TRUE(whole.variants[v].peak.has_value());
      EXPECT_EQ(held.peak->bytes, whole.variants[v].peak->bytes) << v;
      EXPECT_EQ(held.saved_bytes, whole.variants[v].saved_bytes) << v;
    }
  }
}

TEST(PredictRanksTest, BadLayoutsNameTheFlag) {
  const ModelConfig config = TinyLlama(8);
  const PredictOptions options = Variants("none");
  struct Case {
    ParallelSpec parallel;
    const char* message;
  };
  ParallelSpec zero_without_dp;
  zero_without_dp.zero = 2;
  ParallelSpec indivisible;
  indivisible.pp = 3;
  ParallelSpec interleaved_alone;
  interleaved_alone.pp = 2;
  interleaved_alone.schedule = PipelineSchedule::kInterleaved;
  ParallelSpec chunks_without_interleaving;
  chunks_without_interleaving.pp = 2;
  chunks_without_interleaving.virtual_stages = 2;
  ParallelSpec odd_micro_batches = interleaved_alone;
  odd_micro_batches.virtual_stages = 2;
  odd_micro_batches.micro_batches = 3;
  ParallelSpec no_dp;
  no_dp.dp = 0;
  ParallelSpec too_many_chunks;  // 2^40 layers could split so; each chunk is predicted
  too_many_chunks.pp = 2048;
  for (const Case& c : {Case{zero_without_dp, "--zero=2 shards over data-parallel ranks"},
                        Case{indivisible, "--layers 8 is not divisible by --pp 3"},
                        Case{interleaved_alone, "--schedule=interleaved needs --virtual_stages"},
                        Case{chunks_without_interleaving, "needs --schedule=interleaved"},
                        Case{odd_micro_batches, "--micro_batches divisible by --pp"},
                        Case{no_dp, "--dp must be >= 1"},
                        Case{too_many_chunks, "must be at most 1024 model chunks"}}) {
    EXPECT_STATUS(PredictRanks(config, c.parallel, options),
                  absl::StatusCode::kInvalidArgument, c.message);
  }
  ParallelSpec study_pipeline;
  study_pipeline.pp = 2;
  EXPECT_STATUS(PredictRanks(ModelConfig(), study_pipeline, options),
                absl::StatusCode::kInvalidArgument, "not the study family");
}

// The layout is the one home of every parallel dimension: a rank's graphs take their
// part of the model from it (ShardOf), at the edge; a config whose shard says otherwise
// is refused, naming both, rather than predicted as another layout.
TEST(PredictRanksTest, TheConfigsShardIsTheLayouts) {
  RunRequest request;
  request.model = "tiny-llama";
  request.tp = 2;
  request.sp = true;
  request.dp = 2;
  ASSERT_OK_AND_ASSIGN(RunSpec spec, RunSpecFromRequest(request));
  EXPECT_EQ((std::tuple{spec.parallel.tp, spec.parallel.sp, spec.parallel.ep}),
            (std::tuple{2, true, 1}));
  EXPECT_EQ((std::tuple{spec.config.shard.tp, spec.config.shard.sp, spec.config.shard.ep}),
            (std::tuple{2, true, 1}));
  const PredictOptions options = Variants("none");
  ParallelSpec without_tp = spec.parallel;
  without_tp.tp = 1;
  without_tp.sp = false;
  EXPECT_STATUS(PredictRanks(spec.config, without_tp, options), absl::StatusCode::kInternal,
                "the config's shard (tp 2, sp 1, ep 1) is not the layout's (--tp 1, --sp 0");
  ModelConfig whole = spec.config;
  whole.shard = RankShard();
  EXPECT_STATUS(PredictRanks(whole, spec.parallel, options), absl::StatusCode::kInternal,
                "set it with ShardOf");
  EXPECT_TRUE(PredictRanks(spec.config, spec.parallel, options).ok());
}

}  // namespace
}  // namespace memledger
