#include "planner/plan_run.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/spec/option_checks.h"
#include "estimator/step/cuda_allocator.h"
#include "estimator/graph/block_graph.h"
#include "estimator/predict/predict.h"
#include "estimator/predict/ranks.h"
#include "estimator/report/report.h"
#include "estimator/report/timeline_svg.h"
#include "estimator/report/units.h"
#include "estimator/predict/flops.h"
#include "planner/planner.h"
#include "planner/stage_planner.h"

namespace memledger {

absl::Status ValidatePlanRunOptions(const PlanRunOptions& options) {
  // The CLIs and the C ABI give bytes from BudgetBytes; a library caller, its own.
  if (options.budget_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget_bytes must be positive, got ", options.budget_bytes));
  }
  if (absl::Status s = CheckFrontierPoints(options.frontier_points); !s.ok()) return s;
  if (absl::Status s = CheckCpuThreads(options.cpu_threads); !s.ok()) return s;
  if (!(options.flops_per_second >= 0) || options.flops_per_second > 1e30) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--flops_per_second must be >= 0, got ", options.flops_per_second));
  }
  return absl::OkStatus();
}

absl::Status PlannedLayout(const RunSpec& spec) {
  if (DataParallelOf(spec.parallel) == DataParallel::kZero3) {
    return absl::InvalidArgumentError(
        "--zero=3: the planner plans ZeRO 0-2 (ZeRO-3's gathers per layer unit are not "
        "planned yet)");
  }
  if (spec.parallel.ep > 1 && spec.config.moe.routing != RoutingSource::kBalanced) {
    // Each expert-parallel rank receives its own tokens: the ranks' steps differ, and
    // one plan (their all-to-alls must rerun together) would have to fit them all.
    return absl::InvalidArgumentError(
        "--ep: the planner plans expert-parallel ranks under --routing=balanced only, where "
        "every rank receives alike (predict --ep predicts each rank under the standard "
        "variants)");
  }
  return absl::OkStatus();
}

std::string FrontierTitle(const RunSpec& spec) {
  const ModelConfig& c = spec.config;
  return absl::StrCat("memledger planner: ", spec.model, ", ", c.layers, " layers, batch ",
                      c.batch, ", seq ", c.seq, ", ", OptimizerName(spec.optimizer.kind));
}

absl::StatusOr<std::string> PlanTimelineSvg(const RunSpec& spec, const PlanReport& report) {
  return PredictedTimelineSvg(
      absl::StrCat(PredictedStepTitle(spec.config.device), ": the plan"), report.plan_step);
}

