#include "runtime/selective_ops.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "runtime/attention.h"
#include "runtime/autocast.h"

namespace memledger::runtime {
namespace {

namespace ag = torch::autograd;

// The replayed ops below return a cached output and compute only their backward, so
// the op itself is really skipped at recompute. Cached tensors come in by pointer: a
// tensor argument would count as an autograd input.

// CachedLinear: y = x W^T (+ b), with y from the cache. `parameters` is {W} or {W, b}:
// an undefined tensor cannot be an autograd input.
class CachedLinear : public ag::Function<CachedLinear> {
 public:
  static at::Tensor forward(ag::AutogradContext* ctx, const at::Tensor& input,
                            at::TensorList parameters, const at::Tensor* cached) {
    ctx->save_for_backward({input, parameters[0]});
    ctx->saved_data["has_bias"] = parameters.size() > 1;
    return *cached;
  }

  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    const ag::variable_list saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor grad = grads[0].reshape({-1, weight.size(0)});
    const at::Tensor input_2d = input.reshape({-1, weight.size(1)});
    ag::variable_list result = {grad.mm(weight).view(input.sizes()), grad.t().mm(input_2d)};
    if (ctx->saved_data["has_bias"].toBool()) result.push_back(grad.sum(0));
    result.push_back(at::Tensor());
    return result;
  }
};

// CachedConv1D: y = x W (+ b) with W of shape (in, out), y from the cache. `parameters`
// is {W} or {W, b}. Its backward computes what addmm's (with b) or mm's (without)
// would, in their order: AddmmBackward0 the input's gradient first, MmBackward0 the
// weight's.
class CachedConv1D : public ag::Function<CachedConv1D> {
 public:
  static at::Tensor forward(ag::AutogradContext* ctx, const at::Tensor& input,
                            at::TensorList parameters, const at::Tensor* cached) {
    ctx->save_for_backward({input, parameters[0]});
    ctx->saved_data["has_bias"] = parameters.size() > 1;
    return *cached;
  }

  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    const ag::variable_list saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor grad = grads[0].reshape({-1, weight.size(1)});
    const at::Tensor input_2d = input.reshape({-1, weight.size(0)});
    if (!ctx->saved_data["has_bias"].toBool()) {
      at::Tensor grad_weight = input_2d.t().mm(grad);
      at::Tensor grad_input = grad.mm(weight.t()).view(input.sizes());
      return {grad_input, grad_weight, at::Tensor()};
    }
    at::Tensor grad_input = grad.mm(weight.t()).view(input.sizes());
    at::Tensor grad_weight = input_2d.t().mm(grad);
    return {grad_input, grad_weight, grad.sum(0), at::Tensor()};
  }
};

// CachedLayerNorm: native_layer_norm over the last dim, (out, mean, rstd) from the cache.
class CachedLayerNorm : public ag::Function<CachedLayerNorm> {
 public:
  static at::Tensor forward(ag::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const at::Tensor& bias,
                            const at::Tensor* out, const at::Tensor* mean,
                            const at::Tensor* rstd) {
    ctx->save_for_backward({input, weight, bias, *mean, *rstd});
    return *out;
  }

  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    const ag::variable_list saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    auto [grad_input, grad_weight, grad_bias] = at::native_layer_norm_backward(
        grads[0].contiguous(), input, {input.size(-1)}, saved[3], saved[4], saved[1],
        saved[2], {true, true, true});
    return {grad_input, grad_weight, grad_bias, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// CachedActivation: gelu (exact or tanh) or silu, output from the cache.
class CachedActivation : public ag::Function<CachedActivation> {
 public:
  static at::Tensor forward(ag::AutogradContext* ctx, const at::Tensor& input,
                            const std::string& kind, const at::Tensor* cached) {
    ctx->save_for_backward({input});
    ctx->saved_data["kind"] = kind;
    return *cached;
  }

  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    const at::Tensor input = ctx->get_saved_variables()[0];
    const std::string kind = ctx->saved_data["kind"].toStringRef();
    at::Tensor grad = kind == "silu" ? at::silu_backward(grads[0], input)
                                     : at::gelu_backward(grads[0], input, kind);
    return {grad, at::Tensor(), at::Tensor()};
  }
};

// Lower is what autocast does to an argument of a lower-precision op: an fp32 tensor
// becomes a copy in the autocast dtype. The replays below bypass the dispatcher (custom
// Functions are not autocast), so they cast their arguments themselves, as the op they
// stand for would have had them cast.
at::Tensor Lower(const at::Tensor& t) {
  const std::optional<at::ScalarType> dtype = CurrentAutocast();
  if (!dtype.has_value() || !t.defined() || t.scalar_type() != at::kFloat) return t;
  return t.to(*dtype);
}

// Cached runs `compute` and caches its output while recording, or replays the cached
// output through `replay` while replaying; `kind` off the policy runs `compute` plainly.
template <typename Compute, typename Replay>
at::Tensor Cached(SelectiveCache* cache, OpKind kind, Compute compute, Replay replay) {
  if (cache == nullptr || !cache->Saves(kind)) return compute();
  if (!cache->replaying()) {
    at::Tensor out = compute();
    cache->Save(out);
    return out;
  }
  return replay(cache->Next());
}

}  // namespace

