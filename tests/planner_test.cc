// Tests for planner/: the FLOP counts against hand arithmetic, the composed peak of a
// plan against the step simulation's replay of it, and the solver's optimum against
// exhaustive search over every plan of small models (peaks replayed, not composed).
#include "planner/planner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "estimator/graph/family.h"
#include "estimator/spec/config.h"
#include "estimator/step/liveness.h"
#include "estimator/request/model_presets.h"
#include "estimator/predict/predict.h"
#include "estimator/predict/ranks.h"
#include "estimator/predict/flops.h"
#include "tests/status_matchers.h"

namespace memledger {
namespace {

ModelConfig SmallStudy(int64_t layers) {
  return StudyModel(layers, /*width=*/32, /*heads=*/2, /*batch=*/2, /*seq=*/16);
}

ModelConfig Preset(const char* name, int64_t layers) {
  absl::StatusOr<ModelConfig> config = ModelFromPreset(name);
  EXPECT_TRUE(config.ok()) << config.status();
  config->layers = layers;
  config->batch = 2;
  config->seq = 16;
  return *config;
}

// The study block by hand, N = B T tokens, width d, flash attention:
//   forward: ln1, ln2 5 N d each; qkv 2 N d 3d + 3 N d (bias); attention
//   2 B d T (T + 1) (H heads of d/H); proj 2 N d^2 + N d; two residual adds N d each;
//   fc1 2 N d 4d + 4 N d; gelu 4 N d; fc2 2 N 4d d + N d
//   = 24 N d^2 + 25 N d + 2 B d T (T + 1).
//   backward: the four addmm 2x their products plus the bias once (48 N d^2 + 9 N d),
//   attention 2.5x (5 B d T (T + 1)), the rest 2x (2 x 16 N d)
//   = 48 N d^2 + 41 N d + 5 B d T (T + 1).
//   The loss x.pow(2).mean(): N d + N d forward, twice that backward.
// selective(matmul) skips the four products at recompute: 24 N d^2 + 9 N d less.
TEST(FlopsTest, StudyBlockByHand) {
  const ModelConfig config;  // 6 x 128, 4 heads, B 16, T 64
  const int64_t n = 16 * 64, d = 128, b = 16, t = 64;
  const int64_t forward = 24 * n * d * d + 25 * n * d + 2 * b * d * t * (t + 1);
  const int64_t backward = 48 * n * d * d + 41 * n * d + 5 * b * d * t * (t + 1);
  ASSERT_OK_AND_ASSIGN(StepFlops flops, CountStepFlops(config, AttentionMode::kFlash));
  EXPECT_EQ(flops.layer_forward, forward);
  EXPECT_EQ(flops.layer_backward, backward);
  EXPECT_EQ(flops.other_forward, 2 * n * d);
  EXPECT_EQ(flops.other_backward, 4 * n * d);
  EXPECT_EQ(flops.total, 6 * (forward + backward) + 6 * n * d);

  ASSERT_OK_AND_ASSIGN(int64_t none, RecomputeFlops(config, AttentionMode::kFlash, {}));
  EXPECT_EQ(none, 0);
  ASSERT_OK_AND_ASSIGN(int64_t full,
                       RecomputeFlops(config, AttentionMode::kFlash, LayerChoice{true, {}}));
  EXPECT_EQ(full, forward);
  ASSERT_OK_AND_ASSIGN(int64_t matmul, RecomputeFlops(config, AttentionMode::kFlash,
                                                      LayerChoice{true, StudyPolicy()}));
  EXPECT_EQ(matmul, forward - (24 * n * d * d + 9 * n * d));
}

// A frozen LM head (--freeze=lm_head): its matmul's backward computes the input's
// gradient only, one product less. tiny-llama, N = 2 x 16 tokens, d = 32, V = 96: the
// head's forward product is 2 N d V = 196,608 FLOPs, and so is what the backward saves.
TEST(FlopsTest, AFrozenWeightsProductHasOneGradientLess) {
  ModelConfig config = Preset("tiny-llama", 2);
  ASSERT_OK_AND_ASSIGN(StepFlops all, CountStepFlops(config, AttentionMode::kFlash));
  config.freeze.lm_head = true;
  ASSERT_OK_AND_ASSIGN(StepFlops frozen, CountStepFlops(config, AttentionMode::kFlash));
  const int64_t head = 2 * (2 * 16) * 32 * 96;
  EXPECT_EQ(frozen.other_forward, all.other_forward);
  EXPECT_EQ(frozen.other_backward, all.other_backward - head);
  EXPECT_EQ(frozen.layer_backward, all.layer_backward);
  EXPECT_EQ(frozen.total, all.total - head);
}

// On --device=cuda the attention is SDPA's CUDA kernel (fp32: the memory-efficient one;
// bf16: cuDNN's on sm90), which counts as the CPU's flash kernel does: the same study
// block by hand as above.
TEST(FlopsTest, OnCudaTheAttentionKernelsCountAsFlash) {
  const int64_t n = 16 * 64, d = 128, b = 16, t = 64;
  const int64_t forward = 24 * n * d * d + 25 * n * d + 2 * b * d * t * (t + 1);
  const int64_t backward = 48 * n * d * d + 41 * n * d + 5 * b * d * t * (t + 1);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    ModelConfig config;
    config.device = Device::kCuda;
    config.dtype = dtype;
    ASSERT_OK_AND_ASSIGN(StepFlops flops, CountStepFlops(config, AttentionMode::kFlash));
    EXPECT_EQ(flops.layer_forward, forward) << DTypeName(dtype);
    EXPECT_EQ(flops.layer_backward, backward) << DTypeName(dtype);
  }
}

// Replayer replays plans of one model in the step simulation (every layer, no
// composition): the independent peak the planner's composed one is compared with.
// A plan that checkpoints no layer keeps transformers' DynamicCache (use_cache): it is
// replayed on the model's own config, the others without the cache.
struct Replayer {
  StepSimulator simulator;
  ResidentBytes resident;
  OptimizerSpec optimizer;
  std::optional<StepSimulator> cached;

