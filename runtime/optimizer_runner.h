// OptimizerRunner: one real LibTorch optimizer (AdamW, Adam or SGD with momentum) over
// a list of parameters, with optional fp32 master weights, and the bytes of the state it
// holds. Measure() steps the whole model with it; the distributed runtime steps a ZeRO
// shard with it.
//
// Example:
//   OptimizerRunner optimizer(OptimizerSpec(), model.parameters());
//   optimizer.Step();  // on the parameters' .grad
//   int64_t bytes = optimizer.StateBytes().total;
#ifndef RUNTIME_OPTIMIZER_RUNNER_H_
#define RUNTIME_OPTIMIZER_RUNNER_H_

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "estimator/config.h"

namespace memledger::runtime {

// TensorBytes: numel x element size; 0 for an undefined tensor.
int64_t TensorBytes(const at::Tensor& t);

// OptimizerStateBytes is what an optimizer holds after its first step.
struct OptimizerStateBytes {
  int64_t moments = 0;  // its state tensors
  int64_t total = 0;    // plus master copies
};

// OptimizerRunner is one optimizer of `spec` over a model's parameters for as long as
// it lives, as in a training loop. With master weights it owns fp32 copies of the
// parameters, which the optimizer steps on fp32 copies of the gradients before they are
// written back.
class OptimizerRunner {
 public:
  OptimizerRunner(const OptimizerSpec& spec, std::vector<at::Tensor> parameters);

  // Step is optimizer.step() on the parameters' .grad.
  void Step();

  // StateBytes: the optimizer's state tensors (exp_avg, exp_avg_sq, max_exp_avg_sq;
  // momentum_buffer) and, in total, the master copies.
  OptimizerStateBytes StateBytes() const;

 private:
  std::vector<at::Tensor> StateTensors(const torch::optim::OptimizerParamState& state) const;

  OptimizerSpec spec_;
  std::vector<at::Tensor> parameters_;
  std::vector<at::Tensor> masters_;  // fp32 copies; empty without master weights
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
};

}  // namespace memledger::runtime

#endif  // RUNTIME_OPTIMIZER_RUNNER_H_
