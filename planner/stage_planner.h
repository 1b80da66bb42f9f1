// RunStagePlanner: a checkpoint plan for each pipeline stage (--pp, --micro_batches),
// where RunPlanner's composition (plan_run.h) does not apply.
//
// A stage's peak is not one process's: its schedule holds several micro-batches' saved
// tensors at once (1F1B: min(pp - stage, micro_batches)), later micro-batches add into
// the .grads, and a middle stage has neither embeddings nor head. So the plan is not
// composed but searched for and checked by replay:
//   - each stage has a guide, the single-process planner (planner.h) on a model of the
//     stage's layers alone, of their kinds (ModelConfig::LayersAlone), whose batch is its
//     micro-batches in flight, which scales the saved tensors as the schedule does; one
//     process is one stage;
//   - every stage's guide plans its layers for a budget; the whole model's plan (each
//     stage's layers their own choices) is replayed rank by rank (PredictRanks, the
//     step simulation of every stage's whole schedule);
//   - a stage whose replayed peak exceeds the budget is planned again for a budget lower
//     by the excess (after four tries, half the way to its guide's least plan); below
//     that, the stage checkpoints every layer fully, which the first replay checked.
// Every stage's replayed peak (on --device=cuda its reserved peak and the memory outside
// the allocator) fits the budget. The plan is the first the search finds, so a plan of
// less recompute may exist.
//
// Example:
//   RunSpec spec = ...;  // --pp=4 --micro_batches=8 --dp=8 --zero=1
//   PlanRunOptions options;
//   options.budget_bytes = int64_t{40} << 30;
//   absl::StatusOr<PlanReport> report = RunStagePlanner(run, options);  // a ValidRun
//   // report->stages: each stage's layers, choices, replayed peak and recompute.
#ifndef PLANNER_STAGE_PLANNER_H_
#define PLANNER_STAGE_PLANNER_H_

#include "absl/status/statusor.h"
#include "estimator/request/run_request.h"
#include "planner/plan_report.h"
#include "planner/plan_run.h"

namespace memledger {

// RunStagePlanner: InvalidArgument for bad input (ZeRO-3, --timeline_svg, and what
// RunPlanner refuses); ResourceExhausted when some stage exceeds the budget even with
// every layer fully checkpointed, naming the stage and what it needs.
absl::StatusOr<PlanReport> RunStagePlanner(const ValidRun& run, const PlanRunOptions& options);

}  // namespace memledger

#endif  // PLANNER_STAGE_PLANNER_H_
