#include "planner/plan_run.h"

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/predict.h"
#include "estimator/ranks.h"
#include "estimator/report.h"
#include "estimator/timeline_svg.h"
#include "planner/flops.h"
#include "planner/planner.h"

namespace memledger {

absl::Status ValidatePlanRunOptions(const PlanRunOptions& options) {
  if (options.budget_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--budget_gib must be a positive number of GiB, got ",
                     options.budget_bytes, " bytes"));
  }
  if (options.frontier_points < 0 || options.frontier_points == 1 ||
      options.frontier_points > 1000) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--frontier_points must be 0 or between 2 and 1000, got ", options.frontier_points));
  }
  if (options.cpu_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cpu_threads must be >= 1, got ", options.cpu_threads));
  }
  if (!(options.flops_per_second >= 0) || options.flops_per_second > 1e30) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--flops_per_second must be >= 0, got ", options.flops_per_second));
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

absl::StatusOr<PlanReport> RunPlanner(const RunSpec& spec, const PlanRunOptions& options) {
  if (absl::Status s = ValidatePlanRunOptions(options); !s.ok()) return s;
  const ParallelSpec& parallel = spec.parallel;
  if (options.timeline && parallel.Distributed()) {
    return absl::InvalidArgumentError(
        "--timeline_svg draws one process's planned step: not with --dp");
  }
  if (parallel.pp > 1 || parallel.micro_batches > 1 || parallel.zero >= 3) {
    return absl::InvalidArgumentError(
        "--pp, --micro_batches and --zero=3: the planner plans one data-parallel rank "
        "(--dp with ZeRO 0-2) of one micro-batch, not pipeline stages or accumulation yet");
  }
  PlannerOptions planner_options;
  planner_options.attention = spec.attention;
  planner_options.optimizer = spec.optimizer;
  planner_options.cpu_threads = options.cpu_threads;
  planner_options.parallel = parallel;
  absl::StatusOr<Planner> planner = Planner::Create(spec.config, planner_options);
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
    if (!parallel.Distributed()) return Predict(spec.config, o);
    PredictOptions whole_options = o;
    whole_options.peak = false;
    absl::StatusOr<Prediction> whole = Predict(spec.config, whole_options);
    if (!whole.ok()) return whole.status();
    absl::StatusOr<RanksPrediction> ranks = PredictRanks(spec.config, parallel, o);
    if (!ranks.ok()) return ranks.status();
    Prediction rank = RankView(*whole, ranks->kinds[0]);
    for (size_t v = 0; v < rank.variants.size(); ++v) {
      rank.variants[v].peak = ranks->kinds[0].variants[v].held.peak;
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
    absl::StatusOr<VariantRecompute> recompute = RecomputeOf(spec.config, spec.attention, v.variant);
    if (!recompute.ok()) return recompute.status();
    cost.recompute_flops = recompute->recompute_flops;
    cost.overhead = recompute->overhead;
    report.variants.push_back(cost);
  }

  absl::StatusOr<PlanResult> plan = planner->Solve(options.budget_bytes);
  if (!plan.ok()) return plan.status();
  report.plan = *plan;
  // Replay the plan itself: where its peak happens, and a check of the composition.
  predict.variants = {PlanVariant(plan->layers)};
  predict.timeline = options.timeline;
  absl::StatusOr<Prediction> replayed = predicted(predict);
  if (!replayed.ok()) return replayed.status();
  if (const auto& peak = replayed->variants[0].peak; peak.has_value()) {
    if (peak->bytes != plan->peak_bytes) {
      return absl::InternalError(absl::StrCat("the plan's replayed peak ", peak->bytes,
                                              " differs from the composed ", plan->peak_bytes));
    }
    report.plan_peak = *peak;
  }
  if (options.timeline) report.plan_step = replayed->variants;
  report.smallest_budget_bytes = planner->SmallestBudget();
  if (options.frontier_points > 0) {
    absl::StatusOr<std::vector<FrontierPoint>> frontier =
        planner->Frontier(options.frontier_points);
    if (!frontier.ok()) return frontier.status();
    report.frontier = *frontier;
  }
  return report;
}

}  // namespace memledger
