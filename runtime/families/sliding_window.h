// transformers' sliding-window mask in LibTorch, shared by the families with
// sliding-window layers (runtime/families/gemma3/, olmo3/).
#ifndef RUNTIME_FAMILIES_SLIDING_WINDOW_H_
#define RUNTIME_FAMILIES_SLIDING_WINDOW_H_

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cstdint>
#include <vector>

#include "estimator/spec/config.h"
#include "runtime/last_use.h"
#include "runtime/model.h"

namespace memledger::runtime {

// SlidingWindowMask is create_sliding_window_causal_mask's sdpa_mask without vmap
// (masking_utils.py), as the estimator's simulation describes it
// (estimator/step/simulation_schedule.cc, SlidingWindowMask): the (1, 1, T, T) bool mask of
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
  if (config.AttentionOf(index) == LayerAttention::kSliding) {
    own.cos = extras.cos_local;
    own.sin = extras.sin_local;
  } else {
    own.sliding_mask = at::Tensor();
  }
  own.cos_local = own.sin_local = at::Tensor();
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

}  // namespace memledger::runtime

#endif  // RUNTIME_FAMILIES_SLIDING_WINDOW_H_
