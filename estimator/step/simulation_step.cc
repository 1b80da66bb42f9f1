// The step simulation: ZeRO-3's gathered parameter units, the gradients' reduction and
// the optimizer's step.
#include "estimator/step/simulation.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace memledger::liveness_internal {

int64_t Simulation::UnitBytes(int64_t segment) const {
  if (!zero3_) return 0;
  if (segment == Where::kPrologue) return prologue_unit_bytes_;
  if (segment == Where::kHead) return head_unit_bytes_;
  return layer_unit_bytes_[KindOf(segment)];
}

void Simulation::GatherUnit(int64_t segment) {
  if (fsdp2_) {
    FsdpForwardBegins(segment);
    return;
  }
  const int64_t bytes = UnitBytes(segment);
  if (!zero3_ || bytes == 0 || gathered_.count(segment) == 1) return;
  memory_.SetOp(Special(segment, Where::Activity::kParameterGather));
  gathered_[segment] = memory_.Alloc(bytes, MemoryCategory::kParameter);
}

void Simulation::ReleaseUnit(int64_t segment) {
  if (fsdp2_) {
    FsdpForwardEnds(segment);
    return;
  }
  auto it = gathered_.find(segment);
  if (it == gathered_.end()) return;
  memory_.Unref(it->second);
  gathered_.erase(it);
}

void Simulation::ReduceScatterUnit(int64_t segment) {
  const int64_t bytes = UnitBytes(segment);
  if (!zero3_ || bytes == 0) return;
  memory_.SetOp(Special(segment, Where::Activity::kUnitReduction));
  const int bucket = memory_.Alloc(bytes, MemoryCategory::kTemporary);
  // The unit's .grads die in its tensors' order.
  std::vector<std::pair<int, int>> unit_grads;  // (tensor, storage)
  for (const auto& [key, storage] : grads_) {
    if (key.first == segment) unit_grads.emplace_back(key.second, storage);
  }
  std::sort(unit_grads.begin(), unit_grads.end());
  for (const auto& [tensor, storage] : unit_grads) {
    memory_.Unref(storage);
    grads_.erase(ParameterKey{segment, tensor});
  }
  if (shard_grad_ < 0) {  // the first backward's alone (Memory::AllocOnce)
    shard_grad_ = memory_.AllocOnce(shard_elements_ * ElementSizeBytes(config_.dtype),
                                    MemoryCategory::kGradient);
  }
  memory_.Unref(bucket);
  ReleaseUnit(segment);
}

void Simulation::BackwardPassed(int64_t unit, std::optional<int64_t> previous) {
  // FSDP2's post_backward, where the unit's input's gradient is made; the root's is the
  // backward's final callback (FsdpBackwardEnds).
  if (fsdp2_ && unit != kRootUnit) FsdpPostBackward(unit);
  if (!zero3_) return;
  ReduceScatterUnit(unit);
  pending_unit_ = previous;
  if (previous.has_value()) GatherUnit(*previous);
}

// ReduceAndStep: the optimizer's step on every parameter, or on a data-parallel rank the
// gradients' reduction and the ZeRO shard's step (RankStep).
absl::Status Simulation::ReduceAndStep() {
  const int64_t element = ElementSizeBytes(config_.dtype);
  if (fsdp2_) {
    // Reduced unit by unit in the backward: the optimizer steps each parameter's shard.
    std::vector<int64_t> shards;
    shards.reserve(parameter_order_.size());
    for (const ParameterKey& parameter : parameter_order_) {
      shards.push_back(FsdpShardOf(parameter));
    }
    // Under CPUOffloadPolicy torch.optim steps the shards on the host.
    memory_.SetOnHost(FsdpOffload());
    absl::Status status = OptimizerStep(shards);
    memory_.SetOnHost(false);
    return status;
  }
  if (zero3_) {
    // The shard's gradient, reduced unit by unit in the backward, divided by dp x
    // micro-batches, stepped and freed; the parameters stay sharded.
    memory_.SetOp(Special(Where::kHead, Where::Activity::kGradientReduction));
    memory_.ScalarOp(config_.dtype);
    absl::Status status = OptimizerStep({shard_elements_});
    if (shard_grad_ >= 0) memory_.Unref(shard_grad_);
    return status;
  }
  std::vector<int64_t> numels;
  numels.reserve(parameter_order_.size());
  for (const ParameterKey& parameter : parameter_order_) {
    numels.push_back(memory_.bytes(grads_.at(parameter)) / element);
  }
  const ParallelSpec& data = options_.rank.parallel;
  // DDP reduced in the backward, into its resident buckets and back (DdpHook).
  if (data.dp <= 1 || ddp_) return OptimizerStep(numels);
  memory_.SetOp(Special(Where::kHead, Where::Activity::kGradientReduction));
  // A bucket of n elements over `ranks`: at::cat of the .grads' flat views and, when n
  // is not a multiple of ranks, a block of zeros (which dies with the list of pieces).
  auto make_bucket = [&](int64_t n, int64_t ranks) {
    const int64_t padded = ZeroShardElements(n, ranks) * ranks;
    const int padding =
        padded > n ? memory_.Alloc((padded - n) * element, MemoryCategory::kTemporary) : -1;
    const int bucket = memory_.Alloc(padded * element, MemoryCategory::kTemporary);
    if (padding >= 0) memory_.Unref(padding);
    return bucket;
  };
  if (config_.moe.ep > 1) {
    // Expert parallelism (ZeRO 0): the experts' gradients and the rest are reduced
    // apart, each a bucket over its own ranks as below: the rest over all dp ranks, the
    // experts over the dp / ep ranks that hold the same experts (Megatron's expert
    // data-parallel group; one rank when dp == ep, where nothing is exchanged but the
    // bucket is still made and divided by dp).
    for (const bool experts : {false, true}) {
      int64_t group_n = 0;
      for (size_t p = 0; p < numels.size(); ++p) {
        if (expert_shard_[p] == experts) group_n += numels[p];
      }
      const int bucket = make_bucket(group_n, experts ? data.dp / config_.moe.ep : data.dp);
      memory_.ScalarOp(config_.dtype);  // bucket.div_(dp)
      memory_.Unref(bucket);            // copied back into the .grads
    }
    return OptimizerStep(numels);
  }
  int64_t n = 0;
  for (int64_t numel : numels) n += numel;
  const int64_t shard = ZeroShardElements(n, data.dp);
  const int bucket = make_bucket(n, data.dp);
  auto free_grads = [&]() {
    for (const ParameterKey& parameter : parameter_order_) memory_.Unref(grads_.at(parameter));
  };
  // The all-reduce works in place (Gloo's own buffers are not ATen's).
  if (data.zero == 2) {
    // The shard's copy, divided by dp; then the bucket and the .grads freed.
    const int mine = memory_.Alloc(shard * element, MemoryCategory::kGradient);
    memory_.ScalarOp(config_.dtype);
    memory_.Unref(bucket);
    free_grads();
    absl::Status status = OptimizerStep({shard});
    memory_.Unref(mine);
    return status;
  }
  memory_.ScalarOp(config_.dtype);  // bucket.div_(dp)
  free_grads();
  absl::Status status = OptimizerStep({shard});  // on a view of the bucket
  memory_.Unref(bucket);
  return status;
}

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
  const DType dtype =
      optimizer_.master_weights || (fsdp2_ && FsdpMixedPrecision()) ? DType::kFloat32
                                                                    : config_.dtype;
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
