#include "runtime/runtime.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <c10/util/Exception.h>
#include <torch/version.h>

#include <algorithm>
#include <exception>
#include <memory>
#include <functional>
#include <set>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/graph/family.h"
#include "runtime/family.h"
#include "runtime/checkpoint.h"
#include "runtime/counting_allocator.h"
#include "runtime/families/llama/sparse_moe.h"
#include "runtime/model.h"
#include "runtime/optimizer_runner.h"
#include "runtime/saved_tensor_recorder.h"
#include "runtime/threads.h"

namespace memledger::runtime {
namespace {

Variant NoneVariant() { return Variant(); }

void ZeroGrads(const std::vector<at::Tensor>& parameters) {
  for (const at::Tensor& p : parameters) p.mutable_grad() = at::Tensor();
}

// VariantRun is one measured forward+backward: its bytes and a copy of the gradients.
struct VariantRun {
  int64_t hooked_bytes = 0;
  int64_t cache_bytes = 0;
  int64_t held_after_forward_bytes = 0;
  std::vector<at::Tensor> grads;
};

constexpr uint64_t kVariantSeed = 0;

VariantRun RunVariant(const ModelImpl& model, const at::Tensor& input, AttentionMode mode,
                      const Variant& variant,
                      const std::unordered_set<const void*>& parameter_storages) {
  const std::vector<at::Tensor> parameters = model.TrainableParameters();
  ZeroGrads(parameters);
  SavedTensorRecorder recorder(parameter_storages);
  ForwardResult forward;
  VariantRun run;
  {
    // The allocator's witness: what the forward allocated and is still allocated when
    // it returns is what the graph (and the selective caches) hold, plus the loss the
    // caller holds. Independent of the hooks, which only see what nodes pack.
    ScopedCountingAllocator counting;
    {
      // Only the forward is recorded; the scope is gone before backward runs.
      ScopedSavedTensorRecording recording(&recorder);
      // Every variant draws the same dropout masks from the CPU generator (transformers'
      // GPT-2 dropouts; a checkpoint's recompute restores the state it began with), so
      // its gradients compare with none's.
      at::manual_seed(kVariantSeed);
      forward = ForwardWithVariant(model, input, mode, variant);
    }
    run.held_after_forward_bytes =
        counting.live_bytes() - static_cast<int64_t>(forward.loss.storage().nbytes());
  }
  run.hooked_bytes = recorder.bytes();
  run.cache_bytes = forward.cache_bytes;
  forward.loss.backward();
  forward = ForwardResult();  // frees this variant's graph before the next one
  run.grads.reserve(parameters.size());
  for (const at::Tensor& p : parameters) run.grads.push_back(p.grad().clone());
  ZeroGrads(parameters);
  return run;
}

double MaxAbsDiff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  TORCH_CHECK(a.size() == b.size(), "gradient lists differ in length: ", a.size(), " vs ",
              b.size());
  double max_diff = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    max_diff = std::max(max_diff, (a[i] - b[i]).abs().max().item<double>());
  }
  return max_diff;
}

// TimingReporter keeps each repetition's wall time per iteration, in seconds.
class TimingReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context& /*context*/) override { return true; }
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      if (run.run_type != Run::RT_Iteration || run.error_occurred) continue;
      if (run.iterations > 0) {
        seconds.push_back(run.real_accumulated_time / static_cast<double>(run.iterations));
      }
    }
  }
  std::vector<double> seconds;
};

double Median(std::vector<double> values) {
  TORCH_CHECK(!values.empty(), "no timing repetitions were reported");
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// TimeVariant is the median forward+backward time over `repetitions` Google Benchmark
// repetitions of one iteration each, after one untimed warm-up.
double TimeVariant(const ModelImpl& model, const at::Tensor& input, AttentionMode mode,
                   const Variant& variant, int repetitions) {
  const std::vector<at::Tensor> parameters = model.TrainableParameters();
  auto step = [&]() {
    ZeroGrads(parameters);
    ForwardWithVariant(model, input, mode, variant).loss.backward();
  };
  step();  // warm-up: allocator, thread pool, BLAS
  const std::string name = absl::StrCat("memledger_runtime_", variant.Name());
  benchmark::RegisterBenchmark(name.c_str(),
                               [&](benchmark::State& state) {
                                 for (auto _ : state) step();
                               })
      ->Iterations(1)
      ->Repetitions(repetitions)
      ->UseRealTime();
  TimingReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter, absl::StrCat("^", name, "(/|$)"));
  benchmark::ClearRegisteredBenchmarks();
  ZeroGrads(parameters);
  return Median(reporter.seconds);
}

