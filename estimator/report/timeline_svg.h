// TimelineSvg draws the memory of a training step as SVG: one panel per variant, live
// bytes along the step stacked by category (resident parameters and optimizer state and
// the model input at the bottom, then gradients, activations, temporaries), the phases
// (forward, backward, optimizer) marked along the x axis, the peak marked and labelled
// with where it happens, and, from verify, the measured live bytes as a line on top.
//
// Example:
//   TimelinePanel panel{"none", &*prediction.variants[0].timeline};
//   std::string svg = TimelineSvg("memledger: study default", {panel});
#ifndef ESTIMATOR_REPORT_TIMELINE_SVG_H_
#define ESTIMATOR_REPORT_TIMELINE_SVG_H_

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "estimator/step/liveness.h"
#include "estimator/predict/predict.h"
#include "estimator/predict/ranks.h"

namespace memledger {

// MeasuredLine is a measured step: live bytes (resident included) after each allocation
// or free, and the index of each phase's first event (forward, backward, optimizer).
struct MeasuredLine {
  std::vector<int64_t> live;
  std::array<int64_t, kNumStepPhases> phase_start{};
  int64_t peak_bytes = 0;
};

struct TimelinePanel {
  std::string title;                    // the variant: "none"
  const StepTimeline* predicted = nullptr;  // with events; not owned
  std::optional<MeasuredLine> measured;
};

// TimelineSvg renders the panels, top to bottom, under `title`. Each phase gets a share
// of the width proportional to its predicted events, so predicted and measured steps
// line up phase by phase. A step whose forwards and backwards alternate (a pipeline
// rank's schedule) draws them in one span, in time order.
std::string TimelineSvg(const std::string& title, const std::vector<TimelinePanel>& panels);

// PredictedStepTitle is the predicted timeline's title, naming the device (on CUDA the
// bytes are the caching allocator's blocks).
std::string PredictedStepTitle(Device device);

// PredictedTimelineSvg draws each variant's predicted step (recorded with
// PredictOptions::timeline) under `title`, one panel each; Unimplemented, naming why,
// when a variant's step is not simulated (the message is why).
absl::StatusOr<std::string> PredictedTimelineSvg(
    const std::string& title, const std::vector<VariantPrediction>& variants);

// RankTimelineSvg draws a rank's predicted step (PredictRanks with
// PredictOptions::timeline): its chunks' micro-batches in the schedule's order, the
// gradients' reduction and its ZeRO shard's step, one panel per variant; Unimplemented
// where a variant's step is not simulated.
absl::StatusOr<std::string> RankTimelineSvg(const RankKind& rank);

}  // namespace memledger

#endif  // ESTIMATOR_REPORT_TIMELINE_SVG_H_
