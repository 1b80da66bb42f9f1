#include "estimator/predict/ranks.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/graph/family.h"
#include "estimator/parallel/ddp_buckets.h"
#include "estimator/parallel/fsdp2_shards.h"
#include "estimator/spec/checked_math.h"
#include "estimator/spec/option_checks.h"
#include "estimator/step/liveness.h"

namespace memledger {
namespace {

// InFlight walks pipeline rank `stage`'s schedule as Megatron-LM runs it
// (forward_backward_pipelining_without_interleaving, ..._with_interleaving) over
// `chunk_saved`, one micro-batch's saved bytes per local model chunk, and returns how
// many micro-batches of each chunk it holds at its fullest: those it has run forward and
// not yet backward. The first such moment, on ties.
std::vector<int64_t> InFlight(const ParallelSpec& p, int64_t stage,
                              const std::vector<int64_t>& chunk_saved) {
  const int64_t m = p.micro_batches;
  if (p.schedule == PipelineSchedule::k1F1B) {
    // pp - stage - 1 warm-up forwards, then one forward before each backward.
    return {std::min(p.pp - stage, m)};
  }
  const int64_t v = p.virtual_stages;
  const int64_t group = p.pp * v;  // forward k runs chunk (k mod group) / pp
  const int64_t total = m * v;
  const int64_t warmup =
      m == p.pp ? total : std::min((p.pp - stage - 1) * 2 + (v - 1) * p.pp, total);
  const int64_t remaining = total - warmup;
  std::vector<int64_t> held(v, 0), most(v, 0);
  CheckedInt64 bytes = 0, most_bytes = -1;
  auto forward = [&](int64_t k) {
    const int64_t chunk = (k % group) / p.pp;
    ++held[chunk];
    bytes += chunk_saved[chunk];
    if (!bytes.overflowed() && bytes.value() > most_bytes.value()) {
      most = held;
      most_bytes = bytes;
    }
  };
  auto backward = [&](int64_t k) {
    const int64_t chunk = v - 1 - (k % group) / p.pp;
    --held[chunk];
    bytes += -chunk_saved[chunk];
  };
  for (int64_t k = 0; k < warmup; ++k) forward(k);
  // The steady state repeats every `group` steps with no net change (each chunk runs
  // pp forwards and pp backwards a group), so two groups show its fullest moment.
  const int64_t steady = std::min(remaining, 2 * group);
  for (int64_t i = 0; i < steady; ++i) {
    forward(warmup + i);
    backward(i);
  }
  return most;
}


// Held sums the chunks' predictions, each times its micro-batches in flight: saved
// bytes and every split of them.
absl::StatusOr<VariantPrediction> Held(const std::vector<const VariantPrediction*>& chunks,
                                       const std::vector<int64_t>& counts) {
  VariantPrediction sum;
  sum.variant = chunks.front()->variant;
  CheckedInt64 saved = 0, cache = 0, embedding = 0, layers = 0, head = 0, input = 0, copies = 0;
  std::array<CheckedInt64, kNumDTypes> by_dtype{};
  for (size_t c = 0; c < chunks.size(); ++c) {
    const VariantPrediction& v = *chunks[c];
    const CheckedInt64 n = counts[c];
    saved += n * v.saved_bytes;
    cache += n * v.cache_bytes;
    embedding += n * v.embedding_bytes;
    layers += n * v.layers_bytes;
    head += n * v.head_loss_bytes;
    input += n * v.input_bytes_kept;
    copies += n * v.weight_copy_bytes;
    for (int d = 0; d < kNumDTypes; ++d) by_dtype[d] += n * v.saved_by_dtype[d];
  }
  bool overflow = false;
  for (const CheckedInt64& x : {saved, cache, embedding, layers, head, input, copies}) {
    overflow = overflow || x.overflowed();
  }
  for (const CheckedInt64& x : by_dtype) overflow = overflow || x.overflowed();
  if (overflow) {
    return absl::OutOfRangeError(absl::StrCat("the saved bytes in flight of variant ",
                                              sum.variant.Name(), " overflow int64"));
  }
  sum.saved_bytes = saved.value();
  sum.cache_bytes = cache.value();
  sum.embedding_bytes = embedding.value();
  sum.layers_bytes = layers.value();
  sum.head_loss_bytes = head.value();
  sum.input_bytes_kept = input.value();
  sum.weight_copy_bytes = copies.value();
  for (int d = 0; d < kNumDTypes; ++d) sum.saved_by_dtype[d] = by_dtype[d].value();
  return sum;
}

// PredictRankPeaks simulates the rank's whole step per variant (RankStepModelled), its
// data-parallel reduction and ZeRO shard's step included, from what it holds before the
// step: its parameters (with ZeRO 1 and 2 the flat buffer they live in, padded to a
// multiple of dp), its optimizer's state and its micro-batch. Elsewhere each variant
// says why there is no peak.
// `shared` is the layout's step simulator, made at the first stage that needs it (its
// plans do not depend on the stage); each stage simulates with it ForRank.
absl::Status PredictRankPeaks(const ValidConfig& valid, const ParallelSpec& parallel,
                              const PredictOptions& options,
                              std::optional<absl::StatusOr<StepSimulator>>* shared,
                              RankKind* kind) {
  const ModelConfig& config = *valid;
  auto unavailable = [&](const absl::Status& why) {
    for (RankVariant& v : kind->variants) v.held.peak_unavailable = std::string(why.message());
    return absl::OkStatus();
  };
  if (absl::Status s = RankStepModelled(config, parallel); !s.ok()) return unavailable(s);
  if (!shared->has_value()) {
    StepOptions step;
    step.cpu_threads = options.cpu_threads;
    step.cuda_blocks = options.cuda_blocks;
    step.record_events = options.timeline;  // the events only for a timeline's drawing
    step.rules = options.rules;
    step.python_dispatch_mode = options.python_dispatch_mode;
    *shared = StepSimulator::Create(valid, options.attention, step);
  }
  const absl::StatusOr<StepSimulator>& created = **shared;
  if (absl::IsUnimplemented(created.status())) return unavailable(created.status());
  if (!created.ok()) return created.status();
  const StepSimulator simulator = created->ForRank(RankStep{parallel, kind->stage, kind->chunks});
  absl::StatusOr<ResidentBytes> resident =
      RankResident(config, parallel, *kind, options.attention, options.optimizer);
  if (!resident.ok()) return resident.status();
  for (RankVariant& v : kind->variants) {
    absl::StatusOr<StepTimeline> timeline =
        simulator.Simulate(v.held.variant, options.optimizer, *resident);
    if (timeline.ok()) {
      v.held.peak = timeline->peak;
      v.held.peak_reserved_bytes = timeline->peak_reserved_bytes;
      if (options.timeline) {
        v.held.timeline = std::make_shared<const StepTimeline>(*std::move(timeline));
      }
    } else if (absl::IsUnimplemented(timeline.status())) {
      v.held.peak_unavailable = std::string(timeline.status().message());
    } else {
      return timeline.status();
    }
  }
  return absl::OkStatus();
}

// Fsdp2ModelShardElements: a rank's padded Shard(0) elements of every parameter of the
// whole model (FSDP2 runs one stage: ValidateParallel).
int64_t Fsdp2ModelShardElements(const ModelConfig& config, AttentionMode attention,
                                int64_t world) {
  const std::shared_ptr<const ModelGraphs> graphs = ModelGraphsFor(config, attention);
  int64_t elements = 0;
  for (size_t kind = 0; kind < graphs->layer_kinds.size(); ++kind) {
    elements += graphs->LayersOfKind(static_cast<int>(kind), 0, config.layers) *
                Fsdp2UnitOf({&graphs->layer_kinds[kind]}, config, world).shard_elements;
  }
  std::vector<const BlockGraph*> root;
  if (graphs->prologue.has_value()) root.push_back(&*graphs->prologue);
  root.push_back(&graphs->epilogue);
  return elements + Fsdp2UnitOf(root, config, world).shard_elements;
}

// Fsdp2ResidentTensors: an FSDP2 rank's resident tensors on CUDA, a block each: every
// parameter's padded Shard(0) in `stored` (the model's dtype, fp32 under a
// MixedPrecisionPolicy), in the order fully_shard makes them (each decoder layer's unit,
// then the root's: FSDPParam._init_sharded_param), then the optimizer's state, each
// parameter's in model.parameters() order (the embedding, the layers, the final norm and
// the head), as its first step makes it (adam.py, _init_group). Rank 0's: the fullest.
std::vector<ResidentTensor> Fsdp2ResidentTensors(const ModelGraphs& graphs,
                                                 const ModelConfig& config, int64_t world,
                                                 const OptimizerSpec& optimizer, DType stored) {
  struct Shard {
    std::string name;
    int64_t elements = 0;
  };
  auto shards_of = [&](const std::vector<const BlockGraph*>& members,
                       const std::vector<std::string>& wheres) {
    std::vector<Shard> shards;
    const Fsdp2Unit unit = Fsdp2UnitOf(members, config, world);
    for (const Fsdp2Unit::Parameter& p : unit.parameters) {
      const size_t g = static_cast<size_t>(p.graph);
      shards.push_back({absl::StrCat(wheres[g], " ", members[g]->tensors[p.tensor].name),
                        p.shard_elements});
    }
    return shards;
  };
  std::vector<std::vector<Shard>> layers;
  for (int64_t i = 0; i < config.layers; ++i) {
    layers.push_back(shards_of({&graphs.Layer(i)}, {absl::StrCat("layer ", i)}));
  }
  std::vector<Shard> embedding, head;
  if (graphs.prologue.has_value()) embedding = shards_of({&*graphs.prologue}, {"embeddings"});
  head = shards_of({&graphs.epilogue}, {"head"});
  ModelConfig stored_config = config;
  stored_config.dtype = stored;
  const OptimizerBytesPerParameter per = OptimizerBytesOf(stored_config, optimizer);
  const int64_t element = ElementSizeBytes(stored);
  const bool adam = optimizer.kind != OptimizerKind::kSgd;
  std::vector<ResidentTensor> tensors;
  auto parameters = [&](const std::vector<Shard>& shards) {
    for (const Shard& shard : shards) {
      tensors.push_back({absl::StrCat(shard.name, " shard"), MemoryCategory::kParameter,
                         shard.elements * element});
    }
  };
  auto state = [&](const std::vector<Shard>& shards) {
    for (const Shard& shard : shards) {
      auto add = [&](const char* what, int64_t bytes) {
        if (bytes > 0) {
          tensors.push_back(
              {absl::StrCat(shard.name, " ", what), MemoryCategory::kOptimizerState, bytes});
        }
      };
      const int64_t moments = per.moments * shard.elements;
      add(adam ? "exp_avg" : "momentum_buffer", adam ? moments / 2 : moments);
      add("exp_avg_sq", adam ? moments - moments / 2 : 0);
      add("master", per.master * shard.elements);
      add("step", per.per_tensor);
    }
  };
  for (const std::vector<Shard>& layer : layers) parameters(layer);
  parameters(embedding);
  parameters(head);
  state(embedding);
  for (const std::vector<Shard>& layer : layers) state(layer);
  state(head);
  return tensors;
}

// AddDdpBuckets: DDP's buckets, each its own block, made after the parameters and before
// the optimizer's state (which the first step makes). Their split follows the gradients'
// ready order, here the parameters' reverse (the order of a sequential model's backward;
// the real order differs within a layer, where a cap may fall elsewhere).
void AddDdpBuckets(const DdpOptions& ddp, std::vector<ResidentTensor>* tensors) {
  std::vector<int64_t> grad_bytes;
  for (auto t = tensors->rbegin(); t != tensors->rend(); ++t) {
    if (t->category == MemoryCategory::kParameter) grad_bytes.push_back(t->bytes);
  }
  auto state = std::find_if(tensors->begin(), tensors->end(), [](const ResidentTensor& t) {
    return t.category == MemoryCategory::kOptimizerState;
  });
  std::vector<ResidentTensor> buckets;
  for (const int64_t bytes : DdpBucketBytes(grad_bytes, ddp.bucket_cap_mb)) {
    buckets.push_back({absl::StrCat("DDP bucket ", buckets.size()),
                       MemoryCategory::kCommunication, bytes});
  }
  tensors->insert(state, buckets.begin(), buckets.end());
}

}  // namespace

absl::StatusOr<ResidentBytes> RankResident(const ModelConfig& config, const ParallelSpec& parallel,
                                           const RankKind& kind, AttentionMode attention,
                                           const OptimizerSpec& optimizer) {
  // ZeRO 1 and 2 keep the whole flat buffer (padded); ZeRO 3 and FSDP2 their shards
  // (kind.param_bytes).
  const RankShards shards = RankShardsOf(DataParallelOf(parallel));
  const bool flat = shards.flat && !shards.parameters;
  const CheckedInt64 flat_bytes = CheckedInt64(ZeroShardElements(kind.n_params, parallel.dp)) *
                                  parallel.dp * ElementSizeBytes(config.dtype);
  if (flat_bytes.overflowed()) return absl::OutOfRangeError("the parameters' bytes overflow int64");
  const std::shared_ptr<const ModelGraphs> graphs = ModelGraphsFor(config, attention);
  ResidentBytes resident{flat ? flat_bytes.value() : kind.param_bytes,
                         kind.optimizer_state_bytes, BufferBytes(*graphs, config).value(), {},
                         kind.communication_bytes};
  if (config.device != Device::kCuda) return resident;
  // On CUDA each tensor is its own block: without ZeRO the stage's parameters and their
  // state one by one; with ZeRO the rank's flat buffer (or ZeRO-3 shard) and its
  // shard's state, one tensor each, as the runtime holds them (runtime/rank.cc,
  // HomeParameters: the optimizer steps one flat shard).
  std::vector<ResidentTensor>& tensors = resident.tensors;
  if (parallel.fsdp.enabled && parallel.fsdp.offload) {
    // CPUOffloadPolicy: the shards and the optimizer's state in host memory; the device
    // holds the buffers before the step.
    resident.parameter_bytes = 0;
    resident.optimizer_state_bytes = 0;
    AddBufferTensors(*graphs, config, &tensors);
    return resident;
  }
  if (parallel.fsdp.enabled) {
    // The shards stay in the model's dtype under a MixedPrecisionPolicy (fp32: ValidateParallel).
    const DType stored = parallel.fsdp.param_dtype.has_value() ? DType::kFloat32 : config.dtype;
    tensors = Fsdp2ResidentTensors(*graphs, config, parallel.dp, optimizer, stored);
    int64_t parameters = 0, state = 0;
    for (const ResidentTensor& t : tensors) {
      (t.category == MemoryCategory::kParameter ? parameters : state) += t.bytes;
    }
    if (parameters != kind.param_bytes || state != kind.optimizer_state_bytes) {
      tensors.clear();  // not one by one: the peak says so
      return resident;
    }
  } else if (!shards.flat) {
    tensors = ResidentTensors(*graphs, config, optimizer, kind.chunks, kind.param_bytes,
                              kind.optimizer_state_bytes);
    if (tensors.empty()) return resident;  // not one by one: the peak says so
    if (shards.buckets) AddDdpBuckets(parallel.ddp, &tensors);
  } else {
    tensors.push_back({"flat parameters", MemoryCategory::kParameter, resident.parameter_bytes});
    const OptimizerBytesPerParameter per = OptimizerBytesOf(config, optimizer);
    const int64_t shard = ZeroShardElements(kind.n_params, parallel.dp);
    const int64_t moments = per.moments * shard;
    const bool adam = optimizer.kind != OptimizerKind::kSgd;
    for (const auto& [name, bytes] :
         {std::pair<const char*, int64_t>{adam ? "exp_avg" : "momentum_buffer",
                                          adam ? moments / 2 : moments},
          {"exp_avg_sq", adam ? moments - moments / 2 : 0},
          {"master", per.master * shard},
          {"step", per.per_tensor}}) {
      if (bytes > 0) tensors.push_back({name, MemoryCategory::kOptimizerState, bytes});
    }
  }
  AddBufferTensors(*graphs, config, &tensors);
  return resident;
}

namespace {

// ChunkVariants: a chunk's variants, `options`' and `none` (the reference for
// saved_ratio_vs_none), added last unless requested.
std::vector<Variant> ChunkVariants(const PredictOptions& options) {
  std::vector<Variant> variants = options.variants;
  if (std::none_of(variants.begin(), variants.end(),
                   [](const Variant& v) { return v.kind == VariantKind::kNone; })) {
    variants.push_back(Variant());
  }
  return variants;
}

// ValidateRankRun: the run as a layout's ranks run it (their graphs in FSDP2's
// param_dtype, with `none` beside the variants), once the model (ValidConfig) and the
// layout (ValidateParallel) are validated: the run's own checks, not the config's.
absl::Status ValidateRankRun(const ValidConfig& valid, const ParallelSpec& parallel,
                             const PredictOptions& options) {
  return ValidateRunOf(FsdpComputeConfig(valid, parallel), options.attention,
                       ChunkVariants(options), options.optimizer);
}

}  // namespace

absl::StatusOr<RanksPrediction> PredictRanks(const ModelConfig& model,
                                             const ParallelSpec& parallel,
                                             const PredictOptions& options) {
  // A layout's ranks run memledger's Megatron-style rendition (runtime/distributed.h),
  // which keeps no DynamicCache.
  ModelConfig config = model;
  config.use_cache = false;
  absl::StatusOr<ValidConfig> valid = ValidConfig::Of(config);
  if (!valid.ok()) return valid.status();
  if (absl::Status s = ValidateParallel(config, parallel); !s.ok()) return s;
  return PredictValidRanks(*valid, parallel, options);
}

absl::StatusOr<RanksPrediction> PredictValidRanks(const ValidConfig& valid,
                                                  const ParallelSpec& parallel,
                                                  const PredictOptions& options) {
  if (absl::Status s = ValidateRankRun(valid, parallel, options); !s.ok()) return s;
  ModelConfig config = *valid;
  PredictOptions chunk_options = options;
  chunk_options.peak = false;
  chunk_options.timeline = false;
  chunk_options.breakdown = false;
  chunk_options.variants = ChunkVariants(options);
  const auto requested_none =
      std::find_if(options.variants.begin(), options.variants.end(),
                   [](const Variant& v) { return v.kind == VariantKind::kNone; });
  const size_t none = static_cast<size_t>(requested_none - options.variants.begin());
  const int64_t chunks = parallel.pp * parallel.virtual_stages;
  const int64_t chunk_layers = config.layers / chunks;
  const int64_t element = ElementSizeBytes(config.dtype);
  // Under FSDP2's CPUOffloadPolicy torch.optim steps the shards as CPU tensors (a 4-byte
  // step each, as on the CPU).
  const bool offload = parallel.fsdp.enabled && parallel.fsdp.offload;
  ModelConfig state_config = config;
  if (offload) state_config.device = Device::kCpu;
  const OptimizerBytesPerParameter per_parameter =
      OptimizerBytesOf(state_config, options.optimizer);
  // With expert parallelism a kind is one expert-parallel rank of every group of ep
  // data-parallel ranks, or of one group where the routing gives every group's own.
  const int64_t groups = config.RoutedGroups();
  const CheckedInt64 ranks_per_stage =
      CheckedInt64(parallel.tp) * (parallel.dp / parallel.ep / groups);
  ModelConfig chunk_config = config;
  chunk_config.layers = chunk_layers;
  const int64_t korthikanti_chunk = KorthikantiSavedBytes(chunk_config, options.attention);
  if (ranks_per_stage.overflowed() || korthikanti_chunk < 0) {
    return absl::OutOfRangeError("the ranks' counts overflow int64");
  }

  RanksPrediction prediction;
  prediction.parallel = parallel;
  prediction.ep_groups = groups;
  // Every stage's step simulator (PredictRankPeaks), one per expert-parallel rank (and
  // group): their graphs differ.
  const int64_t per_stage = parallel.ep * groups;
  std::vector<std::optional<absl::StatusOr<StepSimulator>>> simulators(
      static_cast<size_t>(per_stage));
  // With expert parallelism each expert-parallel rank is its own kind: its experts and
  // what they receive (ModelConfig::ReceivedLoad) are its own.
  for (int64_t kind_index = 0; kind_index < parallel.pp * per_stage; ++kind_index) {
    const int64_t stage = kind_index / per_stage;
    const ValidConfig on_rank =
        valid.ForExpertRank(kind_index % per_stage / parallel.ep, kind_index % parallel.ep);
    config = *on_rank;
    RankKind kind;
    kind.stage = stage;
    kind.ep_rank = config.shard.ep_rank;
    kind.ep_group = config.shard.ep_group;
    kind.ranks = ranks_per_stage.value();
    std::vector<StagePrediction> predicted;
    CheckedInt64 n_params = 0, n_trainable = 0;
    int64_t n_trainable_tensors = 0;
    for (int64_t local = 0; local < parallel.virtual_stages; ++local) {
      const int64_t global = local * parallel.pp + stage;
      const StageRange range{global * chunk_layers, chunk_layers, global == 0,
                             global == chunks - 1};
      // Under FSDP2's MixedPrecisionPolicy the graphs run in param_dtype.
      absl::StatusOr<StagePrediction> chunk =
          PredictValidStage(FsdpComputeConfig(on_rank, parallel), chunk_options, range);
      if (!chunk.ok()) return chunk.status();
      kind.chunks.push_back(range);
      n_params += chunk->n_params;
      n_trainable += chunk->n_trainable_params;
      n_trainable_tensors += chunk->n_trainable_tensors;
      predicted.push_back(*std::move(chunk));
    }
    for (size_t v = 0; v < chunk_options.variants.size(); ++v) {
      std::vector<const VariantPrediction*> per_chunk;
      std::vector<int64_t> chunk_saved;
      for (const StagePrediction& chunk : predicted) {
        per_chunk.push_back(&chunk.variants[v]);
        chunk_saved.push_back(chunk.variants[v].saved_bytes);
      }
      const std::vector<int64_t> counts = InFlight(parallel, stage, chunk_saved);
      absl::StatusOr<VariantPrediction> held = Held(per_chunk, counts);
      if (!held.ok()) return held.status();
      int64_t in_flight = 0;
      for (int64_t n : counts) in_flight += n;
      if (v == none) {
        kind.saved_bytes_none = held->saved_bytes;
        const CheckedInt64 korthikanti = CheckedInt64(korthikanti_chunk) * in_flight;
        if (korthikanti.overflowed()) return absl::OutOfRangeError("Korthikanti overflows");
        kind.korthikanti_saved_bytes_none = korthikanti.value();
      }
      if (v < options.variants.size()) kind.variants.push_back({*std::move(held), in_flight});
    }
    for (RankVariant& v : kind.variants) {
      v.held.saved_ratio_vs_none = kind.saved_bytes_none == 0
                                       ? 0
                                       : static_cast<double>(v.held.saved_bytes) /
                                             static_cast<double>(kind.saved_bytes_none);
    }
    // What the strategy shards (RankShardsOf): ZeRO's ceil(n / dp) of one flat buffer,
    // stepped as one tensor; FSDP2's padded Shard(0) of every parameter (rank 0's),
    // stepped tensor by tensor.
    const RankShards shards = RankShardsOf(DataParallelOf(parallel));
    const int64_t n = n_params.value();
    const int64_t shard = parallel.fsdp.enabled
                              ? Fsdp2ModelShardElements(config, options.attention, parallel.dp)
                              : ZeroShardElements(n, parallel.dp);
    // Unsharded, only the parameters that train have gradients and optimizer state, in
    // TrainableDtype (LoRA's fp32 adapters); the frozen stay in the model's dtype
    // (--freeze and LoRA are one process's: ValidateParallel). Sharded, every parameter
    // trains.
    const int64_t trainable = n_trainable.value();
    const int64_t trainable_element = ElementSizeBytes(config.TrainableDtype());
    CheckedInt64 param_bytes =
        shards.parameters ? CheckedInt64(shard) * element
                          : CheckedInt64(n - trainable) * element +
                                CheckedInt64(trainable) * trainable_element;
    CheckedInt64 grad_bytes =
        CheckedInt64(shards.gradients ? shard : trainable) * trainable_element;
    const int64_t stepped = shards.optimizer_state ? shard : trainable;
    const int64_t stepped_tensors = shards.flat ? 1 : n_trainable_tensors;
    CheckedInt64 moments = CheckedInt64(stepped) * per_parameter.moments;
    CheckedInt64 state = moments + CheckedInt64(stepped) * per_parameter.master +
                         CheckedInt64(stepped_tensors) * per_parameter.per_tensor;
    // DDP's Reducer: buckets of every gradient's element (of the parameters that
    // require grad) in its dtype.
    const CheckedInt64 communication = shards.buckets ? grad_bytes : CheckedInt64(0);
    const bool views = shards.buckets && parallel.ddp.gradient_as_bucket_view;
    CheckedInt64 total =
        param_bytes + (views ? CheckedInt64(0) : grad_bytes) + state + communication;
    for (const RankVariant& v : kind.variants) total += v.held.saved_bytes;
    if (n_params.overflowed() || n_trainable.overflowed() || total.overflowed() ||
        moments.overflowed()) {
      return absl::OutOfRangeError(
          absl::StrCat("pipeline stage ", stage, ": its bytes overflow int64"));
    }
    kind.n_params = n;
    kind.param_bytes = param_bytes.value();
    kind.grad_bytes = grad_bytes.value();
    kind.optimizer_state_bytes = state.value();
    kind.communication_bytes = communication.value();
    if (offload) kind.host_bytes = (param_bytes + grad_bytes + state).value();
    kind.grads_in_communication = views;
    kind.adamw_state_bytes =
        options.optimizer.kind == OptimizerKind::kAdamW ? moments.value() : 0;
    if (options.peak) {
      if (absl::Status s = PredictRankPeaks(FsdpComputeConfig(on_rank, parallel), parallel,
                                            options,
                                            &simulators[static_cast<size_t>(
                                                kind.ep_group * config.shard.ep + kind.ep_rank)],
                                            &kind);
          !s.ok()) {
        return s;
      }
    }
    prediction.kinds.push_back(std::move(kind));
  }
  std::stable_sort(prediction.kinds.begin(), prediction.kinds.end(),
                   [](const RankKind& a, const RankKind& b) { return a.Load() > b.Load(); });
  return prediction;
}

absl::StatusOr<DistributedPrediction> PredictDistributed(const ModelConfig& model,
                                                         const ParallelSpec& parallel,
                                                         const PredictOptions& options) {
  // The one validation of the request: the model, the layout (the ranks' run is
  // checked below, with the whole model's).
  absl::StatusOr<ValidConfig> valid = ValidConfig::Of(model);
  if (!valid.ok()) return valid.status();
  if (absl::Status s = ValidateParallel(valid->WithoutCache().config(), parallel); !s.ok()) {
    return s;
  }
  if (absl::Status s = ValidateRunOf(*valid, options.attention, options.variants,
                                     options.optimizer);
      !s.ok()) {
    return s;
  }
  return PredictValidDistributed(*valid, parallel, options);
}

absl::StatusOr<DistributedPrediction> PredictValidDistributed(const ValidConfig& valid_model,
                                                              const ParallelSpec& parallel,
                                                              const PredictOptions& options) {
  const ModelConfig& model = *valid_model;
  if (options.timeline) {
    if (absl::Status s = CheckTimelineLayers(model.layers); !s.ok()) return s;
  }
  if (options.breakdown) {
    return absl::InvalidArgumentError(
        "--explain describes one process's step: not with --dp or --pp yet");
  }
  const ValidConfig valid = valid_model.WithoutCache();  // as PredictRanks
  const ModelConfig& config = *valid;
  const ValidConfig whole_valid = valid.AsOneProcess();
  // The whole model's peak is no rank's: only the ranks' are simulated.
  PredictOptions whole_options = options;
  whole_options.peak = false;
  whole_options.timeline = false;
  // The whole model is one process's: every expert in it, on expert-parallel rank 0's
  // batch where the routing gives every rank's.
  absl::StatusOr<Prediction> whole = PredictValid(whole_valid, whole_options);
  if (!whole.ok()) return whole.status();
  if (model.KeepsKvCache() && (TorchDdp(parallel) || parallel.fsdp.enabled)) {
    // transformers' model, whole on each rank, keeps its DynamicCache in training as one
    // process does; the ranks are predicted without it. Where the cache holds bytes of
    // its own (GPT-2's concatenated keys and values: not Llama's, which holds the
    // tensors saved anyway), the prediction says so.
    PredictOptions held;
    held.attention = options.attention;
    held.optimizer = options.optimizer;
    held.peak = false;
    held.variants = {Variant()};
    absl::StatusOr<Prediction> cached = PredictValid(valid_model, held);
    absl::StatusOr<Prediction> uncached = PredictValid(valid, held);
    if (cached.ok() && uncached.ok() &&
        cached->variants[0].held_after_forward_bytes !=
            uncached->variants[0].held_after_forward_bytes) {
      whole->caveats.push_back(absl::StrCat(
          "dp: transformers keeps the model's DynamicCache (use_cache) in training, ",
          cached->variants[0].held_after_forward_bytes -
              uncached->variants[0].held_after_forward_bytes,
          " B more after one process's forward; the ranks are predicted without it "
          "(use_cache false in the config.json matches)"));
    }
  }
  if (TorchDdp(parallel)) {
    // torch's DistributedDataParallel (tests/ddp_witness_test.py measures it on Gloo
    // ranks of the real stack): what is assumed where torch leaves a choice.
    if (parallel.micro_batches > 1) {
      whole->caveats.push_back(
          "dp: DDP's micro-batches before each chunk's last run under no_sync (as "
          "gradient accumulation and torch.distributed.pipelining run them): the Reducer "
          "copies into its buckets in the last backward only");
    }
    if (config.device == Device::kCuda) {
      whole->caveats.push_back(
          "dp: DDP's buckets are split in the parameters' reverse order, each its own "
          "block; torch rebuilds them in the first backward's order from the block of "
          "its first bucket");
    }
  }
  if (parallel.fsdp.enabled && parallel.fsdp.offload) {
    whole->caveats.push_back(
        "fsdp: CPUOffloadPolicy: the shards, their gradients and the optimizer's state are in "
        "host memory (host_bytes, the tensors' bytes: pinned memory's power-of-two blocks "
        "are not counted), outside the device's peak; each all-gather first copies the "
        "shards to the device, each reduce-scatter's output is copied back");
  }
  if (parallel.fsdp.enabled && config.device == Device::kCuda) {
    // tests/fsdp2_witness_test.py measures FSDP2 on Gloo CPU ranks; the CUDA step is
    // torch's source mirrored (data_parallel_fsdp2.cc), its allocator replay checked against
    // torch's own (tests/cuda_allocator_test.cc), its peak against fully_shard on fake CUDA
    // tensors (tests/fsdp2_offload_witness_test.py), no GPU run.
    whole->caveats.push_back(
        "fsdp: FSDP2 on CUDA follows torch's source, checked on fake CUDA tensors, not a GPU "
        "run: the all-gather buffers "
        "on its copy-in stream and the sharded gradients on its reduce-scatter stream (each "
        "stream's blocks cached apart), NCCL averaging in the collective, the copy kernels' "
        "metadata as an H100's 132 SMs size it; NCCL's own buffers are outside the "
        "allocator");
  }
  absl::StatusOr<RanksPrediction> ranks = PredictValidRanks(valid, parallel, options);
  if (!ranks.ok()) return ranks.status();
  return DistributedPrediction{*std::move(whole), *std::move(ranks)};
}

}  // namespace memledger
