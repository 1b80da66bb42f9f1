// PipelineSteps: what one pipeline rank does in a training step, in order, as
// Megatron-LM's schedules run it without overlapped communication
// (forward_backward_pipelining_without_interleaving and ..._with_interleaving): its
// model chunks' forwards and backwards, and between them the point-to-point operations
// that Megatron's p2p_communication posts together and waits for together. The step
// simulation (estimator/step/liveness.h, RankStep) and the distributed runtime's counted step
// (runtime/distributed.h) both execute this list, so that their memory timelines can be
// compared op by op; the runtime checks its forwards and backwards against its own
// independent order (MegatronOrder).
//
// Example:
//   for (const PipelineStep& s : PipelineSteps(parallel, /*stage=*/0)) { ... }
#ifndef ESTIMATOR_STEP_PIPELINE_STEPS_H_
#define ESTIMATOR_STEP_PIPELINE_STEPS_H_

#include <cstdint>
#include <vector>

#include "estimator/request/parallel_spec.h"

namespace memledger {

struct PipelineStep {
  enum class Kind : uint8_t {
    kForward,      // the next micro-batch of local chunk `chunk`
    kBackward,     // the oldest micro-batch of `chunk` run forward and not yet backward
    kCommunicate,  // post, then wait for, the operations below
  };
  Kind kind = Kind::kForward;
  int64_t chunk = 0;  // kForward, kBackward: the local model chunk (0 .. virtual_stages - 1)
  // kCommunicate: the last forward's output is sent (then freed), the last backward's
  // input gradient is sent (then freed with the received input it belongs to), a new
  // buffer receives the next input of local chunk receive_input (-1: none), another
  // the next output gradient of local chunk receive_output_grad (-1: none). Receives
  // are allocated in that order, before anything sent is freed.
  bool send_output = false;
  bool send_input_grad = false;
  int64_t receive_input = -1;
  int64_t receive_output_grad = -1;
};

// PipelineSteps for pipeline rank `stage` of a valid spec (ValidateParallel).
std::vector<PipelineStep> PipelineSteps(const ParallelSpec& p, int64_t stage);

}  // namespace memledger

#endif  // ESTIMATOR_STEP_PIPELINE_STEPS_H_
