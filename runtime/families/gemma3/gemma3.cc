// Gemma 3's text model in LibTorch (Gemma3ForCausalLM, models/gemma3/modeling_gemma3.py),
// op for op as the estimator's graphs (estimator/families/gemma3/gemma3.cc): the scaled
// embedding, Gemma3RMSNorm, sandwich norms, q/k norms on the transposed heads, GeGLU-tanh,
// sliding-window and global layers with their own RoPE tables and, from seq >=
// sliding_window on, the sliding layers' mask; under Megatron's tensor parallelism
// (without sequence parallelism) one rank's shard.
#include <ATen/ATen.h>

#include <cmath>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "runtime/attention.h"
#include "runtime/families/llama/llama.h"
#include "runtime/families/rotary.h"
#include "runtime/families/sliding_window.h"
#include "runtime/family.h"
#include "runtime/selective_ops.h"
#include "runtime/tensor_parallel.h"

namespace memledger::runtime {
namespace {

// GemmaRmsNormImpl is Gemma3RMSNorm: _norm(x.float()) * (1.0 + weight.float()), cast
// back to x's dtype last; every intermediate dies at its last use.
class GemmaRmsNormImpl : public torch::nn::Module {
 public:
  GemmaRmsNormImpl(int64_t width, double eps) : eps_(eps) {
    weight = register_parameter("weight", at::zeros({width}));  // Gemma3RMSNorm's init
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor x32 = x.to(at::kFloat);
    at::Tensor variance = x32.pow(2).mean(-1, /*keepdim=*/true);
    at::Tensor shifted = Last(variance) + eps_;
    at::Tensor inverse = at::rsqrt(Last(shifted));
    at::Tensor normed = Last(x32) * Last(inverse);
    at::Tensor one_plus = weight.to(at::kFloat) + 1.0;
    at::Tensor scaled = Last(normed) * Last(one_plus);
    return Last(scaled).to(x.scalar_type());
  }
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(GemmaRmsNorm);

class Gemma3LayerImpl : public DecoderLayer {
 public:
  // With c.shard.tp > 1, one rank's shard: heads, kv heads and MLP columns / tp.
  Gemma3LayerImpl(const ModelConfig& c, bool sliding)
      : sliding_(sliding), heads_(c.heads / c.shard.tp), kv_heads_(c.KvHeads() / c.shard.tp),
        head_dim_(c.HeadDim()) {
    const int64_t d = c.width, f = c.Intermediate() / c.shard.tp;
    auto linear = [](int64_t in, int64_t out) {
      return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
    };
    // Gemma3DecoderLayer.__init__: self_attn (q, k, v, o, q_norm, k_norm), mlp, then the
    // four norms; torch.optim steps parameters() in this order.
    q_proj = register_module("q_proj", linear(d, heads_ * head_dim_));
    k_proj = register_module("k_proj", linear(d, kv_heads_ * head_dim_));
    v_proj = register_module("v_proj", linear(d, kv_heads_ * head_dim_));
    o_proj = register_module("o_proj", linear(heads_ * head_dim_, d));
    q_norm = register_module("q_norm", GemmaRmsNorm(head_dim_, c.norm_eps));
    k_norm = register_module("k_norm", GemmaRmsNorm(head_dim_, c.norm_eps));
    gate_proj = register_module("gate_proj", linear(d, f));
    up_proj = register_module("up_proj", linear(d, f));
    down_proj = register_module("down_proj", linear(f, d));
    input_layernorm = register_module("input_layernorm", GemmaRmsNorm(d, c.norm_eps));
    post_attention_layernorm =
        register_module("post_attention_layernorm", GemmaRmsNorm(d, c.norm_eps));
    pre_feedforward_layernorm =
        register_module("pre_feedforward_layernorm", GemmaRmsNorm(d, c.norm_eps));
    post_feedforward_layernorm =
        register_module("post_feedforward_layernorm", GemmaRmsNorm(d, c.norm_eps));
  }

  at::Tensor forward(const at::Tensor& x, const LayerExtras& extras, AttentionMode mode,
                     SelectiveCache* cache) override {
    // One statement per last use (Last), in the graph's order. With sequence
    // parallelism x holds this rank's T / tp tokens (DecoderLayer's ColumnParallel).
    const int64_t b = x.size(0), t = extras[RotaryTables::Of(sliding_).cos].size(1);  // all T tokens
    auto heads = [&](const at::Tensor& projected, int64_t n) {
      return projected.view({b, t, n, head_dim_}).transpose(1, 2);
    };
    // Gemma3Attention.forward's argument and locals live to its return, after o_proj.
    at::Tensor h = ColumnInput(input_layernorm->forward(x));
    // q, k and v projected first, then q and k normalised (modeling_gemma3.py:341-346).
    at::Tensor q = heads(ColumnParallel(*q_proj, h, cache), heads_);
    at::Tensor k = heads(ColumnParallel(*k_proj, h, cache), kv_heads_);
    at::Tensor v = heads(ColumnParallel(*v_proj, h, cache), kv_heads_);
    q = q_norm->forward(Last(q));
    k = k_norm->forward(Last(k));
    // From seq >= sliding_window on, a sliding layer attends through the model's mask:
    // SDPA without enable_gqa (repeat_kv copies) and with the mask, which ATen turns into
    // an additive one in q's dtype that the flash node keeps.
    const at::Tensor& sliding_mask = extras[ModelTensor::kSlidingMask];
    const bool masked = sliding_ && sliding_mask.defined();
    at::Tensor a = RopeAttention(q, k, v, extras, RotaryTables::Of(sliding_), heads_, kv_heads_, mode, cache,
                                 masked ? sliding_mask.expand({b, 1, t, t}) : at::Tensor());
    at::Tensor merged = Last(a).transpose(1, 2).contiguous().reshape({b, t, -1});
    at::Tensor projected = RowParallel(*o_proj, Last(merged), cache);
    h = q = k = v = at::Tensor();  // self_attn returns
    // hidden_states = self.post_attention_layernorm(hidden_states): the norm's argument
    // lives to its return (nn.Module.__call__'s *args), then dies as the name is rebound,
    // before the residual add.
    at::Tensor attention_out = post_attention_layernorm->forward(Last(projected));
    at::Tensor x1 = x + Last(attention_out);
    // Gemma3MLP: down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)).
    at::Tensor h2 = ColumnInput(pre_feedforward_layernorm->forward(x1));
    at::Tensor gate = ColumnParallel(*gate_proj, h2, cache);
    at::Tensor act = GeluOp(Last(gate), "tanh", cache);
    at::Tensor up = ColumnParallel(*up_proj, h2, cache);
    at::Tensor product = Last(act) * Last(up);
    at::Tensor down = RowParallel(*down_proj, Last(product), cache);
    h2 = at::Tensor();  // mlp returns
    at::Tensor mlp_out = post_feedforward_layernorm->forward(Last(down));  // as above
    return Last(x1) + Last(mlp_out);
  }

  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  GemmaRmsNorm q_norm{nullptr}, k_norm{nullptr};
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
  GemmaRmsNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  GemmaRmsNorm pre_feedforward_layernorm{nullptr}, post_feedforward_layernorm{nullptr};

