// RunPlanner: one planner run as the CLI and the C ABI make it: the plan for a budget,
// its replayed peak, the fixed variants beside it and the frontier, as a PlanReport.
//
// Example:
//   PlanRunOptions options;
//   options.budget_bytes = int64_t{80} << 30;
//   absl::StatusOr<PlanReport> report = RunPlanner(run, options);  // a ValidRun
//   if (absl::IsResourceExhausted(report.status())) ...  // no plan fits; the message
//                                                         // names the smallest budget
#ifndef PLANNER_PLAN_RUN_H_
#define PLANNER_PLAN_RUN_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "estimator/request/run_request.h"
#include "planner/plan_report.h"

namespace memledger {

struct PlanRunOptions {
  int64_t budget_bytes = 0;   // REQUIRES: > 0
  int64_t frontier_points = 9;    // 0, or 2..1000
  int cpu_threads = 1;        // >= 1
  double flops_per_second = 0;  // > 0: step times too
  // timeline: record the plan's replayed step (PlanReport::plan_step) for its chart; one
  // process's only (not with --dp).
  bool timeline = false;
};

// ValidatePlanRunOptions names the bad option ("--budget_gib", ...) as InvalidArgument.
absl::Status ValidatePlanRunOptions(const PlanRunOptions& options);
// PlannedLayout: InvalidArgument for a layout the planners do not plan (ZeRO-3,
// expert-parallel ranks).
absl::Status PlannedLayout(const RunSpec& spec);

// FrontierTitle is the frontier chart's title (FrontierSvg).
std::string FrontierTitle(const RunSpec& spec);

// PlanTimelineSvg draws the plan's replayed step (a report run with
// PlanRunOptions::timeline), as predict's --timeline_svg draws a variant's.
absl::StatusOr<std::string> PlanTimelineSvg(const RunSpec& spec, const PlanReport& report);

// RunPlanner plans `spec` (its variants are the fixed ones shown beside the plan).
// With --dp (ZeRO 0-2, one micro-batch) it plans one data-parallel rank: its buckets,
// peaks and plan are the rank's. InvalidArgument for bad input, including configs whose
// stretches do not compose yet (Megatron's ops), pipeline stages and accumulation;
// ResourceExhausted when no plan fits the
// budget; Internal if the plan's replayed peak differs from the planner's composed one.
// On --device=cuda the budget holds the replayed plan's reserved peak and the memory
// outside the allocator (PlanReport::plan_device_bytes): a plan whose replay exceeds it
// is made again for a lower composed budget, so the plan returned fits, though a plan
// of less recompute may exist (the reserved peak is not monotone in the plan).
// `run` was validated once where it entered (ValidRunFromFlags, ValidRunFromRequest):
// what the plan predicts and simulates takes its proof.
absl::StatusOr<PlanReport> RunPlanner(const ValidRun& run, const PlanRunOptions& options);

}  // namespace memledger

#endif  // PLANNER_PLAN_RUN_H_
