// MemorySnapshot writes a predicted step as PyTorch writes a measured one:
// torch.cuda.memory._snapshot()'s dict, pickled, which torch.cuda._memory_viz (trace,
// trace_plot, segments) and the memory viewer (https://pytorch.org/memory_viz) read.
//   - device_traces[0]: the step's allocations and frees in order, each an "alloc", or a
//     "free_requested" and its "free_completed", with its address, size, category
//     ("activation", "gradient", ...) and frames naming the op, the layer and the phase.
//     It opens with an "alloc" for each tensor that exists before the step (each
//     parameter and each of its optimizer state's tensors, where the timeline lists
//     them; the buffers and the input one per category), so that replaying it reaches
//     exactly the prediction's peak_bytes.
//   - segments: one segment holding what is still allocated when the step ends.
// Addresses are made up (each allocation its own, 512-byte aligned, never reused).
//
// Example:
//   absl::StatusOr<std::string> pickle = MemorySnapshotPickle(*variant.timeline);
#ifndef ESTIMATOR_REPORT_MEMORY_SNAPSHOT_H_
#define ESTIMATOR_REPORT_MEMORY_SNAPSHOT_H_

#include <string>

#include "absl/status/statusor.h"
#include "estimator/step/liveness.h"

namespace memledger {

// MemorySnapshotPickle: `timeline` (recorded with events) as a pickled snapshot.
// InvalidArgument when the timeline has no events.
absl::StatusOr<std::string> MemorySnapshotPickle(const StepTimeline& timeline);

}  // namespace memledger

#endif  // ESTIMATOR_REPORT_MEMORY_SNAPSHOT_H_
