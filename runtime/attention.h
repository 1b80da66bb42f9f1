// Causal scaled-dot-product attention in the two modes of estimator/config.h.
//
// kFlash follows PyTorch 2.x's CPU flash SDPA saved-tensor contract in a custom autograd
// Function: backward keeps q, k, v, out and logsumexp, never a (B, H, T, T) matrix, and
// recomputes the probabilities. `out` lives in a contiguous (B, T, H, d_head) buffer and
// is returned as its (B, H, T, d_head) transposed view, logsumexp likewise in a
// (B, T, H) buffer, so a caller's `out.transpose(1, 2).reshape(B, T, d)` is a view.
// kMath builds attention from plain ATen ops, which keep the T x T matrices.
//
// Example:
//   at::Tensor a = Attention(AttentionMode::kFlash, q, k, v);  // q, k, v: (B, H, T, dh)
#ifndef RUNTIME_ATTENTION_H_
#define RUNTIME_ATTENTION_H_

#include <ATen/core/Tensor.h>

#include "estimator/config.h"

namespace memledger::runtime {

// FlashOutputs is what the flash forward produces and its backward keeps besides q, k, v.
struct FlashOutputs {
  at::Tensor out;  // (B, H, T, dh), transposed view of a contiguous (B, T, H, dh) buffer
  at::Tensor lse;  // (B, H, T), transposed view of a contiguous (B, T, H) buffer
};

// FlashAttentionForward computes causal softmax(q k^T / sqrt(dh)) v and its logsumexp
// without recording autograd history.
// REQUIRES: q, k, v have the same shape (B, H, T, dh).
FlashOutputs FlashAttentionForward(const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v);

// FlashAttention applies the flash autograd Function and returns `out`. When `cached` is
// non-null its out and lse are used instead of being computed (selective
// checkpointing's recompute); backward is the same either way.
at::Tensor FlashAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const FlashOutputs* cached = nullptr);

// MathAttention is matmul, scale (mul.Scalar), masked_fill with a fresh causal mask,
// softmax, matmul: plain ops under ordinary autograd.
at::Tensor MathAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// Attention dispatches on `mode`.
at::Tensor Attention(AttentionMode mode, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v);

}  // namespace memledger::runtime

#endif  // RUNTIME_ATTENTION_H_