// MeasureStep runs one whole training step of `variant` under a timeline-recording
// counting allocator. zero_grad(set_to_none) only frees, so it runs just before the
// count starts (frees of storages counted by an earlier scope would otherwise show as
// negative bytes); the loss lives until the step ends, as in a training loop.
StepMemory MeasureStep(const ModelImpl& model, const at::Tensor& input, AttentionMode mode,
                       const Variant& variant, OptimizerRunner& optimizer,
                       int64_t resident_bytes) {
  ZeroGrads(model.parameters());
  StepMemory step;
  step.resident_bytes = resident_bytes;
  ForwardResult forward;
  // One intra-op thread: parallel kernels allocate per-chunk workspaces on pool threads,
  // whose overlap in time would make the peak race by a few bytes.
  const int threads = at::get_num_threads();
  at::set_num_threads(kStepThreads);
  {
    ScopedCountingAllocator counting(ScopedCountingAllocator::Record::kTimeline);
    counting.MarkPhase("forward");
    forward = ForwardWithVariant(model, input, mode, variant);
    counting.MarkPhase("backward");
    forward.loss.backward();
    counting.MarkPhase("optimizer");
    optimizer.Step();
    step.peak = counting.peak();
    step.events = counting.events();
    step.phases = counting.phases();
    step.op_names = counting.op_names();
  }
  at::set_num_threads(threads);
  step.peak_bytes = resident_bytes + step.peak.bytes;
  step.routing = MeasuredRouting(model);
  return step;
}

absl::Status ValidateRequest(const ModelConfig& config, AttentionMode attention,
                             const std::vector<Variant>& variants,
                             const RunOptions& options) {
  if (absl::Status status = ValidateRun(config, attention, variants, options.optimizer).status();
      !status.ok()) {
    return status;
  }
  if (absl::Status s = RuntimeFamilyModelled(config); !s.ok()) return s;
  if (!options.skip_timing && options.timing_repetitions < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "timing_repetitions must be >= 1, got ", options.timing_repetitions));
  }
  return absl::OkStatus();
}

