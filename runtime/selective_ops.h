// Ops that selective checkpointing can must-save, and the cache they use.
//
// Inside a checkpointed layer under a SavePolicy, each op of a kind the policy names
// records its output in the layer's SelectiveCache during the forward and, during the
// recompute in backward, takes that output back instead of computing it, while its
// backward is the real op's (so gradients equal `none`'s). Ops of other kinds, and every
// op outside a checkpointed layer (cache == nullptr), run plainly.
//
// Example:
//   at::Tensor y = LinearOp(*fc1, x, cache);  // plain when cache is null
#ifndef RUNTIME_SELECTIVE_OPS_H_
#define RUNTIME_SELECTIVE_OPS_H_

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cstddef>
#include <vector>

#include "estimator/spec/config.h"
#include "runtime/tensor_parallel.h"

namespace memledger::runtime {

// SelectiveCache holds one checkpointed layer's must-saved op outputs. While recording
// (the checkpointed forward) the layer's policy ops append their outputs; while
// replaying (the recompute in backward) they take them out in the same order.
class SelectiveCache {
 public:
  explicit SelectiveCache(const SavePolicy& policy) : policy_(policy) {}

  const SavePolicy& policy() const { return policy_; }
  bool Saves(OpKind kind) const { return policy_.Saves(kind); }
  bool replaying() const { return replaying_; }

  // Save appends an output while recording.
  void Save(const at::Tensor& tensor);
  // StartReplay rewinds to the first saved output.
  void StartReplay();
  // Peek is the saved output `ahead` places after the next while replaying; Pop drops
  // the next `n` (_CachedTorchDispatchMode's storage.pop(0)): the cache holds them no
  // more. A replayed op pops its outputs once its node has saved what it saves, as
  // autograd saves an op's inputs before the dispatch mode pops the cache: a
  // non-reentrant recompute that stops at that save leaves them in the cache.
  const at::Tensor& Peek(size_t ahead = 0) const;
  void Pop(size_t n = 1);
  // Clear drops every saved output.
  void Clear();

  const std::vector<at::Tensor>& tensors() const { return tensors_; }

 private:
  SavePolicy policy_;
  bool replaying_ = false;
  std::vector<at::Tensor> tensors_;
  size_t cursor_ = 0;
};

// LinearOp is linear.forward(input) (at::linear, with or without bias); kind matmul.
at::Tensor LinearOp(torch::nn::LinearImpl& linear, const at::Tensor& input,
                    SelectiveCache* cache);
// FunctionalLinearOp is F.linear(input, weight, bias) (bias may be undefined), as the
// eager experts call it on their select views of the 3-D weights; kind matmul.
at::Tensor FunctionalLinearOp(const at::Tensor& weight, const at::Tensor& bias,
                              const at::Tensor& input, SelectiveCache* cache);

// Conv1DOp is GPT-2's Conv1D: addmm(bias, input.view(-1, in), weight).view(..., out)
// with weight of shape (in, out), or mm without a bias (undefined); kind matmul.
at::Tensor Conv1DOp(const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& input,
                    SelectiveCache* cache);

// GatherLinearOp is a linear (weight (out, in); with `conv1d` GPT-2's Conv1D, weight
// (in, out)) whose (B, T / tp, in) input the sequence-parallel `tp` all-gathers first
// (TensorParallel::GatherLinear); kind matmul.
at::Tensor GatherLinearOp(TensorParallel& tp, const at::Tensor& weight, const at::Tensor& bias,
                          bool conv1d, const at::Tensor& input, SelectiveCache* cache);

// LayerNormOp is norm.forward(input) (native_layer_norm underneath); kind layer_norm.
at::Tensor LayerNormOp(torch::nn::LayerNormImpl& norm, const at::Tensor& input,
                       SelectiveCache* cache);

// GeluOp is at::gelu(input, approximate) ("none" or "tanh"); kind gelu.
at::Tensor GeluOp(const at::Tensor& input, const char* approximate, SelectiveCache* cache);

// SiluOp is at::silu(input); kind silu.
at::Tensor SiluOp(const at::Tensor& input, SelectiveCache* cache);

// AttentionOp is causal attention in `mode` (runtime/attention.h), or with a (B, 1, T, T)
// bool `mask` the masked flash kernel (MaskedFlashAttention); kind attention, for the
// flash op only.
at::Tensor AttentionOp(AttentionMode mode, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, SelectiveCache* cache,
                       const at::Tensor& mask = {});

}  // namespace memledger::runtime

#endif  // RUNTIME_SELECTIVE_OPS_H_
