// OptimizerRunner: torch.optim's AdamW, Adam or SGD (with or without momentum) of the
// pinned release, in its for-loop, foreach or fused implementation, run in C++ with the
// ATen ops each implementation calls (torch/optim/adam.py, sgd.py), with optional fp32
// master weights, and the bytes of the state it holds. Measure() steps the whole model
// with it; the distributed runtime steps a ZeRO shard with it.
//
// Example:
//   OptimizerRunner optimizer(OptimizerSpec(), model.parameters());
//   optimizer.Step();  // on the parameters' .grad
//   int64_t bytes = optimizer.StateBytes().total;
#ifndef RUNTIME_OPTIMIZER_RUNNER_H_
#define RUNTIME_OPTIMIZER_RUNNER_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "estimator/spec/config.h"

namespace memledger::runtime {

// TensorBytes: numel x element size; 0 for an undefined tensor.
int64_t TensorBytes(const at::Tensor& t);

// OptimizerStateBytes is what an optimizer holds after its first step.
struct OptimizerStateBytes {
  int64_t moments = 0;  // exp_avg and exp_avg_sq, or momentum_buffer
  int64_t steps = 0;    // Adam's 0-dim fp32 step tensors
  int64_t total = 0;    // all of opt.state, plus master copies
};

// OptimizerRunner is one optimizer of `spec` over a model's parameters for as long as
// it lives, as in a training loop. With master weights it owns fp32 copies of the
// parameters, which the optimizer steps on fp32 copies of the gradients before they are
// written back.
class OptimizerRunner {
 public:
  OptimizerRunner(const OptimizerSpec& spec, std::vector<at::Tensor> parameters);

  // Step is optimizer.step() on the parameters' .grad; the first makes the state.
  void Step();

  // StateBytes: every tensor of the optimizer's state and, in total, the master copies.
  OptimizerStateBytes StateBytes() const;

 private:
  // State is one stepped tensor's opt.state entry.
  struct State {
    at::Tensor step, exp_avg, exp_avg_sq;  // Adam, AdamW
    at::Tensor momentum_buffer;            // SGD with momentum
  };
  // Lists: the per-tensor lists a foreach or fused implementation passes its kernels,
  // each state's where it has one.
  struct Lists {
    std::vector<at::Tensor> grads, steps, exp_avgs, exp_avg_sqs, momentum_buffers;
  };
  Lists StateLists() const;
  bool IsAdam() const;
  void InitState();
  void AdamForLoop();
  void AdamForeach();
  void AdamFused();
  void SgdStep();

  OptimizerSpec spec_;
  std::vector<at::Tensor> parameters_;
  std::vector<at::Tensor> masters_;  // fp32 copies; empty without master weights
  std::vector<at::Tensor> stepped_;  // the masters, or the parameters themselves
  std::vector<State> state_;         // one per stepped tensor, after the first step
};

}  // namespace memledger::runtime

#endif  // RUNTIME_OPTIMIZER_RUNNER_H_
