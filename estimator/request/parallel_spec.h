// ParallelSpec: how a training run is laid out over ranks, every dimension in one place:
// data parallelism (DDP, FSDP2 or ZeRO 1-3), tensor parallelism and its sequence
// parallelism, pipeline parallelism with its schedule, and expert parallelism. Those
// that split the model itself (tp, sp, ep) give a rank's graphs their part of it
// (ModelConfig::shard = ShardOf(spec)); ValidateParallel checks that the two agree.
//
// Example:
//   ParallelSpec spec;
//   spec.dp = 16;
//   spec.pp = 4;
//   spec.zero = 1;
//   config.shard = ShardOf(spec);
//   absl::Status s = ValidateParallel(config, spec);  // "--layers 30 is not divisible..."
#ifndef ESTIMATOR_REQUEST_PARALLEL_SPEC_H_
#define ESTIMATOR_REQUEST_PARALLEL_SPEC_H_

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "estimator/graph/family.h"
#include "estimator/spec/config.h"

namespace memledger {

// PipelineSchedule is the order in which a pipeline rank runs its micro-batches'
// forwards and backwards (Megatron-LM's schedules).
enum class PipelineSchedule : uint8_t {
  k1F1B,         // warm-up forwards, then one forward one backward, then cool-down
  kInterleaved,  // 1F1B over virtual_stages model chunks per rank
};
absl::string_view PipelineScheduleName(PipelineSchedule schedule);  // "1f1b", "interleaved"
absl::StatusOr<PipelineSchedule> ParsePipelineSchedule(absl::string_view name);

// DdpOptions: torch's DistributedDataParallel, which a data-parallel rank without ZeRO
// runs (torch/nn/parallel/distributed.py; its Reducer, torch/csrc/distributed/c10d/
// reducer.cpp), with the constructor's defaults.
struct DdpOptions {
  // bucket_cap_mb: the Reducer's bucket cap in MiB; unset is torch's default, 25 MiB
  // with a first rebuilt bucket of 1 MiB (_BucketCapacityConfig.create, distributed.py:
  // 87-110: the first bucket has its own cap only when bucket_cap_mb is None).
  std::optional<double> bucket_cap_mb;
  // gradient_as_bucket_view: each .grad becomes a view of its bucket in the backward
  // (reducer.cpp, mark_variable_ready_dense: grad = bucket_view).
  bool gradient_as_bucket_view = false;
  friend bool operator==(const DdpOptions& a, const DdpOptions& b) {
    return a.bucket_cap_mb == b.bucket_cap_mb &&
           a.gradient_as_bucket_view == b.gradient_as_bucket_view;
  }
};

// FsdpOptions: torch's FSDP2 over the data-parallel ranks (torch/distributed/fsdp/
// _fully_shard), fully_shard on each decoder layer and the root, as torchtitan applies it;
// kept apart from --zero (DeepSpeed's and Megatron's meaning).
struct FsdpOptions {
  bool enabled = false;
  // reshard_after_forward, fully_shard's bool | int (_fsdp_init.py:152,
  // _get_post_forward_mesh_info): true (the default) frees each unit's unsharded
  // parameters after its forward, false keeps them to its backward, and an int,
  // reshard_after_forward_ranks, a factor of dp, keeps 1/int of them on each rank (a
  // post-forward mesh of that many ranks, gathered from in the backward). As given;
  // PostForwardRanks resolves them.
  bool reshard_after_forward = true;
  int64_t reshard_after_forward_ranks = 0;  // 0: given as a bool
  // PostForwardRanks: the ranks a unit's parameters are spread over between its forward
  // and its backward: dp (true, or the int dp), 1 (false, or the int 1: torch warns and
  // takes False), or the int. RootPostForwardRanks: the root unit's (1 under
  // reshard_after_forward_auto, below).
  int64_t PostForwardRanks(int64_t dp) const {
    if (!reshard_after_forward) return 1;
    return reshard_after_forward_ranks > 0 ? reshard_after_forward_ranks : dp;
  }
  int64_t RootPostForwardRanks(int64_t dp) const {
    return reshard_after_forward_auto ? 1 : PostForwardRanks(dp);
  }
  // MixedPrecisionPolicy(param_dtype, reduce_dtype): the unsharded parameters (and so
  // the compute) in param_dtype, the gradients reduced in reduce_dtype; the sharded
  // parameters, their gradients and the optimizer's state stay the model's (fp32).
  std::optional<DType> param_dtype;
  std::optional<DType> reduce_dtype;
  // reshard_after_forward_auto: fully_shard's default, None: every unit reshards as with
  // True but the root, which keeps its parameters to the backward (FSDPState._lazy_init,
  // _fsdp_state.py:222: "the parameters would be freed and all-gathered immediately").
  bool reshard_after_forward_auto = false;
  // offload: CPUOffloadPolicy(pin_memory=True): the shards, their gradients and the
  // optimizer's state live in pinned host memory, the optimizer steps there, and each
  // all-gather first copies the shards to the device (_fsdp_param.py:362, :1143;
  // foreach_reduce, _fsdp_collectives.py:779).
  bool offload = false;
  friend bool operator==(const FsdpOptions& a, const FsdpOptions& b) {
    return a.enabled == b.enabled && a.reshard_after_forward == b.reshard_after_forward &&
           a.reshard_after_forward_ranks == b.reshard_after_forward_ranks &&
           a.reshard_after_forward_auto == b.reshard_after_forward_auto &&
           a.offload == b.offload &&
           a.param_dtype == b.param_dtype && a.reduce_dtype == b.reduce_dtype;
  }
};

struct ParallelSpec {
  int64_t dp = 1;  // data-parallel ranks
  int64_t pp = 1;  // pipeline stages
  // virtual_stages: model chunks per pipeline rank (interleaving): rank s runs chunks
  // s, s + pp, s + 2 pp, ... of pp x virtual_stages equal chunks.
  int64_t virtual_stages = 1;
  // micro_batches: per step and pipeline, each of ModelConfig::batch sequences.
  int64_t micro_batches = 1;
  // zero: ZeRO's stage over the dp ranks: 1 shards the optimizer's state, 2 the
  // gradients too, 3 the parameters too; each rank holds ceil(n / dp) of a stage's n
  // parameters' elements (one flat buffer, padded to a multiple of dp).
  int64_t zero = 0;
  PipelineSchedule schedule = PipelineSchedule::k1F1B;
  DdpOptions ddp;  // with dp > 1 and no ZeRO (TorchDdp)
  FsdpOptions fsdp;
  // The model itself split over ranks (RankShard says how): tp tensor-parallel ranks
  // (Megatron's), with sequence parallelism (sp), and ep expert-parallel ranks among the
  // data-parallel ones.
  int64_t tp = 1;
  bool sp = false;
  int64_t ep = 1;

