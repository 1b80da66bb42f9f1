// FrontierSvg draws the planner's answer as a chart: the least recompute overhead at
// each memory budget (a staircase falling from the smallest budget any plan fits to
// the peak without checkpointing), the standard variants as labelled points (a variant
// above the staircase costs more than a plan at its own peak), the budget asked for
// and the plan chosen under it.
//
// Example:
//   std::string svg = FrontierSvg("llama-3-8b, seq 8192", report);  // a PlanReport
#ifndef PLANNER_FRONTIER_SVG_H_
#define PLANNER_FRONTIER_SVG_H_

#include <string>

#include "planner/plan_report.h"

namespace memledger {

// FrontierSvg renders `report`'s frontier (at least two points), variants, budget and
// plan under `title`.
std::string FrontierSvg(const std::string& title, const PlanReport& report);

}  // namespace memledger

#endif  // PLANNER_FRONTIER_SVG_H_
