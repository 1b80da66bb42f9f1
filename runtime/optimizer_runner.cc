#include "runtime/optimizer_runner.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
#include <utility>

namespace memledger::runtime {
namespace {

// torch.optim's defaults (torch/optim/adam.py, adamw.py, sgd.py) at lr 1e-3.
constexpr double kLr = 1e-3;
constexpr double kBeta1 = 0.9;
constexpr double kBeta2 = 0.999;
constexpr double kEps = 1e-8;
constexpr double kAdamWDecay = 1e-2;  // AdamW's default; Adam's is 0

// StepTensor is Adam's state["step"]: a 0-dim fp32 tensor (adam.py:170-176).
at::Tensor StepTensor() { return at::zeros({}, at::TensorOptions().dtype(at::kFloat)); }

}  // namespace

int64_t TensorBytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

OptimizerRunner::OptimizerRunner(const OptimizerSpec& spec, std::vector<at::Tensor> parameters)
    : spec_(spec), parameters_(std::move(parameters)) {
  stepped_ = parameters_;
  if (spec.master_weights) {
    for (at::Tensor& master : stepped_) {
      master = master.detach().to(at::kFloat).requires_grad_(true);
    }
    masters_ = stepped_;
  }
}

bool OptimizerRunner::IsAdam() const {
  return spec_.kind == OptimizerKind::kAdamW || spec_.kind == OptimizerKind::kAdam;
}

void OptimizerRunner::InitState() {
  // _init_group (adam.py:151-185): per parameter, in order, step, exp_avg, exp_avg_sq.
  // SGD's momentum buffer is the first gradient's clone (sgd.py:361, :454; fused's
  // empty_like at :511 is filled by the kernel, the same bytes).
  for (const at::Tensor& p : stepped_) {
    State state;
    if (IsAdam()) {
      state.step = StepTensor();
      state.exp_avg = at::zeros_like(p, at::MemoryFormat::Preserve);
      state.exp_avg_sq = at::zeros_like(p, at::MemoryFormat::Preserve);
    } else if (spec_.momentum > 0) {
      state.momentum_buffer = p.grad().detach().clone();
    }
    state_.push_back(std::move(state));
  }
}

void OptimizerRunner::Step() {
  at::NoGradGuard no_grad;
  if (spec_.master_weights) {
    for (size_t i = 0; i < masters_.size(); ++i) {
      masters_[i].mutable_grad() = parameters_[i].grad().to(at::kFloat);
    }
  }
  const bool first = state_.empty();
  if (first) InitState();
  if (IsAdam()) {
    switch (spec_.impl) {
      case OptimizerImpl::kForLoop: AdamForLoop(); break;
      case OptimizerImpl::kForeach: AdamForeach(); break;
      case OptimizerImpl::kFused: AdamFused(); break;
    }
  } else if (!first || spec_.momentum == 0) {
    SgdStep();
  } else {
    // The first step's buffer is the gradient itself (sgd.py:361): only param.add_.
    for (size_t i = 0; i < stepped_.size(); ++i) {
      stepped_[i].add_(state_[i].momentum_buffer, -kLr);
    }
  }
  if (spec_.master_weights) {
    for (size_t i = 0; i < masters_.size(); ++i) {
      parameters_[i].copy_(masters_[i]);
      masters_[i].mutable_grad() = at::Tensor();
    }
  }
}

// AdamForLoop is _single_tensor_adam (adam.py:397-547), statement by statement: each
// temporary dies where Python drops it, and `denom` lives until the next tensor's is
// bound.
void OptimizerRunner::AdamForLoop() {
  const bool decoupled = spec_.kind == OptimizerKind::kAdamW;
  at::Tensor denom;
  for (size_t i = 0; i < stepped_.size(); ++i) {
    at::Tensor& param = stepped_[i];
    const at::Tensor grad = param.grad();
    State& s = state_[i];
    s.step.add_(1);  // step_t += 1 (:415)
    if (decoupled) param.mul_(1 - kLr * kAdamWDecay);  // (:420)
    s.exp_avg.lerp_(grad, 1 - kBeta1);  // (:457)
    s.exp_avg_sq.mul_(kBeta2).addcmul_(grad, grad, 1 - kBeta2);  // (:476)
    const double step = s.step.item<double>();  // _get_value (:529)
    const double bias_correction1 = 1 - std::pow(kBeta1, step);
    const double bias_correction2_sqrt = std::sqrt(1 - std::pow(kBeta2, step));
    at::Tensor divided;
    {
      at::Tensor root = s.exp_avg_sq.sqrt();  // (:545)
      divided = root.div(bias_correction2_sqrt);
    }
    divided.add_(kEps);
    denom = std::move(divided);
    param.addcdiv_(s.exp_avg, denom, -kLr / bias_correction1);  // (:547)
  }
}

// AdamForeach is _multi_tensor_adam (adam.py:627-800) on one (device, dtype) group. On
// CPU tensors every list op takes ATen's slow path, tensor by tensor.
OptimizerRunner::Lists OptimizerRunner::StateLists() const {
  Lists lists;
  for (size_t i = 0; i < stepped_.size(); ++i) {
    lists.grads.push_back(stepped_[i].grad());
    const State& s = state_[i];
    if (s.step.defined()) lists.steps.push_back(s.step);
    if (s.exp_avg.defined()) lists.exp_avgs.push_back(s.exp_avg);
    if (s.exp_avg_sq.defined()) lists.exp_avg_sqs.push_back(s.exp_avg_sq);
    if (s.momentum_buffer.defined()) lists.momentum_buffers.push_back(s.momentum_buffer);
  }
  return lists;
}

void OptimizerRunner::AdamForeach() {
  const bool decoupled = spec_.kind == OptimizerKind::kAdamW;
  auto [grads, steps, exp_avgs, exp_avg_sqs, unused] = StateLists();
  // torch._foreach_add_(steps, torch.tensor(1.0, device="cpu"), alpha=1.0) (:682-685).
  at::_foreach_add_(steps, at::scalar_tensor(1.0, at::TensorOptions().dtype(at::kFloat)), 1.0);
  if (decoupled) at::_foreach_mul_(stepped_, 1 - kLr * kAdamWDecay);  // (:692)
  at::_foreach_lerp_(exp_avgs, grads, 1 - kBeta1);                      // (:705)
  at::_foreach_mul_(exp_avg_sqs, kBeta2);                               // (:709)
  at::_foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - kBeta2);         // (:722)
  std::vector<c10::Scalar> bias_correction2_sqrt, step_size;
  for (const at::Tensor& step : steps) {
    const double t = step.item<double>();
    bias_correction2_sqrt.emplace_back(std::sqrt(1 - std::pow(kBeta2, t)));
    step_size.emplace_back(-kLr / (1 - std::pow(kBeta1, t)));
  }
  std::vector<at::Tensor> exp_avg_sq_sqrt = at::_foreach_sqrt(exp_avg_sqs);  // (:791)
  at::_foreach_div_(exp_avg_sq_sqrt, bias_correction2_sqrt);                 // (:793)
  at::_foreach_add_(exp_avg_sq_sqrt, kEps);                                  // (:794)
  at::_foreach_addcdiv_(stepped_, exp_avgs, exp_avg_sq_sqrt, step_size);     // (:795)
  // A Python list dies last element first.
  while (!exp_avg_sq_sqrt.empty()) exp_avg_sq_sqrt.pop_back();
}

