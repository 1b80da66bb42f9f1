// transformers' rotary position embedding in LibTorch, shared by the families that use
// it (runtime/families/llama/, gemma3/): the tables a rotary embedding makes once per
// forward, apply_rotary_pos_emb for one of q and k, and repeat_kv.
#ifndef RUNTIME_FAMILIES_ROTARY_H_
#define RUNTIME_FAMILIES_ROTARY_H_

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <utility>

#include "estimator/spec/config.h"
#include "runtime/last_use.h"
#include "runtime/model.h"
#include "runtime/selective_ops.h"

namespace memledger::runtime {

// RopeTables is a rotary embedding's forward without grad, theta `base` and scaling 1:
// inv_freq = 1 / base^(arange(0, d_head, 2) / d_head), freqs = outer(arange(T),
// inv_freq), emb = cat(freqs, freqs); cos and sin of (1, T, d_head), returned in the
// hidden states' dtype as transformers does (cos.to(x.dtype)). The estimator's graph
// makes the same temporaries (estimator/graph/graph_builder.h, GraphBuilder::RopeTables).
inline std::pair<at::Tensor, at::Tensor> RopeTables(int64_t seq, int64_t head_dim, double base,
                                                    at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  at::Tensor inv_freq = 1.0 / at::pow(base, at::arange(0, head_dim, 2, at::kFloat) / head_dim);
  at::Tensor freqs = at::outer(at::arange(seq, at::kFloat), inv_freq);
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos().unsqueeze(0).to(dtype), emb.sin().unsqueeze(0).to(dtype)};
}

// RotaryTables names a rotary embedding's tables among the model-level tensors: the
// global one's, or the sliding-window layers' own (Local).
struct RotaryTables {
  ModelTensor cos = ModelTensor::kRopeCos;
  ModelTensor sin = ModelTensor::kRopeSin;
  static RotaryTables Local() { return {ModelTensor::kRopeLocalCos, ModelTensor::kRopeLocalSin}; }
  static RotaryTables Of(bool sliding) { return sliding ? Local() : RotaryTables(); }
};

// Rope is transformers' apply_rotary_pos_emb for one of q, k: x * cos +
// rotate_half(x) * sin, rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2]), in the order
// of the estimator's graph, each intermediate released after its last reader.
inline at::Tensor Rope(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  // (x * cos) + (rotate_half(x) * sin), left to right (modeling_llama.py:147);
  // rotate_half's order: x1 = x[..., :half], x2 = x[..., half:], cat(-x2, x1).
  at::Tensor x_cos = x * cos;
  at::Tensor x1 = x.slice(-1, 0, half);
  at::Tensor x2 = x.slice(-1, half);
  at::Tensor rotated = at::cat({-Last(x2), Last(x1)}, -1);
  at::Tensor rotated_sin = Last(rotated) * sin;
  return Last(x_cos) + Last(rotated_sin);
}

// RepeatKv is transformers' repeat_kv: (B, kv, T, dh) -> (B, kv * n_rep, T, dh), a copy.
inline at::Tensor RepeatKv(at::Tensor x, int64_t n_rep) {
  const int64_t b = x.size(0), kv = x.size(1), t = x.size(2), dh = x.size(3);
  return Last(x).unsqueeze(2).expand({b, kv, n_rep, t, dh}).reshape({b, kv * n_rep, t, dh});
}

// RopeAttention is the attention of LlamaAttention.forward and its look-alikes
// (Qwen3's, Gemma3Attention) between the projections and o_proj, as the estimator's
// GraphBuilder::RopeAttention describes it: apply_rotary_pos_emb (its argument q held to
// its return), with a DynamicCache its copies of the keys and values (the old locals
// rebound once both exist), repeat_kv where SDPA does not read the shared heads itself
// (always with a `mask`), and attention. `q`, `k` and `v` come back as the forward's
// locals after RoPE and the cache, for the caller to hold to its return.
// `cast_back`: apply_rotary_pos_emb returns q_embed.to(q.dtype), k_embed.to(k.dtype) (a
// family whose tables stay fp32).
// `tables`: the rotary tables the layer reads (a sliding-window layer its own).
inline at::Tensor RopeAttention(at::Tensor& q, at::Tensor& k, at::Tensor& v,
                                const LayerExtras& extras, RotaryTables tables, int64_t heads,
                                int64_t kv_heads, AttentionMode mode, SelectiveCache* cache,
                                const at::Tensor& mask = {}, bool cast_back = false) {
  const at::Tensor cos = extras[tables.cos].unsqueeze(1), sin = extras[tables.sin].unsqueeze(1);
  const at::ScalarType q_type = q.scalar_type(), k_type = k.scalar_type();
  at::Tensor q_embed = Rope(q, cos, sin);
  at::Tensor k_embed = Rope(Last(k), cos, sin);
  if (cast_back) {  // the casts in its return statement, q_embed and k_embed alive to it
    at::Tensor q_cast = q_embed.to(q_type), k_cast = k_embed.to(k_type);
    q_embed = std::move(q_cast);
    k_embed = std::move(k_cast);
  }
  q = std::move(q_embed);
  k = std::move(k_embed);
  if (extras.kv_cache != nullptr) {
    // Under autocast the keys are fp32 (RoPE's product with fp32 cos), the values bf16,
    // promoted to the keys' dtype. A DynamicSlidingWindowLayer keeps a slice of the same
    // copies.
    const at::ScalarType keys = k.scalar_type();
    at::Tensor k_cached = KvCacheUpdate(k, keys, extras.kv_cache);
    at::Tensor v_cached = KvCacheUpdate(v, keys, extras.kv_cache);
    k = std::move(k_cached);
    v = std::move(v_cached);
  }
  at::Tensor k_attention = k, v_attention = v;
  if (kv_heads < heads && (mask.defined() || RepeatsKv(mode, q.size(-1)))) {
    k_attention = RepeatKv(k, heads / kv_heads);
    v_attention = RepeatKv(v, heads / kv_heads);
  }
  return AttentionOp(mode, q, Last(k_attention), Last(v_attention), cache, mask);
}

}  // namespace memledger::runtime

#endif  // RUNTIME_FAMILIES_ROTARY_H_
