#include "planner/stage_planner.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/graph/block_graph.h"
#include "estimator/graph/family.h"
#include "estimator/predict/predict.h"
#include "estimator/predict/ranks.h"
#include "estimator/report/report.h"
#include "estimator/report/units.h"
#include "estimator/predict/flops.h"
#include "planner/planner.h"

namespace memledger {
namespace {

// A stage's layers, in its chunks' order.
std::vector<int64_t> StageLayers(const std::vector<StageRange>& chunks) {
  std::vector<int64_t> layers;
  for (const StageRange& chunk : chunks) {
    for (int64_t l = 0; l < chunk.layers; ++l) layers.push_back(chunk.first_layer + l);
  }
  return layers;
}

// Guide is a stage's single-process planner and its search over the budgets it plans
// for: the guide's plan has less recompute the higher its budget, so the search looks
// for the highest budget whose plan the stage's replay fits.
struct Guide {
  const Planner* planner = nullptr;
  int64_t trial = 0;  // the budget planned for in this round
  // fits: the highest budget whose plan fitted (none yet: every layer fully
  // checkpointed, which fits); fails: the lowest whose plan did not.
  std::optional<int64_t> fits;
  std::optional<int64_t> fails;
  std::vector<LayerChoice> fitting;  // the plan at `fits`, or all-full
  bool done = false;
};

// Tolerance of the budget search: the budget / 4096 (about 20 MiB of 80 GiB).
int64_t Tolerance(int64_t budget) { return std::max<int64_t>(1, budget / 4096); }

// OneProcess is one process's prediction as the ranks of a layout with one stage and
// one micro-batch: what the search replays when there is no pipeline.
RanksPrediction OneProcess(const Prediction& p) {
  RanksPrediction ranks;
  RankKind kind;
  kind.ranks = 1;
  kind.chunks = {WholeModel(p.config)};
  for (const VariantPrediction& v : p.variants) kind.variants.push_back(RankVariant{v, 1});
  ranks.kinds.push_back(std::move(kind));
  return ranks;
}

}  // namespace

absl::StatusOr<PlanReport> RunStagePlanner(const ValidRun& run, const PlanRunOptions& options) {
  if (absl::Status s = ValidatePlanRunOptions(options); !s.ok()) return s;
  const RunSpec& spec = run.spec();
  const ValidConfig& valid = run.config();
  const ModelConfig& config = *valid;
  const ParallelSpec& parallel = spec.parallel;
  if (absl::Status s = PlannedLayout(spec); !s.ok()) return s;
  if (options.timeline && (parallel.Distributed() || parallel.micro_batches > 1)) {
    return absl::InvalidArgumentError(
        "--timeline_svg draws one process's planned step: not with --pp or --micro_batches");
  }
  const bool cuda = config.device == Device::kCuda;
  const int64_t outside = cuda ? config.cuda_context_bytes : 0;
  PredictOptions predict;
  predict.attention = spec.attention;
  predict.optimizer = spec.optimizer;
  predict.cpu_threads = options.cpu_threads;
  // What a stage's rank needs under a variant: its replayed peak, or on CUDA the
  // allocator's reserved peak and what is outside it.
  auto need = [&](const RankVariant& v) -> int64_t {
    return cuda ? v.held.peak_reserved_bytes + outside : v.held.peak->bytes;
  };
  // One process (layers that differ, no layout) is predicted as predict does, with
  // transformers' DynamicCache where it keeps one; a layout's ranks as PredictRanks does.
  const bool one_process = !parallel.Distributed() && parallel.micro_batches <= 1;
  auto ranks_of = [&](const std::vector<Variant>& variants,
                      CudaBlocks blocks =
                          CudaBlocks::kAllocator) -> absl::StatusOr<RanksPrediction> {
    PredictOptions o = predict;
    o.variants = variants;
    o.cuda_blocks = blocks;
    absl::StatusOr<RanksPrediction> ranks;
    if (one_process) {
      absl::StatusOr<Prediction> p = PredictValid(valid, o);
      if (!p.ok()) return p.status();
      ranks = OneProcess(*p);
    } else {
      ranks = PredictValidRanks(valid.WithoutCache(), parallel, o);
    }
    if (!ranks.ok()) return ranks.status();
    for (const RankKind& kind : ranks->kinds) {
      for (const RankVariant& v : kind.variants) {
        if (!v.held.peak.has_value()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "the planner needs each stage's simulated peak: ", v.held.peak_unavailable));
        }
      }
    }
    // By stage, not by load.
    std::sort(ranks->kinds.begin(), ranks->kinds.end(),
              [](const RankKind& a, const RankKind& b) { return a.stage < b.stage; });
    return ranks;
  };

  PlanReport report;
  report.budget_bytes = options.budget_bytes;
  report.parallel = parallel;
  report.flops_per_second = options.flops_per_second;
  report.outside_allocator_bytes = outside;

  // The fixed variants on every stage; each shown at its most loaded stage.
  PredictOptions whole_options = predict;
  whole_options.variants = spec.variants.empty() ? std::vector<Variant>{Variant()} : spec.variants;
  whole_options.peak = false;
  absl::StatusOr<Prediction> whole = PredictValid(valid, whole_options);
  if (!whole.ok()) return whole.status();
  // No fixed variants (the layout search's plans): the whole model's buckets only.
  absl::StatusOr<RanksPrediction> fixed =
      spec.variants.empty() ? absl::StatusOr<RanksPrediction>(RanksPrediction())
                            : ranks_of(spec.variants);
  if (!fixed.ok()) return fixed.status();
  report.prediction =
      one_process || fixed->kinds.empty() ? *whole : RankView(*whole, fixed->kinds[0]);
  for (size_t v = 0; v < spec.variants.size(); ++v) {
    const RankKind* most = &fixed->kinds[0];
    for (const RankKind& kind : fixed->kinds) {
      if (need(kind.variants[v]) > need(most->variants[v])) most = &kind;
    }
    VariantCost cost;
    cost.name = spec.variants[v].Name();
    cost.peak_bytes = most->variants[v].held.peak->bytes;
    cost.peak_reserved_bytes = most->variants[v].held.peak_reserved_bytes;
    absl::StatusOr<VariantRecompute> recompute =
        RecomputeOf(valid, spec.attention, spec.variants[v]);
    if (!recompute.ok()) return recompute.status();
    cost.recompute_flops = recompute->recompute_flops;
    cost.overhead = recompute->overhead;
    report.variants.push_back(cost);
    report.prediction.variants[v].peak = most->variants[v].held.peak;
    report.prediction.variants[v].peak_reserved_bytes = most->variants[v].held.peak_reserved_bytes;
  }

  // Every layer fully checkpointed: the least any stage falls back to. If it does not
  // fit some stage, no plan the search makes does.
  Variant all_full;
  all_full.kind = VariantKind::kFull;
  absl::StatusOr<RanksPrediction> full = ranks_of({all_full});
  if (!full.ok()) return full.status();
  int64_t full_need = 0;
  for (const RankKind& kind : full->kinds) {
    full_need = std::max(full_need, need(kind.variants[0]));
    if (need(kind.variants[0]) > options.budget_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "no checkpoint plan fits ", HumanBytes(options.budget_bytes), " (",
          options.budget_bytes, " bytes)",
          one_process ? std::string() : absl::StrCat(" on pipeline stage ", kind.stage),
          ": every layer fully checkpointed, it needs ", HumanBytes(need(kind.variants[0])),
          " (", need(kind.variants[0]), " bytes", cuda ? ", reserved and outside the allocator" : "",
          ")"));
    }
  }
  report.smallest_budget_bytes = full_need;
  report.smallest_device_bytes = cuda ? full_need : 0;

  // Each stage's guide: the single-process planner on its layers alone at its
  // micro-batches in flight (ModelConfig::LayersAlone; one guide per distinct model).
  PlannerOptions planner_options;
  planner_options.attention = spec.attention;
  planner_options.optimizer = spec.optimizer;
  planner_options.cpu_threads = options.cpu_threads;
  planner_options.parallel.dp = parallel.dp;
  planner_options.parallel.zero = parallel.zero;
  planner_options.parallel.tp = parallel.tp;  // the guide's model is the rank's shard
  planner_options.parallel.sp = parallel.sp;
  planner_options.parallel.ep = parallel.ep;
  std::vector<std::pair<ModelConfig, std::unique_ptr<Planner>>> planners;
  std::vector<Guide> guides;
  for (const RankKind& kind : full->kinds) {
    // With expert parallelism a stage has a kind of rank per expert-parallel rank
    // (sorted by stage): they share its plan.
    if (!report.stages.empty() && report.stages.back().stage == kind.stage) continue;
    StagePlan stage;
    stage.stage = kind.stage;
    stage.chunks = kind.chunks;
    stage.in_flight = std::max<int64_t>(1, kind.variants[0].in_flight);
    const ModelConfig alone = config.LayersAlone(StageLayers(kind.chunks), stage.in_flight);
    auto it = std::find_if(planners.begin(), planners.end(),
                           [&](const auto& entry) { return entry.first == alone; });
    if (it == planners.end()) {
      absl::StatusOr<Planner> planner = Planner::Create(alone, planner_options);
      if (!planner.ok()) return planner.status();
      planners.emplace_back(alone, std::make_unique<Planner>(*std::move(planner)));
      it = std::prev(planners.end());
    }
    Guide guide;
    guide.planner = it->second.get();
    guides.push_back(std::move(guide));
    report.stages.push_back(std::move(stage));
  }

  // most_loaded_of: stage s's rank in a replay that `measure` finds the most loaded (its
  // expert-parallel ranks' kinds share the stage's plan).
  auto most_loaded_of = [&](const RanksPrediction& r, size_t s,
                            auto measure) -> const RankVariant& {
    const RankVariant* most = nullptr;
    for (const RankKind& kind : r.kinds) {
      if (kind.stage != report.stages[s].stage) continue;
      if (most == nullptr || measure(kind.variants[0]) > measure(*most)) most = &kind.variants[0];
    }
    return *most;
  };

  absl::StatusOr<StepFlops> flops = CountStepFlops(valid, spec.attention);
  if (!flops.ok()) return flops.status();
  // Plan every stage, replay them all, and move each stage's budget: up while its plan
  // fits (towards none's peak), down by the excess while it does not (to its guide's
  // least plan), then halving the gap between the two.
  // On CUDA the search replays requests (CudaBlocks::kRequests: a lower bound of the
  // allocated bytes, several times cheaper than the allocator, which replays every
  // micro-batch), each stage needing its requests and the context within `searched`;
  // the plan it settles on is then replayed through the allocator, and where its
  // reserved bytes and the context exceed the budget the search runs again below by the
  // excess (at least 2 MiB; after 4 tries every layer fully checkpointed, which fits).
  const CudaBlocks search_blocks = cuda ? CudaBlocks::kRequests : CudaBlocks::kAllocator;
  auto search_need = [&](const RankVariant& v) { return v.held.peak->bytes + outside; };
  std::vector<LayerChoice> plan(config.layers);
  std::optional<RanksPrediction> fitted;  // the last replay where every stage fitted
  int64_t searched = options.budget_bytes;
  for (int attempt = 0;; ++attempt) {
    for (size_t s = 0; s < guides.size(); ++s) {
      Guide& guide = guides[s];
      const int64_t least = guide.planner->SmallestBudget();
      const int64_t most = std::max(least, guide.planner->PeakOf(std::vector<int>(
                                               StageLayers(report.stages[s].chunks).size(), 0)));
      const Planner* planner = guide.planner;
      guide = Guide();
      guide.planner = planner;
      guide.trial = std::clamp(searched - outside, least, most);
      guide.fitting.assign(StageLayers(report.stages[s].chunks).size(), LayerChoice{true, {}});
    }
    const int64_t tolerance = Tolerance(searched);
    fitted.reset();
    for (int round = 0;; ++round) {
      bool searching = false;
      for (size_t s = 0; s < guides.size(); ++s) {
        Guide& guide = guides[s];
        StagePlan& stage = report.stages[s];
        stage.layers = guide.fitting;
        if (!guide.done) {
          absl::StatusOr<PlanResult> planned = guide.planner->Solve(guide.trial);
          if (!planned.ok()) return planned.status();
          stage.layers = planned->layers;
          ++stage.attempts;
          searching = true;
        }
        const std::vector<int64_t> layers = StageLayers(stage.chunks);
        for (size_t i = 0; i < layers.size(); ++i) plan[layers[i]] = stage.layers[i];
      }
      absl::StatusOr<RanksPrediction> replayed = ranks_of({PlanVariant(plan)}, search_blocks);
      if (!replayed.ok()) return replayed.status();
      if (!searching) {
        fitted = *std::move(replayed);
        break;
      }
      for (size_t s = 0; s < guides.size(); ++s) {
        Guide& guide = guides[s];
        if (guide.done) continue;
        const int64_t excess =
            search_need(most_loaded_of(*replayed, s, search_need)) - searched;
        const int64_t least = guide.planner->SmallestBudget();
        const int64_t most = guide.planner->PeakOf(
            std::vector<int>(StageLayers(report.stages[s].chunks).size(), 0));
        if (excess <= 0) {
          guide.fits = guide.trial;
          guide.fitting = report.stages[s].layers;
        } else {
          guide.fails = guide.trial;
        }
        if (!guide.fails.has_value()) {  // none's plan fits, or climbing towards it
          guide.done = guide.trial >= most;
          guide.trial = most;
        } else if (!guide.fits.has_value()) {  // descending by the excess
          guide.done = guide.trial <= least;
          guide.trial = std::max(least, guide.trial - std::max<int64_t>(excess, tolerance));
        } else {
          guide.trial = *guide.fits + (*guide.fails - *guide.fits) / 2;
        }
        if (guide.fits.has_value() && guide.fails.has_value() &&
            *guide.fails - *guide.fits <= tolerance) {
          guide.done = true;
        }
        if (round >= 64) guide.done = true;  // bounded: keep what fits
      }
    }
    if (!cuda) break;
    // The allocator's replay of the plan found with requests.
    for (size_t s = 0; s < guides.size(); ++s) {
      const std::vector<int64_t> layers = StageLayers(report.stages[s].chunks);
      for (size_t i = 0; i < layers.size(); ++i) plan[layers[i]] = guides[s].fitting[i];
    }
    absl::StatusOr<RanksPrediction> checked = ranks_of({PlanVariant(plan)});
    if (!checked.ok()) return checked.status();
    int64_t excess = 0;
    for (const RankKind& kind : checked->kinds) {
      excess = std::max(excess, need(kind.variants[0]) - options.budget_bytes);
    }
    if (excess <= 0 || attempt >= 4) {
      if (excess > 0) {  // every layer fully checkpointed: it fits (checked above)
        for (size_t s = 0; s < guides.size(); ++s) {
          report.stages[s].layers.assign(StageLayers(report.stages[s].chunks).size(),
                                         LayerChoice{true, {}});
        }
        std::fill(plan.begin(), plan.end(), LayerChoice{true, {}});
        checked = ranks_of({PlanVariant(plan)});
        if (!checked.ok()) return checked.status();
      }
      fitted = *std::move(checked);
      break;
    }
    searched -= std::max<int64_t>(excess, int64_t{2} << 20);
  }
  for (size_t s = 0; s < guides.size(); ++s) {
    const RankVariant& v = most_loaded_of(*fitted, s, need);
    StagePlan& stage = report.stages[s];
    stage.peak_bytes = v.held.peak->bytes;
    stage.peak_reserved_bytes = v.held.peak_reserved_bytes;
    stage.peak_op = v.held.peak->op;
    if (need(v) > options.budget_bytes) {  // every stage's plan fitted its replay
      return absl::InternalError(absl::StrCat("pipeline stage ", stage.stage,
                                              " exceeds the budget under its fitting plan"));
    }
  }
  // The most loaded stage's peak is the plan's.
  const RankVariant* most_loaded = &fitted->kinds[0].variants[0];
  for (const RankKind& kind : fitted->kinds) {
    if (need(kind.variants[0]) > need(*most_loaded)) most_loaded = &kind.variants[0];
  }
  report.plan_peak = most_loaded->held.peak;
  if (cuda) {
    report.plan_reserved_bytes = most_loaded->held.peak_reserved_bytes;
    report.plan_device_bytes = need(*most_loaded);
  }

  // The plan's costs, per micro-batch (every micro-batch recomputes alike).
  report.plan.layers = plan;
  report.plan.peak_bytes = report.plan_peak->bytes;
  report.plan.step_flops = flops->total;
  // Each stage's chunks under the whole plan, each layer by its own kind (an MoE's
  // sparse layers recompute their router and experts).
  const Variant planned = PlanVariant(plan);
  for (StagePlan& stage : report.stages) {
    for (const StageRange& chunk : stage.chunks) {
      absl::StatusOr<StageFlopsCount> count = StageFlops(valid, spec.attention, planned, chunk);
      if (!count.ok()) return count.status();
      stage.recompute_flops += count->recompute;
    }
    report.plan.recompute_flops += stage.recompute_flops;
  }
  report.searched = true;
  if (one_process) {
    report.stages.clear();  // one process: its plan is the whole model's
    if (options.timeline) {
      PredictOptions o = predict;
      o.variants = {PlanVariant(plan)};
      o.timeline = true;
      absl::StatusOr<Prediction> drawn = PredictValid(valid, o);
      if (!drawn.ok()) return drawn.status();
      report.plan_step = drawn->variants;
    }
  }
  report.plan.overhead =
      flops->total > 0 ? (static_cast<double>(flops->total) +
                          static_cast<double>(report.plan.recompute_flops)) /
                             static_cast<double>(flops->total)
                       : 1;
  return report;
}

}  // namespace memledger
