// PredictRanks: the memory of every kind of rank in a distributed run (data parallelism
// with ZeRO, pipeline stages with their schedule, on top of tensor parallelism): per
// rank, its parameters, gradients and optimizer state (ZeRO's shards) and, per
// checkpointing variant, the saved activations of the micro-batches its schedule holds
// at once.
//
// Example:
//   ModelConfig config = *ModelFromPreset("llama-3-70b");
//   ParallelSpec parallel{.dp = 16, .pp = 4, .micro_batches = 8, .zero = 1, .tp = 8};
//   config.shard = ShardOf(parallel);
//   absl::StatusOr<RanksPrediction> r = PredictRanks(config, parallel, PredictOptions());
//   // r->kinds[0]: the most loaded pipeline stage; its ranks (tp x dp) hold the same.
#ifndef ESTIMATOR_PREDICT_RANKS_H_
#define ESTIMATOR_PREDICT_RANKS_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "estimator/spec/config.h"
#include "estimator/step/liveness.h"
#include "estimator/request/parallel_spec.h"
#include "estimator/predict/predict.h"

namespace memledger {

// RankVariant is one variant's activations on a rank.
struct RankVariant {
  // held: the most the rank's schedule holds at once, the saved tensors of every
  // micro-batch chunk it has run forward and not yet backward: saved_bytes and each of
  // its splits (cache, segments, dtypes) summed over them. Its peak is the rank's whole
  // step's where RankStepModelled (and the simulation models the ops), else
  // peak_unavailable says why.
  VariantPrediction held;
  // in_flight: micro-batch chunks held at that moment (1F1B: min(pp - stage,
  // micro_batches); interleaved: by the schedule's order).
  int64_t in_flight = 0;
};

// RankKind is every rank of one pipeline stage: its tp x dp ranks hold the same bytes;
// with expert parallelism, every rank of one stage and one expert-parallel rank.
struct RankKind {
  int64_t stage = 0;               // pipeline rank, 0 = the first
  // ep_rank: with --ep, which experts the ranks hold (ModelConfig's moe.ep_rank); what
  // they receive differs by rank. 0 without.
  int64_t ep_rank = 0;
  // ep_group: with a routing of every data-parallel rank's batch, which group of ep
  // data-parallel ranks (data-parallel rank = ep_group x ep + ep_rank); 0 without.
  int64_t ep_group = 0;
  int64_t ranks = 0;  // how many ranks: tp x dp (/ ep with --ep, / the groups routed apart)
  std::vector<StageRange> chunks;  // the layers it runs (virtual_stages chunks)
  int64_t n_params = 0;            // its stage's parameters, before ZeRO's sharding
  int64_t param_bytes = 0;         // held: a ZeRO-3 shard, or all of them
  int64_t grad_bytes = 0;          // held after the step's reduction: a ZeRO-2 shard, or all
  int64_t optimizer_state_bytes = 0;  // a ZeRO-1 shard, or all
  int64_t adamw_state_bytes = 0;      // AdamW's moments within it; 0 for other optimizers
  // communication_bytes: held for the whole run by the data-parallel strategy: DDP's
  // Reducer buckets, one element per parameter element (TorchDdp); else 0.
  int64_t communication_bytes = 0;
  // host_bytes: of the above, what lives in host memory, not the device's: FSDP2's
  // CPUOffloadPolicy keeps the shards, their gradients and the optimizer's state there.
  int64_t host_bytes = 0;
  // grads_in_communication: the .grads are views of DDP's buckets after the backward
  // (gradient_as_bucket_view): grad_bytes are not held apart.
  bool grads_in_communication = false;
  std::vector<RankVariant> variants;  // as PredictOptions::variants
  int64_t saved_bytes_none = 0;       // `none`'s held bytes, for saved_ratio_vs_none
  // korthikanti_saved_bytes_none: Korthikanti et al.'s per-GPU activations for `none`:
  // their per-layer formula (KorthikantiSavedBytes) times the rank's layers and its
  // micro-batches in flight.
  int64_t korthikanti_saved_bytes_none = 0;
  // Total: on the device, parameters, gradients (held apart), optimizer state,
  // communication buffers and variant v's saved bytes.
  int64_t Total(size_t v) const {
    return param_bytes + (grads_in_communication ? 0 : grad_bytes) + optimizer_state_bytes +
           communication_bytes - host_bytes + variants[v].held.saved_bytes;
  }
  // Load: what ranks are ordered by: the first plan's peak where one is predicted (a
  // plan is what was asked for; predict --plan shows none beside it), else the first
  // variant's; its Total where the peak is not simulated; 0 without variants.
  int64_t Load() const {
    if (variants.empty()) return 0;
    size_t v = 0;
    for (size_t i = 0; i < variants.size(); ++i) {
      if (variants[i].held.variant.kind == VariantKind::kPlan) {
        v = i;
        break;
      }
    }
    return variants[v].held.peak.has_value() ? variants[v].held.peak->bytes : Total(v);
  }
};

struct RanksPrediction {
  ParallelSpec parallel;  // the layout (its ep: the expert-parallel ranks)
  int64_t ep_groups = 1;  // their groups routed apart (ModelConfig::RoutedGroups)
  // kinds: one per pipeline stage, the most loaded first (by Load: a plan's peak, else
  // the first variant's, or its Total where there is none; the earlier stage on ties).
  std::vector<RankKind> kinds;
};

// PredictRanks: InvalidArgument for a bad config, parallel spec or variant (naming the
// flag), OutOfRange on int64 overflow.
absl::StatusOr<RanksPrediction> PredictRanks(const ModelConfig& config,
                                             const ParallelSpec& parallel,
                                             const PredictOptions& options);

// PredictValidRanks: PredictRanks of a config and layout validated at the caller's edge
// (the search's candidate), which checks only the run as the ranks' graphs run it (FSDP2's
// param_dtype). REQUIRES: config without a DynamicCache (use_cache false) and
// ValidateParallel(*config, parallel).ok().
absl::StatusOr<RanksPrediction> PredictValidRanks(const ValidConfig& config,
                                                  const ParallelSpec& parallel,
                                                  const PredictOptions& options);

// RankResident is what `kind`'s ranks hold before the step besides their input: the
// parameters (with ZeRO 1 and 2 the flat buffer they live in, padded to a multiple of
// dp), the optimizer's state (a shard with ZeRO) and the modules' buffers; on CUDA
// also tensor by tensor (ResidentBytes::tensors). OutOfRange when the parameters'
// bytes overflow int64.
absl::StatusOr<ResidentBytes> RankResident(const ModelConfig& config, const ParallelSpec& parallel,
                                           const RankKind& kind, AttentionMode attention,
                                           const OptimizerSpec& optimizer);

// DistributedPrediction is what predict reports for a run with --dp or --pp: the whole
// model's prediction (its config and graphs; no peak, which is no rank's) and every
// kind of rank (see RanksJson in estimator/report/report.h), with its peak where simulated.
struct DistributedPrediction {
  Prediction whole;
  RanksPrediction ranks;
};
absl::StatusOr<DistributedPrediction> PredictDistributed(const ModelConfig& config,
                                                         const ParallelSpec& parallel,
                                                         const PredictOptions& options);
// PredictValidDistributed: PredictDistributed of a request validated at its edge
// (ValidRunFromRequest: the config, the layout and the run), which validates nothing
// again but the run as the ranks' graphs run it. REQUIRES: ValidateParallel(config
// without its cache, parallel).ok() and ValidateRunOf(config, options.attention,
// options.variants, options.optimizer).ok().
absl::StatusOr<DistributedPrediction> PredictValidDistributed(const ValidConfig& config,
                                                              const ParallelSpec& parallel,
                                                              const PredictOptions& options);

}  // namespace memledger

#endif  // ESTIMATOR_PREDICT_RANKS_H_
