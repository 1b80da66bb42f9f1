#include "runtime/selective_ops.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "runtime/attention.h"
#include "runtime/autocast.h"

namespace memledger::runtime {
namespace {

namespace ag = torch::autograd;

// The replayed ops below return a cached output and compute only their backward, so
// the op itself is really skipped at recompute. Cached tensors come in by pointer: a
// tensor argument would count as an autograd input. Each saves its tensors in the order
// of the real op's node (inputs, then outputs, each by name, as the generated
// VariableType saves them), so that a non-reentrant checkpoint's recompute fills the
// holders its forward packed. Each returns a new tensor on the cached storage: the
// cache's own must not take the node as its grad_fn, or a recompute that stops at the
// node's saves would leave the cache holding the node and what it saved.

// SaveLinearOperands saves what the real node does: the input's rows (N, in) and the
// (in, out) matrix, as AddmmBackward0 (mat1_, mat2_) when `addmm`, else MmBackward0
// (mat2_, self_).
void SaveLinearOperands(ag::AutogradContext* ctx, const at::Tensor& input,
                        const at::Tensor& mat2, bool has_bias, bool addmm) {
  const at::Tensor rows = input.reshape({-1, input.size(-1)});
  if (addmm) {
    ctx->save_for_backward({rows, mat2});
  } else {
    ctx->save_for_backward({mat2, rows});
  }
  ctx->saved_data["has_bias"] = has_bias;
  ctx->saved_data["addmm"] = addmm;
  ctx->saved_data["input_sizes"] = input.sizes();
}

// LinearOperands are what SaveLinearOperands saved.
struct LinearOperands {
  explicit LinearOperands(ag::AutogradContext* ctx)
      : has_bias(ctx->saved_data["has_bias"].toBool()),
        input_sizes(ctx->saved_data["input_sizes"].toIntVector()) {
    const ag::variable_list saved = ctx->get_saved_variables();
    const bool addmm = ctx->saved_data["addmm"].toBool();
    rows = saved[addmm ? 0 : 1];
    mat2 = saved[addmm ? 1 : 0];
  }
  bool has_bias;
  std::vector<int64_t> input_sizes;
  at::Tensor rows;  // (N, in)
  at::Tensor mat2;  // (in, out)
};

// CachedLinear: y = x W^T (+ b), with y from the cache. `parameters` is {W} or {W, b}:
// an undefined tensor cannot be an autograd input.
class CachedLinear : public ag::Function<CachedLinear> {
 public:
  static at::Tensor forward(ag::AutogradContext* ctx, const at::Tensor& input,
                            at::TensorList parameters, const at::Tensor* cached) {
    // at::linear runs addmm with a bias on a 2-D or contiguous input (its
    // _flatten_nd_linear), else matmul and add_ (aten/src/ATen/native/Linear.cpp).
    const bool has_bias = parameters.size() > 1;
    SaveLinearOperands(ctx, input, parameters[0].t(), has_bias,
                       has_bias && (input.dim() == 2 || input.is_contiguous()));
    return cached->detach();
  }

  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    const LinearOperands saved(ctx);
    const at::Tensor weight = saved.mat2.t();
    const at::Tensor grad = grads[0].reshape({-1, weight.size(0)});
    ag::variable_list result = {grad.mm(weight).view(saved.input_sizes),
                                grad.t().mm(saved.rows)};
    if (saved.has_bias) result.push_back(grad.sum(0));
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
    SaveLinearOperands(ctx, input, parameters[0], parameters.size() > 1,
                       /*addmm=*/parameters.size() > 1);
    return cached->detach();
  }

  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    const LinearOperands saved(ctx);
    const at::Tensor& weight = saved.mat2;
    const at::Tensor grad = grads[0].reshape({-1, weight.size(1)});
    if (!saved.has_bias) {
      at::Tensor grad_weight = saved.rows.t().mm(grad);
      at::Tensor grad_input = grad.mm(weight.t()).view(saved.input_sizes);
      return {grad_input, grad_weight, at::Tensor()};
    }
    at::Tensor grad_input = grad.mm(weight.t()).view(saved.input_sizes);
    at::Tensor grad_weight = saved.rows.t().mm(grad);
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
    // NativeLayerNormBackward0's order: bias, input, weight, then mean and rstd.
    ctx->save_for_backward({bias, input, weight, *mean, *rstd});
    return out->detach();
  }

  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    const ag::variable_list saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[1];
    auto [grad_input, grad_weight, grad_bias] = at::native_layer_norm_backward(
        grads[0].contiguous(), input, {input.size(-1)}, saved[3], saved[4], saved[2],
        saved[0], {true, true, true});
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
    return cached->detach();
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
  at::Tensor out = replay(cache->Peek());
  cache->Pop();
  return out;
}

}  // namespace

