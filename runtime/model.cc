#include "runtime/model.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <tuple>

#include "runtime/attention.h"

namespace memledger::runtime {
namespace {

namespace ag = torch::autograd;

// The replayed ops below return a cached output and compute only their backward, so
// the op itself is really skipped at recompute. Cached tensors come in by pointer: a
// tensor argument would count as an autograd input.

// CachedLinear: y = x W^T + b, with y from the cache.
class CachedLinear : public ag::Function<CachedLinear> {
 public:
  static at::Tensor forward(ag::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const at::Tensor& /*bias*/,
                            const at::Tensor* cached) {
    ctx->save_for_backward({input, weight});
    return *cached;
  }

  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    const ag::variable_list saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor grad = grads[0].reshape({-1, weight.size(0)});
    const at::Tensor input_2d = input.reshape({-1, weight.size(1)});
    at::Tensor grad_input = grad.mm(weight).view(input.sizes());
    at::Tensor grad_weight = grad.t().mm(input_2d);
    at::Tensor grad_bias = grad.sum(0);
    return {grad_input, grad_weight, grad_bias, at::Tensor()};
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

// CachedGelu: exact GELU, output from the cache.
class CachedGelu : public ag::Function<CachedGelu> {
 public:
  static at::Tensor forward(ag::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor* cached) {
    ctx->save_for_backward({input});
    return *cached;
  }

  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    const at::Tensor input = ctx->get_saved_variables()[0];
    return {at::gelu_backward(grads[0], input, "none"), at::Tensor()};
  }
};

at::Tensor LinearOp(torch::nn::LinearImpl& linear, const at::Tensor& input,
                    SelectiveCache* cache) {
  if (cache == nullptr || !cache->Saves(OpKind::kMatmul)) return linear.forward(input);
  if (!cache->replaying()) {
    at::Tensor out = linear.forward(input);
    cache->Save(out);
    return out;
  }
  return CachedLinear::apply(input, linear.weight, linear.bias, &cache->Next());
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

at::Tensor GeluOp(const at::Tensor& input, SelectiveCache* cache) {
  if (cache == nullptr || !cache->Saves(OpKind::kGelu)) return at::gelu(input);
  if (!cache->replaying()) {
    at::Tensor out = at::gelu(input);
    cache->Save(out);
    return out;
  }
  return CachedGelu::apply(input, &cache->Next());
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
    FlashOutputs outputs = FlashAttentionOutputs(q, k, v);
    cache->Save(outputs.out);
    cache->Save(outputs.lse);
    return outputs.out;
  }
  FlashOutputs cached;
  cached.out = cache->Next();
  cached.lse = cache->Next();
  return FlashAttentionFromCache(q, k, v, cached);
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

BlockImpl::BlockImpl(int64_t width, int64_t heads) : width_(width), heads_(heads) {
  TORCH_CHECK(width % heads == 0, "width ", width, " is not divisible by heads ", heads);
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
  qkv = register_module("qkv", torch::nn::Linear(width, 3 * width));
  proj = register_module("proj", torch::nn::Linear(width, width));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
  fc1 = register_module("fc1", torch::nn::Linear(width, 4 * width));
  fc2 = register_module("fc2", torch::nn::Linear(4 * width, width));
}

at::Tensor BlockImpl::forward(const at::Tensor& x, AttentionMode mode,
                              SelectiveCache* cache) {
  const int64_t batch = x.size(0), seq = x.size(1), d = width_;
  at::Tensor h = LayerNormOp(*ln1, x, cache);
  at::Tensor qkv_out = LinearOp(*qkv, h, cache);
  at::Tensor heads = qkv_out.view({batch, seq, 3, heads_, d / heads_}).permute({2, 0, 3, 1, 4});
  at::Tensor a = AttentionOp(mode, heads.select(0, 0), heads.select(0, 1),
                             heads.select(0, 2), cache);
  at::Tensor y = x + LinearOp(*proj, a.transpose(1, 2).reshape({batch, seq, d}), cache);
  at::Tensor m = GeluOp(LinearOp(*fc1, LayerNormOp(*ln2, y, cache), cache), cache);
  return y + LinearOp(*fc2, m, cache);
}

ModelImpl::ModelImpl(const ModelConfig& config) {
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.layers; ++i) {
    blocks->push_back(Block(config.width, config.heads));
  }
}

std::shared_ptr<BlockImpl> ModelImpl::block(int64_t index) const {
  return blocks->ptr<BlockImpl>(static_cast<size_t>(index));
}

ModelAndInput BuildModel(const ModelConfig& config, int64_t seed) {
  at::manual_seed(static_cast<uint64_t>(seed));
  ModelAndInput built;
  built.model = Model(config);
  built.input = at::randn({config.batch, config.seq, config.width});
  return built;
}

at::Tensor Loss(const at::Tensor& output) { return output.pow(2).mean(); }

int64_t ExpectedParameterCount(const ModelConfig& config) {
  const int64_t d = config.width;
  return config.layers * (12 * d * d + 13 * d);
}

}  // namespace memledger::runtime
