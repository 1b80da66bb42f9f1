// OLMo 3 in LibTorch (Olmo3ForCausalLM, models/olmo3/modeling_olmo3.py), op for op as
// the estimator's graphs (estimator/families/olmo3/olmo3.cc): Olmo3RMSNorm after the
// attention and the MLP, q/k norms over the whole projections, fp32 RoPE tables with
// apply_rotary_pos_emb casting back, sliding-window and full layers with their own
// tables and, from seq >= sliding_window on, the sliding layers' mask. No tensor
// parallelism (its q/k norms span every head).
#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "runtime/attention.h"
#include "runtime/families/rotary.h"
#include "runtime/families/sliding_window.h"
#include "runtime/family.h"
#include "runtime/selective_ops.h"
#include "runtime/tensor_parallel.h"

namespace memledger::runtime {
namespace {

// OlmoRmsNormImpl is Olmo3RMSNorm: hs = x.float(); hs * rsqrt(hs.pow(2).mean(-1) +
// eps); (weight * hs).to(x.dtype): the weight multiplies the fp32 result, the cast comes
// last. `variance` and the normalised hs live to its return, as the Python locals do.
class OlmoRmsNormImpl : public torch::nn::Module {
 public:
  OlmoRmsNormImpl(int64_t width, double eps) : eps_(eps) {
    weight = register_parameter("weight", at::ones({width}));  // Olmo3RMSNorm's init
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor x32 = x.to(at::kFloat);
    at::Tensor variance = x32.pow(2).mean(-1, /*keepdim=*/true);
    at::Tensor inverse = at::rsqrt(variance + eps_);
    at::Tensor normed = Last(x32) * Last(inverse);
    at::Tensor scaled = weight * normed;
    return Last(scaled).to(x.scalar_type());
  }
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(OlmoRmsNorm);

class Olmo3LayerImpl : public DecoderLayer {
 public:
  Olmo3LayerImpl(const ModelConfig& c, bool sliding)
      : sliding_(sliding), heads_(c.heads), kv_heads_(c.KvHeads()), head_dim_(c.HeadDim()) {
    const int64_t d = c.width, f = c.Intermediate();
    auto linear = [](int64_t in, int64_t out) {
      return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
    };
    // Olmo3DecoderLayer.__init__: self_attn (q, k, v, o, q_norm, k_norm), mlp, then the
    // two norms; torch.optim steps parameters() in this order.
    q_proj = register_module("q_proj", linear(d, heads_ * head_dim_));
    k_proj = register_module("k_proj", linear(d, kv_heads_ * head_dim_));
    v_proj = register_module("v_proj", linear(d, kv_heads_ * head_dim_));
    o_proj = register_module("o_proj", linear(heads_ * head_dim_, d));
    q_norm = register_module("q_norm", OlmoRmsNorm(heads_ * head_dim_, c.norm_eps));
    k_norm = register_module("k_norm", OlmoRmsNorm(kv_heads_ * head_dim_, c.norm_eps));
    gate_proj = register_module("gate_proj", linear(d, f));
    up_proj = register_module("up_proj", linear(d, f));
    down_proj = register_module("down_proj", linear(f, d));
    post_attention_layernorm =
        register_module("post_attention_layernorm", OlmoRmsNorm(d, c.norm_eps));
    post_feedforward_layernorm =
        register_module("post_feedforward_layernorm", OlmoRmsNorm(d, c.norm_eps));
  }

