// Cost of a full prediction (the four default variants). The buckets alone
// (BM_PredictBuckets): under 20 us for the study's block, every variant of llama-3-70b
// (embedding to loss) under 50 us, independent of batch, seq, width and layers. With
// the whole step's peak (the default; estimator/step/liveness.h replays the step op by op on
// a model of at most 2k + 1 layers and composes the rest): independent of batch, seq,
// width and layers (compare BM_Predict/layers:6 with BM_Predict/layers:600).
#include <benchmark/benchmark.h>

#include <cstdint>
#include <optional>

#include "estimator/spec/config.h"
#include "estimator/request/model_presets.h"
#include "estimator/request/parallel_spec.h"
#include "estimator/predict/predict.h"
#include "estimator/predict/ranks.h"

namespace memledger {
namespace {

void RunPredict(benchmark::State& state, const ModelConfig& config,
                AttentionMode attention = AttentionMode::kFlash, bool peak = true,
                OptimizerSpec optimizer = {}) {
  PredictOptions options;
  options.attention = attention;
  options.peak = peak;
  options.optimizer = optimizer;
  for (auto _ : state) {
    absl::StatusOr<Prediction> p = Predict(config, options);
    if (!p.ok()) {
      state.SkipWithError(p.status().ToString().c_str());
      break;
    }
    benchmark::DoNotOptimize(p->variants[0].saved_bytes);
  }
}

void BM_Predict(benchmark::State& state) {
  ModelConfig config;  // the study's
  config.layers = state.range(0);
  RunPredict(state, config);
}
BENCHMARK(BM_Predict)->ArgName("layers")->Arg(6)->Arg(600);

void BM_PredictBuckets(benchmark::State& state) {
  ModelConfig config;
  config.layers = state.range(0);
  RunPredict(state, config, AttentionMode::kFlash, /*peak=*/false);
}
BENCHMARK(BM_PredictBuckets)->ArgName("layers")->Arg(6)->Arg(6000000);

void BM_PredictSizes(benchmark::State& state) {
  // The study's config with B, T and d scaled by 2^range: the cost must not move.
  ModelConfig config;
  const int64_t scale = int64_t{1} << state.range(0);
  config.batch *= scale;
  config.seq *= scale;
  config.width *= scale;
  RunPredict(state, config);
}
BENCHMARK(BM_PredictSizes)->ArgName("log2_scale")->Arg(0)->Arg(6);

void BM_PredictGpt3(benchmark::State& state) {
  ModelConfig config = StudyModel(/*layers=*/96, /*width=*/12288, /*heads=*/96,
                                  /*batch=*/1, /*seq=*/2048);
  RunPredict(state, config);
}
BENCHMARK(BM_PredictGpt3);

// Llama3_70b is llama-3-70b at batch 1, seq 8192; nullopt (the benchmark skipped) if the
// preset is missing.
std::optional<ModelConfig> Llama3_70b(benchmark::State& state) {
  absl::StatusOr<ModelConfig> config = ModelFromPreset("llama-3-70b");
  if (!config.ok()) {
    state.SkipWithError("no llama-3-70b preset");
    return std::nullopt;
  }
  config->batch = 1;
  config->seq = 8192;
  return *config;
}

void BM_PredictLlama3_70b(benchmark::State& state) {
  std::optional<ModelConfig> config = Llama3_70b(state);
  if (!config.has_value()) return;
  RunPredict(state, *config);
}
BENCHMARK(BM_PredictLlama3_70b);

// The same model at a new size every call (batch 1 to 4, seq 2048 to 16384): what a
// graph's memos keep (its walks' keeps, its plans' structure) is shared by every size
// whose tensors share storages alike, so a sweep costs what one size does. Nothing is
// remembered by size.
void BM_PredictLlama3_70bSweep(benchmark::State& state) {
  std::optional<ModelConfig> config = Llama3_70b(state);
  if (!config.has_value()) return;
  const PredictOptions options;
  int64_t call = 0;
  for (auto _ : state) {
    ModelConfig sized = *config;
    sized.batch = 1 + call % 4;
    sized.seq = int64_t{2048} << (call / 4 % 4);
    ++call;
    absl::StatusOr<Prediction> p = Predict(sized, options);
    if (!p.ok()) {
      state.SkipWithError(p.status().ToString().c_str());
      break;
    }
    benchmark::DoNotOptimize(p->variants[0].saved_bytes);
  }
}
BENCHMARK(BM_PredictLlama3_70bSweep);

// The same model trained in low precision: 0 under bf16 autocast (the peak replays the
// cast cache and the gradients cast back), 1 in bf16 with fp32 master weights (the
// optimizer step over fp32 copies). Each should cost what fp32 does.
void BM_PredictLlama3_70bLowPrecision(benchmark::State& state) {
  std::optional<ModelConfig> config = Llama3_70b(state);
  if (!config.has_value()) return;
  OptimizerSpec optimizer;
  if (state.range(0) == 0) {
    config->amp = DType::kBFloat16;
  } else {
    config->dtype = DType::kBFloat16;
    optimizer.master_weights = true;
  }
  RunPredict(state, *config, AttentionMode::kFlash, /*peak=*/true, optimizer);
}
BENCHMARK(BM_PredictLlama3_70bLowPrecision)->ArgName("master_weights")->Arg(0)->Arg(1);

// The per-rank question: llama-3-70b on 512 GPUs, TP 8 x PP 4 x DP 16 with
// ZeRO-1, bf16 autocast, seq 8192, 8 micro-batches of 1: every stage's buckets and its
// micro-batches in flight, for the four default variants.
void BM_PredictRanksLlama3_70b(benchmark::State& state) {
  std::optional<ModelConfig> config = Llama3_70b(state);
  if (!config.has_value()) return;
  config->amp = DType::kBFloat16;
  ParallelSpec parallel;
  parallel.tp = 8;
  parallel.dp = 16;
  parallel.pp = 4;
  parallel.zero = 1;
  parallel.micro_batches = 8;
  config->shard = ShardOf(parallel);
  PredictOptions options;
  options.peak = false;
  for (auto _ : state) {
    absl::StatusOr<RanksPrediction> ranks = PredictRanks(*config, parallel, options);
    if (!ranks.ok()) {
      state.SkipWithError(ranks.status().ToString().c_str());
      break;
    }
    benchmark::DoNotOptimize(ranks->kinds[0].param_bytes);
  }
}
BENCHMARK(BM_PredictRanksLlama3_70b);

// RunRankPeaks times PredictRanks with every stage's whole-step peak (the four default
// variants); skipped if the peak is unavailable.
void RunRankPeaks(benchmark::State& state, const ModelConfig& config,
                  const ParallelSpec& parallel) {
  const PredictOptions options;
  for (auto _ : state) {
    absl::StatusOr<RanksPrediction> ranks = PredictRanks(config, parallel, options);
    if (!ranks.ok() || !ranks->kinds[0].variants[0].held.peak.has_value()) {
      state.SkipWithError(ranks.ok() ? ranks->kinds[0].variants[0].held.peak_unavailable.c_str()
                                     : ranks.status().ToString().c_str());
      break;
    }
    benchmark::DoNotOptimize(ranks->kinds[0].variants[0].held.peak->bytes);
  }
}

// Every stage's whole-step peak, composed from the stage replayed with 3 layers (2k + 1
// for every_k) pass by pass: llama-3-70b over PP 8 x DP 16 with ZeRO-1, bf16 autocast,
// seq 8192, `micro_batches` of 1 in 1F1B order. One micro-batch is replayed per
// stage, the later ones' passes copied from its forward and its backward's shadow pass,
// and the middle stages copy all of theirs from stage 1's: the cost barely grows with
// the micro-batches, and not with the layers.
void BM_PredictRanksPeaksLlama3_70b(benchmark::State& state) {
  std::optional<ModelConfig> config = Llama3_70b(state);
  if (!config.has_value()) return;
  config->amp = DType::kBFloat16;
  ParallelSpec parallel;
  parallel.dp = 16;
  parallel.pp = 8;
  parallel.zero = 1;
  parallel.micro_batches = state.range(0);
  RunRankPeaks(state, *config, parallel);
}
BENCHMARK(BM_PredictRanksPeaksLlama3_70b)->ArgName("micro_batches")->Arg(8)->Arg(16)->Unit(benchmark::kMillisecond);

// The layout (TP 8 x PP 4 x DP 16, seq 8192, 8 micro-batches of 1) with every
// stage's whole-step peak, what `predict` answers by default: 0 with ZeRO-1 under bf16
// autocast; 1 with sequence parallelism (a bf16 model: sequence parallelism does not
// run under autocast) and ZeRO-3.
void BM_PredictRanksPeaksLlama3_70bTp8(benchmark::State& state) {
  std::optional<ModelConfig> config = Llama3_70b(state);
  if (!config.has_value()) return;
  ParallelSpec parallel;
  parallel.tp = 8;
  parallel.dp = 16;
  parallel.pp = 4;
  if (state.range(0) == 0) {
    config->amp = DType::kBFloat16;
    parallel.zero = 1;
  } else {
    config->dtype = DType::kBFloat16;
    parallel.sp = true;
    parallel.zero = 3;
  }
  parallel.micro_batches = 8;
  config->shard = ShardOf(parallel);
  RunRankPeaks(state, *config, parallel);
}
BENCHMARK(BM_PredictRanksPeaksLlama3_70bTp8)
    ->ArgName("sp_zero3")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond);

// The interleaved schedule's peaks: llama-3-70b, TP 8 x PP 4 x DP 2 with ZeRO-1 under
// bf16 autocast, 2 virtual stages, 64 micro-batches of 1. 0: as predict runs it (each
// rank's schedule replayed for the fewest micro-batches whose steady state repeats);
// 1: with every event recorded, which replays the whole schedule.
void BM_PredictRanksPeaksLlama3_70bInterleaved(benchmark::State& state) {
  std::optional<ModelConfig> config = Llama3_70b(state);
  if (!config.has_value()) return;
  config->amp = DType::kBFloat16;
  ParallelSpec parallel;
  parallel.tp = 8;
  parallel.dp = 2;
  parallel.pp = 4;
  parallel.zero = 1;
  parallel.virtual_stages = 2;
  parallel.schedule = PipelineSchedule::kInterleaved;
  parallel.micro_batches = 64;
  config->shard = ShardOf(parallel);
  PredictOptions options;
  options.timeline = state.range(0) == 1;
  for (auto _ : state) {
    absl::StatusOr<RanksPrediction> ranks = PredictRanks(*config, parallel, options);
    if (!ranks.ok() || !ranks->kinds[0].variants[0].held.peak.has_value()) {
      state.SkipWithError("no peak");
      break;
    }
    benchmark::DoNotOptimize(ranks->kinds[0].variants[0].held.peak->bytes);
  }
}
BENCHMARK(BM_PredictRanksPeaksLlama3_70bInterleaved)
    ->ArgName("whole_schedule")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond);

void BM_PredictGpt2(benchmark::State& state) {
  absl::StatusOr<ModelConfig> config = ModelFromPreset("gpt2");
  if (!config.ok()) {
    state.SkipWithError("no gpt2 preset");
    return;
  }
  RunPredict(state, *config);
}
BENCHMARK(BM_PredictGpt2);

void BM_PredictMath(benchmark::State& state) {
  RunPredict(state, ModelConfig{}, AttentionMode::kMath);
}
BENCHMARK(BM_PredictMath);

}  // namespace
}  // namespace memledger

BENCHMARK_MAIN();
