#include "estimator/request/parallel_spec.h"

#include <atomic>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "estimator/graph/family.h"
#include "estimator/spec/option_checks.h"

namespace memledger {

absl::string_view PipelineScheduleName(PipelineSchedule schedule) {
  switch (schedule) {
    case PipelineSchedule::k1F1B:
      return "1f1b";
    case PipelineSchedule::kInterleaved:
      return "interleaved";
  }
  return "?";
}

absl::StatusOr<PipelineSchedule> ParsePipelineSchedule(absl::string_view name) {
  if (name == "1f1b") return PipelineSchedule::k1F1B;
  if (name == "interleaved") return PipelineSchedule::kInterleaved;
  return absl::InvalidArgumentError(
      absl::StrCat("--schedule must be 1f1b or interleaved, got '", name, "'"));
}

DataParallel DataParallelOf(int64_t dp, int64_t zero, int64_t ep, bool fsdp) {
  if (dp <= 1) return DataParallel::kOneRank;
  if (fsdp) return DataParallel::kFsdp2;
  if (zero >= 3) return DataParallel::kZero3;
  if (TorchDdp(dp, zero, ep, fsdp)) return DataParallel::kDdp;
  // Expert parallelism without ZeRO (ValidateParallel refuses it with ZeRO).
  if (ep > 1) return DataParallel::kReplicated;
  return zero == 2 ? DataParallel::kZero2 : DataParallel::kZero1;
}

// One row per strategy: ZeRO's stages shard the optimizer's state (1), the gradients
// too (2), the parameters too (3); FSDP2 shards all three, parameter by parameter.
RankShards RankShardsOf(DataParallel data_parallel) {
  switch (data_parallel) {
    case DataParallel::kOneRank:
    case DataParallel::kReplicated:
      return {};
    case DataParallel::kDdp:
      return {.buckets = true};
    case DataParallel::kZero1:
      return {.optimizer_state = true, .flat = true};
    case DataParallel::kZero2:
      return {.gradients = true, .optimizer_state = true, .flat = true};
    case DataParallel::kZero3:
      return {.parameters = true, .gradients = true, .optimizer_state = true, .flat = true};
    case DataParallel::kFsdp2:
      return {.parameters = true, .gradients = true, .optimizer_state = true};
  }
  return {};
}

const char* DataParallelName(DataParallel data_parallel) {
  switch (data_parallel) {
    case DataParallel::kOneRank: return "none";
    case DataParallel::kDdp: return "ddp";
    case DataParallel::kReplicated: return "replicated";
    case DataParallel::kZero1:
    case DataParallel::kZero2:
    case DataParallel::kZero3: return "zero";
    case DataParallel::kFsdp2: return "fsdp2";
  }
  return "?";
}

namespace {
std::atomic<int64_t> validate_parallel_calls{0};
}  // namespace

int64_t ValidateParallelCalls() {
  return validate_parallel_calls.load(std::memory_order_relaxed);
}

absl::Status ValidateParallel(const ModelConfig& config, const ParallelSpec& spec) {
  validate_parallel_calls.fetch_add(1, std::memory_order_relaxed);
  // The rank's graphs hold the part of the model the layout gives it (any expert-parallel
  // rank's: ForExpertRank picks it after).
  RankShard shard = config.shard;
  shard.ep_rank = 0;
  shard.ep_group = 0;
  if (!(shard == ShardOf(spec))) {
    return absl::InternalError(absl::StrCat(
        "the config's shard (tp ", config.shard.tp, ", sp ", config.shard.sp, ", ep ",
        config.shard.ep, ") is not the layout's (--tp ", spec.tp, ", --sp ", spec.sp,
        ", --ep ", spec.ep, "): set it with ShardOf"));
  }
  for (const auto& [flag, value] :
       {std::pair<const char*, int64_t>{"dp", spec.dp},
        {"pp", spec.pp},
        {"virtual_stages", spec.virtual_stages},
        {"micro_batches", spec.micro_batches}}) {
    if (value < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, " must be >= 1, got ", value));
    }
  }
  if (absl::Status s = CheckZeroStage(spec.zero); !s.ok()) return s;
  // What trains, frozen parameters and peft's adapters, on one process or on DDP's
  // ranks (its Reducer buckets only what requires grad: reducer.cpp, the parameters
  // with requires_grad); not yet with ZeRO, FSDP2, stages or gradient accumulation.
  const bool ddp_only = TorchDdp(spec.dp, spec.zero, spec.ep, spec.fsdp.enabled) &&
                        spec.pp == 1 && spec.micro_batches == 1;
  if ((config.freeze.any() || config.lora.enabled()) && spec.Accumulates() && !ddp_only) {
    return absl::InvalidArgumentError(absl::StrCat(
        config.lora.enabled() ? "--lora_rank" : "--freeze",
        " is modelled on one process, or on --dp ranks under DDP: not with --pp, "
        "--micro_batches above 1, --zero or --fsdp yet"));
  }
  if (config.offload_activations && spec.Accumulates()) {
    return absl::InvalidArgumentError(
        "--offload_activations is modelled on one process and one micro-batch: not with "
        "--dp, --pp or --micro_batches above 1 yet");
  }
  if (spec.Accumulates() && config.layers > kMaxRankLayers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--layers ", config.layers, " is more than the ", kMaxRankLayers,
        " layers a rank's step is simulated with (--dp, --pp, --micro_batches: every "
        "parameter's gradient bucket is laid out)"));
  }
  if (spec.zero > 0 && spec.dp < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--zero=", spec.zero, " shards over data-parallel ranks: it needs --dp > 1"));
  }
  if (spec.ep > 1) {
    // Expert parallelism splits the data-parallel ranks (transformers 5.23 asks ep_size
    // to divide its data-parallel world, distributed/configuration_utils.py).
    if (spec.dp % spec.ep != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--ep ", spec.ep, " must divide --dp ", spec.dp,
          " (expert-parallel ranks are data-parallel ranks)"));
    }
    if (spec.zero > 0) {
      return absl::InvalidArgumentError(
          "--ep with --zero is not modelled yet (experts' state shards over other ranks)");
    }
    const int64_t groups = config.RoutedGroups();
    if (groups > 1 && groups != spec.dp / spec.ep) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--routing gives ", groups, " expert-parallel groups' rows; --dp ", spec.dp,
          " / --ep ", spec.ep, " has ", spec.dp / spec.ep));
    }
  }
  if (spec.pp > 1 && !FamilyOf(config.family).decoder) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--pp: pipeline stages are modelled for the decoder families (",
        FamilyNames(&FamilyDef::decoder), "), not the ", FamilyName(config.family),
        " family"));
  }
  const bool interleaved = spec.schedule == PipelineSchedule::kInterleaved;
  if (interleaved && spec.pp < 2) {
    return absl::InvalidArgumentError("--schedule=interleaved needs --pp > 1");
  }
  if (interleaved != (spec.virtual_stages > 1)) {
    return absl::InvalidArgumentError(
        interleaved ? "--schedule=interleaved needs --virtual_stages >= 2"
                    : absl::StrCat("--virtual_stages ", spec.virtual_stages,
                                   " needs --schedule=interleaved"));
  }
  int64_t chunks = 0;
  if (__builtin_mul_overflow(spec.pp, spec.virtual_stages, &chunks) ||
      chunks > kMaxPipelineChunks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--pp ", spec.pp, " x --virtual_stages ", spec.virtual_stages, " must be at most ",
        kMaxPipelineChunks, " model chunks"));
  }
  // The ranks' step simulation replays every micro-batch of every model chunk (a quarter
  // of a millisecond each on CUDA, on a 2-core machine): bounded, one prediction stays
  // within seconds and a few hundred MB.
  if (spec.micro_batches > kMaxMicroBatches) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--micro_batches must be at most ", kMaxMicroBatches, ", got ", spec.micro_batches));
  }
  if (chunks * spec.micro_batches > kMaxChunkMicroBatches) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--pp ", spec.pp, " x --virtual_stages ", spec.virtual_stages, " x --micro_batches ",
        spec.micro_batches, " must be at most ", kMaxChunkMicroBatches,
        " (the step replays each model chunk's every micro-batch)"));
  }
  // layers <= kMaxCudaLayers (ValidateConfig) and micro_batches <= kMaxMicroBatches: the
  // product fits.
  if (config.device == Device::kCuda && spec.micro_batches > 1 &&
      config.layers <= kMaxCudaLayers &&
      config.layers * spec.micro_batches > kMaxChunkMicroBatches) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--layers ", config.layers, " x --micro_batches ", spec.micro_batches,
        " must be at most ", kMaxChunkMicroBatches,
        " on --device=cuda (each micro-batch's layers are simulated tensor by tensor)"));
  }
  if (config.layers % chunks != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--layers ", config.layers, " is not divisible by --pp ", spec.pp,
        " x --virtual_stages ", spec.virtual_stages, " (every model chunk holds as many)"));
  }
  if (spec.fsdp.enabled) {
    // FSDP2 shards over the data-parallel ranks, as fully_shard lays a decoder out; the
    // layouts beside it come later.
    if (spec.dp < 2) return absl::InvalidArgumentError("--fsdp shards over --dp ranks: it needs --dp > 1");
    if (spec.zero > 0) {
      return absl::InvalidArgumentError(
          "--fsdp is torch's FSDP2, --zero DeepSpeed's and Megatron's sharding: give one");
    }
    const char* beside = spec.ep > 1 ? "--ep"
                         : spec.tp > 1   ? "--tp"
                         : spec.pp > 1     ? "--pp"
                                           : nullptr;
    if (beside != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("--fsdp with ", beside, " is not modelled yet"));
    }
    if (!FamilyOf(config.family).decoder) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--fsdp: fully_shard's units are modelled for the decoder families (",
          FamilyNames(&FamilyDef::decoder), "), not the ", FamilyName(config.family),
          " family"));
    }
    if (spec.fsdp.offload && config.device != Device::kCuda) {
      return absl::InvalidArgumentError(
          "--offload=cpu moves FSDP2's shards from a GPU to host memory: it needs "
          "--device=cuda");
    }
    // _get_post_forward_mesh_info (_fsdp_init.py:162): an int is a factor of the mesh.
    const int64_t ranks = spec.fsdp.reshard_after_forward_ranks;
    if (ranks != 0 && (ranks < 1 || ranks > spec.dp || spec.dp % ranks != 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--reshard_after_forward as a number must divide the --dp ", spec.dp,
          " ranks (fully_shard's post-forward mesh), got ", ranks));
    }
    const FsdpOptions& mp = spec.fsdp;
    if (mp.param_dtype.has_value() || mp.reduce_dtype.has_value()) {
      // MixedPrecisionPolicy over fp32 parameters, reducing in fp32 (torchtitan's); a
      // reduction in bf16 adds FSDP2's cast of the sharded gradient, not modelled yet.
      if (config.dtype != DType::kFloat32 || config.amp != DType::kFloat32) {
        return absl::InvalidArgumentError(
            "--mp_param_dtype: FSDP2's mixed precision is modelled over fp32 parameters "
            "without --amp (--dtype=fp32)");
      }
      if (!mp.param_dtype.has_value()) {
        return absl::InvalidArgumentError("--mp_reduce_dtype needs --mp_param_dtype");
      }
      if (mp.reduce_dtype.value_or(*mp.param_dtype) != DType::kFloat32) {
        return absl::InvalidArgumentError(
            "--mp_reduce_dtype: FSDP2 reducing in bf16 or fp16 is not modelled yet "
            "(give --mp_reduce_dtype=fp32)");
      }
    }
  } else if (spec.fsdp.offload) {
    return absl::InvalidArgumentError("--offload is FSDP2's CPUOffloadPolicy: it needs --fsdp");
  } else if (!spec.fsdp.reshard_after_forward || spec.fsdp.reshard_after_forward_ranks != 0 ||
             spec.fsdp.reshard_after_forward_auto) {
    return absl::InvalidArgumentError("--reshard_after_forward is FSDP2's: it needs --fsdp");
  } else if (spec.fsdp.param_dtype.has_value() || spec.fsdp.reduce_dtype.has_value()) {
    return absl::InvalidArgumentError(
        "--mp_param_dtype and --mp_reduce_dtype are FSDP2's MixedPrecisionPolicy: they need "
        "--fsdp");
  }
  // DDP's options change nothing elsewhere: given without DDP they would be ignored.
  const bool ddp_options = spec.ddp.bucket_cap_mb.has_value() || spec.ddp.gradient_as_bucket_view;
  if (ddp_options && !TorchDdp(spec)) {
    return absl::InvalidArgumentError(absl::StrCat(
        spec.ddp.bucket_cap_mb.has_value() ? "--ddp_bucket_mb" : "--gradient_as_bucket_view",
        " is an option of torch's DistributedDataParallel: it needs --dp > 1 without --zero",
        spec.ep > 1 ? " or --ep" : spec.fsdp.enabled ? " or --fsdp" : ""));
  }
  if (spec.ddp.bucket_cap_mb.has_value() &&
      !(*spec.ddp.bucket_cap_mb > 0 && *spec.ddp.bucket_cap_mb <= kMaxDdpBucketMib)) {
    return absl::InvalidArgumentError(absl::StrCat("--ddp_bucket_mb must be a number of MiB above 0 and at most ",
                                                   kMaxDdpBucketMib, ", got ",
                                                   *spec.ddp.bucket_cap_mb));
  }
  if (interleaved && spec.micro_batches % spec.pp != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--schedule=interleaved needs --micro_batches divisible by --pp (as Megatron's), got ",
        spec.micro_batches, " and ", spec.pp));
  }
  return absl::OkStatus();
}

absl::Status RankStepModelled(const ModelConfig& config, const ParallelSpec& spec) {
  auto missing = [](absl::string_view what) {
    return absl::UnimplementedError(
        absl::StrCat("peak memory per rank: the step is not modelled ", what, " yet"));
  };
  // ZeRO-3 gathers a unit's parameters for its forward and backward; a tied embedding
  // keeps its unit gathered from the forward's start to the backward's end, on one stage
  // (over stages each end holds a copy, exchanged over the embedding group).
  if (spec.zero >= 3 && config.tie_embeddings && spec.pp > 1) {
    return missing("with --zero=3 and a tied embedding over pipeline stages");
  }
  if (spec.fsdp.enabled && spec.micro_batches > 1) {
    return missing("with --fsdp and --micro_batches (FSDP2's gradient accumulation)");
  }

  return absl::OkStatus();
}

}  // namespace memledger