  // Distributed: more than tensor parallelism.
  bool Distributed() const { return dp > 1 || pp > 1; }
  // Accumulates: one rank's step runs several micro-batches (pipeline stages, or gradient
  // accumulation on one process), which only the ranks' step simulation models.
  bool Accumulates() const { return Distributed() || micro_batches > 1; }
  friend bool operator==(const ParallelSpec& a, const ParallelSpec& b) {
    return a.dp == b.dp && a.pp == b.pp && a.virtual_stages == b.virtual_stages &&
           a.micro_batches == b.micro_batches && a.zero == b.zero && a.schedule == b.schedule &&
           a.ddp == b.ddp && a.fsdp == b.fsdp && a.tp == b.tp && a.sp == b.sp && a.ep == b.ep;
  }
};

// ShardOf: the part of the model a rank of this layout holds in its graphs (expert-
// parallel rank 0 of group 0's; ValidConfig::ForExpertRank picks another).
inline RankShard ShardOf(const ParallelSpec& spec) {
  RankShard shard;
  shard.tp = spec.tp;
  shard.sp = spec.sp;
  shard.ep = spec.ep;
  return shard;
}

// TorchDdp: the data-parallel ranks run torch's DistributedDataParallel: dp > 1 without
// ZeRO or FSDP2, and without expert parallelism (whose experts reduce over their own
// ranks, as transformers' expert-parallel training does: verify/witness_ranks.py).
inline bool TorchDdp(int64_t dp, int64_t zero, int64_t ep, bool fsdp = false) {
  return dp > 1 && zero == 0 && ep <= 1 && !fsdp;
}
inline bool TorchDdp(const ParallelSpec& spec) {
  return TorchDdp(spec.dp, spec.zero, spec.ep, spec.fsdp.enabled);
}

// DataParallel is how the data-parallel ranks run: the strategy whose program a rank's
// step runs (estimator/step/data_parallel_program.h) and whose shards it holds
// (RankShardsOf).
enum class DataParallel : uint8_t {
  kOneRank,     // dp == 1
  kDdp,         // TorchDdp
  kReplicated,  // dp > 1 beside expert parallelism, without ZeRO
  kZero1,       // --zero=1
  kZero2,       // --zero=2
  kZero3,       // --zero=3
  kFsdp2,       // --fsdp
};
DataParallel DataParallelOf(int64_t dp, int64_t zero, int64_t ep, bool fsdp);
inline DataParallel DataParallelOf(const ParallelSpec& spec) {
  return DataParallelOf(spec.dp, spec.zero, spec.ep, spec.fsdp.enabled);
}

// RankShards: what a data-parallel rank holds of its stage's n parameters, their
// gradients and the optimizer's state: each all n, or its shard (ZeRO's ceil(n / dp) of
// one flat buffer, FSDP2's padded Shard(0) of each parameter); and DDP's buckets.
struct RankShards {
  bool parameters = false;
  bool gradients = false;
  bool optimizer_state = false;
  // flat: ZeRO's one flat buffer of the whole stage's parameters (padded to a multiple
  // of dp), its shard stepped as one tensor.
  bool flat = false;
  // buckets: DDP's Reducer keeps a bucket element for every parameter element, resident.
  bool buckets = false;
};
RankShards RankShardsOf(DataParallel data_parallel);

// DataParallelName: how the data-parallel ranks run, as the JSON's data_parallel says it
// (predict's, the search's, verify's): "none" (one rank), "ddp" (TorchDdp), "fsdp2",
// "zero" (--zero) or "replicated" (beside expert parallelism).
const char* DataParallelName(DataParallel data_parallel);
inline const char* DataParallelName(int64_t dp, int64_t zero, int64_t ep, bool fsdp) {
  return DataParallelName(DataParallelOf(dp, zero, ep, fsdp));
}

// kMaxDdpBucketMib bounds --ddp_bucket_mb (1 TiB: one bucket holds any model).
inline constexpr double kMaxDdpBucketMib = 1 << 20;

// kMaxPipelineChunks bounds pp x virtual_stages: each chunk is predicted on its own
// (Megatron-LM runs at most a few hundred).
inline constexpr int64_t kMaxPipelineChunks = 1024;
// kMaxMicroBatches bounds --micro_batches, and kMaxChunkMicroBatches the model chunks
// times the micro-batches, which the ranks' step simulation replays one by one (eight
// times the bound took 125 s and 2.7 GB here: --pp=8 with 65,536 micro-batches on CUDA).
inline constexpr int64_t kMaxMicroBatches = 8192;
// kMaxRankLayers bounds the layers of a rank's step (data or pipeline parallelism,
// gradient accumulation), which lays out every parameter's gradient bucket: 2 stages and
// 2 micro-batches over 10^7 of tiny-llama's layers took 11 s and 3.5 GB here, then
// bad_alloc; 65,536 take 0.1 s. One process's step is composed instead
// (kMaxLayerPeriod). On CUDA, where each micro-batch's layers are simulated tensor by
// tensor, the layers times the micro-batches are at most kMaxChunkMicroBatches (2
// stages, 8 micro-batches and 4,096 layers took 9.2 s and 654 MB).
inline constexpr int64_t kMaxRankLayers = 65536;
inline constexpr int64_t kMaxChunkMicroBatches = 65536;

// ValidateParallel returns InvalidArgument naming the flag, e.g. "--zero=1 shards over
// data-parallel ranks: it needs --dp > 1" or "--layers 30 is not divisible by --pp 4 x
// --virtual_stages 1"; Internal where config.shard is not the layout's (ShardOf).
absl::Status ValidateParallel(const ModelConfig& config, const ParallelSpec& spec);
// ValidateParallelCalls: how many times ValidateParallel has run in this process, for
// the tests that a request validates its layout once.
int64_t ValidateParallelCalls();

// ZeroShardElements: a rank's part of n elements split over dp ranks by ZeRO: one flat
// buffer padded to a multiple of dp, ceil(n / dp) each.
inline int64_t ZeroShardElements(int64_t n, int64_t dp) {
  return n / dp + (n % dp != 0 ? 1 : 0);
}

// FsdpComputeConfig: the config a rank's graphs run in: under FSDP2's
// MixedPrecisionPolicy the parameters' dtype is param_dtype (the sharded ones stay
// config.dtype).
inline ModelConfig FsdpComputeConfig(ModelConfig config, const ParallelSpec& spec) {
  if (spec.fsdp.enabled && spec.fsdp.param_dtype.has_value()) {
    config.dtype = *spec.fsdp.param_dtype;
  }
  return config;
}
// REQUIRES: ValidateParallel(*config, spec).ok().
inline ValidConfig FsdpComputeConfig(const ValidConfig& config, const ParallelSpec& spec) {
  if (spec.fsdp.enabled && spec.fsdp.param_dtype.has_value()) {
    return config.InParameterDType(*spec.fsdp.param_dtype);
  }
  return config;
}

// RankStepModelled: OK when a rank's whole step, and so its peak, is both simulated
// (estimator/step/liveness.h) and measured on ranks (runtime/distributed.h): data
// parallelism with ZeRO 0-2, micro-batches accumulated, pipeline stages (1F1B or
// interleaved), tensor and sequence parallelism with Megatron's collectives, ZeRO-3's
// parameters gathered unit by unit (a tied embedding on one stage only), expert
// parallelism (measured on transformers' own ranks: verify/witness_ranks.py). Otherwise
// Unimplemented, naming what is not modelled yet.
absl::Status RankStepModelled(const ModelConfig& config, const ParallelSpec& spec);

}  // namespace memledger

#endif  // ESTIMATOR_REQUEST_PARALLEL_SPEC_H_
