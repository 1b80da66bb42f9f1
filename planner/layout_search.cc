#include "planner/layout_search.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/spec/checked_math.h"
#include "estimator/graph/block_graph.h"
#include "estimator/graph/family.h"
#include "estimator/request/parallel_spec.h"
#include "estimator/spec/option_checks.h"
#include "estimator/predict/predict.h"
#include "estimator/predict/ranks.h"
#include "estimator/report/units.h"
#include "estimator/request/plan_file.h"
#include "estimator/predict/flops.h"
#include "planner/stage_planner.h"
#include "planner/stage_traffic.h"

namespace memledger {
namespace {

// Shape is a layout without its checkpointing: one PredictRanks call covers its
// variants.
struct Shape {
  int64_t tp = 1, pp = 1, dp = 1, zero = 0;
  bool sp = false;
  int64_t micro_batch_size = 1, micro_batches = 1, virtual_stages = 1;
  int64_t ep = 1;
  bool fsdp = false;  // the data-parallel ranks run torch's FSDP2 (--fsdp)
};

Shape ShapeOf(const SearchedLayout& l) {
  return Shape{l.tp,       l.pp, l.dp, l.zero, l.sp, l.micro_batch_size, l.micro_batches,
               l.virtual_stages, l.ep, l.fsdp};
}

// CheckFixedLayout: each layout flag the search is given, against what that part of a
// layout must be on its own, so that a bad one is named (it was "fits no layout of 8
// GPUs with the layout flags given" for all of them).
absl::Status CheckFixedLayout(const SearchOptions& options, const ModelConfig& config) {
  const LayoutConstraints& f = options.fixed;
  auto bad = [](absl::string_view flag, int64_t value, absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " ", value, " ", what));
  };
  for (const auto& [flag, value] :
       {std::pair<const char*, std::optional<int64_t>>{"tp", f.tp}, {"pp", f.pp},
        {"dp", f.dp}, {"virtual_stages", f.virtual_stages}, {"batch", f.micro_batch_size}}) {
    if (value.has_value() && *value < 1) return bad(flag, *value, "must be >= 1");
  }
  if (f.zero.has_value()) {
    if (absl::Status s = CheckZeroStage(*f.zero); !s.ok()) return s;
  }
  const int64_t node = std::min(options.gpus, options.gpus_per_node);
  if (f.tp.has_value() && node % *f.tp != 0) {
    return bad("tp", *f.tp,
               absl::StrCat("does not divide a node's ", node,
                            " GPUs (tensor-parallel ranks share a node)"));
  }
  for (const auto& [flag, value] :
       {std::pair<const char*, std::optional<int64_t>>{"pp", f.pp}, {"dp", f.dp}}) {
    if (value.has_value() && options.gpus % *value != 0) {
      return bad(flag, *value, absl::StrCat("does not divide the ", options.gpus, " GPUs"));
    }
  }
  if (f.pp.has_value() && config.layers % *f.pp != 0) {
    return bad("pp", *f.pp, absl::StrCat("does not divide the ", config.layers, " layers"));
  }
  if (f.micro_batch_size.has_value() && options.global_batch % *f.micro_batch_size != 0) {
    return bad("batch", *f.micro_batch_size,
               absl::StrCat("(sequences per micro-batch) does not divide --global_batch ",
                            options.global_batch));
  }
  if (f.virtual_stages.has_value() && *f.virtual_stages > kMaxPipelineChunks) {
    return bad("virtual_stages", *f.virtual_stages,
               absl::StrCat("must be at most ", kMaxPipelineChunks));
  }
  if (f.tp.has_value() && *f.tp > 1) {
    // The model's own checks of a tensor-parallel split (heads, kv heads, vocab, family).
    ModelConfig split = config;
    split.shard.tp = *f.tp;
    if (absl::Status s = ValidateConfig(split); !s.ok()) return s;
  }
  return absl::OkStatus();
}