  int64_t Peak(const Planner& planner, const std::vector<int>& plan) const {
    std::vector<LayerChoice> layers;
    bool checkpoints = false;
    for (int c : plan) {
      layers.push_back(planner.choices()[c]);
      checkpoints = checkpoints || layers.back().checkpointed;
    }
    const StepSimulator& s = cached.has_value() && !checkpoints ? *cached : simulator;
    absl::StatusOr<StepTimeline> t = s.Simulate(PlanVariant(layers), optimizer, resident);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? t->peak.bytes : -1;
  }
};

absl::StatusOr<Replayer> ReplayerFor(const ModelConfig& model, AttentionMode attention,
                                     const OptimizerSpec& optimizer = OptimizerSpec()) {
  // The planner predicts without transformers' use_cache (Planner::Create).
  ModelConfig config = model;
  config.use_cache = false;
  StepOptions step;
  step.record_events = false;
  absl::StatusOr<StepSimulator> simulator = StepSimulator::Create(config, attention, step);
  if (!simulator.ok()) return simulator.status();
  PredictOptions options;
  options.attention = attention;
  options.variants = {Variant()};
  options.optimizer = optimizer;
  options.peak = false;
  absl::StatusOr<Prediction> p = Predict(config, options);
  if (!p.ok()) return p.status();
  Replayer replayer{*std::move(simulator),
                    {p->param_bytes, p->optimizer_state_bytes, p->buffer_bytes},
                    optimizer,
                    std::nullopt};
  if (model.KeepsKvCache()) {
    absl::StatusOr<StepSimulator> cached = StepSimulator::Create(model, attention, step);
    if (!cached.ok()) return cached.status();
    replayer.cached = *std::move(cached);
  }
  return replayer;
}

// Every plan of `choices` over `layers` layers, as indices into choices.
std::vector<std::vector<int>> AllPlans(int64_t layers, int choices) {
  std::vector<std::vector<int>> plans(1);
  for (int64_t i = 0; i < layers; ++i) {
    std::vector<std::vector<int>> longer;
    for (const std::vector<int>& plan : plans) {
      for (int c = 0; c < choices; ++c) {
        longer.push_back(plan);
        longer.back().push_back(c);
      }
    }
    plans = std::move(longer);
  }
  return plans;
}

struct Case {
  const char* name;
  ModelConfig config;
  AttentionMode attention;
  bool general = false;  // PlannerOptions::general
  OptimizerSpec optimizer;
};

// A bf16 model with fp32 master weights (the optimizer's step holds every layer's fp32
// .grad copy) and foreach AdamW (a square root of every exp_avg_sq at once): the
// optimizer's rise grows with the layers.
ModelConfig Bf16(ModelConfig config) {
  config.dtype = DType::kBFloat16;
  return config;
}
// bf16 autocast: a checkpointed layer's weight casts live in autocast's cache until the
// forward ends (no backward node keeps them), so every later moment depends on how many
// layers before it are checkpointed.
ModelConfig Larger(ModelConfig config) {
  config.batch = 8;
  config.seq = 128;
  return config;
}
ModelConfig Autocast(ModelConfig config) {
  config.amp = DType::kBFloat16;
  return config;
}
OptimizerSpec MasterWeights() {
  OptimizerSpec optimizer;
  optimizer.master_weights = true;
  return optimizer;
}
OptimizerSpec Foreach() {
  OptimizerSpec optimizer;
  optimizer.impl = OptimizerImpl::kForeach;
  return optimizer;
}

std::vector<Case> Cases(int64_t layers) {
  // Wide and short: parameters outweigh activations, so AdamW's step temporaries
  // (2 x the largest parameter) make the peak, after the backward.
  const ModelConfig wide =
      StudyModel(layers, /*width=*/128, /*heads=*/2, /*batch=*/1, /*seq=*/4);
  return {
      {"study flash", SmallStudy(layers), AttentionMode::kFlash, false, {}},
      {"study math", SmallStudy(layers), AttentionMode::kMath, false, {}},
      {"tiny-llama flash", Preset("tiny-llama", layers), AttentionMode::kFlash, false, {}},
      {"tiny-gpt2 math", Preset("tiny-gpt2", layers), AttentionMode::kMath, false, {}},
      {"study flash, general labels", SmallStudy(layers), AttentionMode::kFlash, true, {}},
      {"tiny-llama flash, general labels", Preset("tiny-llama", layers),
       AttentionMode::kFlash, true, {}},
      {"wide study flash", wide, AttentionMode::kFlash, false, {}},
      {"wide study bf16, master weights", Bf16(wide), AttentionMode::kFlash, false,
       MasterWeights()},
      {"tiny-llama bf16, master weights", Bf16(Preset("tiny-llama", layers)),
       AttentionMode::kFlash, false, MasterWeights()},
      {"wide study, foreach", wide, AttentionMode::kFlash, false, Foreach()},
      {"study bf16 autocast", Autocast(SmallStudy(layers)), AttentionMode::kFlash, false, {}},
      {"tiny-llama bf16 autocast", Autocast(Preset("tiny-llama", layers)),
       AttentionMode::kFlash, false, {}},
      {"tiny-llama bf16 autocast B8 T128", Autocast(Larger(Preset("tiny-llama", layers))),
       AttentionMode::kFlash, false, {}},
      {"tiny-llama bf16 autocast B8 T128, general labels",
       Autocast(Larger(Preset("tiny-llama", layers))), AttentionMode::kFlash, true, {}},
  };
}

// ComposedAgainstReplayed compares the planner's composed peak with the replayed step's
// for every plan of up to 3 layers over its choices, or 40 random plans of more, and
// counts them into *compared.
void ComposedAgainstReplayed(const Case& c, int64_t layers, const PlannerOptions& options,
                             std::mt19937& random, int* compared) {
  ASSERT_OK_AND_ASSIGN(Planner planner, Planner::Create(c.config, options));
  ASSERT_OK_AND_ASSIGN(Replayer replay, ReplayerFor(c.config, c.attention, c.optimizer));
  const int n = static_cast<int>(planner.choices().size());
  std::vector<std::vector<int>> plans;
  if (layers <= 3) {
    plans = AllPlans(layers, n);
  } else {
    for (int k = 0; k < 40; ++k) {
      std::vector<int> plan(layers);
      for (int& choice : plan) choice = static_cast<int>(random() % n);
      plans.push_back(plan);
    }
  }
  for (const std::vector<int>& plan : plans) {
    ASSERT_EQ(planner.PeakOf(plan), replay.Peak(planner, plan))
        << c.name << " plan " << absl::StrJoin(plan, " ");
    ++*compared;
  }
}

// The planner composes a plan's peak from stretches of short probe models; the
// simulation replays the plan itself. Every 3-layer plan, and random longer ones.
TEST(PlannerTest, ComposedPeakEqualsTheReplayedPlan) {
  std::mt19937 random(7);
  int compared = 0;
  for (int64_t layers : {1, 2, 3, 9}) {
    for (const Case& c : Cases(layers)) {
      if (c.general) continue;  // the same composition
      PlannerOptions options;
      options.attention = c.attention;
      options.optimizer = c.optimizer;
      ComposedAgainstReplayed(c, layers, options, random, &compared);
    }
  }
  // 1, 2 and 3 layers: 17^k plans for the five studies with flash (4 op kinds: the
  // study in fp32 and under autocast, the wide one in fp32, in bf16 with master weights
  // and with foreach), 9^k with math (3), 9^k for llama (3) in fp32, in bf16 with master
  // weights and under autocast (at B 2, T 16 and at B 8, T 128), 5^k for gpt2 with math
  // (matmul, layer_norm: its gelu_new has no gelu op); 11 x 40 random 9-layer plans.
  EXPECT_EQ(compared, 5 * (17 + 17 * 17 + 17 * 17 * 17) + 5 * (9 + 81 + 729) +
                          (5 + 25 + 125) + 11 * 40);
}

// Models whose layers differ: their kinds and each kind's first layer are the planner's
// contexts too (planner_probes.cc).
// Gemma 3 with `pattern` (its layer_types' period) and a window of 8 under seq 16: the
// sliding-window layers attend through the mask the decoder makes (math attention
// with a window of 32: no mask, which it does not model), and each span has its own
// RoPE tables, which the first layer of the span frees.
ModelConfig Gemma(int64_t layers, std::vector<LayerAttention> pattern, int64_t window = 8) {
  ModelConfig config = Preset("tiny-gemma3", layers);
  config.sliding_window = window;
  config.layer_attention = std::move(pattern);
  return config;
}
// Qwen3-MoE with a dense first layer (mlp_only_layers [0]), under either experts
// implementation; `routed`: eager experts with a given routing, a row per sparse layer
// (each summing to B T k = 2 x 16 x 2 = 64 over 4 experts, at most B T = 32 each), so
// that every sparse layer is its own kind.
ModelConfig DenseFirstMoe(int64_t layers, ExpertsImpl impl, bool routed = false) {
  ModelConfig config = Preset("tiny-qwen3-moe", layers);
  config.moe.impl = impl;
  config.moe.sparse_layers.assign(layers, true);
  config.moe.sparse_layers[0] = false;
  if (routed) {
    const std::vector<std::vector<int64_t>> rows = {
        {16, 16, 16, 16}, {32, 16, 8, 8}, {0, 0, 32, 32}, {32, 32, 0, 0}};
    config.moe.routing = RoutingSource::kGiven;
    for (int64_t i = 1; i < layers; ++i) config.moe.routing_rows.push_back(rows[(i - 1) % 4]);
  }
  return config;
}

std::vector<Case> DifferingCases(int64_t layers) {
  const LayerAttention kS = LayerAttention::kSliding, kF = LayerAttention::kFull;
  std::vector<Case> cases = {
      {"gemma3 [S F]", Gemma(layers, {kS, kF}), AttentionMode::kFlash, false, {}},
      {"gemma3 [F S S], math", Gemma(layers, {kF, kS, kS}, 32), AttentionMode::kMath, false, {}},
      {"gemma3 [S S F], general labels", Gemma(layers, {kS, kS, kF}), AttentionMode::kFlash,
       true, {}},
      {"gemma3 [S F] bf16 autocast", Autocast(Gemma(layers, {kS, kF})), AttentionMode::kFlash,
       false, {}},
  };
  if (layers >= 2) {  // a dense first layer and sparse ones
    cases.push_back({"qwen3-moe dense first, grouped_mm",
                     DenseFirstMoe(layers, ExpertsImpl::kGroupedMm), AttentionMode::kFlash,
                     false, {}});
    cases.push_back({"qwen3-moe dense first, eager routed",
                     DenseFirstMoe(layers, ExpertsImpl::kEager, true), AttentionMode::kFlash,
                     false, {}});
    cases.push_back({"qwen3-moe dense first, eager routed, bf16 master weights",
                     Bf16(DenseFirstMoe(layers, ExpertsImpl::kEager, true)),
                     AttentionMode::kFlash, false, MasterWeights()});
  }
  return cases;
}

// A pipeline stage's guide is the model of its layers alone (ModelConfig::LayersAlone):
// each keeps its attention span, sparseness and routing row, and the batch and rows
// scale by the micro-batches in flight.
TEST(PlannerTest, AStagesGuideModelIsItsLayersAlone) {
  const LayerAttention kS = LayerAttention::kSliding, kF = LayerAttention::kFull;
  // Gemma 3's 5 : 1 pattern over 12 layers: layers 4, 5, 6 are sliding, global, sliding.
  ModelConfig gemma = Gemma(12, {kS, kS, kS, kS, kS, kF});
  ModelConfig alone = gemma.LayersAlone({4, 5, 6}, 2);
  EXPECT_EQ(alone.layers, 3);
  EXPECT_EQ(alone.batch, 2 * gemma.batch);
  EXPECT_EQ(alone.layer_attention, (std::vector<LayerAttention>{kS, kF, kS}));
  EXPECT_OK(ValidateConfig(alone));
  // An MoE whose layers 0 and 3 are dense, with a routing row for each sparse layer
  // (1, 2, 4; each summing to B T k = 64): layers 2, 3, 4 keep rows 2 and 3, times 3.
  ModelConfig moe = DenseFirstMoe(5, ExpertsImpl::kEager, true);
  moe.moe.sparse_layers = {false, true, true, false, true};
  moe.moe.routing_rows = {{16, 16, 16, 16}, {32, 16, 8, 8}, {0, 0, 32, 32}};
  ASSERT_OK(ValidateConfig(moe));
  ModelConfig stage = moe.LayersAlone({2, 3, 4}, 3);
  EXPECT_EQ(stage.batch, 3 * moe.batch);
  EXPECT_EQ(stage.moe.sparse_layers, (std::vector<bool>{true, false, true}));
  EXPECT_EQ(stage.moe.routing_rows,
            (std::vector<std::vector<int64_t>>{{96, 48, 24, 24}, {0, 0, 96, 96}}));
  EXPECT_OK(ValidateConfig(stage));
}

// The planner composes a plan's peak for layers that differ: its kinds differ from the
// probes' order, and the first layer of each kind frees what only that kind keeps.
// Every plan of 1 to 3 layers (none, full and two policies each), and random 9-layer
// plans over every choice.
TEST(PlannerTest, LayersThatDifferComposeToTheReplayedPlan) {
  std::mt19937 random(13);
  int compared = 0;
  for (int64_t layers : {1, 2, 3, 9}) {
    for (const Case& c : DifferingCases(layers)) {
      SCOPED_TRACE(c.name);
      PlannerOptions options;
      options.attention = c.attention;
      options.optimizer = c.optimizer;
      options.general = c.general;
      if (layers <= 3) {
        options.choices = {LayerChoice{false, {}}, LayerChoice{true, {}},
                           LayerChoice{true, SavePolicy{OpKind::kMatmul}},
                           LayerChoice{true, SavePolicy{OpKind::kMatmul, OpKind::kGelu}}};
        if (c.config.family != Family::kGemma3) {
          options.choices.back() = LayerChoice{true, SavePolicy{OpKind::kSilu}};
        }
      }
      ComposedAgainstReplayed(c, layers, options, random, &compared);
    }
  }
  // 1 layer: the 4 gemma cases, 4 plans each (none, full and the two policies); 2 and 3
  // layers: the 7 cases, 4^2 and 4^3; 9 layers: the 7 cases, 40 random plans each.
  EXPECT_EQ(compared, 4 * 4 + 7 * (16 + 64) + 7 * 40);
}

// Expert parallelism under balanced routing: every expert-parallel rank holds as many
// experts and receives as many rows, so one plan's peak is every rank's. The planner
// composes the rank's step (its experts, AllToAllEP's buffers, the experts' own
// reduction) to every rank's replayed peak.
TEST(PlannerTest, ExpertParallelRanksUnderBalancedRoutingComposeToEveryRanksPeak) {
  int compared = 0;
  for (ExpertsImpl impl : {ExpertsImpl::kEager, ExpertsImpl::kGroupedMm}) {
    for (const auto& [dp, ep] : {std::pair<int64_t, int64_t>{2, 2}, {4, 2}}) {
      PlannerOptions options;
      options.parallel.dp = dp;
      options.parallel.ep = ep;
      ModelConfig config = DenseFirstMoe(3, impl);
      config.shard = ShardOf(options.parallel);
      SCOPED_TRACE(::testing::Message() << "impl " << static_cast<int>(impl) << " dp " << dp
                                        << " ep " << ep);
      options.choices = {LayerChoice{false, {}}, LayerChoice{true, {}},
                         LayerChoice{true, SavePolicy{OpKind::kMatmul}}};
      ASSERT_OK_AND_ASSIGN(Planner planner, Planner::Create(config, options));
      for (const std::vector<int>& plan : AllPlans(3, 3)) {
        std::vector<LayerChoice> choices;
        for (int c : plan) choices.push_back(planner.choices()[c]);
        PredictOptions predict;
        predict.variants = {PlanVariant(choices)};
        ASSERT_OK_AND_ASSIGN(RanksPrediction ranks,
                             PredictRanks(config, options.parallel, predict));
        ASSERT_EQ(ranks.parallel.ep, ep);
        for (const RankKind& kind : ranks.kinds) {
          const VariantPrediction& held = kind.variants[0].held;
          ASSERT_TRUE(held.peak.has_value()) << held.peak_unavailable;
          ASSERT_EQ(planner.PeakOf(plan), held.peak->bytes)
              << "ep rank " << kind.ep_rank << " plan " << absl::StrJoin(plan, " ");
        }
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, 2 * 2 * 27);
}

// The solver against every plan: at budgets between the smallest and the largest peak
// (each a plan's replayed peak, where the answer changes), the least recompute among the
// plans that fit; for layers alike and layers that differ.
TEST(PlannerTest, OptimalAgainstExhaustiveSearch) {
  int budgets = 0;
  for (int64_t layers : {3, 4}) {
    std::vector<Case> cases = Cases(layers);
    for (Case& c : DifferingCases(layers)) cases.push_back(std::move(c));
    for (const Case& c : cases) {
      SCOPED_TRACE(c.name);
      PlannerOptions options;
      options.attention = c.attention;
      options.general = c.general;
      options.optimizer = c.optimizer;
      if (layers == 4) {  // keep 4^4 plans: none, full and two policies
        options.choices = {LayerChoice{false, {}}, LayerChoice{true, {}},
                           LayerChoice{true, SavePolicy{OpKind::kMatmul}},
                           LayerChoice{true, c.config.family == Family::kLlama
                                                 ? SavePolicy{OpKind::kSilu}
                                             : c.config.family == Family::kGpt2
                                                 ? SavePolicy{OpKind::kMatmul, OpKind::kLayerNorm}
                                                 : SavePolicy{OpKind::kMatmul, OpKind::kGelu}}};
      }
      ASSERT_OK_AND_ASSIGN(Planner planner, Planner::Create(c.config, options));
      ASSERT_OK_AND_ASSIGN(Replayer replay, ReplayerFor(c.config, c.attention, c.optimizer));
      const int n = static_cast<int>(planner.choices().size());
      struct Scored {
        int64_t peak;
        int64_t cost;
      };
      std::vector<Scored> scored;
      for (const std::vector<int>& plan : AllPlans(layers, n)) {
        int64_t cost = 0;
        for (size_t i = 0; i < plan.size(); ++i) cost += planner.recompute_flops(i, plan[i]);
        scored.push_back({replay.Peak(planner, plan), cost});
      }
      std::vector<int64_t> peaks;
      for (const Scored& s : scored) peaks.push_back(s.peak);
      std::sort(peaks.begin(), peaks.end());
      peaks.erase(std::unique(peaks.begin(), peaks.end()), peaks.end());
      EXPECT_EQ(planner.SmallestBudget(), peaks.front()) << c.name;
      EXPECT_STATUS(planner.Solve(peaks.front() - 1), absl::StatusCode::kResourceExhausted,
                    absl::StrCat("smallest peak any plan reaches is"));
      // Every distinct peak when few, else 40 of them evenly, plus one byte below each.
      const size_t stride = std::max<size_t>(1, peaks.size() / 40);
      for (size_t k = 0; k < peaks.size(); k += stride) {
        for (int64_t budget : {peaks[k], peaks[k] + 1, k > 0 ? peaks[k] - 1 : peaks[k]}) {
          int64_t best = -1;
          for (const Scored& s : scored) {
            if (s.peak <= budget && (best < 0 || s.cost < best)) best = s.cost;
          }
          ASSERT_OK_AND_ASSIGN(PlanResult plan, planner.Solve(budget));
          EXPECT_EQ(plan.recompute_flops, best) << c.name << " L" << layers << " budget "
                                                << budget;
          std::vector<int> indices;
          for (const LayerChoice& choice : plan.layers) {
            indices.push_back(static_cast<int>(
                std::find(planner.choices().begin(), planner.choices().end(), choice) -
                planner.choices().begin()));
          }
          const int64_t replayed = replay.Peak(planner, indices);
          EXPECT_EQ(plan.peak_bytes, replayed) << c.name;
          EXPECT_LE(replayed, budget) << c.name;
          ++budgets;
        }
      }
    }
  }
  EXPECT_GT(budgets, 200);
}

// With use_cache, transformers keeps the DynamicCache only when no layer is
// checkpointed. Under autocast its values are promoted to the keys' fp32, so the plan of
// no checkpoints peaks higher with the cache than the composed stretches (which have
// none) say: the planner must use the cached peak, and under a budget between the two
// pick a plan that checkpoints.
TEST(PlannerTest, ThePlanWithoutCheckpointsKeepsTheCache) {
  ModelConfig config = Autocast(Larger(Preset("tiny-llama", 4)));
  ASSERT_TRUE(config.use_cache);
  ASSERT_OK_AND_ASSIGN(Planner planner, Planner::Create(config, PlannerOptions()));
  PredictOptions options;
  options.variants = {Variant()};
  ASSERT_OK_AND_ASSIGN(Prediction cached, Predict(config, options));
  ASSERT_TRUE(cached.variants[0].peak.has_value());
  const int64_t with_cache = cached.variants[0].peak->bytes;
  EXPECT_EQ(planner.PeakOf(std::vector<int>(4, 0)), with_cache);
  ModelConfig uncached = config;
  uncached.use_cache = false;
  ASSERT_OK_AND_ASSIGN(Replayer replay, ReplayerFor(uncached, AttentionMode::kFlash));
  const int64_t without_cache = replay.Peak(planner, std::vector<int>(4, 0));
  ASSERT_LT(without_cache, with_cache);
  ASSERT_OK_AND_ASSIGN(PlanResult plan, planner.Solve(with_cache - 1));
  bool checkpoints = false;
  for (const LayerChoice& choice : plan.layers) checkpoints = checkpoints || choice.checkpointed;
  EXPECT_TRUE(checkpoints);
  EXPECT_LE(plan.peak_bytes, with_cache - 1);
  ASSERT_OK_AND_ASSIGN(PlanResult none, planner.Solve(with_cache));
  EXPECT_EQ(none.recompute_flops, 0);
  EXPECT_EQ(none.peak_bytes, with_cache);
}

// A data-parallel rank's step is one process's up to the backward's end, then the
// gradients' reduction and the rank's (sharded) optimizer step over the whole model's
// parameters: composed from the probes and the rank's own end, every plan's peak must be
// the one PredictRanks replays for the rank.
TEST(PlannerTest, DataParallelPlansComposeToTheRanksPeak) {
  std::mt19937 random(11);
  int compared = 0;
  struct Rank {
    const char* name;
    ModelConfig config;
    OptimizerSpec optimizer;
  };
  for (int64_t layers : {3, 7}) {
    for (const Rank& r : {Rank{"tiny-llama", Larger(Preset("tiny-llama", layers)), {}},
                          Rank{"tiny-llama bf16, master weights",
                               Bf16(Larger(Preset("tiny-llama", layers))), MasterWeights()},
                          Rank{"wide study", StudyModel(layers, 128, 2, 1, 4), {}},
                          Rank{"gemma3 [S F]",
                               Gemma(layers, {LayerAttention::kSliding, LayerAttention::kFull}),
                               {}},
                          Rank{"qwen3-moe dense first, eager routed",
                               DenseFirstMoe(layers, ExpertsImpl::kEager, true), {}}}) {
      for (const auto& [dp, zero] : {std::pair<int64_t, int64_t>{2, 0}, {2, 1}, {3, 1}, {3, 2}}) {
        SCOPED_TRACE(::testing::Message() << r.name << " L" << layers << " dp " << dp
                                          << " zero " << zero);
        PlannerOptions options;
        options.optimizer = r.optimizer;
        options.parallel.dp = dp;
        options.parallel.zero = zero;
        options.choices = {LayerChoice{false, {}}, LayerChoice{true, {}},
                           LayerChoice{true, SavePolicy{OpKind::kMatmul}}};
        ASSERT_OK_AND_ASSIGN(Planner planner, Planner::Create(r.config, options));
        std::vector<std::vector<int>> plans;
        if (layers == 3) {
          plans = AllPlans(layers, static_cast<int>(planner.choices().size()));
        } else {
          for (int k = 0; k < 12; ++k) {
            std::vector<int> plan(layers);
            for (int& c : plan) c = static_cast<int>(random() % planner.choices().size());
            plans.push_back(plan);
          }
        }
        for (const std::vector<int>& plan : plans) {
          std::vector<LayerChoice> choices;
          for (int c : plan) choices.push_back(planner.choices()[c]);
          PredictOptions predict;
          predict.optimizer = r.optimizer;
          predict.variants = {PlanVariant(choices)};
          ASSERT_OK_AND_ASSIGN(RanksPrediction ranks,
                               PredictRanks(r.config, options.parallel, predict));
          const VariantPrediction& held = ranks.kinds[0].variants[0].held;
          ASSERT_TRUE(held.peak.has_value()) << held.peak_unavailable;
          ASSERT_EQ(planner.PeakOf(plan), held.peak->bytes) << absl::StrJoin(plan, " ");
          ++compared;
        }
        // The solver's plan fits what the rank replays.
        ASSERT_OK_AND_ASSIGN(PlanResult best, planner.Solve(planner.SmallestBudget()));
        EXPECT_EQ(best.peak_bytes, planner.SmallestBudget());
      }
    }
  }
  // 5 models x 4 layouts, each every 3-layer plan of 3 choices and 12 random 7-layer ones.
  EXPECT_EQ(compared, 5 * 4 * (27 + 12));
}

// On --device=cuda the planner composes requests rounded to 512 B (CudaBlocks::kRequests):
// with expandable segments that is what the caching allocator's simulation (checked
// against PyTorch's own in cuda_allocator_expandable_test) reports as
// max_memory_allocated for the whole plan, replayed by Predict (or PredictRanks for a
// data-parallel rank); without them the allocator's peak is at least it.
TEST(PlannerTest, OnCudaComposedPeakIsTheExpandableAllocatorsPeak) {
  std::mt19937 random(13);
  int compared = 0;
  struct CudaCase {
    const char* name;
    ModelConfig config;
    OptimizerSpec optimizer;
    int64_t dp = 1;
    int64_t zero = 0;
  };
  for (int64_t layers : {3, 8}) {
    for (CudaCase c : {CudaCase{"tiny-llama bf16", Bf16(Larger(Preset("tiny-llama", layers))), {}},
                       CudaCase{"tiny-llama bf16 autocast", Autocast(Larger(Preset("tiny-llama", layers))),
                                {}},
                       CudaCase{"tiny-gpt2 bf16, master weights",
                                Bf16(Larger(Preset("tiny-gpt2", layers))), MasterWeights()},
                       CudaCase{"study fp32", Larger(SmallStudy(layers)), {}},
                       CudaCase{"tiny-llama bf16, dp 2 ZeRO-1",
                                Bf16(Larger(Preset("tiny-llama", layers))), MasterWeights(), 2, 1},
                       CudaCase{"gemma3 [S F] bf16",
                                Bf16(Gemma(layers, {LayerAttention::kSliding,
                                                    LayerAttention::kFull})),
                                {}}}) {
      SCOPED_TRACE(::testing::Message() << c.name << " L" << layers);
      c.config.device = Device::kCuda;
      c.config.expandable_segments = true;
      PlannerOptions options;
      options.optimizer = c.optimizer;
      options.parallel.dp = c.dp;
      options.parallel.zero = c.zero;
      options.choices = {LayerChoice{false, {}}, LayerChoice{true, {}},
                         LayerChoice{true, SavePolicy{OpKind::kMatmul}}};
      ASSERT_OK_AND_ASSIGN(Planner planner, Planner::Create(c.config, options));
      std::vector<std::vector<int>> plans;
      if (layers == 3) {
        plans = AllPlans(layers, 3);
      } else {
        for (int k = 0; k < 8; ++k) {
          std::vector<int> plan(layers);
          for (int& choice : plan) choice = static_cast<int>(random() % 3);
          plans.push_back(plan);
        }
      }
      for (const std::vector<int>& plan : plans) {
        std::vector<LayerChoice> choices;
        for (int choice : plan) choices.push_back(planner.choices()[choice]);
        PredictOptions predict;
        predict.optimizer = c.optimizer;
        predict.variants = {PlanVariant(choices)};
        // The whole step through the allocator's simulation, with and without
        // expandable segments.
        auto allocated = [&](bool expandable) -> int64_t {
          ModelConfig config = c.config;
          config.expandable_segments = expandable;
          if (c.dp > 1) {
            absl::StatusOr<RanksPrediction> ranks =
                PredictRanks(config, options.parallel, predict);
            EXPECT_TRUE(ranks.ok()) << ranks.status();
            return ranks.ok() && ranks->kinds[0].variants[0].held.peak.has_value()
                       ? ranks->kinds[0].variants[0].held.peak->bytes
                       : -1;
          }
          absl::StatusOr<Prediction> p = Predict(config, predict);
          EXPECT_TRUE(p.ok()) << p.status();
          return p.ok() && p->variants[0].peak.has_value() ? p->variants[0].peak->bytes : -1;
        };
        const int64_t composed = planner.PeakOf(plan);
        ASSERT_EQ(composed, allocated(true)) << absl::StrJoin(plan, " ");
        ASSERT_GE(allocated(false), composed) << absl::StrJoin(plan, " ");
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, 6 * (27 + 8));
}

TEST(PlannerTest, FrontierFallsFromNoneToTheSmallestPeak) {
  const ModelConfig config = SmallStudy(6);
  ASSERT_OK_AND_ASSIGN(Planner planner, Planner::Create(config, PlannerOptions()));
  ASSERT_OK_AND_ASSIGN(std::vector<FrontierPoint> frontier, planner.Frontier(5));
  ASSERT_EQ(frontier.size(), 5u);
  EXPECT_EQ(frontier.front().budget_bytes, planner.SmallestBudget());
  // At none's own peak, none fits: no recompute.
  EXPECT_EQ(frontier.back().plan.recompute_flops, 0);
  EXPECT_EQ(frontier.back().plan.overhead, 1.0);
  for (size_t k = 1; k < frontier.size(); ++k) {
    EXPECT_LE(frontier[k].plan.recompute_flops, frontier[k - 1].plan.recompute_flops);
    EXPECT_LE(frontier[k].plan.peak_bytes, frontier[k].budget_bytes);
  }
}

TEST(PlannerTest, BadInput) {
  ModelConfig config = SmallStudy(2);
  PlannerOptions options;
  options.choices = {LayerChoice{true, SavePolicy{OpKind::kSilu}}};
  EXPECT_STATUS(Planner::Create(config, options), absl::StatusCode::kInvalidArgument, "silu");
  config.width = 33;
  EXPECT_STATUS(Planner::Create(config, PlannerOptions()), absl::StatusCode::kInvalidArgument,
                "--width");
  config = SmallStudy(kMaxPlannerLayers + 1);
  EXPECT_STATUS(Planner::Create(config, PlannerOptions()), absl::StatusCode::kInvalidArgument,
                "at most 1024 layers");
}

}  // namespace
}  // namespace memledger
