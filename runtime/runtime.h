// memledger's runtime: trains the real model once per checkpointing variant in LibTorch
// and measures the memory buckets the estimator predicts.
//
// saved_bytes of a variant is the sum of nbytes over every unique storage (by data
// pointer) that autograd packs for backward during the forward (model and loss),
// parameter storages excluded, plus the bytes of the selective must-save cache.
//
// Example:
//   absl::StatusOr<Measurement> m = Measure(ModelConfig(), AttentionMode::kFlash,
//                                           DefaultVariants(), RunOptions());
//   if (m.ok()) std::cout << m->variants[0].saved_bytes;  // none: 51,052,544
#ifndef RUNTIME_RUNTIME_H_
#define RUNTIME_RUNTIME_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "estimator/spec/config.h"
#include "runtime/counting_allocator.h"

namespace memledger::runtime {

// RunOptions controls a measurement.
struct RunOptions {
  // seed seeds LibTorch before the model and the input are drawn.
  int64_t seed = 0;
  // skip_timing leaves every VariantMeasurement::time_s empty (much faster).
  bool skip_timing = false;
  // timing_repetitions is how many timed forward+backward runs a variant gets (after a
  // warm-up); time_s is their median. Must be >= 1 unless skip_timing.
  int timing_repetitions = 5;
  // optimizer: the optimizer whose real step measures its state.
  OptimizerSpec optimizer;
  // measure_steps: run each variant's whole training step once more under the counting
  // allocator (VariantMeasurement::step): one more forward+backward+step per variant.
  bool measure_steps = true;
  // progress, when set, is called with the variant's name before it is measured.
  std::function<void(absl::string_view what)> progress;
};

// kStepThreads: the intra-op threads a measured step runs on (see StepMemory).
inline constexpr int kStepThreads = 1;

// StepMemory is the memory of one whole training step (docs/DESIGN.md, "Peak memory"):
// zero_grad(set_to_none), forward, backward, optimizer.step(), with parameters, optimizer
// state (and master weights) and the model input existing before it starts. Counted by
// a ScopedCountingAllocator with a timeline: the bytes the step allocates on top of
// `resident_bytes`, and where their maximum happens. The step runs on kStepThreads
// intra-op threads: parallel kernels allocate workspaces per chunk on pool threads, and
// their overlap in time would make the peak race by a few bytes.
struct StepMemory {
  // resident_bytes: parameters + optimizer state (with master copies) + the model input.
  int64_t resident_bytes = 0;
  // peak_bytes = resident_bytes + the step's largest live bytes.
  int64_t peak_bytes = 0;
  // peak: where (phase "forward", "backward" or "optimizer"; the op running). Its
  // bytes are the step's own, without resident_bytes.
  PeakPoint peak;
  // The timeline: every allocation and free, and where each phase begins.
  std::vector<AllocationEvent> events;
  std::vector<PhaseMark> phases;
  std::vector<std::string> op_names;
  // routing: with the eager experts, this step's own (its forward's, which a recompute
  // repeats), one row per sparse layer: each step runs on the parameters the steps
  // before it moved, so it may route otherwise than Measurement::routing.
  std::vector<std::vector<int64_t>> routing;
};

// VariantMeasurement is what one checkpointing variant kept and cost.
struct VariantMeasurement {
  Variant variant;
  // saved_bytes = hooked_bytes + cache_bytes.
  int64_t saved_bytes = 0;
  // hooked_bytes: unique non-parameter storages autograd packed during the forward.
  int64_t hooked_bytes = 0;
  // cache_bytes: unique storages in the selective must-save caches (0 otherwise).
  int64_t cache_bytes = 0;
  // held_after_forward_bytes: what a counting CPU allocator still has allocated, of what
  // the forward allocated, when the forward returns, less the loss the caller holds: the
  // graph's saved tensors and the caches, witnessed without the hooks. The model input,
  // allocated before, is not in it even when it is saved.
  int64_t held_after_forward_bytes = 0;
  // max_grad_diff: max |g - g_none| over every element of every parameter gradient.
  double max_grad_diff = 0.0;
  // step: one whole training step of this variant under the counting allocator.
  StepMemory step;
  // time_s: median forward+backward wall time in seconds; empty with skip_timing.
  std::optional<double> time_s;
};

// Measurement is the whole run on one config.
struct Measurement {
  ModelConfig config;
  AttentionMode attention = AttentionMode::kFlash;
  int64_t n_params = 0;
  int64_t param_bytes = 0;
  int64_t grad_bytes = 0;
  int64_t buffer_bytes = 0;  // the model's buffers (RoPE's inverse frequencies)
  OptimizerSpec optimizer;
  // optimizer_state_bytes: after one real step, the bytes of every state tensor the
  // optimizer holds (exp_avg, exp_avg_sq; momentum_buffer) plus the fp32 master copies.
  int64_t optimizer_state_bytes = 0;
  // adamw_state_bytes: exp_avg + exp_avg_sq of AdamW (lr 1e-3); 0 for other optimizers.
  int64_t adamw_state_bytes = 0;
  // variants, in the order requested.
  std::vector<VariantMeasurement> variants;
  // reference_saved_bytes: saved_bytes of `none`, which always runs first as the
  // gradient reference, whether or not `none` was requested; the measured denominator of
  // every saved_ratio_vs_none.
  int64_t reference_saved_bytes = 0;
  // torch_version: the LibTorch release the runtime was built against ("2.15.0").
  std::string torch_version;
  // max_grad_diff: the largest of the variants' max_grad_diff.
  double max_grad_diff = 0.0;
  // routing: with the eager experts, the tokens each expert received in the reference
  // forward, one row per sparse layer (every variant's saved and held bytes are measured
  // on the same parameters and input); predict's --routing rows.
  std::vector<std::vector<int64_t>> routing;
};

// TorchVersion is the release of the LibTorch this runtime is built against (the
// TORCH_VERSION of its headers, which come from the same wheel as its libraries).
std::string TorchVersion();

// Measure builds the seeded model and measures each variant with only its own graph
// alive; the `none` variant always runs first as the gradient reference. Finally one
// real AdamW step on the reference gradients gives the optimizer-state bytes (the study
// steps before measuring; stepping last saves a forward+backward and keeps every
// variant on the reference's parameters).
// Timing uses Google Benchmark's global registry and clears it afterwards, so do not
// call it with timing while benchmarks of your own are registered but not yet run.
// Uses min(4, hardware threads) intra-op threads (ConfigureThreads).
//
// Errors: Unimplemented when LibTorch has no CPU kernel for an op in the config's dtype
// (nothing in the current graphs; every op has bf16 and fp16 CPU kernels in 2.15);
// InvalidArgument for a bad config (ValidateConfig), a policy the attention mode
// lacks (ValidatePolicy), an empty or duplicate variant list or bad timing_repetitions;
// Internal for a LibTorch error or a broken invariant.
absl::StatusOr<Measurement> Measure(const ModelConfig& config, AttentionMode attention,
                                    const std::vector<Variant>& variants,
                                    const RunOptions& options = RunOptions());

}  // namespace memledger::runtime

#endif  // RUNTIME_RUNTIME_H_
