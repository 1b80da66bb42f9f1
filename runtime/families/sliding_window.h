// transformers' sliding-window mask in LibTorch, shared by the families with
// sliding-window layers (runtime/families/gemma3/, olmo3/).
#ifndef RUNTIME_FAMILIES_SLIDING_WINDOW_H_
#define RUNTIME_FAMILIES_SLIDING_WINDOW_H_

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "estimator/spec/config.h"
#include "runtime/families/rotary.h"
#include "runtime/last_use.h"
#include "runtime/model.h"

namespace memledger::runtime {

// SlidingWindowMask is create_sliding_window_causal_mask's sdpa_mask without vmap
// (masking_utils.py), as the estimator's simulation describes it
// (estimator/graph/graph_builder.h, GraphBuilder::SlidingWindowMaskTensor): the (1, 1, T, T) bool mask of
// kv > q - window and kv <= q.
inline at::Tensor SlidingWindowMask(int64_t batch, int64_t seq, int64_t window) {
  at::NoGradGuard no_grad;
  at::Tensor batch_arange = at::arange(batch, at::kLong);
  at::Tensor head_arange = at::arange(1, at::kLong);
  at::Tensor q = at::arange(seq, at::kLong) + 0;
  at::Tensor kv = at::arange(seq, at::kLong) + 0;
  const at::Tensor q4 = q.view({1, 1, seq, 1}), kv4 = kv.view({1, 1, 1, seq});
  at::Tensor result = at::ones({}, q.options().dtype(at::kBool));  // q_idx.new_ones(())
  at::Tensor shifted = q4 - window;
  at::Tensor in_window = kv4 > Last(shifted);
  result = result & Last(in_window);
  at::Tensor causal = kv4 <= q4;
  result = result & Last(causal);
  return result;
}

// SlidingWindowExtrasOf is ModelImpl::ExtrasOf for a model of sliding-window and full
// layers: layer `index` gets its type's position_embeddings (a sliding layer the local
// tables) and attention_mask (the sliding mask, or none).
inline LayerExtras SlidingWindowExtrasOf(const ModelConfig& config, int64_t index,
                                         const LayerExtras& extras) {
  LayerExtras own = extras;
  const bool sliding = config.AttentionOf(index) == LayerAttention::kSliding;
  // What the other type reads: the other tables, and a full layer no mask.
  const RotaryTables other = RotaryTables::Of(!sliding);
  own[other.cos] = own[other.sin] = at::Tensor();
  if (!sliding) own[ModelTensor::kSlidingMask] = at::Tensor();
  return own;
}

// SlidingWindowCacheLayers is ModelImpl::CacheLayers for such a model: each sliding
// layer's DynamicSlidingWindowLayer holds torch.tensor(sliding_window, dtype=torch.long)
// (cache_utils.py, DynamicSlidingWindowLayer.__init__).
inline std::vector<at::Tensor> SlidingWindowCacheLayers(const ModelConfig& config,
                                                        int64_t layers) {
  std::vector<at::Tensor> tensors;
  for (int64_t i = 0; i < layers; ++i) {
    if (config.AttentionOf(i) == LayerAttention::kSliding) {
      tensors.push_back(at::scalar_tensor(config.sliding_window, at::kLong));
    }
  }
  return tensors;
}

// RotaryPerLayerType is such a model's rotary embedding, one per layer type its layers
// have (Gemma3RotaryEmbedding, Olmo3RotaryEmbedding): its global tables (rope_theta
// `full_theta`) for the full layers, its local ones (`sliding_theta`) for the sliding
// layers.
class RotaryPerLayerType {
 public:
  RotaryPerLayerType(const ModelConfig& config, double full_theta, double sliding_theta)
      : config_(config), full_theta_(full_theta), sliding_theta_(sliding_theta) {
    for (int64_t i = 0; i < config.layers; ++i) {
      (config.AttentionOf(i) == LayerAttention::kSliding ? has_sliding_ : has_full_) = true;
    }
  }
  // RegisterBuffers: {type}_inv_freq and {type}_original_inv_freq, fp32, d_head / 2 each,
  // for each type the layers have, in sorted order (the estimator's
  // GraphBuilder::RotaryBuffersPerLayerType).
  void RegisterBuffers(torch::nn::Module& module) const {
    const int64_t head_dim = config_.HeadDim();
    for (const auto& [present, type, base] :
         {std::tuple<bool, const char*, double>{has_full_, "full", full_theta_},
          {has_sliding_, "sliding", sliding_theta_}}) {
      if (!present) continue;
      at::Tensor inv_freq = 1.0 / at::pow(base, at::arange(0, head_dim, 2, at::kFloat) / head_dim);
      module.register_buffer(std::string(type) + "_inv_freq", inv_freq);
      module.register_buffer(std::string(type) + "_original_inv_freq", inv_freq.clone());
    }
  }
  // Extras is ModelImpl::Extras for such a model: position_ids, the sliding layers' mask
  // when materialized, then the tables of each layer type the layers have, in `dtype`:
  // the global ones, then the local ones (the estimator's DecoderModelTensors).
  LayerExtras Extras(int64_t seq, at::ScalarType dtype) const {
    at::NoGradGuard no_grad;
    const int64_t head_dim = config_.HeadDim();
    LayerExtras extras;
    extras[ModelTensor::kPositionIds] = PositionIds(seq);
    if (config_.SlidingWindowMasked()) {
      extras[ModelTensor::kSlidingMask] =
          SlidingWindowMask(config_.batch, seq, config_.sliding_window);
    }
    for (const auto& [present, tables, base] :
         {std::tuple<bool, RotaryTables, double>{has_full_, RotaryTables(), full_theta_},
          {has_sliding_, RotaryTables::Local(), sliding_theta_}}) {
      if (!present) continue;
      std::tie(extras[tables.cos], extras[tables.sin]) = RopeTables(seq, head_dim, base, dtype);
    }
    return extras;
  }

 private:
  ModelConfig config_;
  double full_theta_, sliding_theta_;
  bool has_full_ = false, has_sliding_ = false;
};

}  // namespace memledger::runtime

#endif  // RUNTIME_FAMILIES_SLIDING_WINDOW_H_
