// planner: the checkpoint plan with the least recompute whose predicted step peak fits
// a memory budget, per layer, with the frontier of budgets and overheads.
#include <cmath>
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "estimator/atomic_file.h"
#include "estimator/cli_flags.h"
#include "estimator/predict.h"
#include "estimator/report.h"
#include "planner/flops.h"
#include "planner/frontier_svg.h"
#include "planner/plan_report.h"
#include "planner/planner.h"

ABSL_FLAG(double, budget_gib, 0,
          "The memory budget in GiB (2^30 bytes) the step's predicted peak must fit; "
          "required.");
ABSL_FLAG(int32_t, frontier_points, 9,
          "Budgets in the frontier, evenly from the smallest any plan fits to the peak "
          "without checkpointing; 0 for none.");
ABSL_FLAG(std::string, plan_out, "",
          "Also write the JSON report to this file, for verify --plan=FILE.");
ABSL_FLAG(double, flops_per_second, 0,
          "This machine's throughput, to predict step times (./bazelw run "
          "//runtime:runtime_benchmark prints it, measured once); 0: overheads only.");
ABSL_FLAG(std::string, frontier_svg, "",
          "Also draw the frontier (budget -> least overhead, the fixed variants, the plan) "
          "as an SVG chart to this file.");
ABSL_FLAG(int32_t, cpu_threads, 1,
          "LibTorch's intra-op threads on the CPU, which size some kernels' workspaces in "
          "the step's peak (a few KiB).");

namespace {

constexpr char kUsage[] =
    "Finds the checkpoint plan with the least recompute whose predicted training-step "
    "peak fits --budget_gib: each layer not checkpointed, checkpointed, or selective with "
    "any set of op kinds saved (matmul, attention, layer_norm, gelu, silu). Exact, by a "
    "dynamic program over layers on the step simulation's stretches.\n\n"
    "  ./bazelw run //planner -- --model=llama-3-8b --seq=8192 --budget_gib=80 "
    "--format=table\n\n"
    "Recompute is counted in FLOPs; the overhead is (step + recompute) / step.\n"
    "Exit status: 0 on success, 2 for bad input, 3 when no plan fits (the message gives "
    "the smallest budget that would).";

// Overhead of recomputing `recompute` on top of `step` FLOPs.
double Overhead(int64_t step, int64_t recompute) {
  return step > 0 ? (static_cast<double>(step) + static_cast<double>(recompute)) /
                        static_cast<double>(step)
                  : 1;
}

}  // namespace

