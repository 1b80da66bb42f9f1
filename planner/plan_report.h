// The checkpoint planner's report: JSON (the plan per layer, its predicted peak and
// recompute, the standard variants beside it, the frontier) and a table, and the
// reader of a plan file that verify --plan runs.
//
// Example:
//   PlanReport report{...};
//   std::cout << JsonString(PlanReportJson(report));
//   absl::StatusOr<Variant> plan = ParsePlanJson(text);  // {"plan": ["none", ...]}
#ifndef PLANNER_PLAN_REPORT_H_
#define PLANNER_PLAN_REPORT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "estimator/spec/config.h"
#include "estimator/request/parallel_spec.h"
#include "estimator/predict/predict.h"
#include "estimator/request/plan_file.h"  // ParsePlanJson, ReadPlan: plan files
#include "planner/planner.h"
#include "rapidjson/document.h"

namespace memledger {

// VariantCost is one standard variant's predicted peak and recompute overhead.
struct VariantCost {
  std::string name;
  std::optional<int64_t> peak_bytes;  // absent where the peak is not simulated
  int64_t peak_reserved_bytes = 0;    // on --device=cuda: max_memory_reserved()
  int64_t recompute_flops = 0;
  double overhead = 1;
};

// StagePlan is one pipeline stage's part of a staged plan (stage_planner.h).
struct StagePlan {
  int64_t stage = 0;
  std::vector<StageRange> chunks;  // the layers it runs
  int64_t in_flight = 0;           // micro-batches its schedule holds at once, at most
  std::vector<LayerChoice> layers;  // its layers' choices, in the chunks' order
  int64_t peak_bytes = 0;           // its rank's step, replayed (cuda: allocated)
  int64_t peak_reserved_bytes = 0;  // cuda: max_memory_reserved()
  std::string peak_op;              // where its peak happens
  int64_t recompute_flops = 0;      // per micro-batch, its layers'
  int attempts = 0;                 // how many plans its search replayed
};

struct PlanReport {
  Prediction prediction;  // the model's buckets (and the standard variants' peaks)
  int64_t budget_bytes = 0;
  PlanResult plan;
  // plan_peak: where the plan's peak happens, from the step simulation's replay of the
  // plan (equal in bytes to plan.peak_bytes, which the planner composed).
  std::optional<StepPeak> plan_peak;
  // On --device=cuda the plan is composed from requests rounded to 512 B
  // (CudaBlocks::kRequests): plan.peak_bytes, the frontier's peaks and the smallest
  // budget count so, which is max_memory_allocated() exactly with expandable segments.
  // The plan's replay through the caching allocator gives its allocated peak
  // (plan_peak), its reserved peak, and with the memory outside the allocator what the
  // device must hold, which the budget holds.
  int64_t plan_reserved_bytes = 0;
  int64_t outside_allocator_bytes = 0;
  int64_t plan_device_bytes = 0;  // plan_reserved_bytes + outside_allocator_bytes
  // smallest_device_bytes: on cuda, what the plan of the least composed peak needs on
  // the device (replayed), a budget known to fit.
  int64_t smallest_device_bytes = 0;
  int64_t smallest_budget_bytes = 0;
  std::vector<VariantCost> variants;
  std::vector<FrontierPoint> frontier;
  double flops_per_second = 0;  // > 0: also predict step times
  // parallel: the data-parallel layout whose one rank is planned (dp 1: one process).
  ParallelSpec parallel;
  // plan_step: with PlanRunOptions::timeline, the plan's replay with its recorded step.
  std::vector<VariantPrediction> plan_step;
  // stages: with --pp or --micro_batches, each stage's plan (`plan` is the whole model's
  // choices, peak_bytes the most loaded stage's); no frontier.
  std::vector<StagePlan> stages;
  // searched: the plan was searched for and replayed (pipeline stages, layers that
  // differ: stage_planner.h), not composed; there is no frontier.
  bool searched = false;
};

// PlanRuns is a plan as runs of equal choices: "0-3 full", "4 selective:matmul"; its
// layers numbered from `first`.
std::vector<std::string> PlanRuns(const std::vector<LayerChoice>& layers, int64_t first = 0);

// StageRuns is a stage's plan as runs, chunk by chunk, numbered as the model's layers.
std::vector<std::string> StageRuns(const StagePlan& stage);

// PlanReportJson: the study's head (config, attention, optimizer, parameter buckets),
// then budget_bytes, plan (one choice name per layer), peak_bytes, peak (phase, op,
// by_category), recompute_flops,
// step_flops, overhead, smallest_budget_bytes, variants {name: {peak_bytes,
// recompute_flops, overhead}}, frontier [{budget_bytes, peak_bytes, recompute_flops,
// overhead, plan (runs)}] and, with a throughput, step_seconds.
rapidjson::Document PlanReportJson(const PlanReport& report);

// PlanReportTable: the plan as runs of layers, its peak and overhead, the standard
// variants and the frontier.
std::string PlanReportTable(const PlanReport& report);

}  // namespace memledger

#endif  // PLANNER_PLAN_REPORT_H_
