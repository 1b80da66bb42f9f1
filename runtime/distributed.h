// The distributed runtime: one training step on real c10d ranks. Each rank is its own
// process on loopback, in Gloo process groups (one FileStore in a private directory).
// A rank runs its tensor-parallel shard (runtime/model.h, ShardOf) of its pipeline
// stage of the seeded model on its data-parallel slice of the batch:
//   - tensor parallelism through runtime/tensor_parallel.h: f and g around column- and
//     row-parallel linears, the vocabulary-parallel embedding and cross-entropy, and
//     with sequence parallelism the scatter, gather-linears and reduce-scatters;
//   - micro-batches in Megatron's order (1F1B, or interleaved over virtual stages), with
//     send/recv between the ranks of neighbouring model chunks;
//   - gradients reduced over its data-parallel group (an all-reduce, or ZeRO-2/3's
//     reduce-scatter into a shard), the optimizer stepped on its ZeRO shard and the
//     result all-gathered; torch's DDP (runtime/ddp_reducers.h) or FSDP2
//     (runtime/fsdp2_units.h) in the counted steps;
// and measures its own buckets and, where RankStepModelled (estimator/request/parallel_spec.h),
// each variant's whole step under the counting allocator. The parent gathers every rank's gradients and compares
// them with one process training on the whole batch, and every rank's updated
// parameters with its shard stepped whole on the gathered gradients.
//
// A rank process is the caller's own executable run again with one more flag (see
// kRankWorkerFlag): its main() must hand that flag to RunRankWorker.
//
// Example (in a main that parses the usual flags):
//   if (!worker.empty()) return RunRankWorker(config, parallel, request, worker);
//   absl::StatusOr<DistributedMeasurement> m =
//       MeasureDistributed(config, parallel, request, {argv, argv + argc});
#ifndef RUNTIME_DISTRIBUTED_H_
#define RUNTIME_DISTRIBUTED_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "estimator/spec/config.h"
#include "estimator/request/parallel_spec.h"

namespace memledger::runtime {

// RankPosition is where a rank sits in Megatron's layout:
// rank = tp_rank + tp x (dp_rank + dp x stage).
struct RankPosition {
  int64_t rank = 0;
  int64_t tp_rank = 0;
  int64_t dp_rank = 0;
  int64_t stage = 0;  // pipeline rank
};
RankPosition PositionOf(int64_t rank, const ParallelSpec& parallel);
int64_t WorldSize(const ParallelSpec& parallel);  // tp x dp x pp

// kMaxRanks bounds the rank processes one machine starts: each loads LibTorch and builds
// the whole model.
inline constexpr int64_t kMaxRanks = 64;

// DistributedRequest is what every rank runs.
struct DistributedRequest {
  AttentionMode attention = AttentionMode::kFlash;
  // variants: measured in order after `none`, which always runs first as the gradient
  // reference (and is the step's gradients).
  std::vector<Variant> variants;
  OptimizerSpec optimizer;
  int64_t seed = 0;
  // timeout_s: a rank that has not finished by then (or a collective that waits that
  // long) fails the run; every rank is then killed.
  int64_t timeout_s = 300;
  // fault: "<rank>:exit" or "<rank>:hang" makes that rank die or hang once its process
  // group exists (tests of the failure paths); empty in real runs.
  std::string fault;
};

// RankVariantMeasurement is one variant's activations on a rank over its schedule.
struct RankVariantMeasurement {
  Variant variant;
  // held_bytes: the most saved bytes the rank held at once: the saved tensors (as the
  // single-process runtime counts them: unique non-parameter storages packed by the
  // forward, plus selective caches) of every micro-batch it had run forward and not
  // yet backward.
  int64_t held_bytes = 0;
  int64_t in_flight = 0;  // micro-batches held at that moment (the first such moment)
  // max_grad_diff: the rank's reduced gradients against the single-process run's.
  double max_grad_diff = 0;
  // The whole step's peak, counted by the allocator, where RankStepModelled: the bytes
  // resident before the step plus the step's largest live bytes, its phase ("forward",
  // "backward" or "optimizer", which includes the gradients' reduction and the
  // all-gather) and the op running then. peak_bytes is -1 where not measured.
  int64_t peak_bytes = -1;
  // unit_grad_diff: with ZeRO-3 or FSDP2, the counted step's shard gradient (reduced
  // unit by unit as its backward passes them) against the same step's without gathering
  // (all parameters present, one reduction at the end), on the same parameters; -1
  // where not run.
  double unit_grad_diff = -1;
  std::string peak_phase;
  std::string peak_op;
};

// RankMeasurement is what one rank holds.
struct RankMeasurement {
  RankPosition position;
  int64_t n_params = 0;     // its stage's parameters (those its forward uses)
  int64_t param_bytes = 0;  // after the step: its stage's parameters, or a ZeRO-3 shard
  int64_t grad_bytes = 0;   // after the reduction: all of the stage's, or a ZeRO-2/3 shard
  int64_t optimizer_state_bytes = 0;             // after the step, with master copies
  int64_t adamw_state_bytes = 0;                 // AdamW's moments; 0 for other optimizers
  std::vector<RankVariantMeasurement> variants;  // `none` first, then as requested
  // max_param_diff: its parameters after the step against its stage's parameters
  // stepped whole (unsharded) on the gradients its data-parallel ranks reduced.
  double max_param_diff = 0;
};

struct DistributedMeasurement {
  ParallelSpec parallel;
  std::vector<RankMeasurement> ranks;  // by rank
};

// RankWorkerFlag is the flag a rank process is started with: "--rank_worker=DIR:RANK".
inline constexpr absl::string_view kRankWorkerFlag = "--rank_worker=";

// MeasureDistributed starts WorldSize(parallel) rank processes, each
// `command` (argv of the caller's executable and its flags; the executable is run as
// /proc/self/exe) plus kRankWorkerFlag, waits for all of them (killing all on the first
// failure or at the timeout) and compares their gradients with a single-process run of
// the whole batch
// (dp x micro_batches x config.batch sequences), their updated parameters with the
// unsharded step (RankMeasurement::max_param_diff).
// Errors: InvalidArgument for a bad request; Unimplemented for what the distributed
// runtime does not run (core_attention);
// DeadlineExceeded naming the rank that did not finish; Internal naming the rank that
// failed, with the last line it wrote.
absl::StatusOr<DistributedMeasurement> MeasureDistributed(const ModelConfig& config,
                                                          const ParallelSpec& parallel,
                                                          const DistributedRequest& request,
                                                          const std::vector<std::string>& command);

// RunRankWorker runs the rank named by `worker` ("DIR:RANK", the flag's value) and
// writes its measurement into DIR. Returns the process's exit status: 0, or 1 after
// printing the error to stderr.
int RunRankWorker(const ModelConfig& config, const ParallelSpec& parallel,
                  const DistributedRequest& request, absl::string_view worker);

}  // namespace memledger::runtime

#endif  // RUNTIME_DISTRIBUTED_H_
