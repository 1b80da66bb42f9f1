#include "estimator/step/step_ledger.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace memledger::liveness_internal {

std::string WhereText(const Where& where, const OptimizerSpec& optimizer) {
  const std::string segment = where.segment == Where::kHead       ? "head"
                              : where.segment == Where::kPrologue ? "embedding"
                                                                  : absl::StrCat("layer ", where.segment);
  switch (where.activity) {
    case Where::Activity::kCheckpointNode:
      return absl::StrCat(segment, " (CheckpointFunction)");
    case Where::Activity::kLossBackward:
      return "loss.backward()";
    case Where::Activity::kDynamicCache:
      return absl::StrCat(segment, " DynamicCache (its sliding-window layers)");
    case Where::Activity::kOptimizerStep:
      return absl::StrCat(OptimizerName(optimizer.kind), ".step()");
    case Where::Activity::kGradientReduction:
      return "the gradients' reduction over the data-parallel ranks";
    case Where::Activity::kPointToPoint:
      return "the pipeline's sends and receives";
    case Where::Activity::kParameterGather:
      return absl::StrCat(segment, " parameters' all-gather (ZeRO-3)");
    case Where::Activity::kUnitReduction:
      return absl::StrCat(segment, " gradients' reduce-scatter (ZeRO-3)");
    case Where::Activity::kOp:
      break;
  }
  std::string text = absl::StrCat(segment, where.recompute ? " recompute " : " ",
                                  where.graph->ops[where.op].name);
  if (where.node != nullptr) absl::StrAppend(&text, " (", where.node, ")");
  return text;
}

}  // namespace memledger::liveness_internal
