// The planner's cost: llama-3-70b (80 layers, batch 1, seq 8192, fp32, AdamW) with every
// per-layer choice (none, full, selective with each of the 7 non-empty subsets of
// matmul, attention and silu), at budgets 1/4, 1/2 and 3/4 of the way from the
// smallest peak any plan reaches to the peak without checkpointing. The target (issue
// 13): a plan in <= 10 ms, probes included (BM_PlanLlama70b); BM_CreateLlama70b and
// BM_SolveLlama70b split it.
//   ./bazelw run //planner:planner_benchmark
#include <benchmark/benchmark.h>

#include <cstdint>

#include "estimator/spec/config.h"
#include "estimator/request/model_presets.h"
#include "planner/planner.h"

namespace memledger {
namespace {

ModelConfig Llama70b() {
  absl::StatusOr<ModelConfig> config = ModelFromPreset("llama-3-70b");
  config->batch = 1;
  config->seq = 8192;
  return *config;
}

// BudgetAt: `quarters` quarters of the way from the smallest peak to none's.
int64_t BudgetAt(const Planner& planner, int64_t layers, int64_t quarters) {
  const int64_t lo = planner.SmallestBudget();
  const int64_t hi = planner.PeakOf(std::vector<int>(layers, 0));
  return lo + (hi - lo) / 4 * quarters;
}

// Create (the probe simulations) and Solve, as a planner run does.
void BM_PlanLlama70b(benchmark::State& state) {
  const ModelConfig config = Llama70b();
  absl::StatusOr<Planner> setup = Planner::Create(config, PlannerOptions());
  if (!setup.ok()) {
    state.SkipWithError(setup.status().ToString().c_str());
    return;
  }
  const int64_t budget = BudgetAt(*setup, config.layers, state.range(0));
  for (auto _ : state) {
    absl::StatusOr<Planner> planner = Planner::Create(config, PlannerOptions());
    absl::StatusOr<PlanResult> plan = planner->Solve(budget);
    if (!plan.ok()) {
      state.SkipWithError(plan.status().ToString().c_str());
      break;
    }
    benchmark::DoNotOptimize(plan->recompute_flops);
  }
  state.counters["choices"] = static_cast<double>(setup->choices().size());
  state.counters["candidates"] = static_cast<double>(setup->candidates().size());
}
BENCHMARK(BM_PlanLlama70b)->ArgName("quarter")->Arg(1)->Arg(2)->Arg(3)->Unit(benchmark::kMillisecond);

// The same plan in the recipes people train with: 0 under bf16 autocast (the cast
// cache's frees are a dimension of the solver's labels), 1 in bf16 with fp32 master
// weights (the optimizer's fp32 copies added per layer), halfway between the smallest
// peak and none's.
void BM_PlanLlama70bLowPrecision(benchmark::State& state) {
  ModelConfig config = Llama70b();
  PlannerOptions options;
  if (state.range(0) == 0) {
    config.amp = DType::kBFloat16;
  } else {
    config.dtype = DType::kBFloat16;
    options.optimizer.master_weights = true;
  }
  absl::StatusOr<Planner> setup = Planner::Create(config, options);
  if (!setup.ok()) {
    state.SkipWithError(setup.status().ToString().c_str());
    return;
  }
  const int64_t budget = BudgetAt(*setup, config.layers, 2);
  for (auto _ : state) {
    absl::StatusOr<Planner> planner = Planner::Create(config, options);
    absl::StatusOr<PlanResult> plan = planner->Solve(budget);
    if (!plan.ok()) {
      state.SkipWithError(plan.status().ToString().c_str());
      break;
    }
    benchmark::DoNotOptimize(plan->recompute_flops);
  }
}
BENCHMARK(BM_PlanLlama70bLowPrecision)
    ->ArgName("master_weights")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond);

// Create alone: the probe simulations, FLOP counts and tables.
void BM_CreateLlama70b(benchmark::State& state) {
  const ModelConfig config = Llama70b();
  for (auto _ : state) {
    absl::StatusOr<Planner> planner = Planner::Create(config, PlannerOptions());
    benchmark::DoNotOptimize(planner->candidates().size());
  }
}
BENCHMARK(BM_CreateLlama70b)->Unit(benchmark::kMillisecond);

// Solve alone, the probes done once.
void BM_SolveLlama70b(benchmark::State& state) {
  const ModelConfig config = Llama70b();
  absl::StatusOr<Planner> planner = Planner::Create(config, PlannerOptions());
  const int64_t budget = BudgetAt(*planner, config.layers, state.range(0));
  for (auto _ : state) {
    absl::StatusOr<PlanResult> plan = planner->Solve(budget);
    benchmark::DoNotOptimize(plan->recompute_flops);
  }
}
BENCHMARK(BM_SolveLlama70b)->ArgName("quarter")->Arg(1)->Arg(2)->Arg(3)->Unit(benchmark::kMillisecond);

// The frontier of 9 budgets (each a Solve, and the smallest budget's bisection).
void BM_FrontierLlama70b(benchmark::State& state) {
  const ModelConfig config = Llama70b();
  absl::StatusOr<Planner> planner = Planner::Create(config, PlannerOptions());
  for (auto _ : state) {
    absl::StatusOr<std::vector<FrontierPoint>> frontier = planner->Frontier(9);
    benchmark::DoNotOptimize(frontier->size());
  }
}
BENCHMARK(BM_FrontierLlama70b)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace memledger

BENCHMARK_MAIN();
