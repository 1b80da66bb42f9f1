// A checkpoint plan given to predict or verify (--plan): a //planner plan file, or the
// plan written inline as runs of layer choices.
//
// Example:
//   absl::StatusOr<Variant> a = ReadPlan("plan.json");  // {"plan": ["full", "none"]}
//   absl::StatusOr<Variant> b = ReadPlan("full*2;selective:matmul,attention*3;none*75");
//   std::string text = PlanRunsText(*b);  // "full*2;selective:matmul,attention*3;none*75"
#ifndef ESTIMATOR_REQUEST_PLAN_FILE_H_
#define ESTIMATOR_REQUEST_PLAN_FILE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "estimator/spec/config.h"

namespace memledger {

// ParsePlanJson reads a plan document's "plan" array (LayerChoice names) as a kPlan
// variant; errors say what is wrong and where ("plan[3]: unknown layer choice 'half'").
absl::StatusOr<Variant> ParsePlanJson(absl::string_view json);

// ParsePlanRuns reads a plan written inline: runs separated by ';', each a layer choice
// and, after '*', how many layers in a row take it ("full*2;none*6"; no count: one).
absl::StatusOr<Variant> ParsePlanRuns(absl::string_view text);

// PlanRunsText writes a kPlan variant as ParsePlanRuns reads it.
std::string PlanRunsText(const Variant& plan);

// ReadPlan reads --plan: a file's path when it ends in ".json", else inline runs;
// errors start "--plan ".
absl::StatusOr<Variant> ReadPlan(const std::string& value);

}  // namespace memledger

#endif  // ESTIMATOR_REQUEST_PLAN_FILE_H_