std::vector<int64_t> Divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d <= n / d; ++d) {
    if (n % d != 0) continue;
    out.push_back(d);
    if (d != n / d) out.push_back(n / d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// MicroBatchSizes: the sizes a rank's `sequences` split into, ascending, each with at
// most kMaxMicroBatches micro-batches (ValidateParallel refuses more). Counting the
// micro-batches, not every divisor, keeps a huge --global_batch to 8,192 steps per
// data-parallel size: its divisors took 23 s to list at 2^63 - 1.
std::vector<int64_t> MicroBatchSizes(int64_t sequences) {
  std::vector<int64_t> out;
  for (int64_t micro_batches = std::min(sequences, kMaxMicroBatches); micro_batches >= 1;
       --micro_batches) {
    if (sequences % micro_batches == 0) out.push_back(sequences / micro_batches);
  }
  return out;
}

// Shapes enumerates every layout of options.gpus: tp divides a node's GPUs, pp the layers,
// dp x micro_batch_size the global batch; the family's and the parallel spec's own checks
// refuse the rest when evaluated. With `fsdp` every one runs FSDP2 over the data-parallel
// ranks (modelled without tp, pp or ep: ValidateParallel).
std::vector<Shape> Shapes(const ModelConfig& config, const SearchOptions& options, bool fsdp) {
  const LayoutConstraints& fixed = options.fixed;
  auto allowed = [](const std::optional<int64_t>& want, int64_t value) {
    return !want.has_value() || *want == value;
  };
  std::vector<Shape> shapes;
  for (int64_t tp : Divisors(std::min(options.gpus, options.gpus_per_node))) {
    if (options.gpus % tp != 0) continue;
    for (int64_t pp : Divisors(options.gpus / tp)) {
      if (config.layers % pp != 0) continue;
      const int64_t dp = options.gpus / tp / pp;
      if (options.global_batch % dp != 0) continue;
      for (int64_t micro_batch_size : MicroBatchSizes(options.global_batch / dp)) {
        const int64_t micro_batches = options.global_batch / dp / micro_batch_size;
        std::vector<int64_t> virtual_stages = {1};
        const int64_t most_v =
            std::max(options.max_virtual_stages, fixed.virtual_stages.value_or(0));
        for (int64_t v = 2; pp > 1 && v <= most_v; ++v) {
          // Megatron's interleaved schedule: micro-batches a multiple of pp.
          if ((config.layers / pp) % v == 0 && micro_batches % pp == 0) {
            virtual_stages.push_back(v);
          }
        }
        for (int64_t v : virtual_stages) {
          for (int64_t zero = 0; zero <= (dp > 1 ? 3 : 0); ++zero) {
            for (bool sp : {false, true}) {
              if (sp && tp == 1) continue;
              if (!allowed(fixed.tp, tp) || !allowed(fixed.pp, pp) || !allowed(fixed.dp, dp) ||
                  !allowed(fixed.zero, zero) || !allowed(fixed.micro_batch_size, micro_batch_size) ||
                  !allowed(fixed.virtual_stages, v) || (fixed.sp.has_value() && *fixed.sp != sp)) {
                continue;
              }
              // A mixture of experts' experts also split over ep of the dp ranks, where
              // --ep is modelled (no tp, no ZeRO).
              for (int64_t ep : Divisors(dp)) {
                if (ep > 1 && (!config.moe.Sparse() || config.moe.experts % ep != 0 ||
                               tp > 1 || zero > 0)) {
                  continue;
                }
                if (!allowed(fixed.ep, ep)) continue;
                if (fsdp && (tp > 1 || pp > 1 || ep > 1 || zero > 0 || dp < 2)) continue;
                shapes.push_back(
                    {tp, pp, dp, zero, sp, micro_batch_size, micro_batches, v, ep, fsdp});
              }
            }
          }
        }
      }
    }
  }
  return shapes;
}

// Evaluated is what one shape gave: its layouts that fit, and the rest counted.
struct Evaluated {
  std::vector<SearchedLayout> fits;
  int64_t invalid = 0, too_big = 0, unmodelled = 0;
  std::string refusal;  // why the shape was refused or has no peak, where it was
  bool simulated = false;
  // What did not fit: the simulated peaks, and the bounds of those never simulated.
  int64_t smallest_peak = std::numeric_limits<int64_t>::max();
  std::vector<int64_t> bounds;  // by variant; -1 where simulated or invalid
  // The modelled step time without recompute, which no plan beats (infinite: invalid).
  double none_time_s = std::numeric_limits<double>::infinity();
};

class Search {
 public:
  // model_flops: one sequence's forward and backward over the whole model, without
  // recompute (for the MFU).
  Search(const RunRequest& request, const RunSpec& base, const SearchOptions& options,
         const FsdpOptions& fsdp, double model_flops)
      : request_(request), base_(base), options_(options), fsdp_(fsdp), model_flops_(model_flops),
        cuda_(base.config.device == Device::kCuda),
        allocatable_(options.budget_bytes -
                     (cuda_ ? base.config.cuda_context_bytes : int64_t{0})) {}

  // Evaluate predicts the shape's ranks: the bound for every variant, then the peaks of
  // those the bound lets fit (`simulate_all`: of every variant, for the smallest-peak
  // message).
  Evaluated Evaluate(const Shape& shape, bool simulate_all = false) const {
    Evaluated out;
    const size_t n = base_.variants.size();
    out.bounds.assign(n, -1);
    ParallelSpec parallel{shape.dp, shape.pp, shape.virtual_stages, shape.micro_batches,
                          shape.zero,
                          shape.virtual_stages > 1 ? PipelineSchedule::kInterleaved
                                                   : PipelineSchedule::k1F1B,
                          DdpOptionsFor(shape), shape.fsdp ? fsdp_ : FsdpOptions{},
                          shape.tp, shape.sp, shape.ep};
    ModelConfig config = base_.config;
    config.batch = shape.micro_batch_size;
    config.shard = ShardOf(parallel);
    // The candidate's one validation: its config, its layout, its run; its two
    // predictions below take the proof.
    absl::StatusOr<ValidConfig> valid = ValidConfig::Of(config);
    absl::Status checked = valid.status();
    if (checked.ok()) checked = ValidateParallel(config, parallel);
    if (checked.ok()) {
      checked = ValidateRunOf(*valid, base_.attention, base_.variants, base_.optimizer);
    }
    if (!checked.ok()) {
      out.invalid = static_cast<int64_t>(n);
      out.refusal = std::string(checked.message());
      return out;
    }
    const ValidConfig ranks_config = valid->WithoutCache();  // a rank keeps no DynamicCache
    PredictOptions options;
    options.attention = base_.attention;
    options.optimizer = base_.optimizer;
    options.variants = base_.variants;
    options.peak = false;
    // On CUDA first as requests (Check replays the best through the allocator).
    options.cuda_blocks = CudaBlocks::kRequests;
    absl::StatusOr<RanksPrediction> ranks = PredictValidRanks(ranks_config, parallel, options);
    if (!ranks.ok()) {
      out.invalid = static_cast<int64_t>(n);
      out.refusal = std::string(ranks.status().message());
      return out;
    }
    if (absl::StatusOr<SearchedLayout> fastest =  // its step without recompute
            Layout(shape, *valid, Variant(), *ranks, ranks->kinds[0], 0);
        fastest.ok()) {
      out.none_time_s = fastest->time.total_s;
    }
    // The bound: what every rank holds at its fullest moment.
    std::vector<size_t> maybe;
    for (size_t v = 0; v < n; ++v) {
      int64_t bound = 0;
      for (const RankKind& kind : ranks->kinds) {
        bound = std::max(bound, kind.param_bytes + kind.optimizer_state_bytes +
                                    kind.variants[v].held.saved_bytes);
      }
      if (bound <= allocatable_ || simulate_all) {
        maybe.push_back(v);
      } else {
        ++out.too_big;
        out.bounds[v] = bound;
      }
    }
    if (maybe.empty()) return out;
    options.peak = true;
    options.variants.clear();
    for (size_t v : maybe) options.variants.push_back(base_.variants[v]);
    absl::StatusOr<RanksPrediction> peaks = PredictValidRanks(ranks_config, parallel, options);
    out.simulated = true;
    if (!peaks.ok()) {
      out.unmodelled += static_cast<int64_t>(maybe.size());
      out.refusal = std::string(peaks.status().message());
      return out;
    }
    for (size_t i = 0; i < maybe.size(); ++i) {
      const Variant& variant = base_.variants[maybe[i]];
      int64_t peak = -1;
      const RankKind* loaded = nullptr;
      for (const RankKind& kind : peaks->kinds) {
        const VariantPrediction& held = kind.variants[i].held;
        if (!held.peak.has_value()) {
          loaded = nullptr;
          if (out.refusal.empty()) out.refusal = held.peak_unavailable;
          break;
        }
        if (held.peak->bytes > peak) {
          peak = held.peak->bytes;
          loaded = &kind;
        }
      }
      if (loaded == nullptr) {
        ++out.unmodelled;
        continue;
      }
      if (peak > allocatable_) {
        ++out.too_big;
        out.smallest_peak =
            std::min(out.smallest_peak, peak + (options_.budget_bytes - allocatable_));
        continue;
      }
      absl::StatusOr<SearchedLayout> layout = Layout(shape, *valid, variant, *peaks, *loaded, peak);
      if (!layout.ok()) {
        ++out.invalid;
        continue;
      }
      if (cuda_) {
        layout->checked = false;
        layout->device_bytes = peak + (options_.budget_bytes - allocatable_);
      }
      out.fits.push_back(*std::move(layout));
    }
    return out;
  }

 private:
  // Layout times the shape under `variant` on its slowest stage.
  absl::StatusOr<SearchedLayout> Layout(const Shape& shape, const ValidConfig& valid,
                                        const Variant& variant, const RanksPrediction& ranks,
                                        const RankKind& loaded, int64_t peak) const {
    const ModelConfig& config = *valid;
    SearchedLayout layout;
    layout.tp = shape.tp;
    layout.pp = shape.pp;
    layout.dp = shape.dp;
    layout.zero = shape.zero;
    layout.ep = shape.ep;
    layout.fsdp = shape.fsdp;
    layout.sp = shape.sp;
    layout.micro_batch_size = shape.micro_batch_size;
    layout.micro_batches = shape.micro_batches;
    layout.virtual_stages = shape.virtual_stages;
    layout.checkpoint = variant;
    layout.peak_bytes = peak;
    layout.stage = loaded.stage;
    StepTimeInput in;
    in.tp = shape.tp;
    in.pp = shape.pp;
    in.dp = shape.dp;
    const RankShards shards =
        RankShardsOf(DataParallelOf(shape.dp, shape.zero, shape.ep, shape.fsdp));
    in.gathers_parameters = shards.parameters;
    in.ep = shape.ep;
    in.sp = shape.sp;
    in.micro_batch_size = shape.micro_batch_size;
    in.micro_batches = shape.micro_batches;
    in.virtual_stages = shape.virtual_stages;
    in.gpus_per_node = options_.gpus_per_node;
    in.seq = config.seq;
    in.width = config.width;
    // Under FSDP2's MixedPrecisionPolicy the graphs run, and the parameters are gathered,
    // in param_dtype.
    const DType compute = shape.fsdp ? fsdp_.param_dtype.value_or(config.dtype) : config.dtype;
    const DType activations = config.amp != DType::kFloat32 ? config.amp : compute;
    in.activation_element_bytes = ElementSizeBytes(activations);
    in.parameter_element_bytes = ElementSizeBytes(compute);
    in.low_precision_matmul = activations != DType::kFloat32;
    // The slowest stage sets the pipeline's pace; FLOPs of all ranks for the rate.
    double step_flops = 0;
    bool first = true;
    for (const RankKind& kind : ranks.kinds) {
      int64_t flops = 0;
      // An expert-parallel rank runs its own experts on what its tokens' routing sends.
      const ValidConfig rank = valid.ForExpertRank(kind.ep_group, kind.ep_rank);
      for (const StageRange& chunk : kind.chunks) {
        absl::StatusOr<StageFlopsCount> count = StageFlops(rank, base_.attention, variant, chunk);
        if (!count.ok()) return count.status();
        flops += count->Total();
      }
      // Each of the kind's ranks (a stage's tp x dp, or its share of expert-parallel
      // ranks) runs them.
      step_flops += static_cast<double>(flops) * static_cast<double>(kind.ranks);
      if (first || flops > in.stage_flops) {
        in.stage_flops = flops;
        in.tp_all_reduces = TpAllReduces(kind.chunks, variant);
        in.ep_all_to_alls = shape.ep > 1 ? EpAllToAlls(config, kind.chunks, variant) : 0;
        first = false;
      }
    }
    in.routed_rows = config.batch * config.seq * config.moe.top_k;
    in.expert_parameters = shape.ep > 1 ? ExpertParameters(config, base_.attention, loaded.chunks)
                                        : 0;
    in.stage_parameters = loaded.n_params;
    // A rank that shards the optimizer's state steps its shard (ZeRO's; FSDP2's
    // per-parameter shards are as many elements, but for their padding).
    in.stepped_elements = shards.optimizer_state ? ZeroShardElements(loaded.n_params, shape.dp)
                                                 : loaded.n_params;
    in.optimizer_state_bytes = loaded.optimizer_state_bytes;
    layout.time = PredictStepTime(options_.gpu, options_.mfu, in);
    // Per GPU: every rank's FLOPs, micro_batches times, over the GPUs.
    const double gpus = static_cast<double>(options_.gpus);
    const double per_step = step_flops * static_cast<double>(shape.micro_batches) / gpus;
    layout.tflops_per_gpu = per_step / layout.time.total_s / 1e12;
    const double peak_flops = in.low_precision_matmul ? options_.gpu.bf16_flops
                                                      : options_.gpu.fp32_flops;
    layout.mfu = model_flops_ * static_cast<double>(options_.global_batch) /
                 (layout.time.total_s * gpus * peak_flops);
    RunRequest request = RequestFor(shape);
    if (variant.kind == VariantKind::kPlan) {
      request.plan = PlanRunsText(variant);  // predict and verify take the plan inline
    } else {
      request.variants = variant.Name();
    }
    layout.flags = RequestFlags(request);
    return layout;
  }

 public:
  // Planned is `shape` with a checkpoint plan per stage (RunStagePlanner) within the
  // budget, timed as the variants are; nullopt when no plan fits.
  absl::StatusOr<std::optional<SearchedLayout>> Planned(const Shape& shape) const {
    absl::StatusOr<ValidRun> validated = ValidRunFromRequest(RequestFor(shape));
    if (!validated.ok()) return validated.status();
    // No fixed variants beside the plan: the search has them.
    const ValidRun run = validated->WithoutVariants();
    const RunSpec* spec = &run.spec();
    PlanRunOptions plan_options;
    plan_options.budget_bytes = options_.budget_bytes;
    plan_options.frontier_points = 0;
    absl::StatusOr<PlanReport> report = RunStagePlanner(run, plan_options);
    if (absl::IsResourceExhausted(report.status())) return std::nullopt;
    if (!report.ok()) return report.status();
    const Variant plan = PlanVariant(report->plan.layers);
    const std::vector<LayerChoice>& layers = report->plan.layers;
    if (std::all_of(layers.begin(), layers.end(),
                    [&](const LayerChoice& c) { return c == layers.front(); })) {
      return std::nullopt;  // one choice everywhere: a standard variant's layout
    }
    PredictOptions options;
    options.attention = base_.attention;
    options.optimizer = base_.optimizer;
    options.variants = {plan};
    absl::StatusOr<RanksPrediction> ranks =
        PredictValidRanks(run.config().WithoutCache(), spec->parallel, options);
    if (!ranks.ok()) return ranks.status();
    // On CUDA the planner replayed its plan through the allocator, and so does this.
    return Replayed(shape, run.config(), plan, *ranks);
  }

  // Check replays `layout` (a standard variant's, found as requests) through the caching
  // allocator's simulation: the layout as its ranks' blocks and reserved peaks say, or
  // nullopt when they do not fit (or have no peak).
  absl::StatusOr<std::optional<SearchedLayout>> Check(const SearchedLayout& found) const {
    const Shape shape = ShapeOf(found);
    // The layout validated once (its request), its ranks predicted from the proof.
    absl::StatusOr<ValidRun> run = ValidRunFromRequest(RequestFor(shape));
    if (!run.ok()) return run.status();
    PredictOptions options;
    options.attention = base_.attention;
    options.optimizer = base_.optimizer;
    options.variants = {found.checkpoint};
    absl::StatusOr<RanksPrediction> ranks =
        PredictValidRanks(run->config().WithoutCache(), run->spec().parallel, options);
    if (!ranks.ok()) return ranks.status();
    return Replayed(shape, run->config(), found.checkpoint, *ranks);
  }

 private:
  // Replayed is the layout of `ranks` (one variant, simulated): its most loaded rank's
  // peak and, on CUDA, its ranks' largest reserved peak and device bytes (checked);
  // nullopt when a rank has no peak or the device bytes exceed the budget.
  absl::StatusOr<std::optional<SearchedLayout>> Replayed(const Shape& shape,
                                                         const ValidConfig& valid,
                                                         const Variant& variant,
                                                         const RanksPrediction& ranks) const {
    const ModelConfig& config = *valid;
    const RankKind* loaded = nullptr;
    int64_t peak = -1, reserved = 0;
    for (const RankKind& kind : ranks.kinds) {
      const VariantPrediction& held = kind.variants[0].held;
      if (!held.peak.has_value()) return std::nullopt;
      reserved = std::max(reserved, held.peak_reserved_bytes);
      if (held.peak->bytes > peak) {
        peak = held.peak->bytes;
        loaded = &kind;
      }
    }
    absl::StatusOr<SearchedLayout> layout = Layout(shape, valid, variant, ranks, *loaded, peak);
    if (!layout.ok()) return layout.status();
    if (cuda_) {
      layout->peak_reserved_bytes = reserved;
      layout->device_bytes = reserved + config.cuda_context_bytes;
      if (layout->device_bytes > options_.budget_bytes) return std::nullopt;
    }
    return std::optional<SearchedLayout>(*std::move(layout));
  }

 private:

  // RequestFor is the search's request laid out as `shape` (predict's and verify's).
  RunRequest RequestFor(const Shape& shape) const {
    RunRequest request = request_;
    request.batch = shape.micro_batch_size;
    request.tp = shape.tp;
    request.sp = shape.sp;
    request.dp = shape.dp;
    request.pp = shape.pp;
    request.zero = shape.zero;
    request.ep = shape.ep;
    request.micro_batches = shape.micro_batches;
    request.virtual_stages = shape.virtual_stages;
    request.schedule = shape.virtual_stages > 1 ? "interleaved" : "1f1b";
    const DdpOptions ddp = DdpOptionsFor(shape);
    request.ddp_bucket_mb = ddp.bucket_cap_mb;
    request.gradient_as_bucket_view = ddp.gradient_as_bucket_view;
    return request;
  }

  // DdpOptionsFor: the request's DDP options on a layout that runs DDP; none elsewhere.
  DdpOptions DdpOptionsFor(const Shape& shape) const {
    if (!TorchDdp(shape.dp, shape.zero, shape.ep)) return {};
    return DdpOptions{request_.ddp_bucket_mb, request_.gradient_as_bucket_view};
  }

  const RunRequest& request_;
  const RunSpec& base_;
  const SearchOptions& options_;
  const FsdpOptions fsdp_;  // the request's, for the layouts that run FSDP2
  const double model_flops_;
  const bool cuda_;
  // allocatable_: what a rank's allocated peak may reach: the budget, less the CUDA
  // context on CUDA.
  const int64_t allocatable_;
};

// ForEach runs fn(i) for i in [0, n) over `threads` threads.
template <typename Fn>
void ForEach(size_t n, int threads, Fn fn) {
  std::atomic<size_t> next{0};
  auto work = [&]() {
    for (size_t i = next++; i < n; i = next++) fn(i);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
}

}  // namespace

absl::StatusOr<SearchOptions> SearchOptionsFrom(const SearchRequest& request) {
  absl::StatusOr<GpuSpec> gpu = GpuPreset(request.gpu);
  if (!gpu.ok()) return gpu.status();
  const double gib = request.gpu_memory_gib.value_or(gpu->memory_gib);
  const std::optional<int64_t> budget = GibToBytes(gib);
  if (!budget.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--gpu_memory_gib must be a positive number of GiB below 2^33, got ", gib));
  }
  if (request.threads < 0 || request.threads > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("--threads must be between 0 (the cores) and 1024, got ", request.threads));
  }
  SearchOptions options;
  options.gpus = request.gpus;
  options.gpus_per_node = request.gpus_per_node;
  options.budget_bytes = *budget;
  options.global_batch = request.global_batch;
  options.gpu = *gpu;
  options.mfu = request.mfu;
  options.max_virtual_stages = request.max_virtual_stages;
  options.threads = static_cast<int>(request.threads);
  if (request.planned_layouts < 0 || request.planned_layouts > 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--planned_layouts must be between 0 and 64, got ", request.planned_layouts));
  }
  options.planned_layouts = request.planned_layouts;
  if (request.checked_layouts < 0 || request.checked_layouts > 4096) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--checked_layouts must be between 0 and 4096, got ", request.checked_layouts));
  }
  options.checked_layouts = request.checked_layouts;
  options.fixed = request.fixed;
  return options;
}

