// The layout search's reports: JSON (every layout that fits, best first, with the
// flags that reproduce it), a table of the best, and a chart of peak against step time.
#ifndef PLANNER_SEARCH_REPORT_H_
#define PLANNER_SEARCH_REPORT_H_

#include <cstddef>
#include <string>

#include "planner/layout_search.h"
#include "rapidjson/document.h"

namespace memledger {

// kTimeModelNote says, in every report, that step times are modelled.
extern const char kTimeModelNote[];

// SearchJson: the study's head for the model (config, dtype, optimizer, its whole
// parameters), "search" (the question: gpus, gpus_per_node, gpu and its source,
// budget_bytes, global_batch, mfu, time_model), the counts (candidates, invalid,
// too_big, unmodelled, simulated, fitting) and "layouts": tp, pp, dp, zero, sp,
// micro_batch_size, micro_batches, virtual_stages, schedule, checkpoint, peak_bytes,
// peak_stage, step_time_s, time (its parts), tflops_per_gpu, mfu, front and flags.
rapidjson::Document SearchJson(const SearchResult& result, const SearchOptions& options);

// SearchTable: the question, the counts, the `top` fastest layouts and the command that
// predicts the best.
std::string SearchTable(const SearchResult& result, const SearchOptions& options, size_t top);

// SearchSvg: every layout that fits as a point (step time, peak), coloured by its
// checkpointing, the budget drawn, the front (no faster layout has a lower peak) joined
// and the best marked.
std::string SearchSvg(const SearchResult& result, const SearchOptions& options);

}  // namespace memledger

#endif  // PLANNER_SEARCH_REPORT_H_
