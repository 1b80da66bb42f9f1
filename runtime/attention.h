// Causal scaled-dot-product attention in the two modes of estimator/config.h.
//
// kFlash is PyTorch's own kernel: at::scaled_dot_product_attention(q, k, v, {}, 0.0,
// /*is_causal=*/true), which on the CPU dispatches to
// _scaled_dot_product_flash_attention_for_cpu. Its backward node
// (ScaledDotProductFlashAttentionForCpuBackward0) keeps query, key, value, output and
// logsumexp, never a (B, H, T, T) matrix; `output` is allocated token-major (B, T, H, dh)
// and handed out as its (1, 2)-transposed view, logsumexp likewise as (B, T, H) viewed
// as (B, H, T).
// kMath builds attention from plain ATen ops, which keep the T x T matrices.
//
// Example:
//   at::Tensor a = Attention(AttentionMode::kFlash, q, k, v);  // q, k, v: (B, H, T, dh)
#ifndef RUNTIME_ATTENTION_H_
#define RUNTIME_ATTENTION_H_

#include <ATen/core/Tensor.h>

#include "estimator/spec/config.h"

namespace memledger::runtime {

// FlashOutputs is what the CPU flash kernel returns: both are what its backward keeps.
struct FlashOutputs {
  at::Tensor out;  // (B, H, T, dh), transposed view of a contiguous (B, T, H, dh) buffer
  at::Tensor lse;  // (B, H, T) logsumexp, transposed view of a contiguous (B, T, H) one
};

// FlashAttention is at::scaled_dot_product_attention(q, k, v, {}, 0.0, is_causal=true):
// the real kernel under ordinary autograd.
at::Tensor FlashAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// FlashAttentionOutputs runs the op FlashAttention dispatches to on the CPU,
// _scaled_dot_product_flash_attention_for_cpu, and returns both of its outputs. It
// records autograd history like any op; selective checkpointing calls it in no-grad
// mode to fill its cache. With `additive_mask` (AdditiveMask's) the masked kernel,
// not causal.
FlashOutputs FlashAttentionOutputs(const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v, const at::Tensor& additive_mask = {});

// FlashAttentionFromCache returns `cached.out` as the attention of (q, k, v) with the
// real kernel's backward (_scaled_dot_product_flash_attention_for_cpu_backward over the
// cached out and logsumexp): what a must-saved flash op is at selective recompute.
// REQUIRES: `cached` came from FlashAttentionOutputs on the same q, k, v values (and
// additive mask, which the node then keeps too).
at::Tensor FlashAttentionFromCache(const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v, const FlashOutputs& cached,
                                   const at::Tensor& additive_mask = {});

// AdditiveMask is ATen's convert_boolean_attn_mask of a bool SDPA mask: where(mask,
// scalar_tensor(0), scalar_tensor(-inf)) in `dtype`.
at::Tensor AdditiveMask(const at::Tensor& mask, at::ScalarType dtype);

// MaskedFlashAttention is at::scaled_dot_product_attention(q, k, v, mask, 0.0,
// is_causal=false) with a (B, 1, T, T) bool mask: ATen's convert_boolean_attn_mask
// makes the additive mask in q's dtype (two 0-dim numbers, then where), and the CPU
// flash kernel runs with it, its node keeping it (Gemma 3's sliding-window layers).
at::Tensor MaskedFlashAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& mask);

// MathAttention is matmul, scale (mul.Scalar), masked_fill with a fresh causal mask,
// softmax, matmul: plain ops under ordinary autograd.
at::Tensor MathAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// Attention dispatches on `mode`.
at::Tensor Attention(AttentionMode mode, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v);

// MegatronCoreAttention is megatron-gpt's math attention: q k^T, the scale, Megatron's
// fused causal softmax (no mask tensor; keeps its output) and dropout on the
// probabilities (runtime/dropout.h, keeps its mask), times v. `layer` names the dropout
// site.
at::Tensor MegatronCoreAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 int64_t layer);

}  // namespace memledger::runtime

#endif  // RUNTIME_ATTENTION_H_
