// The step simulation: the optimizer's step (a data-parallel rank's reduction around it
// is its program's, estimator/step/data_parallel_program.h).
#include "estimator/step/simulation.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace memledger::liveness_internal {

// OptimizerStep is torch.optim's step() of the pinned release, in the implementation the
// spec names, on a step whose state exists (torch/optim/adam.py, sgd.py; AdamW is Adam
// with decoupled weight decay, adamw.py:36-49). A Python number passed to an in-place op
// that takes a Tensor is wrapped as an 8-byte 0-dim tensor and converted to the updated
// tensor's dtype on the CPU (Memory::ScalarOp: +8, +e, -e, -8); a number taken as a
// Scalar (lerp_'s weight, addcmul_'s value, add_'s alpha) allocates nothing, nor do
// _get_value, the Python-float bias corrections or the fused kernels.
absl::Status Simulation::OptimizerStep(const std::vector<int64_t>& numels) {
  memory_.SetOp(Special(Where::kHead, Where::Activity::kOptimizerStep));
  // With master weights (runtime/runtime.cc, OptimizerRunner::Step) every .grad is first
  // copied to fp32 as its master's .grad; the optimizer steps the fp32 masters; then
  // each parameter is copied back from its master (in place) and the master's .grad
  // dies.
  // FSDP2's MixedPrecisionPolicy steps the fp32 shards too.
  const DType dtype = optimizer_.master_weights || data_parallel_->StepsFp32()
                          ? DType::kFloat32
                          : config_.TrainableDtype();
  std::vector<int> master_grads;
  if (optimizer_.master_weights) {
    for (size_t p = 0; p < numels.size(); ++p) {
      const int64_t fp32_bytes = numels[p] * ElementSizeBytes(DType::kFloat32);
      master_grads.push_back(memory_.Alloc(fp32_bytes, MemoryCategory::kGradient));
      if (auto* layer_bytes = OptimizerLayerBytes(p)) {
        (*layer_bytes)[static_cast<int>(MemoryCategory::kGradient)] += fp32_bytes;
      }
    }
  }
  const int64_t element = ElementSizeBytes(dtype);
  const int64_t scalar_bytes = 8 + element;  // a wrapped number and its conversion
  const DType step_dtype = DType::kFloat32;  // Adam's `step`: _get_scalar_dtype()
  const bool adam =
      optimizer_.kind == OptimizerKind::kAdamW || optimizer_.kind == OptimizerKind::kAdam;
  // Adam's default weight_decay is 0; AdamW's 1e-2 multiplies the parameter in place.
  const bool decoupled_decay = optimizer_.kind == OptimizerKind::kAdamW;
  const bool momentum = optimizer_.kind == OptimizerKind::kSgd && optimizer_.momentum > 0;
  switch (optimizer_.impl) {
    case OptimizerImpl::kForLoop:
      if (adam) {
        // _single_tensor_adam, per tensor: step_t += 1 (adam.py:415); AdamW's
        // param.mul_(1 - lr * wd) (:420); exp_avg.lerp_ (:457, nothing);
        // exp_avg_sq.mul_(b2).addcmul_ (:476); denom = (exp_avg_sq.sqrt() / bc2_sqrt)
        // .add_(eps) (:545): the root dies after the division, and the last tensor's
        // denom lives until this one's is bound; param.addcdiv_ (:547, nothing).
        // Its largest moment: the last denom, the root, the quotient and its wrapped
        // divisor.
        int64_t last_denom_bytes = 0;
        int last_denom = -1;
        for (int64_t numel : numels) {
          const int64_t bytes = numel * element;
          if (!memory_.itemized()) {
            memory_.Peek(last_denom_bytes + 2 * bytes + scalar_bytes, MemoryCategory::kTemporary);
            last_denom_bytes = bytes;
            continue;
          }
          memory_.ScalarOp(step_dtype);
          if (decoupled_decay) memory_.ScalarOp(dtype);
          memory_.ScalarOp(dtype);
          const int root = memory_.Alloc(bytes, MemoryCategory::kTemporary);
          const Memory::Wrapped divisor = memory_.WrapScalar(dtype);
          const int denom = memory_.Alloc(bytes, MemoryCategory::kTemporary);
          memory_.Drop(divisor);
          memory_.Unref(root);
          memory_.ScalarOp(dtype);
          if (last_denom >= 0) memory_.Unref(last_denom);
          last_denom = denom;
        }
        if (last_denom >= 0) memory_.Unref(last_denom);
      } else if (momentum) {
        // _single_tensor_sgd: buf.mul_(momentum).add_(grad) (sgd.py:364); param.add_
        // (:379, nothing).
        for (size_t p = 0; p < numels.size(); ++p) {
          if (memory_.itemized()) {
            memory_.ScalarOp(dtype);
          } else {
            memory_.Peek(scalar_bytes, MemoryCategory::kTemporary);
          }
        }
      }
      break;
    case OptimizerImpl::kForeach: {
      // The slow path on CPU tensors runs each list op tensor by tensor.
      auto scalar_per_tensor = [&]() {
        for (size_t p = 0; p < numels.size(); ++p) {
          if (memory_.itemized()) {
            memory_.ScalarOp(dtype);
          } else {
            memory_.Peek(scalar_bytes, MemoryCategory::kTemporary);
          }
        }
      };
      if (adam) {
        // _multi_tensor_adam: _foreach_add_(steps, torch.tensor(1.0), alpha=1.0)
        // (adam.py:682-685); AdamW's _foreach_mul_(params, ...) (:692);
        // _foreach_mul_(exp_avg_sqs, b2) (:709); exp_avg_sq_sqrt =
        // _foreach_sqrt(exp_avg_sqs) (:791), the whole list alive until the function
        // returns, through _foreach_div_ and _foreach_add_ (:793-794).
        memory_.Transient(ElementSizeBytes(step_dtype));
        if (decoupled_decay) scalar_per_tensor();
        scalar_per_tensor();
        int64_t list_bytes = 0;
        std::vector<int> roots;
        for (size_t p = 0; p < numels.size(); ++p) {
          const int64_t numel = numels[p];
          list_bytes += numel * element;
          if (auto* layer_bytes = OptimizerLayerBytes(p)) {
            (*layer_bytes)[static_cast<int>(MemoryCategory::kTemporary)] += numel * element;
          }
          if (memory_.itemized()) {
            roots.push_back(memory_.Alloc(numel * element, MemoryCategory::kTemporary));
          }
        }
        if (!memory_.itemized()) {
          memory_.Peek(list_bytes + scalar_bytes, MemoryCategory::kTemporary);
          break;
        }
        scalar_per_tensor();
        scalar_per_tensor();
        for (auto root = roots.rbegin(); root != roots.rend(); ++root) memory_.Unref(*root);
      } else if (momentum) {
        scalar_per_tensor();  // _foreach_mul_(bufs, momentum) (sgd.py:445)
      }
      break;
    }
    case OptimizerImpl::kFused:
      // _fused_adam: _foreach_add_(steps, 1) (adam.py:877), then the kernel, which
      // allocates nothing; _fused_sgd_ (sgd.py:529) allocates nothing.
      if (!adam) break;
      for (size_t p = 0; p < numels.size(); ++p) {
        if (memory_.itemized()) {
          memory_.ScalarOp(step_dtype);
        } else {
          memory_.Peek(8 + ElementSizeBytes(step_dtype), MemoryCategory::kTemporary);
        }
      }
      break;
  }
  for (int master_grad : master_grads) memory_.Unref(master_grad);
  return absl::OkStatus();
}

}  // namespace memledger::liveness_internal