void SelectiveCache::Save(const at::Tensor& tensor) {
  TORCH_CHECK(!replaying_, "SelectiveCache::Save while replaying");
  // Detached, as _CachingTorchDispatchMode stores them: the output's node (whose saved
  // tensors may be a non-reentrant checkpoint's holders, owning the cache) stays out.
  tensors_.push_back(tensor.detach());
}

void SelectiveCache::StartReplay() {
  replaying_ = true;
  cursor_ = 0;
}

const at::Tensor& SelectiveCache::Peek(size_t ahead) const {
  TORCH_CHECK(replaying_ && cursor_ + ahead < tensors_.size(),
              "SelectiveCache::Peek: replay asked for more outputs than were saved (",
              tensors_.size(), ")");
  return tensors_[cursor_ + ahead];
}

void SelectiveCache::Pop(size_t n) {
  for (size_t i = 0; i < n; ++i) tensors_[cursor_++].reset();
}

void SelectiveCache::Clear() {
  tensors_.clear();
  cursor_ = 0;
}

at::Tensor LinearOp(torch::nn::LinearImpl& linear, const at::Tensor& input,
                    SelectiveCache* cache) {
  return FunctionalLinearOp(linear.weight, linear.bias, input, cache);
}

at::Tensor FunctionalLinearOp(const at::Tensor& weight, const at::Tensor& bias,
                              const at::Tensor& input, SelectiveCache* cache) {
  return Cached(
      cache, OpKind::kMatmul, [&] { return at::linear(input, weight, bias); },
      [&](const at::Tensor& out) {
        // In autocast's order for linear: bias, weight, input (its wrapper's call
        // arguments, evaluated last to first), so that the casts' backward nodes run in
        // the order they do after a real linear.
        const at::Tensor lowered_bias = bias.defined() ? Lower(bias) : at::Tensor();
        std::vector<at::Tensor> parameters = {Lower(weight)};
        if (lowered_bias.defined()) parameters.push_back(lowered_bias);
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
  at::Tensor out = CachedLayerNorm::apply(input, norm.weight, norm.bias, &cache->Peek(0),
                                          &cache->Peek(1), &cache->Peek(2));
  cache->Pop(3);
  return out;
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
                       const at::Tensor& v, SelectiveCache* cache, const at::Tensor& mask) {
  // Only the flash op can be must-saved (ValidatePolicy rejects it for math). Its cache
  // holds the real kernel's two outputs; at recompute its backward uses them.
  if (mode != AttentionMode::kFlash || cache == nullptr ||
      !cache->Saves(OpKind::kAttention)) {
    return mask.defined() ? MaskedFlashAttention(q, k, v, mask) : Attention(mode, q, k, v);
  }
  // The CPU kernel's op is not on autocast's list (scaled_dot_product_attention is):
  // cast as the composite would have, then convert the mask as it does.
  const at::Tensor q_low = Lower(q), k_low = Lower(k), v_low = Lower(v);
  const at::Tensor additive =
      mask.defined() ? AdditiveMask(mask, q_low.scalar_type()) : at::Tensor();
  if (!cache->replaying()) {
    FlashOutputs outputs = FlashAttentionOutputs(q_low, k_low, v_low, additive);
    cache->Save(outputs.out);
    cache->Save(outputs.lse);
    return outputs.out;
  }
  FlashOutputs cached;
  cached.out = cache->Peek(0);
  cached.lse = cache->Peek(1);
  at::Tensor out = FlashAttentionFromCache(q_low, k_low, v_low, cached, additive);
  cache->Pop(2);
  return out;
}

}  // namespace memledger::runtime
