// Segment plans (internal to estimator/liveness): one segment graph (a layer, the
// prologue, the head) walked for one config, with what the step simulation's replay
// needs: each op's storages read, each storage's last forward use, what each backward
// node releases, and which ops return their input itself.
//
// Example:
//   absl::StatusOr<std::unique_ptr<SegmentPlan>> plan =
//       MakePlan(graphs->layer, config, /*input_requires_grad=*/true, /*rules=*/nullptr);
#ifndef ESTIMATOR_SEGMENT_PLAN_H_
#define ESTIMATOR_SEGMENT_PLAN_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "estimator/block_graph.h"
#include "estimator/config.h"
#include "estimator/rules.h"
#include "estimator/walker.h"

namespace memledger::liveness_internal {

// SegmentPlan is one segment graph walked for one config, with what the replay needs:
// each op's storages read and each storage's last forward use.
struct SegmentPlan {
  const BlockGraph* graph = nullptr;
  BlockWalk walk;  // with layouts, not checkpointed
  std::vector<std::vector<int>> reads;  // per op: distinct non-parameter storages read
  std::vector<int> last_use;            // per storage: the last op reading it, -1: none
  int input_storage = -1;
  int output_storage = -1;
  // releases: per op, the storages its node's release_variables() lets go, in
  // Functions.h's order (saved inputs by name, then outputs), as the rules keep them.
  std::vector<std::vector<int>> releases;
  // same_as: for the output of an op that returns its input itself (.to() of the same
  // dtype, contiguous() of a contiguous tensor), that input; -1 otherwise. Such an op
  // makes no backward node: gradients go straight to the input.
  std::vector<int> same_as;
};

// MakePlan walks `graph` with layouts and derives the plan; Internal for an op with more
// than three inputs (a backward node keeps at most three gradients).
absl::StatusOr<std::unique_ptr<SegmentPlan>> MakePlan(const BlockGraph& graph,
                                                      const ModelConfig& config,
                                                      bool input_requires_grad,
                                                      const RuleTable* rules);

// ModelPlans are a model's segment plans, made once and shared by every variant's
// simulation: the prologue (families), the first layer (whose input needs no gradient in
// the study), the other layers and the head.
struct ModelPlans {
  std::shared_ptr<const ModelGraphs> graphs;
  std::unique_ptr<SegmentPlan> prologue;
  std::unique_ptr<SegmentPlan> first;
  std::unique_ptr<SegmentPlan> rest;
  std::unique_ptr<SegmentPlan> head;
};

}  // namespace memledger::liveness_internal

#endif  // ESTIMATOR_SEGMENT_PLAN_H_
