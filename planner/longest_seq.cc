#include "planner/longest_seq.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/graph/family.h"

namespace memledger {

absl::StatusOr<SearchResult> SearchLongestSequence(RunRequest request,
                                                   const SearchOptions& options,
                                                   int64_t up_to) {
  if (up_to < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--longest_seq must be >= 1, got ", up_to));
  }
  request.seq = 1;
  absl::StatusOr<RunSpec> spec = RunSpecFromRequest(request);
  if (!spec.ok()) return spec.status();
  // Learned positions (GPT-2's) bound the sequence; RoPE's max_position_embeddings does
  // not (predict runs past it).
  const int64_t positions = spec->config.max_positions;
  const bool learned = FamilyOf(spec->config.family).learned_positions;
  const int64_t upper = learned && positions > 0 ? std::min(up_to, positions) : up_to;
  // No layout fits where the search says so, or where the step's bytes or FLOPs
  // overflow int64 (OutOfRange): no GPU holds that.
  auto none_fits = [](const absl::Status& status) {
    return absl::IsResourceExhausted(status) || absl::IsOutOfRange(status);
  };
  int64_t searches = 0;
  absl::Status at_one;  // why no layout fits a sequence of 1, once searched
  // The search at `seq`: a layout fits where it is ok, none where ResourceExhausted.
  auto search_at = [&](int64_t seq) {
    request.seq = seq;
    ++searches;
    absl::StatusOr<SearchResult> result = SearchLayouts(request, options);
    if (seq == 1) at_one = result.status();
    return result;
  };
  // Sequence parallelism splits the sequence over the tensor-parallel ranks, so a
  // length that is not a multiple of tp rules those layouts out: what fits is a prefix
  // of the multiples of `granule` (every tensor-parallel size divides it), not of every
  // length. Bisect over those, then try the lengths up to the next one, longest first.
  const int64_t granule = std::max<int64_t>(1, std::min(options.gpus, options.gpus_per_node));
  absl::StatusOr<SearchResult> best = absl::ResourceExhaustedError("no length searched");
  int64_t fits = 0, fails = upper / granule + 1;  // in granules; 0 fits trivially
  for (int64_t probe = fails - 1; probe > fits && fails - fits > 1;
       probe = fits + (fails - fits) / 2) {
    absl::StatusOr<SearchResult> at = search_at(probe * granule);
    if (at.ok()) {
      fits = probe;
      best = std::move(at);
    } else if (none_fits(at.status())) {
      fails = probe;
    } else {
      return at.status();
    }
  }
  // The lengths above the last multiple that fits, below the next (none past `upper`;
  // written so that no product can overflow).
  const int64_t last = fits * granule;
  const int64_t scan_from = upper - last < granule ? upper : last + granule - 1;
  for (int64_t seq = scan_from; seq > last; --seq) {
    absl::StatusOr<SearchResult> at = search_at(seq);
    if (at.ok() || !none_fits(at.status())) {
      best = std::move(at);
      break;
    }
  }
  if (!best.ok() && none_fits(best.status())) {
    // Nothing fit, down to a sequence of 1: what its search said.
    if (absl::IsResourceExhausted(at_one)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("--longest_seq: not even a sequence of 1 fits: ", at_one.message()));
    }
    return at_one;
  }
  if (!best.ok()) return best.status();
  SearchResult result = *std::move(best);
  result.longest_seq_up_to = upper;
  result.longest_seq_searches = searches;
  return result;
}

}  // namespace memledger
