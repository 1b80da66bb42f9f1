#include "runtime/attention.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <limits>

namespace memledger::runtime {
namespace {

namespace ag = torch::autograd;

// CausalMask is true above the diagonal: key positions a query may not see.
at::Tensor CausalMask(int64_t seq, const at::TensorOptions& options) {
  return at::ones({seq, seq}, options.dtype(at::kBool)).triu(1);
}

double Scale(const at::Tensor& q) { return 1.0 / std::sqrt(static_cast<double>(q.size(-1))); }

// Scores are q k^T * scale with masked positions at -inf.
at::Tensor MaskedScores(const at::Tensor& q, const at::Tensor& k) {
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)).mul_(Scale(q));
  return s.masked_fill_(CausalMask(q.size(-2), q.options()),
                        -std::numeric_limits<float>::infinity());
}

class FlashAttentionFunction : public ag::Function<FlashAttentionFunction> {
 public:
  static at::Tensor forward(ag::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v,
                            const FlashOutputs* cached) {
    FlashOutputs outputs = cached != nullptr ? *cached : FlashAttentionForward(q, k, v);
    ctx->save_for_backward({q, k, v, outputs.out, outputs.lse});
    return outputs.out;
  }

  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    const ag::variable_list saved = ctx->get_saved_variables();
    const at::Tensor& q = saved[0];
    const at::Tensor& k = saved[1];
    const at::Tensor& v = saved[2];
    const at::Tensor& out = saved[3];
    const at::Tensor& lse = saved[4];
    const at::Tensor& dout = grads[0];
    const double scale = Scale(q);
    // Recompute the probabilities from the kept logsumexp; masked entries are exp(-inf).
    at::Tensor p = at::exp(MaskedScores(q, k).sub_(lse.unsqueeze(-1)));
    at::Tensor dv = at::matmul(p.transpose(-2, -1), dout);
    at::Tensor dp = at::matmul(dout, v.transpose(-2, -1));
    at::Tensor delta = (dout * out).sum(-1, /*keepdim=*/true);
    at::Tensor ds = p.mul_(dp.sub_(delta));
    at::Tensor dq = at::matmul(ds, k).mul_(scale);
    at::Tensor dk = at::matmul(ds.transpose(-2, -1), q).mul_(scale);
    return {dq, dk, dv, at::Tensor()};
  }
};

}  // namespace

FlashOutputs FlashAttentionForward(const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v) {
  at::NoGradGuard no_grad;
  const int64_t batch = q.size(0), heads = q.size(1), seq = q.size(2), head_dim = q.size(3);
  at::Tensor s = MaskedScores(q, k);
  at::Tensor lse = at::logsumexp(s, -1);  // (B, H, T)
  at::Tensor p = at::exp(s.sub_(lse.unsqueeze(-1)));
  // PyTorch's layout: out and lse are allocated token-major, handed out transposed.
  at::Tensor out_buffer = at::empty({batch, seq, heads, head_dim}, q.options());
  out_buffer.transpose(1, 2).copy_(at::matmul(p, v));
  at::Tensor lse_buffer = at::empty({batch, seq, heads}, q.options());
  lse_buffer.transpose(1, 2).copy_(lse);
  return {out_buffer.transpose(1, 2), lse_buffer.transpose(1, 2)};
}

at::Tensor FlashAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const FlashOutputs* cached) {
  return FlashAttentionFunction::apply(q, k, v, cached);
}

at::Tensor MathAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t seq = q.size(2);
  at::Tensor s = at::matmul(q, k.transpose(-2, -1));
  s = s.mul(1.0 / std::sqrt(static_cast<double>(q.size(-1))));  // mul.Scalar
  at::Tensor mask = at::ones({seq, seq}, q.options().dtype(at::kBool)).triu(1);
  s = s.masked_fill(mask, -std::numeric_limits<float>::infinity());
  at::Tensor p = at::softmax(s, -1);
  return at::matmul(p, v);
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