absl::StatusOr<Measurement> MeasureOrThrow(const ModelConfig& config,
                                           AttentionMode attention,
                                           const std::vector<Variant>& variants,
                                           const RunOptions& options) {
  ConfigureThreads();
  UseNativeKernels();

  ModelAndInput built = BuildModel(config, options.seed);
  const ModelImpl& model = *built.model;
  const std::vector<at::Tensor> parameters = model.parameters();

  Measurement m;
  m.config = config;
  m.attention = attention;
  std::unordered_set<const void*> parameter_storages;
  for (const at::Tensor& p : parameters) {
    m.n_params += p.numel();
    m.param_bytes += TensorBytes(p);
    parameter_storages.insert(StorageKey(p));
  }
  for (const at::Tensor& b : built.model->buffers()) m.buffer_bytes += TensorBytes(b);
  if (const auto expected = FamilyOf(config.family).expected_parameters; expected != nullptr) {
    if (const std::optional<int64_t> count = expected(config); m.n_params != count) {
      return absl::InternalError(absl::StrCat("model has ", m.n_params,
                                              " parameters, expected ", count.value_or(-1)));
    }
  }

  const bool none_requested =
      std::any_of(variants.begin(), variants.end(),
                  [](const Variant& v) { return v.kind == VariantKind::kNone; });
  if (options.progress) {
    options.progress(none_requested ? "none" : "none (gradient reference)");
  }
  const VariantRun reference =
      RunVariant(model, built.input, attention, NoneVariant(), parameter_storages);
  m.reference_saved_bytes = reference.hooked_bytes + reference.cache_bytes;
  m.torch_version = TorchVersion();
  m.routing = MeasuredRouting(*built.model);

  for (const Variant& variant : variants) {
    VariantMeasurement vm;
    vm.variant = variant;
    if (variant.kind == VariantKind::kNone) {
      vm.hooked_bytes = reference.hooked_bytes;
      vm.cache_bytes = reference.cache_bytes;
      vm.held_after_forward_bytes = reference.held_after_forward_bytes;
    } else {
      if (options.progress) options.progress(variant.Name());
      const VariantRun run =
          RunVariant(model, built.input, attention, variant, parameter_storages);
      vm.hooked_bytes = run.hooked_bytes;
      vm.cache_bytes = run.cache_bytes;
      vm.held_after_forward_bytes = run.held_after_forward_bytes;
      vm.max_grad_diff = MaxAbsDiff(run.grads, reference.grads);
    }
    vm.saved_bytes = vm.hooked_bytes + vm.cache_bytes;
    if (!options.skip_timing) {
      vm.time_s = TimeVariant(model, built.input, attention, variant,
                              options.timing_repetitions);
    }
    m.max_grad_diff = std::max(m.max_grad_diff, vm.max_grad_diff);
    m.variants.push_back(std::move(vm));
  }

  // Gradient and optimizer-state bytes from one real optimizer step on the reference
  // gradients. It comes last (the study steps first) so that no extra forward+backward
  // is needed and every variant runs on the same parameters as the reference. The frozen
  // parameters have neither.
  const std::vector<at::Tensor> trainable = model.TrainableParameters();
  for (size_t i = 0; i < trainable.size(); ++i) {
    trainable[i].mutable_grad() = reference.grads[i];
    m.grad_bytes += TensorBytes(trainable[i].grad());
  }
  m.optimizer = options.optimizer;
  OptimizerRunner optimizer(options.optimizer, trainable);
  optimizer.Step();
  const OptimizerStateBytes state = optimizer.StateBytes();
  m.optimizer_state_bytes = state.total;
  m.adamw_state_bytes = options.optimizer.kind == OptimizerKind::kAdamW ? state.moments : 0;

  // Each variant's whole step, now that the optimizer state exists (the parameters move
  // with every step; their gradients were compared above).
  if (options.measure_steps) {
    const int64_t resident_bytes =
        m.param_bytes + m.buffer_bytes + m.optimizer_state_bytes + TensorBytes(built.input);
    for (VariantMeasurement& vm : m.variants) {
      if (options.progress) options.progress(absl::StrCat(vm.variant.Name(), " (step)"));
      vm.step = MeasureStep(model, built.input, attention, vm.variant, optimizer,
                            resident_bytes);
    }
  }
  ZeroGrads(parameters);
  return m;
}

}  // namespace

std::string TorchVersion() { return TORCH_VERSION; }

absl::StatusOr<Measurement> Measure(const ModelConfig& config, AttentionMode attention,
                                    const std::vector<Variant>& variants,
                                    const RunOptions& options) {
  if (absl::Status status = ValidateRequest(config, attention, variants, options);
      !status.ok()) {
    return status;
  }
  // One process, PyTorch's ops: tensor-parallel ranks and Megatron's ops (dropout, fused
  // softmax) are predicted, not measured yet.
  for (const Variant& variant : variants) {
    if (variant.kind == VariantKind::kCoreAttention) {
      return absl::UnimplementedError(
          "the runtime has no core_attention recompute yet");
    }
  }
  if (config.lora.enabled()) {
    return absl::UnimplementedError(
        "the runtime runs no LoRA adapters yet: --lora_rank is checked against peft "
        "(tests/real_stack_test.py), not measured by verify");
  }
  if (config.shard.tp > 1 || config.shard.sp) {
    return absl::UnimplementedError(
        "one process runs no tensor parallelism: --tp runs on ranks (runtime/distributed.h, "
        "verify --tp)");
  }
  try {
    return MeasureOrThrow(config, attention, variants, options);
  } catch (const c10::NotImplementedError& e) {
    // An op without a CPU kernel in this dtype: the config cannot be measured here.
    return absl::UnimplementedError(absl::StrCat("LibTorch ", TorchVersion(),
                                                 " cannot run this config on the CPU: ",
                                                 e.what_without_backtrace()));
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("LibTorch: ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("runtime: ", e.what()));
  }
}

}  // namespace memledger::runtime
