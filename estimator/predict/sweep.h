// Sweeps: a grid of runs over batch, seq and layers (--sweep=batch:1..64,seq:1024..32768),
// each predicted and checked against a memory budget, as CSV or JSON lines.
//
// Example:
//   absl::StatusOr<SweepGrid> grid = ParseSweep("batch:1..8,seq:1024|4096");
//   // grid->points: (batch 1, seq 1024), (1, 4096), (2, 1024), ... (8, 4096)
#ifndef ESTIMATOR_PREDICT_SWEEP_H_
#define ESTIMATOR_PREDICT_SWEEP_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "estimator/request/run_request.h"

namespace memledger {

// SweepAxis is one swept field and its values.
struct SweepAxis {
  std::string name;  // "batch", "seq" or "layers"
  std::vector<int64_t> values;
};

struct SweepGrid {
  std::vector<SweepAxis> axes;  // in the order given; the last varies fastest
  int64_t size() const;
};

// ParseSweep parses comma-separated axes "name:lo..hi" (lo, 2 lo, 4 lo, ... up to hi) or
// "name:v1|v2|v3". Names: batch, seq, layers; each at most once; values >= 1; at most
// 100,000 points. Errors are InvalidArgument naming --sweep.
absl::StatusOr<SweepGrid> ParseSweep(absl::string_view text);

// SweepFormat is how rows are printed.
enum class SweepFormat { kCsv, kJsonLines };

// RunSweep predicts every point of `grid` (the request with the point's values) and
// returns the text: one row per point and variant with the parameter, gradient,
// optimizer-state and saved bytes, their sum, the step's peak (empty where not
// simulated) and whether the peak (else the sum) fits `budget_bytes` (<= 0: no budget,
// fits is empty). A point the request's model cannot take (e.g. seq
// beyond GPT-2's positions) is an error naming the point.
absl::StatusOr<std::string> RunSweep(const RunRequest& request, const SweepGrid& grid,
                                     int64_t budget_bytes, SweepFormat format);

}  // namespace memledger

#endif  // ESTIMATOR_PREDICT_SWEEP_H_
