#include "verify/verify.h"

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "estimator/spec/checked_math.h"
#include "estimator/graph/rules.h"
#include "estimator/graph/shape.h"
#include "estimator/report/units.h"
#include "estimator/predict/flops.h"

namespace memledger {

BucketCheck CheckBucket(std::string name, int64_t predicted, int64_t measured) {
  BucketCheck check;
  check.name = std::move(name);
  check.predicted = predicted;
  check.measured = measured;
  check.ratio = predicted == 0 ? (measured == 0 ? 1.0 : 0.0)
                               : static_cast<double>(measured) / static_cast<double>(predicted);
  return check;
}

absl::Status CheckFootprint(int64_t footprint_bytes, int64_t max_memory_bytes) {
  const int64_t limit = max_memory_bytes > 0 ? max_memory_bytes : DefaultMaxMemoryBytes();
  if (footprint_bytes <= limit) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "the run is predicted to need ", HumanBytes(footprint_bytes), " (", footprint_bytes,
      " bytes), more than --max_memory_gib allows (", HumanBytes(limit),
      "); lower --batch, --seq, --width or --layers"));
}

std::string Verdict(const std::string& ok, const std::vector<std::string>& failures) {
  if (failures.empty()) return absl::StrCat("\nOK: ", ok, "\n");
  std::string out = "\nFAILED:\n";
  for (const std::string& f : failures) absl::StrAppend(&out, "  ", f, "\n");
  return out;
}

std::string MismatchLine(const BucketCheck& bucket) {
  return absl::StrFormat("%s: measured %d, predicted %d (ratio %.6f)", bucket.name,
                         bucket.measured, bucket.predicted, bucket.ratio);
}

int64_t PredictedFootprintBytes(const Prediction& p) {
  // With the step's predicted peaks: the largest, plus what verification itself holds
  // besides a training step: the reference gradients and one variant's copy of them.
  int64_t largest_peak = -1;
  for (const VariantPrediction& v : p.variants) {
    if (!v.peak.has_value()) {
      largest_peak = -1;
      break;
    }
    largest_peak = std::max(largest_peak, v.peak->bytes);
  }
  if (largest_peak >= 0) {
    CheckedInt64 total = CheckedInt64(largest_peak) + CheckedInt64(p.grad_bytes) * 2;
    return total.overflowed() ? INT64_MAX : total.value();
  }
  int64_t largest_saved = p.saved_bytes_none;
  for (const VariantPrediction& v : p.variants) largest_saved = std::max(largest_saved, v.saved_bytes);
  const ModelConfig& c = p.config;
  const int64_t fp32 = ElementSizeBytes(DType::kFloat32);
  // Transients beside what is saved: math attention's scores and probabilities, and the
  // decoder families' logits next to their log-probabilities.
  CheckedInt64 scores = CheckedInt64(c.batch) * c.heads * c.seq * c.seq * fp32;
  CheckedInt64 logits = CheckedInt64(c.batch) * c.seq * c.vocab * fp32;
  CheckedInt64 total = CheckedInt64(p.param_bytes) + CheckedInt64(p.grad_bytes) * 2 +
                       p.adamw_state_bytes + largest_saved + scores * 2 + logits;
  return total.overflowed() ? INT64_MAX : total.value();
}

int64_t DefaultMaxMemoryBytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024 / 2;
  }
  return int64_t{4} << 30;
}

namespace {

// Routed is `config` with the eager experts' routing given row by row.
ModelConfig Routed(const ModelConfig& config, const std::vector<std::vector<int64_t>>& rows) {
  ModelConfig routed = config;
  routed.moe.routing = RoutingSource::kGiven;
  routed.moe.routing_rows = rows;
  return routed;
}

}  // namespace