int main(int argc, char** argv) {
  memledger::ParseCommandLineOrExit(argc, argv, kUsage);
  absl::StatusOr<memledger::RunSpec> spec = memledger::RunSpecFromFlags();
  if (!spec.ok()) return memledger::ReportError(spec.status());
  if (spec->format != "json" && spec->format != "table") {
    return memledger::ReportError(absl::InvalidArgumentError(
        absl::StrCat("--format must be json or table, got '", spec->format, "'")));
  }
  const double budget_gib = absl::GetFlag(FLAGS_budget_gib);
  const double budget = budget_gib * static_cast<double>(int64_t{1} << 30);
  if (!(budget_gib > 0) || !(budget < 9.2e18)) {
    return memledger::ReportError(absl::InvalidArgumentError(absl::StrCat(
        "--budget_gib must be a positive number of GiB below 2^33, got ", budget_gib)));
  }
  const int32_t points = absl::GetFlag(FLAGS_frontier_points);
  if (points < 0 || points == 1 || points > 1000) {
    return memledger::ReportError(absl::InvalidArgumentError(absl::StrCat(
        "--frontier_points must be 0 or between 2 and 1000, got ", points)));
  }
  const double flops_per_second = absl::GetFlag(FLAGS_flops_per_second);
  if (!(flops_per_second >= 0) || std::isinf(flops_per_second)) {
    return memledger::ReportError(absl::InvalidArgumentError(absl::StrCat(
        "--flops_per_second must be >= 0, got ", flops_per_second)));
  }

  memledger::PlannerOptions options;
  options.attention = spec->attention;
  options.optimizer = spec->optimizer;
  options.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  if (options.cpu_threads < 1) {
    return memledger::ReportError(absl::InvalidArgumentError(
        absl::StrCat("--cpu_threads must be >= 1, got ", options.cpu_threads)));
  }
  absl::StatusOr<memledger::Planner> planner =
      memledger::Planner::Create(spec->config, options);
  if (absl::IsUnimplemented(planner.status())) {
    // Not simulated yet (bf16, autocast): bad input here; exit 3 means "no plan fits".
    return memledger::ReportError(absl::InvalidArgumentError(planner.status().message()));
  }
  if (!planner.ok()) return memledger::ReportError(planner.status());

  memledger::PlanReport report;
  report.budget_bytes = static_cast<int64_t>(budget);
  report.flops_per_second = flops_per_second;
  // The standard variants beside the plan: --variants (default none, full, every_2,
  // selective with --policy), their peaks and recompute.
  memledger::PredictOptions predict;
  predict.attention = spec->attention;
  predict.optimizer = spec->optimizer;
  predict.variants = spec->variants;
  predict.cpu_threads = options.cpu_threads;
  absl::StatusOr<memledger::Prediction> prediction = memledger::Predict(spec->config, predict);
  if (!prediction.ok()) return memledger::ReportError(prediction.status());
  report.prediction = *prediction;
  const int64_t step = planner->step_flops().total;
  for (const memledger::VariantPrediction& v : prediction->variants) {
    memledger::VariantCost cost;
    cost.name = v.variant.Name();
    if (v.peak.has_value()) cost.peak_bytes = v.peak->bytes;
    for (int64_t i = 0; i < spec->config.layers; ++i) {
      absl::StatusOr<int64_t> flops =
          memledger::RecomputeFlops(spec->config, spec->attention, v.variant.At(i));
      if (!flops.ok()) return memledger::ReportError(flops.status());
      cost.recompute_flops += *flops;
    }
    cost.overhead = Overhead(step, cost.recompute_flops);
    report.variants.push_back(cost);
  }

  absl::StatusOr<memledger::PlanResult> plan = planner->Solve(report.budget_bytes);
  if (absl::IsResourceExhausted(plan.status())) {
    std::cerr << "error: " << plan.status().message() << "\n";
    return 3;
  }
  if (!plan.ok()) return memledger::ReportError(plan.status());
  report.plan = *plan;
  // Replay the plan itself: where its peak happens, and a check of the composition.
  predict.variants = {memledger::PlanVariant(plan->layers)};
  absl::StatusOr<memledger::Prediction> replayed = memledger::Predict(spec->config, predict);
  if (!replayed.ok()) return memledger::ReportError(replayed.status());
  if (const auto& peak = replayed->variants[0].peak; peak.has_value()) {
    if (peak->bytes != plan->peak_bytes) {
      return memledger::ReportError(absl::InternalError(absl::StrCat(
          "the plan's replayed peak ", peak->bytes, " differs from the composed ",
          plan->peak_bytes)));
    }
    report.plan_peak = *peak;
  }
  report.smallest_budget_bytes = planner->SmallestBudget();
  if (points > 0) {
    absl::StatusOr<std::vector<memledger::FrontierPoint>> frontier = planner->Frontier(points);
    if (!frontier.ok()) return memledger::ReportError(frontier.status());
    report.frontier = *frontier;
  }

  if (const std::string path = absl::GetFlag(FLAGS_frontier_svg); !path.empty()) {
    if (report.frontier.size() < 2) {
      return memledger::ReportError(
          absl::InvalidArgumentError("--frontier_svg needs --frontier_points >= 2"));
    }
    const memledger::ModelConfig& c = spec->config;
    const std::string title = absl::StrCat(
        "memledger planner: ", spec->model, ", ", c.layers, " layers, batch ", c.batch, ", seq ",
        c.seq, ", ", memledger::OptimizerName(spec->optimizer.kind));
    if (absl::Status s = memledger::WriteFileAtomically(path, memledger::FrontierSvg(title, report));
        !s.ok()) {
      return memledger::ReportError(s);
    }
  }
  const std::string json = memledger::JsonString(memledger::PlanReportJson(report));
  for (const std::string& path : {absl::GetFlag(FLAGS_plan_out), absl::GetFlag(FLAGS_json_out)}) {
    if (path.empty()) continue;
    if (absl::Status s = memledger::WriteFileAtomically(path, json); !s.ok()) {
      return memledger::ReportError(s);
    }
  }
  std::cout << (spec->table ? memledger::PlanReportTable(report) : json);
  return 0;
}
