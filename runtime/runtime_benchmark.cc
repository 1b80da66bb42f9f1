// runtime_benchmark: what measuring costs and what checkpointing costs, on the study's
// default config (6 x 128, 4 heads, 16 x 64).
//
//   ./bazelw run -c opt //runtime:runtime_benchmark
//
// Prints, before the Google Benchmark table:
//   - Measure()'s saved bytes and median times per variant, flash and math;
//   - peak RSS growth of one `none` forward+backward vs a whole Measure() (one graph
//     alive at a time, so the two should be close);
// and after it the ratios: hook overhead (measured / plain forward+backward of `none`,
// target <= 1.05) and recompute cost (full / none, selective / none) beside the
// planner's FLOP model of it, and this machine's throughput (the step's FLOPs over
// none's median time), which //planner takes as --flops_per_second.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "estimator/spec/config.h"
#include "estimator/predict/flops.h"
#include "runtime/checkpoint.h"
#include "runtime/model.h"
#include "runtime/runtime.h"
#include "runtime/saved_tensor_recorder.h"
#include "runtime/threads.h"

namespace memledger::runtime {
namespace {

// ProcStatusKib reads a "<field>: <n> kB" line of /proc/self/status.
long ProcStatusKib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stol(line.substr(field.size() + 1));
  }
  return -1;
}

// ResetPeakRss makes VmHWM restart from the current RSS (Linux >= 4.0).
bool ResetPeakRss() {
  std::ofstream clear_refs("/proc/self/clear_refs");
  clear_refs << "5";
  return static_cast<bool>(clear_refs);
}

void StepOnce(const ModelImpl& model, const at::Tensor& input, const Variant& variant,
              bool record) {
  for (const at::Tensor& p : model.parameters()) p.mutable_grad() = at::Tensor();
  ForwardResult forward;
  if (record) {
    SavedTensorRecorder recorder;
    ScopedSavedTensorRecording recording(&recorder);
    forward = ForwardWithVariant(model, input, AttentionMode::kFlash, variant);
  } else {
    forward = ForwardWithVariant(model, input, AttentionMode::kFlash, variant);
  }
  forward.loss.backward();
}

void PrintMeasurement(const Measurement& m) {
  std::printf("%s attention: n_params %ld, param %ld B, grad %ld B, adamw %ld B\n",
              std::string(AttentionModeName(m.attention)).c_str(), m.n_params,
              m.param_bytes, m.grad_bytes, m.adamw_state_bytes);
  for (const VariantMeasurement& vm : m.variants) {
    std::printf("  %-10s saved %10ld B (hooked %10ld + cache %10ld)  max_grad_diff %.3g",
                vm.variant.Name().c_str(), vm.saved_bytes, vm.hooked_bytes, vm.cache_bytes,
                vm.max_grad_diff);
    if (vm.time_s) std::printf("  time %.4f s", *vm.time_s);
    std::printf("\n");
  }
}

void ReportMemory() {
  const ModelConfig config;
  {
    // Warm-up outside the measured phases: thread pools, BLAS buffers, allocator.
    ModelAndInput built = BuildModel(config, /*seed=*/0);
    StepOnce(*built.model, built.input, Variant(), /*record=*/false);
  }
  const bool can_reset = ResetPeakRss();
  const long base_kib = ProcStatusKib("VmRSS");
  {
    ModelAndInput built = BuildModel(config, /*seed=*/0);
    StepOnce(*built.model, built.input, Variant(), /*record=*/true);
  }
  const long single_kib = ProcStatusKib("VmHWM");
  ResetPeakRss();
  RunOptions options;
  options.skip_timing = true;
  absl::StatusOr<Measurement> m =
      Measure(config, AttentionMode::kFlash, DefaultVariants(), options);
  const long whole_kib = ProcStatusKib("VmHWM");
  if (!m.ok()) std::printf("Measure failed: %s\n", m.status().ToString().c_str());
  // Freed memory mostly stays resident (malloc keeps it), so compare absolute peaks:
  // the whole Measure() should not reach far above one variant's peak.
  std::printf(
      "peak RSS (%s): baseline %ld KiB; one none forward+backward peak %ld KiB "
      "(+%ld); whole Measure() peak %ld KiB; whole/single peak %.3f\n",
      can_reset ? "VmHWM reset per phase" : "VmHWM NOT resettable, numbers cumulative",
      base_kib, single_kib, single_kib - base_kib, whole_kib,
      static_cast<double>(whole_kib) / std::max(1L, single_kib));
}