  at::Tensor forward(const at::Tensor& x, const LayerExtras& extras, AttentionMode mode,
                     SelectiveCache* cache) override {
    const int64_t b = x.size(0), t = x.size(1);
    auto heads = [&](const at::Tensor& projected, int64_t n) {
      return projected.view({b, t, n, head_dim_}).transpose(1, 2);
    };
    // Olmo3Attention.forward: q_norm(q_proj(x)), k_norm(k_proj(x)), v_proj(x) (M:177-179).
    at::Tensor q = heads(q_norm->forward(ColumnParallel(*q_proj, x, cache)), heads_);
    at::Tensor k = heads(k_norm->forward(ColumnParallel(*k_proj, x, cache)), kv_heads_);
    at::Tensor v = heads(ColumnParallel(*v_proj, x, cache), kv_heads_);
    const at::Tensor& sliding_mask = extras[ModelTensor::kSlidingMask];
    const bool masked = sliding_ && sliding_mask.defined();
    at::Tensor a = RopeAttention(q, k, v, extras, RotaryTables::Of(sliding_), heads_, kv_heads_, mode, cache,
                                 masked ? sliding_mask.expand({b, 1, t, t}) : at::Tensor(),
                                 /*cast_back=*/true);
    at::Tensor merged = Last(a).transpose(1, 2).contiguous().reshape({b, t, -1});
    at::Tensor projected = RowParallel(*o_proj, Last(merged), cache);
    q = k = v = at::Tensor();  // self_attn returns
    // hidden_states = self.post_attention_layernorm(hidden_states), then the residual.
    at::Tensor attention_out = post_attention_layernorm->forward(Last(projected));
    at::Tensor x1 = x + Last(attention_out);
    // Olmo3MLP: down_proj(silu(gate_proj(x)) * up_proj(x)).
    at::Tensor gate = ColumnParallel(*gate_proj, x1, cache);
    at::Tensor act = SiluOp(Last(gate), cache);
    at::Tensor up = ColumnParallel(*up_proj, x1, cache);
    at::Tensor product = Last(act) * Last(up);
    at::Tensor down = RowParallel(*down_proj, Last(product), cache);
    at::Tensor mlp_out = post_feedforward_layernorm->forward(Last(down));
    return Last(x1) + Last(mlp_out);
  }

  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  OlmoRmsNorm q_norm{nullptr}, k_norm{nullptr};
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
  OlmoRmsNorm post_attention_layernorm{nullptr}, post_feedforward_layernorm{nullptr};

 private:
  bool sliding_;
  int64_t heads_, kv_heads_, head_dim_;
};

class Olmo3Model : public ModelImpl {
 public:
  explicit Olmo3Model(const ModelConfig& c)
      : config_(c), rotary_(c, kTheta, kTheta) {
    embed_tokens = register_module("embed_tokens", torch::nn::Embedding(c.vocab, c.width));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.layers; ++i) {
      const bool sliding = c.AttentionOf(i) == LayerAttention::kSliding;
      layers->push_back(std::make_shared<Olmo3LayerImpl>(c, sliding));
    }
    norm = register_module("norm", OlmoRmsNorm(c.width, c.norm_eps));
    // Olmo3RotaryEmbedding's buffers per layer type; rope_theta 500000 for both.
    rotary_.RegisterBuffers(*this);
    if (!c.tie_embeddings) {
      lm_head = register_module(
          "lm_head", torch::nn::Linear(torch::nn::LinearOptions(c.width, c.vocab).bias(false)));
    }
  }

  ModelStart Prologue(const at::Tensor& input_ids) const override {
    ModelStart start;
    start.hidden = InputEmbeddings(embed_tokens.ptr()->forward(input_ids));
    start.extras = Extras(input_ids.size(1), start.hidden.scalar_type());
    start.decoder_locals = {start.hidden};  // Olmo3Model.forward's inputs_embeds
    return start;
  }

  LayerExtras Extras(int64_t seq, at::ScalarType) const override {
    return rotary_.Extras(seq, at::kFloat);  // its tables stay fp32 (Olmo3RotaryEmbedding)
  }

  LayerExtras ExtrasOf(int64_t index, const LayerExtras& extras) const override {
    return SlidingWindowExtrasOf(config_, index, extras);  // Olmo3DecoderLayer's type's
  }

  std::vector<at::Tensor> CacheLayers() const override {
    return SlidingWindowCacheLayers(config_, num_layers());
  }

  at::Tensor Epilogue(at::Tensor hidden, const at::Tensor& input_ids,
                      const std::function<void()>& decoder_returns) const override {
    const at::Tensor& weight = lm_head ? lm_head->weight : embed_tokens->weight;
    const at::Tensor normed = norm.ptr()->forward(hidden);
    hidden = at::Tensor();  // Olmo3Model.forward returns its norm's output
    decoder_returns();
    return CausalLmLoss(LmHeadLogits(tensor_parallel, normed, weight), input_ids,
                        tensor_parallel);
  }

  torch::nn::Embedding embed_tokens{nullptr};
  OlmoRmsNorm norm{nullptr};
  torch::nn::Linear lm_head{nullptr};

 private:
  static constexpr double kTheta = 500000;  // Olmo3Config's default_theta (C:84)
  ModelConfig config_;
  RotaryPerLayerType rotary_;
};

}  // namespace

const RuntimeFamily& Olmo3RuntimeFamily() {
  static const RuntimeFamily kDef = {
      .id = Family::kOlmo3,
      .make_model = [](const ModelConfig& c) -> std::shared_ptr<ModelImpl> {
        return std::make_shared<Olmo3Model>(c);
      },
      .prologue_prefixes = {"embed_tokens."},
  };
  return kDef;
}

}  // namespace memledger::runtime
