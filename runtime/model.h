// The measured model: a stack of pre-LN Transformer blocks in LibTorch, and the
// selective-checkpointing cache its ops consult.
//
// Block forward, x of shape (B, T, d):
//   h = ln1(x); qkv = qkv_lin(h)                      // Linear(d, 3d)
//   q, k, v = qkv.view(B, T, 3, H, dh).permute(2, 0, 3, 1, 4)   // views of qkv
//   x = x + proj(attention(q, k, v).transpose(1, 2).reshape(B, T, d))
//   x = x + fc2(gelu(fc1(ln2(x))))                   // Linear(d, 4d), exact GELU
//
// Example:
//   ModelAndInput built = BuildModel(config, /*seed=*/0);
//   at::Tensor loss = Loss(built.model->block(0).forward(built.input, AttentionMode::kFlash));
#ifndef RUNTIME_MODEL_H_
#define RUNTIME_MODEL_H_

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "estimator/config.h"

namespace memledger::runtime {

// SelectiveCache holds one checkpointed block's must-saved op outputs. While recording
// (the checkpointed forward) the block's policy ops append their outputs; while
// replaying (the recompute in backward) they take them back in the same order instead
// of computing them, and their backward uses the recomputed inputs.
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
  // Next returns the next saved output while replaying.
  const at::Tensor& Next();
  // Clear drops every saved output.
  void Clear();

  const std::vector<at::Tensor>& tensors() const { return tensors_; }

 private:
  SavePolicy policy_;
  bool replaying_ = false;
  std::vector<at::Tensor> tensors_;
  size_t cursor_ = 0;
};

// BlockImpl is one pre-LN block with 12 d^2 + 13 d parameters.
// REQUIRES: width % heads == 0.
class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(int64_t width, int64_t heads);

  // forward runs the block. With a `cache`, ops its policy names are recorded or
  // replayed (see SelectiveCache); without, every op runs plainly.
  at::Tensor forward(const at::Tensor& x, AttentionMode mode,
                     SelectiveCache* cache = nullptr);

  int64_t width() const { return width_; }
  int64_t heads() const { return heads_; }

  torch::nn::LayerNorm ln1{nullptr};
  torch::nn::Linear qkv{nullptr};
  torch::nn::Linear proj{nullptr};
  torch::nn::LayerNorm ln2{nullptr};
  torch::nn::Linear fc1{nullptr};
  torch::nn::Linear fc2{nullptr};

 private:
  int64_t width_;
  int64_t heads_;
};
TORCH_MODULE(Block);

// ModelImpl is `config.layers` blocks, registered in order as "blocks".
class ModelImpl : public torch::nn::Module {
 public:
  explicit ModelImpl(const ModelConfig& config);

  int64_t num_blocks() const { return static_cast<int64_t>(blocks->size()); }
  std::shared_ptr<BlockImpl> block(int64_t index) const;

  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(Model);

// ModelAndInput is a freshly built model and its input batch.
struct ModelAndInput {
  Model model{nullptr};
  at::Tensor input;  // (batch, seq, width) fp32, does not require grad
};

// BuildModel seeds LibTorch's generator with `seed`, builds the model, then draws the
// input with randn, so the same (config, seed) always gives the same model and input.
// REQUIRES: ValidateConfig(config).ok().
ModelAndInput BuildModel(const ModelConfig& config, int64_t seed);

// Loss is the study's loss, x.pow(2).mean() (pow with a Scalar exponent).
at::Tensor Loss(const at::Tensor& output);

// ExpectedParameterCount is layers * (12 d^2 + 13 d).
int64_t ExpectedParameterCount(const ModelConfig& config);

}  // namespace memledger::runtime

#endif  // RUNTIME_MODEL_H_