// MedianReporter prints like the console reporter and keeps each benchmark's median.
class MedianReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.run_type == Run::RT_Aggregate && run.aggregate_name == "median") {
        median_s[run.run_name.function_name] =
            run.real_accumulated_time / static_cast<double>(run.iterations);
      }
    }
  }
  std::map<std::string, double> median_s;
};

}  // namespace
}  // namespace memledger::runtime

int main(int argc, char** argv) {
  using namespace memledger;
  using namespace memledger::runtime;
  const int threads = ConfigureThreads();  // as Measure() does
  UseNativeKernels();
  std::printf("intra-op threads: %d\n", threads);

  ReportMemory();
  for (AttentionMode mode : {AttentionMode::kFlash, AttentionMode::kMath}) {
    RunOptions options;
    options.skip_timing = mode == AttentionMode::kMath;
    absl::StatusOr<Measurement> m = Measure(ModelConfig(), mode, DefaultVariants(), options);
    if (!m.ok()) {
      std::fprintf(stderr, "Measure failed: %s\n", m.status().ToString().c_str());
      return 1;
    }
    PrintMeasurement(*m);
  }

  // Measure() with timing clears the registry, so register only now.
  ModelAndInput built = BuildModel(ModelConfig(), /*seed=*/0);
  const ModelImpl& model = *built.model;
  const at::Tensor input = built.input;
  struct Case {
    std::string name;
    Variant variant;
    bool record;
  };
  std::vector<Case> cases;
  // none/measured right after none/plain: adjacent runs see the same machine state.
  for (const Variant& v : DefaultVariants()) {
    cases.push_back({v.Name() + "/plain", v, false});
    if (v.kind == VariantKind::kNone) cases.push_back({"none/measured", v, true});
  }
  for (const Case& c : cases) {
    benchmark::RegisterBenchmark(("ForwardBackward/" + c.name).c_str(),
                                 [&model, &input, c](benchmark::State& state) {
                                   for (auto _ : state) {
                                     StepOnce(model, input, c.variant, c.record);
                                   }
                                 })
        ->Unit(benchmark::kMillisecond)
        ->Repetitions(9)
        ->ReportAggregatesOnly(true)
        ->UseRealTime();
  }
  benchmark::Initialize(&argc, argv);
  MedianReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();

  auto median = [&](const std::string& name) {
    auto it = reporter.median_s.find("ForwardBackward/" + name);
    return it == reporter.median_s.end() ? 0.0 : it->second;
  };
  const double none = median("none/plain");
  if (none > 0) {
    std::printf("hook overhead, measured/plain (none): %.3f (target <= 1.05)\n",
                median("none/measured") / none);
    // Measured forward+backward time over none's, beside the planner's predicted
    // (step + recompute FLOPs) / step FLOPs.
    const ModelConfig config;
    absl::StatusOr<StepFlops> flops = CountStepFlops(config, AttentionMode::kFlash);
    for (const Variant& v : DefaultVariants()) {
      if (v.kind == VariantKind::kNone) continue;
      absl::StatusOr<VariantRecompute> r = RecomputeOf(config, AttentionMode::kFlash, v);
      if (!r.ok()) continue;
      std::printf("recompute cost, %s/none: measured %.3f, predicted by FLOPs %.3f\n",
                  v.Name().c_str(), median(v.Name() + "/plain") / none, r->overhead);
    }
    if (flops.ok()) {
      std::printf("throughput: %.4g FLOP/s (none's step, %.4g FLOPs, in %.4g s; "
                  "//planner --flops_per_second)\n",
                  static_cast<double>(flops->total) / none, static_cast<double>(flops->total),
                  none);
    }
  }
  return 0;
}
