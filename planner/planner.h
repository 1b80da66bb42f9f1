// Planner: the checkpoint plan with the least recompute whose predicted step peak fits a
// memory budget (docs/DESIGN.md, "Peak memory"; issue 13).
//
// The peak of a plan comes from the step simulation (estimator/step/liveness.h) without
// replaying the plan: a step is a sequence of stretches (each layer's forward, the
// head's, each layer's backward, ...) whose net bytes and rises compose the peak, and a
// layer's stretches depend only on its kind (Gemma 3's sliding and global layers, an
// MoE's dense and sparse ones), its own choice, whether it is the first or the last and
// whether it is the first of its kind, whether its two neighbours are checkpointed and,
// checkpointed, which groups of model-level tensors it is the lowest holder of (those only
// checkpoint frames hold: transformers' position ids, Gemma 3's sliding-window mask; the
// head's stretches depend on which groups are held). Create() simulates short probe
// models of the model's kinds (planner_probes.cc) that contain every such context, and
// checks that every context seen twice has the same stretches (the assumption, checked
// on each use).
//
// The solver is exact: a dynamic program over layers whose state is (this layer's
// choice, whether the previous one is checkpointed, whether any earlier one is, and the
// groups they hold) and, per state, the Pareto set of
// partial plans by four sums that the rest of the step can only add to (the forward's
// live bytes, the worst backward moment so far shifted by what later layers add, the
// bytes that remain after the backward, recompute FLOPs). Dominated choices (no cheaper
// in recompute and no smaller in any stretch than another with the same checkpointing)
// are dropped first.
//
// On --device=cuda the probes count each storage as its request rounded to 512 B
// (CudaBlocks::kRequests, estimator/step/liveness.h), which composes: PeakOf and the budgets
// are then max_memory_allocated() with expandable segments, a lower bound without.
// RunPlanner (plan_run.h) replays the plan through the caching allocator.
//
// Example:
//   absl::StatusOr<Planner> planner = Planner::Create(config, PlannerOptions());
//   absl::StatusOr<PlanResult> plan = planner->Solve(80LL << 30);
//   if (absl::IsResourceExhausted(plan.status())) ... planner->SmallestBudget() ...
#ifndef PLANNER_PLANNER_H_
#define PLANNER_PLANNER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "estimator/spec/config.h"
#include "estimator/step/liveness.h"
#include "estimator/request/parallel_spec.h"
#include "estimator/predict/flops.h"

namespace memledger {

// kMaxPlannerLayers bounds the layers a plan may have (the largest models have a few
// hundred): the solver keeps each layer's partial plans, whose number grows with the
// layers (1,000 study layers at a mid budget: 9 s, 0.6 GB).
inline constexpr int64_t kMaxPlannerLayers = 1024;

struct PlannerOptions {
  AttentionMode attention = AttentionMode::kFlash;
  OptimizerSpec optimizer;
  // cpu_threads: as StepOptions::cpu_threads (the runtime measures at 1).
  int cpu_threads = 1;
  // choices: what a layer may be; empty means every choice the model has: none, full
  // and selective with every non-empty subset of its op kinds.
  std::vector<LayerChoice> choices;
  // general: use the general labels (F, U, S, cost) even where the step's stretches
  // allow the local ones (F, cost); tests run both.
  bool general = false;
  // parallel: one data-parallel rank's step (dp ranks with ZeRO 0-2, one micro-batch,
  // one pipeline stage): its layers' stretches are one process's, its resident bytes
  // and the step's end (the gradients' reduction, the sharded optimizer step) the rank's.
  ParallelSpec parallel;
};

// PlanResult is one plan and what it costs.
struct PlanResult {
  std::vector<LayerChoice> layers;
  int64_t peak_bytes = 0;       // the predicted peak of the step under the plan
  int64_t recompute_flops = 0;  // summed over layers
  int64_t step_flops = 0;       // the step without recompute (`none`'s)
  // overhead: predicted step time over `none`'s, (step + recompute) / step.
  double overhead = 1;
};

// FrontierPoint: at this budget, the best plan's peak and overhead.
struct FrontierPoint {
  int64_t budget_bytes = 0;
  PlanResult plan;
};

class Planner {
 public:
  // Create simulates the probes and counts FLOPs. InvalidArgument for a bad config or
  // choice, Unimplemented where the stretches do not compose yet (Megatron's ops),
  // Internal when a layer's stretches depend on more than its context. With
  // transformers' use_cache, the plan that checkpoints nothing keeps the DynamicCache
  // (its peak is replayed once, as predict's --variants=none counts it); every other
  // plan runs without it (gradient checkpointing turns it off).
  // This one validates the config and the layout (options.parallel) once.
  static absl::StatusOr<Planner> Create(const ModelConfig& config,
                                        const PlannerOptions& options);
  // Create of a config and layout its caller validated (a ValidRun's, the stage
  // planner's stage): nothing is checked again. REQUIRES: ValidateParallel(*config,
  // options.parallel).ok().
  static absl::StatusOr<Planner> Create(const ValidConfig& config,
                                        const PlannerOptions& options);

  // Solve returns the plan with the least recompute FLOPs whose peak <= budget_bytes
  // (among equals, the one with the smallest peak); ResourceExhausted when none fits,
  // its message naming SmallestBudget().
  absl::StatusOr<PlanResult> Solve(int64_t budget_bytes) const;
  // SmallestBudget is the least peak any plan reaches.
  int64_t SmallestBudget() const;
  // Frontier: the best plan at `points` budgets from SmallestBudget() to the peak of
  // `none` (the most any plan needs to have no recompute), evenly spaced.
  absl::StatusOr<std::vector<FrontierPoint>> Frontier(int points) const;

  // PeakOf composes a plan's peak from the stretches (what the solver optimizes; tests
  // compare it with the simulation). `plan` indexes choices().
  int64_t PeakOf(const std::vector<int>& plan) const;
  // Evaluate is a plan's PlanResult (peak composed).
  PlanResult Evaluate(const std::vector<int>& plan) const;

  const std::vector<LayerChoice>& choices() const;
  // recompute_flops: what `layer` recomputes under `choice` (its kind's).
  int64_t recompute_flops(int64_t layer, int choice) const;
  const StepFlops& step_flops() const;
  // candidates: the choices the solver considers (the undominated ones), into choices().
  const std::vector<int>& candidates() const;

  struct Tables;  // planner.cc

 private:
  explicit Planner(std::shared_ptr<const Tables> tables) : tables_(std::move(tables)) {}
  std::shared_ptr<const Tables> tables_;
};

// AllChoices lists none, full and selective with every non-empty subset of the op kinds
// the model has (ValidatePolicy's), in that order.
std::vector<LayerChoice> AllChoices(const ModelConfig& config, AttentionMode attention);

}  // namespace memledger

#endif  // PLANNER_PLANNER_H_
