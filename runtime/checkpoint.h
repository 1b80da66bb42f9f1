// Activation checkpointing in C++ (torch.utils.checkpoint is Python-only, in 2.x too), and
// the model forward under a checkpointing Variant.
//
// A checkpointed layer is a custom autograd Function over (x, the layer's parameters),
// as torch.utils.checkpoint's reentrant CheckpointFunction (checkpoint.py:241-330): its
// forward keeps the CPU RNG state, runs the layer without a graph and saves only x,
// which counts as saved even when it does not require grad; the tensors the layer is
// called with besides (position ids, Llama's cos and sin) it holds without saving them,
// as transformers binds them into the checkpointed function. Its backward recomputes the
// layer with grad enabled on a detached x, under the forward's RNG state (the current
// one kept aside meanwhile, as fork_rng does), and returns the gradients of x and of
// every parameter. Under a SavePolicy (selective checkpointing) the forward also fills a
// SelectiveCache that the node owns and the recompute reuses.
//
// Example:
//   ForwardResult result = ForwardWithVariant(*model, input, AttentionMode::kFlash,
//                                             variant);
//   result.loss.backward();
#ifndef RUNTIME_CHECKPOINT_H_
#define RUNTIME_CHECKPOINT_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "estimator/spec/config.h"
#include "runtime/model.h"

namespace memledger::runtime {

// CheckpointLayer runs `layer` on `x` under checkpointing. With a `policy` (selective)
// the policy ops' outputs are cached; they are appended to `cached` when it is non-null
// so the caller can account for them.
at::Tensor CheckpointLayer(const std::shared_ptr<DecoderLayer>& layer, const at::Tensor& x,
                           const LayerExtras& extras, AttentionMode mode,
                           CheckpointImpl impl = CheckpointImpl::kNonReentrant,
                           const SavePolicy* policy = nullptr,
                           std::vector<at::Tensor>* cached = nullptr);

// ForwardResult is a model forward plus loss.
struct ForwardResult {
  at::Tensor loss;
  // cache_bytes is the sum of nbytes over the unique storages of every selective cache
  // filled by this forward (0 unless the variant is selective).
  int64_t cache_bytes = 0;
};

// ForwardWithVariant runs the prologue, the layers (checkpointing those `variant` names,
// Variant::IsCheckpointed; selective variants cache their policy's ops) and the
// epilogue's loss.
ForwardResult ForwardWithVariant(const ModelImpl& model, const at::Tensor& input,
                                 AttentionMode mode, const Variant& variant);

// ParameterUnits is ZeRO-3's parameter gathering, unit by unit (runtime/zero_units.h
// implements it): a unit is the prologue (kPrologue), one layer (its index) or the head
// (kHead). ForwardStage gathers each unit's parameters before its forward and releases
// them after; in the backward, a hook on each unit's input (whose gradient is complete
// once the unit's backward has run) calls BackwardPassed with the unit before it in the
// stage (kNone for none).
class ParameterUnits {
 public:
  static constexpr int64_t kNone = -2;
  static constexpr int64_t kPrologue = -1;
  static constexpr int64_t kHead = std::numeric_limits<int64_t>::max();
  virtual ~ParameterUnits() = default;
  virtual void Gather(int64_t unit) = 0;
  virtual void Release(int64_t unit) = 0;
  // LossMade: the head's forward returned `loss`, from which the backward will start
  // (FSDP2 hooks the root's pre-backward on it).
  virtual void LossMade(const at::Tensor& /*loss*/) {}
  // BeginBackward: the stage's backward is about to start from `last`, its last unit.
  virtual void BeginBackward(int64_t last) = 0;
  // BackwardPassed: `unit`'s backward has run; `previous` is next.
  virtual void BackwardPassed(int64_t unit, int64_t previous) = 0;
  // EndBackward: the backward has returned (the stage's first unit's hook, where its
  // input needs no gradient, never ran).
  virtual void EndBackward() = 0;
};

// ForwardStage runs one pipeline stage's part of the model as ForwardWithVariant runs
// all of it (layer indices, and so the variant's choices, are the whole model's). A stage
// without the prologue starts from `received` (the previous stage's output; its extras
// made here); `input` is the model input (the prologue's, and the loss's labels). Its
// `loss` is the loss with the head, else the stage's output hidden states. With `units`,
// ZeRO-3's gathering around each unit.
ForwardResult ForwardStage(const ModelImpl& model, const StageRange& stage,
                           const at::Tensor& received, const at::Tensor& input,
                           AttentionMode mode, const Variant& variant,
                           ParameterUnits* units = nullptr);

}  // namespace memledger::runtime

#endif  // RUNTIME_CHECKPOINT_H_
