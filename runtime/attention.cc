#include "runtime/attention.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "runtime/dropout.h"
#include "runtime/last_use.h"

namespace memledger::runtime {
namespace {

namespace ag = torch::autograd;

constexpr double kDropout = 0.0;
constexpr bool kCausal = true;

// CachedFlashAttention returns the cached output; its backward is the real kernel's.
// The cache comes in by pointer: a tensor argument would count as an autograd input.
class CachedFlashAttention : public ag::Function<CachedFlashAttention> {
 public:
  static at::Tensor forward(ag::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v,
                            const FlashOutputs* cached, const at::Tensor* additive_mask) {
    // In the real node's order (attn_mask, key, query, value, logsumexp, output: inputs,
    // then outputs, each by name), so that a non-reentrant checkpoint's recompute fills
    // the holders its forward packed.
    ctx->saved_data["masked"] = additive_mask->defined();
    if (additive_mask->defined()) {
      ctx->save_for_backward({*additive_mask, k, q, v, cached->lse, cached->out});
    } else {
      ctx->save_for_backward({k, q, v, cached->lse, cached->out});
    }
    return cached->out.detach();
  }

  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    ag::variable_list saved = ctx->get_saved_variables();
    at::Tensor mask;
    if (ctx->saved_data["masked"].toBool()) {
      mask = saved.front();
      saved.erase(saved.begin());
    }
    const bool masked = mask.defined();
    auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        grads[0], saved[1], saved[0], saved[2], saved[4], saved[3], kDropout,
        /*is_causal=*/!masked, masked ? std::optional<at::Tensor>(mask) : std::nullopt);
    return {dq, dk, dv, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor FlashAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  // enable_gqa as transformers passes it (k and v may have fewer heads than q); the CPU
  // flash kernel reads the shared heads itself.
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, kDropout, kCausal,
                                          /*scale=*/std::nullopt,
                                          /*enable_gqa=*/k.size(1) < q.size(1));
}

at::Tensor MaskedFlashAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& mask) {
  return at::scaled_dot_product_attention(q, k, v, mask, kDropout, /*is_causal=*/false);
}

FlashOutputs FlashAttentionOutputs(const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v, const at::Tensor& additive_mask) {
  const bool masked = additive_mask.defined();
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
      q, k, v, kDropout, /*is_causal=*/!masked,
      masked ? std::optional<at::Tensor>(additive_mask) : std::nullopt);
  return {out, lse};
}

at::Tensor FlashAttentionFromCache(const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v, const FlashOutputs& cached,
                                   const at::Tensor& additive_mask) {
  return CachedFlashAttention::apply(q, k, v, &cached, &additive_mask);
}

at::Tensor AdditiveMask(const at::Tensor& mask, at::ScalarType dtype) {
  const at::TensorOptions options = mask.options().dtype(dtype);
  return at::where(mask, at::scalar_tensor(0.0, options),
                   at::scalar_tensor(-std::numeric_limits<double>::infinity(), options));
}

at::Tensor MathAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  // One statement per last use (see Last in runtime/model.h).
  const int64_t seq = q.size(2);
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1));
  at::Tensor scaled = Last(scores).mul(1.0 / std::sqrt(static_cast<double>(q.size(-1))));
  at::Tensor mask = at::ones({seq, seq}, q.options().dtype(at::kBool)).triu(1);
  at::Tensor masked = Last(scaled).masked_fill(Last(mask), -std::numeric_limits<float>::infinity());
  at::Tensor p = at::softmax(Last(masked), -1);
  return at::matmul(Last(p), v);
}

namespace {

// FusedCausalSoftmax is Megatron's scaled_upper_triang_masked_softmax after the scale,
// as its fused kernel runs: the causal mask applied inside (no mask tensor), the
// probabilities its one new tensor, kept for backward; the backward works in place on
// the incoming gradient (scaled_upper_triang_masked_softmax_cuda.cpp: "backward pass is
// completely in-place"). Rows of (..., T, T) in plain loops, in fp32.
struct FusedCausalSoftmax : ag::Function<FusedCausalSoftmax> {
  static at::Tensor forward(ag::AutogradContext* ctx, const at::Tensor& scores) {
    TORCH_CHECK(scores.is_contiguous(), "FusedCausalSoftmax: contiguous scores");
    const int64_t seq = scores.size(-1), rows = scores.numel() / seq;
    at::Tensor probs = at::empty(scores.sizes(), scores.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, scores.scalar_type(), "softmax", [&] {
      const scalar_t* in = scores.data_ptr<scalar_t>();
      scalar_t* out = probs.data_ptr<scalar_t>();
      for (int64_t r = 0; r < rows; ++r, in += seq, out += seq) {
        const int64_t visible = r % seq + 1;  // query r % seq sees keys 0..r % seq
        float max = -std::numeric_limits<float>::infinity(), sum = 0;
        for (int64_t j = 0; j < visible; ++j) max = std::max(max, static_cast<float>(in[j]));
        for (int64_t j = 0; j < visible; ++j) sum += std::exp(static_cast<float>(in[j]) - max);
        for (int64_t j = 0; j < seq; ++j) {
          out[j] = j < visible ? static_cast<scalar_t>(std::exp(static_cast<float>(in[j]) - max) / sum)
                               : scalar_t(0);
        }
      }
    });
    ctx->save_for_backward({probs});
    return probs;
  }
  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    const at::Tensor probs = ctx->get_saved_variables()[0];
    at::Tensor grad = grads[0];
    TORCH_CHECK(grad.is_contiguous(), "FusedCausalSoftmax: a contiguous gradient");
    const int64_t seq = probs.size(-1), rows = probs.numel() / seq;
    // d scores = probs * (grad - sum(grad * probs)), row by row, into grad itself.
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, probs.scalar_type(), "softmax", [&] {
      const scalar_t* p = probs.data_ptr<scalar_t>();
      scalar_t* g = grad.data_ptr<scalar_t>();
      for (int64_t r = 0; r < rows; ++r, p += seq, g += seq) {
        float dot = 0;
        for (int64_t j = 0; j < seq; ++j) dot += static_cast<float>(g[j]) * static_cast<float>(p[j]);
        for (int64_t j = 0; j < seq; ++j) {
          g[j] = static_cast<scalar_t>(static_cast<float>(p[j]) * (static_cast<float>(g[j]) - dot));
        }
      }
    });
    return {grad};
  }
};

}  // namespace

at::Tensor MegatronCoreAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 int64_t layer) {
  // One statement per last use (see Last in runtime/model.h).
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1));
  at::Tensor scaled = Last(scores).mul(1.0 / std::sqrt(static_cast<double>(q.size(-1))));
  at::Tensor probs = FusedCausalSoftmax::apply(Last(scaled));
  at::Tensor dropped = MegatronDropout(Last(probs), {layer, DropoutKind::kAttentionProbs});
  return at::matmul(Last(dropped), v);
}

at::Tensor Attention(AttentionMode mode, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v) {
  switch (mode) {
    case AttentionMode::kFlash:
      return FlashAttention(q, k, v);
    case AttentionMode::kMath:
      return MathAttention(q, k, v);
  }
  TORCH_CHECK(false, "unknown attention mode");
}

}  // namespace memledger::runtime
