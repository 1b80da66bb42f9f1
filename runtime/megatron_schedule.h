// Megatron-LM's pipeline layout and order, as the rank runtime runs them: a pipeline
// rank's model chunks and its order of forwards and backwards (written independently
// of estimator/step/pipeline_steps.h, which the runtime checks it against).
#ifndef RUNTIME_MEGATRON_SCHEDULE_H_
#define RUNTIME_MEGATRON_SCHEDULE_H_

#include <cstdint>
#include <vector>

#include "estimator/spec/config.h"
#include "estimator/request/parallel_spec.h"

namespace memledger::runtime::distributed_internal {

// ChunksOf: pipeline rank `stage`'s model chunks, in order: chunk c is model chunk
// g = c x pp + stage of pp x virtual_stages equal ones; g = 0 has the embedding, the
// last the head.
std::vector<StageRange> ChunksOf(const ModelConfig& config, const ParallelSpec& parallel,
                                 int64_t stage);

// ScheduleStep is one forward or backward of one micro-batch through one local chunk.
struct ScheduleStep {
  bool forward = true;
  int64_t micro_batch = 0;
  int64_t chunk = 0;
};

// MegatronOrder is pipeline rank `stage`'s order of steps, as Megatron-LM's
// forward_backward_pipelining_without_interleaving and ..._with_interleaving run them:
// warm-up forwards, then one forward before each backward, then the remaining
// backwards. 1F1B warms up with min(pp - stage - 1, m) forwards; interleaved with
// (pp - stage - 1) x 2 + (v - 1) x pp (all m x v when m == pp), and forward k runs
// chunk (k mod pp v) / pp of micro-batch (k / pp v) x pp + k mod pp, backward k the
// chunks in reverse.
std::vector<ScheduleStep> MegatronOrder(const ParallelSpec& p, int64_t stage);

}  // namespace memledger::runtime::distributed_internal

#endif  // RUNTIME_MEGATRON_SCHEDULE_H_