namespace {

// CheckBest replays the best unchecked layouts through the caching allocator, a few at
// a time in parallel, until options.checked_layouts fit (a planned layout counts: its
// plan was replayed so); those that do not fit are dropped.
absl::Status CheckBest(const Search& search, const SearchOptions& options, int threads,
                       SearchResult* result) {
  std::vector<SearchedLayout>& layouts = result->layouts;
  int64_t fitting = 0;
  size_t next = 0;
  while (fitting < options.checked_layouts && next < layouts.size()) {
    // The next batch: as many unchecked layouts as are still needed (at least one per
    // thread), in rank order.
    std::vector<size_t> batch;
    for (; next < layouts.size() &&
           static_cast<int64_t>(batch.size()) <
               std::max<int64_t>(threads, options.checked_layouts - fitting);
         ++next) {
      if (layouts[next].checked) {
        ++fitting;
        if (fitting >= options.checked_layouts) break;
        continue;
      }
      batch.push_back(next);
    }
    std::vector<absl::StatusOr<std::optional<SearchedLayout>>> checked(batch.size());
    ForEach(batch.size(), threads,
            [&](size_t i) { checked[i] = search.Check(layouts[batch[i]]); });
    for (size_t i = 0; i < batch.size(); ++i) {
      if (!checked[i].ok()) return checked[i].status();
      ++result->checked;
      if (checked[i]->has_value()) {
        layouts[batch[i]] = **checked[i];
        ++fitting;
      } else {
        layouts[batch[i]].peak_bytes = -1;  // dropped below
        ++result->dropped_when_checked;
      }
    }
  }
  layouts.erase(std::remove_if(layouts.begin(), layouts.end(),
                               [](const SearchedLayout& l) { return l.peak_bytes < 0; }),
                layouts.end());
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SearchResult> SearchLayouts(const RunRequest& request,
                                           const SearchOptions& options) {
  if (options.gpus < 1 || options.gpus > kMaxSearchGpus) {
    return absl::InvalidArgumentError(absl::StrCat("--gpus must be from 1 to ", kMaxSearchGpus,
                                                   ", got ", options.gpus));
  }
  if (options.gpus_per_node < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--gpus_per_node must be >= 1, got ", options.gpus_per_node));
  }
  if (options.gpus > options.gpus_per_node && options.gpus % options.gpus_per_node != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--gpus ", options.gpus, " is not a multiple of --gpus_per_node ", options.gpus_per_node,
        " (whole nodes above one)"));
  }
  if (options.global_batch < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--global_batch must be >= 1, got ", options.global_batch));
  }
  if (options.budget_bytes < 1) {
    return absl::InvalidArgumentError("--gpu_memory_gib must be a positive number of GiB");
  }
  if (!(options.mfu > 0 && options.mfu <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--mfu must be in (0, 1], got ", options.mfu));
  }
  if (options.max_virtual_stages < 1 || options.max_virtual_stages > kMaxPipelineChunks) {
    // Each count up to it is tried per pipeline depth: bounded like the model chunks.
    return absl::InvalidArgumentError(
        absl::StrCat("--max_virtual_stages must be between 1 and ", kMaxPipelineChunks,
                     ", got ", options.max_virtual_stages));
  }
  const RunRequest defaults;
  for (const auto& [flag, set] :
       {std::pair<const char*, bool>{"tp", request.tp != defaults.tp},
        {"sp", request.sp},
        {"dp", request.dp != defaults.dp},
        {"pp", request.pp != defaults.pp},
        {"zero", request.zero != defaults.zero},
        {"micro_batches", request.micro_batches != defaults.micro_batches},
        {"virtual_stages", request.virtual_stages != defaults.virtual_stages},
        {"schedule", request.schedule != defaults.schedule}}) {
    if (set) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--", flag, ": the search chooses the layout (SearchOptions::fixed constrains it)"));
    }
  }
  if (request.ep != defaults.ep) {
    return absl::InvalidArgumentError(
        "--ep: the search chooses the layout (SearchOptions::fixed constrains it)");
  }
  if (!request.plan.empty()) {
    return absl::InvalidArgumentError(
        "--plan: the search chooses the checkpointing (the standard --variants, and plans "
        "of its own: --planned_layouts)");
  }
  if (request.routing != "balanced" && request.routing != "worst") {
    return absl::InvalidArgumentError(
        "--routing: a routing file holds one step's batch; the search changes the batch "
        "(use balanced or worst)");
  }
  if (request.offload != defaults.offload) {
    return absl::InvalidArgumentError(
        "--offload: the search's step time does not model the host's optimizer step and the "
        "copies to and from it yet (predict --offload=cpu answers for one layout)");
  }
  if (request.offload_activations != defaults.offload_activations) {
    return absl::InvalidArgumentError(
        "--offload_activations: the search's step time does not model the copies to and "
        "from host memory yet (predict and plan take it)");
  }
  RunRequest base_request = request;
  base_request.batch = 1;
  // DDP's options are its layouts' (LayoutSearch::DdpOptionsFor), not one GPU's; so are
  // FSDP2's with --fsdp (without it, one GPU's request refuses them, naming --fsdp).
  base_request.ddp_bucket_mb.reset();
  base_request.gradient_as_bucket_view = false;
  absl::StatusOr<FsdpOptions> fsdp = FsdpOptionsFrom(request);
  if (!fsdp.ok()) return fsdp.status();
  if (request.fsdp) {
    base_request.fsdp = false;
    base_request.reshard_after_forward = defaults.reshard_after_forward;
    base_request.mp_param_dtype.clear();
    base_request.mp_reduce_dtype.clear();
  }
  // The request's one validation (ValidRun): the search's whole-model numbers take the
  // proof; each layout then validates once as a candidate.
  absl::StatusOr<ValidRun> base_run = ValidRunFromRequest(base_request);
  if (!base_run.ok()) return base_run.status();
  const RunSpec* base = &base_run->spec();
  if (request.fsdp && options.gpus < 2) {
    return absl::InvalidArgumentError(
        "--fsdp shards over the data-parallel ranks: it needs --gpus > 1");
  }
  if (request.fsdp) {
    // The FSDP2 options against a layout of them all (their message, as predict's).
    ParallelSpec all_ranks;
    all_ranks.dp = std::max<int64_t>(options.gpus, 2);
    all_ranks.fsdp = *fsdp;
    if (absl::Status s = ValidateParallel(base->config, all_ranks); !s.ok()) return s;
  }
  if (options.fixed.ep.has_value()) {
    // --ep fixes the expert parallelism: the model must have it (predict's checks).
    ModelConfig with_ep = base->config;
    with_ep.shard.ep = *options.fixed.ep;
    if (absl::Status s = ValidateConfig(with_ep); !s.ok()) return s;
  }
  if (absl::Status s = CheckFixedLayout(options, base->config); !s.ok()) return s;
  // Every layout of more than one GPU is a rank's step, bounded (ValidateParallel): said
  // once here rather than as every layout refused.
  if (base->config.layers > kMaxRankLayers && options.gpus > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--layers ", base->config.layers, " is more than the ", kMaxRankLayers,
        " layers a rank's step is simulated with (every layout of ", options.gpus,
        " GPUs is one)"));
  }
  absl::StatusOr<StepFlops> model_flops = CountStepFlops(base_run->config(), base->attention);
  if (!model_flops.ok()) return model_flops.status();
  const Search search(request, *base, options, *fsdp, static_cast<double>(model_flops->total));
  const std::vector<Shape> shapes = Shapes(base->config, options, request.fsdp);
  if (shapes.empty()) {
    const LayoutConstraints& f = options.fixed;
    const bool constrained = f.tp || f.pp || f.dp || f.zero || f.micro_batch_size ||
                             f.virtual_stages || f.sp || f.ep;
    return absl::InvalidArgumentError(absl::StrCat(
        "--global_batch ", options.global_batch, " fits no layout of ", options.gpus,
        " GPUs", constrained ? " with the layout flags given" : "",
        ": it must be a multiple of the data-parallel size (GPUs / (tp x pp), pp "
        "dividing the ", base->config.layers, " layers, tp dividing a node's ",
        options.gpus_per_node, ")"));
  }
  std::vector<Evaluated> evaluated(shapes.size());
  const int threads = options.threads > 0
                          ? options.threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  ForEach(shapes.size(), threads, [&](size_t i) { evaluated[i] = search.Evaluate(shapes[i]); });

  SearchResult result;
  result.config = base->config;
  result.model = base->model;
  result.attention = base->attention;
  result.optimizer = base->optimizer;
  if (request.fsdp) result.fsdp = *fsdp;
  {
    PredictOptions whole;
    whole.attention = base->attention;
    whole.optimizer = base->optimizer;
    whole.variants = {Variant()};
    whole.peak = false;
    absl::StatusOr<Prediction> p = PredictValid(base_run->config(), whole);
    if (!p.ok()) return p.status();
    result.n_params = p->n_params;
    result.param_bytes = p->param_bytes;
    result.grad_bytes = p->grad_bytes;
    result.optimizer_state_bytes = p->optimizer_state_bytes;
    result.adamw_state_bytes = p->adamw_state_bytes;
  }
  int64_t smallest = std::numeric_limits<int64_t>::max();
  std::string refusal;  // the first refused shape's reason
  for (const Evaluated& e : evaluated) {
    if (refusal.empty()) refusal = e.refusal;
    result.candidates += static_cast<int64_t>(base->variants.size());
    result.invalid += e.invalid;
    result.too_big += e.too_big;
    result.unmodelled += e.unmodelled;
    result.simulated += e.simulated ? 1 : 0;
    smallest = std::min(smallest, e.smallest_peak);
    for (const SearchedLayout& layout : e.fits) result.layouts.push_back(layout);
  }
  if (result.layouts.empty()) {
    // The smallest peak of all: those never simulated only where their bound is below
    // the smallest simulated peak, smallest bound first.
    std::vector<std::pair<int64_t, size_t>> bounded;
    for (size_t i = 0; i < evaluated.size(); ++i) {
      int64_t least = std::numeric_limits<int64_t>::max();
      for (int64_t b : evaluated[i].bounds) {
        if (b >= 0) least = std::min(least, b);
      }
      if (least != std::numeric_limits<int64_t>::max()) bounded.push_back({least, i});
    }
    std::sort(bounded.begin(), bounded.end());
    for (const auto& [bound, i] : bounded) {
      if (bound >= smallest) break;
      const Evaluated all = search.Evaluate(shapes[i], /*simulate_all=*/true);
      smallest = std::min(smallest, all.smallest_peak);
      if (refusal.empty()) refusal = all.refusal;
    }
    if (smallest == std::numeric_limits<int64_t>::max()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "no layout of ", options.gpus, " GPUs is modelled for this model (", result.invalid,
          " refused, ", result.unmodelled, " without a simulated peak)",
          refusal.empty() ? "" : "; the first refused: ", refusal));
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "no layout of ", options.gpus, " GPUs fits ", HumanBytes(options.budget_bytes),
        " per GPU; the smallest peak of any layout is ", HumanBytes(smallest), " (",
        smallest, " bytes)"));
  }
  auto by_time = [](const SearchedLayout& a, const SearchedLayout& b) {
    auto key = [](const SearchedLayout& l) {
      return std::make_tuple(l.time.total_s, l.peak_bytes, l.tp, l.pp, l.dp, l.zero, l.sp,
                             l.micro_batch_size, l.virtual_stages, l.checkpoint.Name());
    };
    return key(a) < key(b);
  };
  std::sort(result.layouts.begin(), result.layouts.end(), by_time);
  // Plans per stage for the shapes that must recompute (some variant fits, none does
  // not) and could be fastest, their step without recompute (which no plan of theirs
  // beats) shorter than the best layout's. Taken in turn from two orders: by the time of
  // their fastest variant that fits (a plan does at least as well), and by that bound.
  const double best_s = result.layouts.front().time.total_s;
  std::vector<std::pair<double, size_t>> by_variant, by_bound;
  for (size_t i = 0; i < evaluated.size(); ++i) {
    const Evaluated& e = evaluated[i];
    if (e.fits.empty() || !(e.none_time_s < best_s)) continue;
    // The stage planner plans every data-parallel program but ZeRO 3's, and
    // expert-parallel ranks only where they receive alike (PlannedLayout).
    const Shape& shape = shapes[i];
    if (DataParallelOf(shape.dp, shape.zero, shape.ep, shape.fsdp) == DataParallel::kZero3 ||
        (shape.ep > 1 && base->config.moe.routing != RoutingSource::kBalanced)) {
      continue;
    }
    double fastest = std::numeric_limits<double>::infinity();
    bool none_fits = false;
    for (const SearchedLayout& l : e.fits) {
      none_fits = none_fits || !l.checkpoint.CheckpointsAnyLayer();
      fastest = std::min(fastest, l.time.total_s);
    }
    if (none_fits) continue;
    by_variant.push_back({fastest, i});
    by_bound.push_back({e.none_time_s, i});
  }
  std::sort(by_variant.begin(), by_variant.end());
  std::sort(by_bound.begin(), by_bound.end());
  std::vector<size_t> chosen;
  for (size_t k = 0; k < by_variant.size() &&
                     static_cast<int64_t>(chosen.size()) < options.planned_layouts;
       ++k) {
    for (size_t i : {by_variant[k].second, by_bound[k].second}) {
      if (static_cast<int64_t>(chosen.size()) < options.planned_layouts &&
          std::find(chosen.begin(), chosen.end(), i) == chosen.end()) {
        chosen.push_back(i);
      }
    }
  }
  std::vector<Shape> to_plan;
  for (size_t i : chosen) to_plan.push_back(shapes[i]);
  std::vector<absl::StatusOr<std::optional<SearchedLayout>>> planned(to_plan.size());
  ForEach(to_plan.size(), threads, [&](size_t i) { planned[i] = search.Planned(to_plan[i]); });
  for (absl::StatusOr<std::optional<SearchedLayout>>& p : planned) {
    if (!p.ok()) return p.status();
    ++result.planned;
    if (p->has_value()) result.layouts.push_back(**std::move(p));
  }
  std::sort(result.layouts.begin(), result.layouts.end(), by_time);
  result.cuda = base->config.device == Device::kCuda;
  if (result.cuda) {
    result.outside_allocator_bytes = base->config.cuda_context_bytes;
    if (absl::Status s = CheckBest(search, options, threads, &result); !s.ok()) return s;
    if (result.layouts.empty()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "no layout of ", options.gpus, " GPUs fits ", HumanBytes(options.budget_bytes),
          " per GPU once the caching allocator's reserve is replayed (",
          result.dropped_when_checked, " fitted as requests and were dropped)"));
    }
    std::sort(result.layouts.begin(), result.layouts.end(), by_time);
  }
  int64_t lowest = std::numeric_limits<int64_t>::max();
  for (SearchedLayout& layout : result.layouts) {
    layout.front = layout.peak_bytes < lowest;
    lowest = std::min(lowest, layout.peak_bytes);
  }
  return result;
}

}  // namespace memledger
