// Activation checkpointing in C++ (torch.utils.checkpoint is Python-only, in 2.x too), and
// the model forward under a checkpointing Variant.
//
// A checkpointed layer is a custom autograd Function over (x, the layer's extras, its
// parameters): its forward runs the layer without a graph and saves only its tensor
// inputs, x and the extras (Llama's cos and sin), which count as saved even when they do
// not require grad (as PyTorch 2.x's non-reentrant checkpoint saves its inputs). Its
// backward recomputes the layer with grad enabled on a detached x and returns the
// gradients of x and of every parameter. Under a SavePolicy (selective checkpointing)
// the forward also fills a SelectiveCache that the node owns and the recompute reuses.
//
// Example:
//   ForwardResult result = ForwardWithVariant(*model, input, AttentionMode::kFlash,
//                                             variant);
//   result.loss.backward();
#ifndef RUNTIME_CHECKPOINT_H_
#define RUNTIME_CHECKPOINT_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "estimator/config.h"
#include "runtime/model.h"

namespace memledger::runtime {

// CheckpointLayer runs `layer` on `x` under checkpointing. With a `policy` (selective)
// the policy ops' outputs are cached; they are appended to `cached` when it is non-null
// so the caller can account for them.
at::Tensor CheckpointLayer(const std::shared_ptr<DecoderLayer>& layer, const at::Tensor& x,
                           const LayerExtras& extras, AttentionMode mode,
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

// ForwardStage runs one pipeline stage's part of the model as ForwardWithVariant runs
// all of it (layer indices, and so the variant's choices, are the whole model's). A stage
// without the prologue starts from `received` (the previous stage's output; its extras
// made here); `input` is the model input (the prologue's, and the loss's labels). Its
// `loss` is the loss with the head, else the stage's output hidden states.
ForwardResult ForwardStage(const ModelImpl& model, const StageRange& stage,
                           const at::Tensor& received, const at::Tensor& input,
                           AttentionMode mode, const Variant& variant);

}  // namespace memledger::runtime

#endif  // RUNTIME_CHECKPOINT_H_