// AdamFused is _fused_adam (adam.py:845-896): the steps, then one kernel.
void OptimizerRunner::AdamFused() {
  auto [grads, steps, exp_avgs, exp_avg_sqs, unused] = StateLists();
  at::_foreach_add_(steps, 1);  // (:877)
  const bool decoupled = spec_.kind == OptimizerKind::kAdamW;
  const double decay = decoupled ? kAdamWDecay : 0.0;
  if (decoupled) {
    at::_fused_adamw_(stepped_, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps,
                      kLr, kBeta1, kBeta2, decay, kEps, /*amsgrad=*/false, /*maximize=*/false);
  } else {
    at::_fused_adam_(stepped_, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps,
                     kLr, kBeta1, kBeta2, decay, kEps, /*amsgrad=*/false, /*maximize=*/false);
  }
}

// SgdStep is SGD's steady step (dampening 0, no Nesterov, no weight decay).
void OptimizerRunner::SgdStep() {
  const bool momentum = spec_.momentum > 0;
  switch (spec_.impl) {
    case OptimizerImpl::kForLoop:
      // _single_tensor_sgd: buf.mul_(momentum).add_(grad) (sgd.py:364); param.add_ (:379).
      for (size_t i = 0; i < stepped_.size(); ++i) {
        const at::Tensor grad = stepped_[i].grad();
        if (momentum) {
          state_[i].momentum_buffer.mul_(spec_.momentum).add_(grad);
          stepped_[i].add_(state_[i].momentum_buffer, -kLr);
        } else {
          stepped_[i].add_(grad, -kLr);
        }
      }
      break;
    case OptimizerImpl::kForeach: {
      // _multi_tensor_sgd: _foreach_mul_(bufs) then _foreach_add_ (sgd.py:445-472).
      auto [grads, steps, exp_avgs, exp_avg_sqs, bufs] = StateLists();
      if (momentum) {
        at::_foreach_mul_(bufs, spec_.momentum);
        at::_foreach_add_(bufs, grads, 1.0);
        at::_foreach_add_(stepped_, bufs, -kLr);
      } else {
        at::_foreach_add_(stepped_, grads, -kLr);
      }
      break;
    }
    case OptimizerImpl::kFused: {
      // _fused_sgd (sgd.py:529): one kernel.
      auto [grads, steps, exp_avgs, exp_avg_sqs, bufs] = StateLists();
      at::_fused_sgd_(stepped_, grads, bufs, /*weight_decay=*/0.0, spec_.momentum, kLr,
                      /*dampening=*/0.0, /*nesterov=*/false, /*maximize=*/false,
                      /*is_first_step=*/false);
      break;
    }
  }
}

OptimizerStateBytes OptimizerRunner::StateBytes() const {
  OptimizerStateBytes bytes;
  for (const State& s : state_) {
    bytes.moments += TensorBytes(s.exp_avg) + TensorBytes(s.exp_avg_sq) +
                     TensorBytes(s.momentum_buffer);
    bytes.steps += TensorBytes(s.step);
  }
  bytes.total = bytes.moments + bytes.steps;
  for (const at::Tensor& master : masters_) bytes.total += TensorBytes(master);
  return bytes;
}

}  // namespace memledger::runtime
