// VerifyRanks: the distributed runtime (runtime/distributed.h) against PredictRanks,
// rank by rank: each rank's parameters, gradients and optimizer state after the step,
// and per variant the saved bytes its schedule held at once and how many micro-batches
// that was; plus each rank's gradients and updated parameters against one process
// training on the whole batch.
//
// Example (in verify's main, which also runs the rank processes):
//   absl::StatusOr<RanksVerifyReport> r =
//       VerifyRanks(config, parallel, request, 1e-5, 0, {argv, argv + argc});
//   std::cout << RanksVerifyTable(*r);
#ifndef VERIFY_VERIFY_RANKS_H_
#define VERIFY_VERIFY_RANKS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "estimator/spec/config.h"
#include "estimator/request/parallel_spec.h"
#include "estimator/predict/ranks.h"
#include "rapidjson/document.h"
#include "runtime/distributed.h"
#include "verify/verify.h"

namespace memledger {

// RankCheck is one rank: its buckets, predicted (its stage's RankKind) and measured.
struct RankCheck {
  runtime::RankMeasurement measured;
  std::vector<BucketCheck> buckets;
};

struct RanksVerifyReport {
  ModelConfig config;
  ParallelSpec parallel;
  runtime::DistributedRequest request;
  RanksPrediction prediction;
  std::vector<RankCheck> ranks;  // by rank
  double grad_tolerance = 0;
  // failures: one line per bucket that is not exact, and per rank whose gradients or
  // updated parameters differ from the single process's by more than grad_tolerance.
  std::vector<std::string> failures;
  // With --witness=transformers, the real stack on as many Gloo ranks (torch's DDP or
  // FSDP2: verify/witness_ranks.py): each bucket's prediction (the predicted rank's, as
  // predict gives it) and what each rank measured; witness_failures: a line per rank and
  // bucket that is not the prediction (rank 0 exactly; under FSDP2, whose prediction is
  // rank 0's, the fullest, the others at most it).
  struct WitnessRow {
    std::string bucket;
    int64_t predicted = 0;
    std::vector<int64_t> ranks;
  };
  std::vector<WitnessRow> witness;
  std::vector<std::string> witness_failures;
  // measured: the LibTorch ranks ran (false under FSDP2, which they do not run: the
  // prediction is checked against the real stack only).
  bool measured = true;
  bool Passed() const { return failures.empty() && witness_failures.empty(); }
};

// PredictedRanksReport is a report of the prediction alone, for a layout the LibTorch
// ranks do not run (FSDP2's MixedPrecisionPolicy), which AddRanksWitness checks against
// the real stack.
absl::StatusOr<RanksVerifyReport> PredictedRanksReport(const ModelConfig& config,
                                                       const ParallelSpec& parallel,
                                                       const runtime::DistributedRequest& request);

// AddRanksWitness compares each rank of the real stack (RunRanksWitness, by rank) with
// PredictRanks as predict runs it (its default threads and Python dispatch mode, as
// transformers' checkpointing runs): parameters, gradients, the optimizer's state, DDP's
// buckets and each variant's peak.
absl::Status AddRanksWitness(const std::vector<std::map<std::string, int64_t>>& witness,
                             RanksVerifyReport* report);

// RankGradTolerance is the default largest max_grad_diff of ranks against one process:
// 2 sqrt(n) eps, eps the machine epsilon of the dtype the step computes in (autocast's,
// else the model's) and n the step's longest reduction (the width, the MLP's, the
// attention heads', the vocabulary, or the tokens a weight's gradient sums: batch x seq
// x micro-batches x dp). Why: ranks sum partial results one process adds in one pass
// (tensor-parallel outputs, data-parallel gradients), in another order. A sum of n
// terms rounded with unit roundoff u = eps / 2 is off the exact one by about sqrt(n) u
// times the terms' magnitude (Higham and Mary, "A new approach to probabilistic
// rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019, with lambda = 1), so two
// orders differ by up to 2 sqrt(n) u = sqrt(n) eps; a gradient passes through the
// forward's reductions and the backward's, twice that, on gradients of order 1 (these
// models' init). Measured on this project's rank tests: fp32 diffs up to 4.8e-7 (Gemma
// 3, tp 2 with sp, n = 96: tolerance 2.3e-6); bf16 autocast up to 0.0117 under
// ATEN_CPU_CAPABILITY=avx2 (tp 2, n = 96: 0.153).
double RankGradTolerance(const ModelConfig& config, const ParallelSpec& parallel);

// VerifyRanks: the estimator's errors (InvalidArgument), ResourceExhausted when the
// ranks and the reference would not fit in max_memory_bytes (CheckFootprint; every rank
// process builds the whole model and batch, as the reference does), and
// MeasureDistributed's.
absl::StatusOr<RanksVerifyReport> VerifyRanks(const ModelConfig& config,
                                              const ParallelSpec& parallel,
                                              const runtime::DistributedRequest& request,
                                              double grad_tolerance, int64_t max_memory_bytes,
                                              const std::vector<std::string>& command);

// RanksVerifyJson: the study's head (config, attention, torch, dtype, optimizer and the
// parameter buckets of the most loaded rank, most_loaded_rank and its counted
// peak_bytes), parallel (the layout), backend, and per rank its position, buckets
// (predicted, measured, ratio), max_grad_diff per variant, max_param_diff and
// peak_where; grad_tolerance, passed, failures.
rapidjson::Document RanksVerifyJson(const RanksVerifyReport& report);

// RanksVerifyTable: one line per rank and bucket, then the verdict.
std::string RanksVerifyTable(const RanksVerifyReport& report);

}  // namespace memledger

#endif  // VERIFY_VERIFY_RANKS_H_
