#include "runtime/optimizer_runner.h"

#include <ATen/ATen.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <utility>

namespace memledger::runtime {

int64_t TensorBytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

OptimizerRunner::OptimizerRunner(const OptimizerSpec& spec, std::vector<at::Tensor> parameters)
    : spec_(spec), parameters_(std::move(parameters)) {
  std::vector<at::Tensor> stepped = parameters_;
  if (spec.master_weights) {
    for (at::Tensor& master : stepped) {
      master = master.detach().to(at::kFloat).requires_grad_(true);
    }
    masters_ = stepped;
  }
  switch (spec.kind) {
    case OptimizerKind::kAdamW:
      optimizer_ = std::make_unique<torch::optim::AdamW>(stepped, torch::optim::AdamWOptions(1e-3));
      break;
    case OptimizerKind::kAdam:
      optimizer_ = std::make_unique<torch::optim::Adam>(stepped, torch::optim::AdamOptions(1e-3));
      break;
    case OptimizerKind::kSgd:
      optimizer_ = std::make_unique<torch::optim::SGD>(
          stepped, torch::optim::SGDOptions(1e-3).momentum(spec.momentum));
      break;
  }
}

void OptimizerRunner::Step() {
  if (spec_.master_weights) {
    for (size_t i = 0; i < masters_.size(); ++i) {
      masters_[i].mutable_grad() = parameters_[i].grad().to(at::kFloat);
    }
  }
  optimizer_->step();
  if (spec_.master_weights) {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < masters_.size(); ++i) {
      parameters_[i].copy_(masters_[i]);
      masters_[i].mutable_grad() = at::Tensor();
    }
  }
}

OptimizerStateBytes OptimizerRunner::StateBytes() const {
  OptimizerStateBytes bytes;
  for (const auto& entry : optimizer_->state()) {
    for (const at::Tensor& t : StateTensors(*entry.second)) bytes.moments += TensorBytes(t);
  }
  bytes.total = bytes.moments;
  for (const at::Tensor& master : masters_) bytes.total += TensorBytes(master);
  return bytes;
}

std::vector<at::Tensor> OptimizerRunner::StateTensors(
    const torch::optim::OptimizerParamState& state) const {
  switch (spec_.kind) {
    case OptimizerKind::kAdamW: {
      const auto& adamw = static_cast<const torch::optim::AdamWParamState&>(state);
      return {adamw.exp_avg(), adamw.exp_avg_sq(), adamw.max_exp_avg_sq()};
    }
    case OptimizerKind::kAdam: {
      const auto& adam = static_cast<const torch::optim::AdamParamState&>(state);
      return {adam.exp_avg(), adam.exp_avg_sq(), adam.max_exp_avg_sq()};
    }
    case OptimizerKind::kSgd:
      return {static_cast<const torch::optim::SGDParamState&>(state).momentum_buffer()};
  }
  return {};
}

}  // namespace memledger::runtime
