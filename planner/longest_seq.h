// The longest sequence a run fits: search --longest_seq=N bisects --seq over [1, N] with
// the layout search (planner/layout_search.h) as its test, "does some layout of the GPUs
// fit at this length". A layout's peak grows with its sequence, and every layout runs
// every multiple of the largest tensor-parallel size (sequence parallelism needs tp to
// divide the sequence): what fits is a prefix of those multiples, bisected, and the
// lengths between the last that fits and the next are tried one by one.
//
// Example (Llama-3.1-8B, LoRA r 16 on every linear layer, one 80 GB GPU):
//   absl::StatusOr<SearchResult> r = SearchLongestSequence(request, options, 131072);
//   // r->config.seq: the longest that fits; r->layouts: those that fit at it.
#ifndef PLANNER_LONGEST_SEQ_H_
#define PLANNER_LONGEST_SEQ_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "estimator/request/run_request.h"
#include "planner/layout_search.h"

namespace memledger {

// SearchLongestSequence: the search at the longest request.seq in [1, up_to] (capped at
// the model's learned positions, GPT-2's) at which a layout fits, with
// SearchResult::longest_seq_up_to and longest_seq_searches set; request.seq is ignored.
// A length whose step overflows int64 fits nothing. InvalidArgument for up_to < 1 or a
// search's bad input; ResourceExhausted when not even one token fits, naming the
// smallest memory that would.
absl::StatusOr<SearchResult> SearchLongestSequence(RunRequest request,
                                                   const SearchOptions& options,
                                                   int64_t up_to);

}  // namespace memledger

#endif  // PLANNER_LONGEST_SEQ_H_
