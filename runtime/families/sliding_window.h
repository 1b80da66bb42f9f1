// transformers' sliding-window mask in LibTorch, shared by the families with
// sliding-window layers (runtime/families/gemma3/, olmo3/).
#ifndef RUNTIME_FAMILIES_SLIDING_WINDOW_H_
#define RUNTIME_FAMILIES_SLIDING_WINDOW_H_

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cstdint>

#include "runtime/last_use.h"

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

}  // namespace memledger::runtime

#endif  // RUNTIME_FAMILIES_SLIDING_WINDOW_H_