 private:
  bool sliding_;
  int64_t heads_, kv_heads_, head_dim_;
};

class Gemma3Model : public ModelImpl {
 public:
  explicit Gemma3Model(const ModelConfig& c)
      : config_(c), rotary_(c, 1e6, 1e4) {
    const int64_t vocab = c.vocab / c.shard.tp;  // a tensor-parallel rank's rows
    embed_tokens = register_module("embed_tokens", torch::nn::Embedding(vocab, c.width));
    // Gemma3TextScaledWordEmbedding's embed_scale: sqrt(hidden_size), 0-dim.
    embed_scale = register_buffer("embed_scale", at::scalar_tensor(std::sqrt(c.width)));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.layers; ++i) {
      const bool sliding = c.AttentionOf(i) == LayerAttention::kSliding;
      layers->push_back(std::make_shared<Gemma3LayerImpl>(c, sliding));
    }
    norm = register_module("norm", GemmaRmsNorm(c.width, c.norm_eps));
    // Gemma3RotaryEmbedding's buffers per layer type (rope_theta 1e6 for the full
    // layers, rope_local_base_freq 1e4 for the sliding ones).
    rotary_.RegisterBuffers(*this);
    if (!c.tie_embeddings) {
      lm_head = register_module(
          "lm_head", torch::nn::Linear(torch::nn::LinearOptions(c.width, vocab).bias(false)));
    }
  }

  ModelStart Prologue(const at::Tensor& input_ids) const override {
    ModelStart start;
    at::Tensor embeddings = tensor_parallel != nullptr
                                ? tensor_parallel->VocabEmbedding(input_ids, embed_tokens->weight)
                                : embed_tokens.ptr()->forward(input_ids);
    // Gemma3TextScaledWordEmbedding returns the scaled lookup.
    start.hidden = InputEmbeddings(Last(embeddings) * embed_scale);
    start.extras = Extras(input_ids.size(1), start.hidden.scalar_type());
    start.hidden = ToSequenceParallel(tensor_parallel, std::move(start.hidden));
    start.decoder_locals = {start.hidden};  // Gemma3TextModel.forward's inputs_embeds
    return start;
  }

  LayerExtras Extras(int64_t seq, at::ScalarType dtype) const override {
    return rotary_.Extras(seq, dtype);  // its tables in the hidden states' dtype
  }

  LayerExtras ExtrasOf(int64_t index, const LayerExtras& extras) const override {
    return SlidingWindowExtrasOf(config_, index, extras);  // Gemma3DecoderLayer's type's
  }

  bool BufferInModelDtype(const std::string& name) const override {
    return name == "embed_scale";  // torch.tensor(embed_scale), made in the default dtype
  }

  std::vector<at::Tensor> CacheLayers() const override {
    return SlidingWindowCacheLayers(config_, num_layers());
  }

  at::Tensor Epilogue(at::Tensor hidden, const at::Tensor& input_ids,
                      const std::function<void()>& decoder_returns) const override {
    const at::Tensor& weight = lm_head ? lm_head->weight : embed_tokens->weight;
    const at::Tensor normed = norm.ptr()->forward(hidden);
    hidden = at::Tensor();  // Gemma3TextModel.forward returns its norm's output
    decoder_returns();
    return CausalLmLoss(LmHeadLogits(tensor_parallel, normed, weight), input_ids,
                        tensor_parallel);
  }

  torch::nn::Embedding embed_tokens{nullptr};
  at::Tensor embed_scale;
  GemmaRmsNorm norm{nullptr};
  torch::nn::Linear lm_head{nullptr};

 private:
  ModelConfig config_;
  RotaryPerLayerType rotary_;
};

}  // namespace

const RuntimeFamily& Gemma3RuntimeFamily() {
  static const RuntimeFamily kDef = {
      .id = Family::kGemma3,
      .make_model = [](const ModelConfig& c) -> std::shared_ptr<ModelImpl> {
        return std::make_shared<Gemma3Model>(c);
      },
      .shard_of = LlamaShardOf,
      .gradient_is_partial = LlamaGradientIsPartial,
      .prologue_prefixes = {"embed_tokens."},
  };
  return kDef;
}

}  // namespace memledger::runtime