void SelectiveCache::Save(const at::Tensor& tensor) {
  TORCH_CHECK(!replaying_, "SelectiveCache::Save while replaying");
  tensors_.push_back(tensor);
}

void SelectiveCache::StartReplay() {
  replaying_ = true;
  cursor_ = 0;
}

const at::Tensor& SelectiveCache::Next() {
  TORCH_CHECK(replaying_ && cursor_ < tensors_.size(),
              "SelectiveCache::Next: replay asked for more outputs than were saved (",
              tensors_.size(), ")");
  return tensors_[cursor_++];
}

void SelectiveCache::Clear() {
  tensors_.clear();
  cursor_ = 0;
}

at::Tensor LinearOp(torch::nn::LinearImpl& linear, const at::Tensor& input,
                    SelectiveCache* cache) {
  return Cached(
      cache, OpKind::kMatmul, [&] { return at::linear(input, linear.weight, linear.bias); },
      [&](const at::Tensor& out) {
        // In autocast's order for linear: bias, weight, input (its wrapper's call
        // arguments, evaluated last to first), so that the casts' backward nodes run in
        // the order they do after a real linear.
        const at::Tensor bias = linear.bias.defined() ? Lower(linear.bias) : at::Tensor();
        std::vector<at::Tensor> parameters = {Lower(linear.weight)};
        if (bias.defined()) parameters.push_back(bias);
        const at::Tensor x = Lower(input);
        return CachedLinear::apply(x, at::TensorList(parameters), &out);
      });
}

at::Tensor GatherLinearOp(TensorParallel& tp, const at::Tensor& weight, const at::Tensor& bias,
                          bool conv1d, const at::Tensor& input, SelectiveCache* cache) {
  return Cached(
      cache, OpKind::kMatmul,
      [&] { return tp.GatherLinear(input, weight, bias, conv1d, nullptr); },
      [&](const at::Tensor& out) { return tp.GatherLinear(input, weight, bias, conv1d, &out); });
}

at::Tensor Conv1DOp(const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& input,
                    SelectiveCache* cache) {
  return Cached(
      cache, OpKind::kMatmul,
      [&] {
        std::vector<int64_t> sizes = input.sizes().vec();
        sizes.back() = weight.size(1);
        const at::Tensor rows = input.view({-1, input.size(-1)});
        return (bias.defined() ? at::addmm(bias, rows, weight) : rows.mm(weight)).view(sizes);
      },
      [&](const at::Tensor& out) {
        // In autocast's order for addmm(bias, input, weight): weight, input, bias (mm's:
        // weight, input).
        std::vector<at::Tensor> parameters = {Lower(weight)};
        const at::Tensor x = Lower(input);
        if (bias.defined()) parameters.push_back(Lower(bias));
        return CachedConv1D::apply(x, at::TensorList(parameters), &out);
      });
}

at::Tensor LayerNormOp(torch::nn::LayerNormImpl& norm, const at::Tensor& input,
                       SelectiveCache* cache) {
  if (cache == nullptr || !cache->Saves(OpKind::kLayerNorm)) return norm.forward(input);
  if (!cache->replaying()) {
    // What LayerNorm's forward calls underneath, keeping all three outputs.
    auto [out, mean, rstd] =
        at::native_layer_norm(input, norm.options.normalized_shape(), norm.weight,
                              norm.bias, norm.options.eps());
    cache->Save(out);
    cache->Save(mean);
    cache->Save(rstd);
    return out;
  }
  const at::Tensor& out = cache->Next();
  const at::Tensor& mean = cache->Next();
  const at::Tensor& rstd = cache->Next();
  return CachedLayerNorm::apply(input, norm.weight, norm.bias, &out, &mean, &rstd);
}

at::Tensor GeluOp(const at::Tensor& input, const char* approximate, SelectiveCache* cache) {
  return Cached(
      cache, OpKind::kGelu, [&] { return at::gelu(input, approximate); },
      [&](const at::Tensor& out) {
        return CachedActivation::apply(input, std::string(approximate), &out);
      });
}

at::Tensor SiluOp(const at::Tensor& input, SelectiveCache* cache) {
  return Cached(
      cache, OpKind::kSilu, [&] { return at::silu(input); },
      [&](const at::Tensor& out) {
        return CachedActivation::apply(input, std::string("silu"), &out);
      });
}

at::Tensor AttentionOp(AttentionMode mode, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, SelectiveCache* cache) {
  // Only the flash op can be must-saved (ValidatePolicy rejects it for math). Its cache
  // holds the real kernel's two outputs; at recompute its backward uses them.
  if (mode != AttentionMode::kFlash || cache == nullptr ||
      !cache->Saves(OpKind::kAttention)) {
    return Attention(mode, q, k, v);
  }
  if (!cache->replaying()) {
    // The CPU kernel's op is not on autocast's list (scaled_dot_product_attention is):
    // cast as the composite would have.
    FlashOutputs outputs = FlashAttentionOutputs(Lower(q), Lower(k), Lower(v));
    cache->Save(outputs.out);
    cache->Save(outputs.lse);
    return outputs.out;
  }
  FlashOutputs cached;
  cached.out = cache->Next();
  cached.lse = cache->Next();
  return FlashAttentionFromCache(Lower(q), Lower(k), Lower(v), cached);
}

}  // namespace memledger::runtime
