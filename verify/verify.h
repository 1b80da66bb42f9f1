// Verify: runs the estimator and the LibTorch runtime on one config and compares them
// bucket by bucket and variant by variant, with Korthikanti's formula alongside and the
// gradients of every variant checked against `none`.
//
// Example:
//   VerifyOptions options;
//   options.run.skip_timing = true;
//   absl::StatusOr<VerifyReport> report = Verify(ModelConfig{}, options);
//   if (report.ok() && report->Passed()) ...  // every ratio exactly 1, grads agree
#ifndef VERIFY_VERIFY_H_
#define VERIFY_VERIFY_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "estimator/spec/config.h"
#include "estimator/predict/predict.h"
#include "estimator/graph/rules.h"
#include "runtime/runtime.h"

namespace memledger {

struct VerifyOptions {
  AttentionMode attention = AttentionMode::kFlash;
  std::vector<Variant> variants = DefaultVariants();
  OptimizerSpec optimizer;
  runtime::RunOptions run;  // its optimizer is replaced by the one above
  // grad_tolerance: the largest acceptable max_grad_diff (fp32).
  double grad_tolerance = 1e-5;
  // max_memory_bytes: refuse configs whose predicted footprint exceeds this; <= 0 means
  // half of this machine's available memory.
  int64_t max_memory_bytes = 0;
  // timeline: keep the predicted step's every allocation (for --timeline_svg).
  bool timeline = false;
  // rules: the estimator's op rules; null means the pinned release's. Tests pass a
  // deliberately wrong table to watch verify fail.
  const RuleTable* rules = nullptr;
};

// BucketCheck is one bucket: predicted by the estimator, measured by the runtime.
struct BucketCheck {
  std::string name;  // "param_bytes", "saved_bytes.every_2", ...
  int64_t predicted = 0;
  int64_t measured = 0;
  double ratio = 0;  // measured / predicted (1 when both are 0)
  bool exact() const { return predicted == measured; }
};
// Check makes a BucketCheck (ratio 1 when both are 0); MismatchLine is the failure line
// of one that is not exact.
BucketCheck CheckBucket(std::string name, int64_t predicted, int64_t measured);
std::string MismatchLine(const BucketCheck& bucket);
// Verdict is a report table's last lines: "OK: " and `ok`, or "FAILED:" and the failures.
std::string Verdict(const std::string& ok, const std::vector<std::string>& failures);

struct VerifyReport {
  Prediction prediction;
  runtime::Measurement measurement;
  std::vector<BucketCheck> buckets;
  double grad_tolerance = 0;
  // measured saved_bytes of `none` (Measurement::reference_saved_bytes, measured even
  // when `none` was not requested) over Korthikanti's prediction.
  double measured_over_korthikanti = 0;
  int64_t predicted_footprint_bytes = 0;
  // peak_unavailable: why the step's peak was not predicted (then not compared), or "".
  std::string peak_unavailable;
  // predicted_overhead: per measured variant (measurement.variants' order), the FLOP
  // model's (step + recompute) / step (estimator/predict/flops.h), to set beside the measured
  // time_s ratio to none; empty where the FLOPs could not be counted.
  std::vector<std::optional<double>> predicted_overhead;
  // failures: one line per bucket that is not exact, variant whose gradients differ, or
  // a runtime built against another torch release than the estimator's rules describe.
  std::vector<std::string> failures;
  // witness: with --witness=transformers, what the real stack measured (verify/witness.py),
  // by bucket name; witness_failures: one line per bucket where it is not the prediction.
  std::map<std::string, int64_t> witness;
  std::vector<std::string> witness_failures;

  bool Passed() const { return failures.empty() && witness_failures.empty(); }
};

// AddWitness puts the real stack's measurements beside `report`'s buckets and a line in
// witness_failures for each that is not the prediction.
void AddWitness(const std::map<std::string, int64_t>& witness, VerifyReport* report);

// PredictedFootprintBytes bounds what a verification run needs: the largest predicted
// step peak plus the reference gradients and a variant's copy of them; where the step's
// peak is not modelled, parameters, gradients and the reference gradients, AdamW state,
// the largest variant's saved bytes, the attention's transient (B, H, T, T) scores and
// probabilities, and the logits.
int64_t PredictedFootprintBytes(const Prediction& prediction);

// DefaultMaxMemoryBytes is half of MemAvailable (/proc/meminfo); 4 GiB if unreadable.
int64_t DefaultMaxMemoryBytes();

// CheckFootprint: ResourceExhausted naming both sizes when `footprint_bytes` exceeds
// max_memory_bytes (<= 0: DefaultMaxMemoryBytes()).
absl::Status CheckFootprint(int64_t footprint_bytes, int64_t max_memory_bytes);

// Verify returns InvalidArgument for bad input, ResourceExhausted (naming the predicted
// size) if the run would not fit in max_memory_bytes, and the runtime's errors.
absl::StatusOr<VerifyReport> Verify(const ModelConfig& config, const VerifyOptions& options);

}  // namespace memledger

#endif  // VERIFY_VERIFY_H_
