// Flops: the arithmetic of one training step, counted op by op from the model's graphs,
// the checkpoint planner's cost model. A step's time is predicted as its FLOPs over a
// throughput the user measures once per machine (//runtime:runtime_benchmark prints
// it); recompute overheads are FLOP ratios and need no calibration.
//
// What an op costs (forward; a multiply-add is 2 FLOPs):
//   - addmm, mm, bmm: 2 M K N (addmm adds M N for the bias);
//   - flash attention: 2 B H d T (T + 1) (its two products over the causal triangle
//     only, which the CPU kernel skips block by block);
//   - norms, softmax, log_softmax, nll_loss: 5 per element; other elementwise ops and
//     reductions: 1 per element; views, copies, embeddings, masks: 0.
// Backward: 2x forward for the products (a gradient per operand), 2.5x for flash
// attention (FlashAttention-2's five products against two), 2x for the rest.
//
// Example:
//   absl::StatusOr<StepFlops> f = CountStepFlops(config, AttentionMode::kFlash);
//   absl::StatusOr<int64_t> r = RecomputeFlops(config, AttentionMode::kFlash, choice);
#ifndef ESTIMATOR_PREDICT_FLOPS_H_
#define ESTIMATOR_PREDICT_FLOPS_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "estimator/graph/family.h"
#include "estimator/spec/config.h"

namespace memledger {

// StepFlops is one step without recompute.
struct StepFlops {
  int64_t layer_forward = 0;   // one decoder layer (the first's kind)
  int64_t layer_backward = 0;
  int64_t other_forward = 0;   // prologue (embeddings) and epilogue (head, loss)
  int64_t other_backward = 0;
  // Total: every layer, prologue and epilogue, forward and backward.
  int64_t total = 0;
};

// CountStepFlops counts a config's step; OutOfRange when it overflows int64.
absl::StatusOr<StepFlops> CountStepFlops(const ModelConfig& config, AttentionMode attention);
// The same for a config its caller validated.
absl::StatusOr<StepFlops> CountStepFlops(const ValidConfig& config, AttentionMode attention);

// RecomputeFlops is what layer `layer`'s checkpoint recomputes under `choice`: its
// forward less the ops its selective cache serves (0 when not checkpointed).
absl::StatusOr<int64_t> RecomputeFlops(const ModelConfig& config, AttentionMode attention,
                                       const LayerChoice& choice, int64_t layer = 0);
// The same for a config its caller validated.
absl::StatusOr<int64_t> RecomputeFlops(const ValidConfig& config, AttentionMode attention,
                                       const LayerChoice& choice, int64_t layer = 0);

// VariantRecompute is what a variant recomputes over its layers, and the overhead
// (step + recompute) / step of its forward and backward.
struct VariantRecompute {
  int64_t recompute_flops = 0;
  int64_t step_flops = 0;
  double overhead = 1;
};

// RecomputeOf counts `variant`'s recompute layer by layer.
absl::StatusOr<VariantRecompute> RecomputeOf(const ModelConfig& config, AttentionMode attention,
                                             const Variant& variant);
// The same for a config its caller validated.
absl::StatusOr<VariantRecompute> RecomputeOf(const ValidConfig& config, AttentionMode attention,
                                             const Variant& variant);

// StageFlops is one micro-batch's arithmetic on one rank of a pipeline stage: its layers'
// forward and backward, the prologue on the first stage and the head on the last, and
// the recompute of the layers `variant` checkpoints (by their global index, as every_k
// counts them). For the rank's share under tensor parallelism, pass the config with
// its tp: its graphs are one rank's.
struct StageFlopsCount {
  int64_t forward = 0;
  int64_t backward = 0;
  int64_t recompute = 0;
  int64_t Total() const { return forward + backward + recompute; }
};
absl::StatusOr<StageFlopsCount> StageFlops(const ModelConfig& config, AttentionMode attention,
                                           const Variant& variant, const StageRange& stage);
// The same for a config its caller validated (the search's candidates).
absl::StatusOr<StageFlopsCount> StageFlops(const ValidConfig& config, AttentionMode attention,
                                           const Variant& variant, const StageRange& stage);

}  // namespace memledger

#endif  // ESTIMATOR_PREDICT_FLOPS_H_
