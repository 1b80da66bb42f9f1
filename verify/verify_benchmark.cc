// Is verification cheap enough to run on every change? Compares, on the default config:
//   BM_BareSteps        the four variants' bare forward+backward steps (no hooks, no
//                       estimator, model already built);
//   BM_VerifyInProcess  Verify() with skip_timing: model, estimator, hooks, gradients,
//                       AdamW step;
//   BM_VerifyProcess    a whole `verify --skip_timing` process, start to exit;
//   BM_ProcessStart     `verify --help`: loading LibTorch and its static initialisers,
//                       which every LibTorch process pays (about 0.3 s for 2.15 here).
// The ratios are printed at the end. The target for a whole run is set against the
// reference study itself (<= 0.5 x its wall time): verify/study_wall_time.sh.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "estimator/spec/config.h"
#include "runtime/checkpoint.h"
#include "runtime/model.h"
#include "runtime/threads.h"
#include "verify/verify.h"

namespace memledger {
namespace {

void BM_BareSteps(benchmark::State& state) {
  runtime::ConfigureThreads();  // as Measure() does
  runtime::UseNativeKernels();
  runtime::ModelAndInput built = runtime::BuildModel(ModelConfig{}, /*seed=*/0);
  const std::vector<at::Tensor> parameters = built.model->parameters();
  auto steps = [&] {
    for (const Variant& variant : DefaultVariants()) {
      for (const at::Tensor& p : parameters) p.mutable_grad() = at::Tensor();
      runtime::ForwardWithVariant(*built.model, built.input, AttentionMode::kFlash, variant)
          .loss.backward();
    }
  };
  steps();  // warm-up
  for (auto _ : state) steps();
}
BENCHMARK(BM_BareSteps)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3);

void BM_VerifyInProcess(benchmark::State& state) {
  VerifyOptions options;
  options.run.skip_timing = true;
  for (auto _ : state) {
    absl::StatusOr<VerifyReport> report = Verify(ModelConfig{}, options);
    if (!report.ok() || !report->Passed()) {
      state.SkipWithError("Verify failed");
      break;
    }
  }
}
BENCHMARK(BM_VerifyInProcess)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3);

// RunProcess times whole runs of `command`. `bazel run` starts benchmarks in their
// runfiles tree, where verify/verify lives.
void RunProcess(benchmark::State& state, const char* command) {
  for (auto _ : state) {
    if (std::system(command) != 0) {
      state.SkipWithError(command);
      break;
    }
  }
}

void BM_VerifyProcess(benchmark::State& state) {
  RunProcess(state, "verify/verify --skip_timing > /dev/null");
}
BENCHMARK(BM_VerifyProcess)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3);

void BM_ProcessStart(benchmark::State& state) {
  RunProcess(state, "verify/verify --help > /dev/null 2>&1");
}
BENCHMARK(BM_ProcessStart)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3);

// RatioReporter prints as usual and remembers each benchmark's mean real time.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  RatioReporter() : ConsoleReporter(OO_Tabular) {}  // plain text, also in logs

  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.run_type == Run::RT_Iteration && !run.error_occurred) {
        seconds[run.benchmark_name()] = run.GetAdjustedRealTime();
      }
    }
  }
  std::map<std::string, double> seconds;
};

}  // namespace
}  // namespace memledger

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  memledger::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  const auto& t = reporter.seconds;
  const auto bare = t.find("BM_BareSteps/min_time:3.000/real_time");
  const auto in_process = t.find("BM_VerifyInProcess/min_time:3.000/real_time");
  const auto process = t.find("BM_VerifyProcess/min_time:3.000/real_time");
  if (bare != t.end() && in_process != t.end()) {
    std::printf("Verify() in process / bare steps = %.3f\n", in_process->second / bare->second);
  }
  const auto start = t.find("BM_ProcessStart/min_time:3.000/real_time");
  if (bare != t.end() && process != t.end()) {
    std::printf("verify --skip_timing process / bare steps = %.3f\n",
                process->second / bare->second);
  }
  if (bare != t.end() && process != t.end() && start != t.end()) {
    std::printf("(verify process - process start) / bare steps = %.3f; process start %.0f ms\n",
                (process->second - start->second) / bare->second, start->second * 1e3);
  }
  benchmark::Shutdown();
  return 0;
}