absl::StatusOr<PlanReport> RunPlanner(const ValidRun& run, const PlanRunOptions& options) {
  const RunSpec& spec = run.spec();
  const ValidConfig& valid = run.config();
  if (absl::Status s = ValidatePlanRunOptions(options); !s.ok()) return s;
  if (absl::Status s = PlannedLayout(spec); !s.ok()) return s;
  const ParallelSpec& parallel = spec.parallel;
  if (options.timeline && parallel.Distributed()) {
    return absl::InvalidArgumentError(
        "--timeline_svg draws one process's planned step: not with --dp");
  }
  // Pipeline stages and accumulated micro-batches hold several micro-batches at once:
  // their plans are searched for and replayed stage by stage.
  if (parallel.pp > 1 || parallel.micro_batches > 1) return RunStagePlanner(run, options);
  PlannerOptions planner_options;
  planner_options.attention = spec.attention;
  planner_options.optimizer = spec.optimizer;
  planner_options.cpu_threads = options.cpu_threads;
  planner_options.parallel = parallel;
  absl::StatusOr<Planner> planner = Planner::Create(valid, planner_options);
  if (absl::IsUnimplemented(planner.status())) {
    // Not composed yet (autocast): the input is what cannot be planned.
    return absl::InvalidArgumentError(planner.status().message());
  }
  if (!planner.ok()) return planner.status();

  PlanReport report;
  report.budget_bytes = options.budget_bytes;
  report.parallel = parallel;
  report.flops_per_second = options.flops_per_second;
  // The fixed variants beside the plan, their peaks and recompute.
  PredictOptions predict;
  predict.attention = spec.attention;
  predict.optimizer = spec.optimizer;
  predict.variants = spec.variants;
  predict.cpu_threads = options.cpu_threads;
  // predicted: one process's prediction, or a data-parallel rank's (its buckets and
  // peaks, as PredictRanks replays them).
  auto predicted = [&](const PredictOptions& o) -> absl::StatusOr<Prediction> {
    if (!parallel.Distributed()) return PredictValid(valid, o);
    PredictOptions whole_options = o;
    whole_options.peak = false;
    absl::StatusOr<Prediction> whole = PredictValid(valid, whole_options);
    if (!whole.ok()) return whole.status();
    absl::StatusOr<RanksPrediction> ranks = PredictValidRanks(valid.WithoutCache(), parallel, o);
    if (!ranks.ok()) return ranks.status();
    Prediction rank = RankView(*whole, ranks->kinds[0]);
    for (size_t v = 0; v < rank.variants.size(); ++v) {
      rank.variants[v].peak = ranks->kinds[0].variants[v].held.peak;
      rank.variants[v].peak_reserved_bytes = ranks->kinds[0].variants[v].held.peak_reserved_bytes;
    }
    return rank;
  };
  absl::StatusOr<Prediction> prediction = predicted(predict);
  if (!prediction.ok()) return prediction.status();
  report.prediction = *prediction;
  for (const VariantPrediction& v : prediction->variants) {
    VariantCost cost;
    cost.name = v.variant.Name();
    if (v.peak.has_value()) cost.peak_bytes = v.peak->bytes;
    cost.peak_reserved_bytes = v.peak_reserved_bytes;
    absl::StatusOr<VariantRecompute> recompute = RecomputeOf(valid, spec.attention, v.variant);
    if (!recompute.ok()) return recompute.status();
    cost.recompute_flops = recompute->recompute_flops;
    cost.overhead = recompute->overhead;
    report.variants.push_back(cost);
  }

  // replay: a plan's step, simulated whole: where its peak happens, and a check of the
  // composition. On CUDA through the caching allocator, whose blocks are the composed
  // requests with expandable segments and at least them without.
  const bool cuda = spec.config.device == Device::kCuda;
  const int64_t outside = cuda ? spec.config.cuda_context_bytes : 0;
  auto replay = [&](const PlanResult& plan, bool timeline) -> absl::StatusOr<VariantPrediction> {
    PredictOptions o = predict;
    o.variants = {PlanVariant(plan.layers)};
    o.timeline = timeline;
    absl::StatusOr<Prediction> replayed = predicted(o);
    if (!replayed.ok()) return replayed.status();
    const VariantPrediction& v = replayed->variants[0];
    if (v.peak.has_value() &&
        (cuda && !spec.config.expandable_segments ? v.peak->bytes < plan.peak_bytes
                                                   : v.peak->bytes != plan.peak_bytes)) {
      return absl::InternalError(absl::StrCat("the plan's replayed peak ", v.peak->bytes,
                                              " differs from the composed ", plan.peak_bytes));
    }
    return v;
  };
  // The device's bytes under a plan: the allocator's reserved peak and what is outside it.
  auto device_bytes = [&](const VariantPrediction& v) { return v.peak_reserved_bytes + outside; };
  report.smallest_budget_bytes = planner->SmallestBudget();
  // On CUDA, a plan known to fit the least device: of the plan with the least composed
  // peak and all-full, the one whose replay needs less.
  std::optional<std::pair<PlanResult, VariantPrediction>> least;
  if (cuda) {
    absl::StatusOr<PlanResult> lowest = planner->Solve(report.smallest_budget_bytes);
    if (!lowest.ok()) return lowest.status();
    for (const PlanResult& candidate :
         {*lowest, planner->Evaluate(std::vector<int>(spec.config.layers, /*full=*/1))}) {
      absl::StatusOr<VariantPrediction> v = replay(candidate, options.timeline);
      if (!v.ok()) return v.status();
      if (!least.has_value() || device_bytes(*v) < device_bytes(least->second)) {
        least.emplace(candidate, *std::move(v));
      }
    }
    report.smallest_device_bytes = device_bytes(least->second);
    if (options.budget_bytes < report.smallest_device_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "no checkpoint plan fits ", HumanBytes(options.budget_bytes), " (",
          options.budget_bytes, " bytes) on cuda; the least found needs ",
          HumanBytes(report.smallest_device_bytes), " (", report.smallest_device_bytes,
          " bytes: the allocator's reserved peak and ", HumanBytes(outside), " outside it)"));
    }
  }
  // On CUDA the plan is made for a budget of composed requests, replayed, and made again
  // for a budget lower by what the replay exceeds (at least a 2 MiB segment) until the
  // device holds it (the allocator's rounding and segments only add to the requests),
  // or the budget passes below every plan's, where the least one found fits.
  int64_t planned_within = options.budget_bytes - outside;
  absl::StatusOr<PlanResult> plan;
  absl::StatusOr<VariantPrediction> replayed;
  for (int attempt = 0;; ++attempt) {
    if (cuda && planned_within < report.smallest_budget_bytes) {
      plan = least->first;
      replayed = least->second;
      break;
    }
    plan = planner->Solve(planned_within);
    if (!plan.ok()) return plan.status();
    replayed = replay(*plan, options.timeline);
    if (!replayed.ok()) return replayed.status();
    if (!cuda || device_bytes(*replayed) <= options.budget_bytes) break;
    int64_t step = std::max<int64_t>(device_bytes(*replayed) - options.budget_bytes,
                                     kCudaSmallBuffer);
    // After a few tries, halve the distance to the least plan: a bounded search.
    if (attempt >= 4) step = std::max(step, (planned_within - report.smallest_budget_bytes) / 2);
    planned_within -= step;
  }
  report.plan = *plan;
  if (replayed->peak.has_value()) report.plan_peak = *replayed->peak;
  if (cuda) {
    report.plan_reserved_bytes = replayed->peak_reserved_bytes;
    report.outside_allocator_bytes = outside;
    report.plan_device_bytes = device_bytes(*replayed);
  }
  if (options.timeline) report.plan_step = {*replayed};
  if (options.frontier_points > 0) {
    absl::StatusOr<std::vector<FrontierPoint>> frontier =
        planner->Frontier(static_cast<int>(options.frontier_points));
    if (!frontier.ok()) return frontier.status();
    report.frontier = *frontier;
  }
  return report;
}

}  // namespace memledger