absl::StatusOr<VerifyReport> Verify(const ModelConfig& config, const VerifyOptions& options) {
  PredictOptions predict_options;
  predict_options.attention = options.attention;
  predict_options.variants = options.variants;
  predict_options.rules = options.rules;
  // The runtime runs selective checkpoints without a Python dispatch mode.
  predict_options.python_dispatch_mode = false;
  predict_options.optimizer = options.optimizer;
  predict_options.timeline = options.timeline;
  // The measured step's intra-op threads size the CPU kernels' workspaces.
  predict_options.cpu_threads = runtime::kStepThreads;
  absl::StatusOr<Prediction> prediction = Predict(config, predict_options);
  if (!prediction.ok()) return prediction.status();

  VerifyReport report;
  report.grad_tolerance = options.grad_tolerance;
  report.predicted_footprint_bytes = PredictedFootprintBytes(*prediction);
  if (absl::Status s = CheckFootprint(report.predicted_footprint_bytes, options.max_memory_bytes);
      !s.ok()) {
    return s;
  }

  runtime::RunOptions run_options = options.run;
  run_options.optimizer = options.optimizer;
  absl::StatusOr<runtime::Measurement> measurement =
      runtime::Measure(config, options.attention, options.variants, run_options);
  if (!measurement.ok()) return measurement.status();
  if (!measurement->routing.empty()) {
    // The eager experts' sizes are the routing, which the model's data decides: predict
    // what the runtime ran with its own routing (docs/DESIGN.md, sparse MoE). The saved
    // and held bytes come from forwards on the first parameters; each variant's whole
    // step runs on the parameters the steps before it moved, and routes as they say.
    prediction = Predict(Routed(config, measurement->routing), predict_options);
    if (!prediction.ok()) return prediction.status();
    for (VariantPrediction& predicted : prediction->variants) {
      for (const runtime::VariantMeasurement& v : measurement->variants) {
        if (v.variant.Name() != predicted.variant.Name() || v.step.routing.empty() ||
            v.step.routing == measurement->routing) {
          continue;
        }
        PredictOptions step_options = predict_options;
        step_options.variants = {v.variant};
        absl::StatusOr<Prediction> step =
            Predict(Routed(config, v.step.routing), step_options);
        if (!step.ok()) return step.status();
        predicted.peak = step->variants[0].peak;
        predicted.peak_reserved_bytes = step->variants[0].peak_reserved_bytes;
        predicted.peak_unavailable = step->variants[0].peak_unavailable;
        predicted.timeline = step->variants[0].timeline;
      }
    }
  }

  const Prediction& p = *prediction;
  const runtime::Measurement& m = *measurement;
  report.buckets.push_back(CheckBucket("n_params", p.n_params, m.n_params));
  report.buckets.push_back(CheckBucket("param_bytes", p.param_bytes, m.param_bytes));
  report.buckets.push_back(CheckBucket("grad_bytes", p.grad_bytes, m.grad_bytes));
  report.buckets.push_back(CheckBucket("buffer_bytes", p.buffer_bytes, m.buffer_bytes));
  report.buckets.push_back(
      CheckBucket("optimizer_state_bytes", p.optimizer_state_bytes, m.optimizer_state_bytes));
  if (options.optimizer.kind == OptimizerKind::kAdamW) {
    report.buckets.push_back(
        CheckBucket("adamw_state_bytes", p.adamw_state_bytes, m.adamw_state_bytes));
  }
  // Pair variants by name: the runtime reports them in the order requested, but nothing
  // should rest on that.
  for (const VariantPrediction& predicted : p.variants) {
    const std::string name = predicted.variant.Name();
    const runtime::VariantMeasurement* measured = nullptr;
    for (const runtime::VariantMeasurement& v : m.variants) {
      if (v.variant.Name() == name) measured = &v;
    }
    if (measured == nullptr) {
      return absl::InternalError(absl::StrCat("the runtime did not measure variant ", name));
    }
    report.buckets.push_back(
        CheckBucket(absl::StrCat("saved_bytes.", name), predicted.saved_bytes,
                    measured->saved_bytes));
  }
  // The allocator's witness of the same: what stays allocated after the forward, which
  // does not include the model input the caller allocated.
  for (const VariantPrediction& predicted : p.variants) {
    const std::string name = predicted.variant.Name();
    for (const runtime::VariantMeasurement& v : m.variants) {
      if (v.variant.Name() != name) continue;
      report.buckets.push_back(CheckBucket(absl::StrCat("held_after_forward_bytes.", name),
                                     predicted.held_after_forward_bytes,
                                     v.held_after_forward_bytes));
    }
  }
  // The whole step's peak, where the step simulation models the config.
  for (const VariantPrediction& predicted : p.variants) {
    if (!predicted.peak.has_value()) {
      report.peak_unavailable = predicted.peak_unavailable;
      continue;
    }
    const std::string name = predicted.variant.Name();
    for (const runtime::VariantMeasurement& v : m.variants) {
      if (v.variant.Name() != name || v.step.peak_bytes == 0) continue;
      report.buckets.push_back(
          CheckBucket(absl::StrCat("peak_bytes.", name), predicted.peak->bytes, v.step.peak_bytes));
    }
  }
  if (m.torch_version != kTorchRelease) {
    report.failures.push_back(absl::StrCat("the estimator's rules describe torch ",
                                           kTorchRelease, " but the runtime links torch ",
                                           m.torch_version));
  }
  for (const BucketCheck& bucket : report.buckets) {
    if (!bucket.exact()) report.failures.push_back(MismatchLine(bucket));
  }
  for (const runtime::VariantMeasurement& v : m.variants) {
    if (!(v.max_grad_diff <= options.grad_tolerance)) {  // also catches NaN
      report.failures.push_back(absl::StrFormat("max_grad_diff of %s is %g > tolerance %g",
                                                v.variant.Name(), v.max_grad_diff,
                                                options.grad_tolerance));
    }
  }
  // Measured over measured: `none` always runs (the gradient reference), requested or not.
  report.measured_over_korthikanti = static_cast<double>(m.reference_saved_bytes) /
                                     static_cast<double>(p.korthikanti_saved_bytes_none);
  report.prediction = *std::move(prediction);
  report.measurement = *std::move(measurement);
  for (const runtime::VariantMeasurement& v : report.measurement.variants) {
    absl::StatusOr<VariantRecompute> recompute = RecomputeOf(config, options.attention, v.variant);
    report.predicted_overhead.push_back(
        recompute.ok() ? std::optional<double>(recompute->overhead) : std::nullopt);
  }
  return report;
}

void AddWitness(const std::map<std::string, int64_t>& witness, VerifyReport* report) {
  report->witness = witness;
  for (const BucketCheck& bucket : report->buckets) {
    auto measured = witness.find(bucket.name);
    if (measured == witness.end() || measured->second == bucket.predicted) continue;
    report->witness_failures.push_back(absl::StrCat(bucket.name, ": the real stack measured ",
                                                    measured->second, ", predicted ",
                                                    bucket.predicted));
  }
}

}  // namespace memledger
