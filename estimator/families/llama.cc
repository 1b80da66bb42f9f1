// The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3): transformers' LlamaForCausalLM and
// its look-alikes, embedding to cross-entropy.
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/config_json.h"
#include "estimator/family.h"
#include "estimator/graph_builder.h"

namespace memledger {
namespace {

// Llama family (Llama 2/3, Mistral, Qwen2): embed_tokens(input_ids).
BlockGraph BuildLlamaPrologue(const ModelConfig& config) {
  GraphBuilder g(config);
  // LlamaRotaryEmbedding's buffers, fp32 whatever the model's dtype:
  // inv_freq and its clone original_inv_freq, d_head / 2 each (modeling_llama.py:86-87).
  g.Buffer("rotary_emb.inv_freq", DType::kFloat32, {kDHead / 2});
  g.Buffer("rotary_emb.original_inv_freq", DType::kFloat32, {kDHead / 2});
  int input_ids = g.Global(ModelTensor::kInputIds, DType::kInt64, {kB, kT});
  int weight = g.Param("embed_tokens.weight", {kV, kD});
  int embeddings = g.VocabEmbedding("embed_tokens", weight, input_ids);
  if (config.sp) {  // Megatron scatters the embeddings to the sequence-parallel region
    embeddings = g.Op1(OpType::kScatter, "embeddings.scatter", {embeddings},
                       {.shape = {kB, kTs, kD}});
  }
  return g.Finish(embeddings);
}

// LlamaDecoderLayer.forward with RoPE tables (1, T, d_head) made once per forward. With
// sequence parallelism the residual stream and the norms hold T / tp tokens (kTs), the
// q/k/v and gate/up projections all-gather them, o_proj and down_proj reduce-scatter.
BlockGraph BuildLlamaLayer(const ModelConfig& config, AttentionMode mode) {
  GraphBuilder g(config);
  int x = g.Input("x", {kB, kTs, kD});
  // The layer reads transformers' rotary embedding's cos and sin, cast to the hidden
  // states' dtype (modeling_llama.py, LlamaModel.forward). It is called with position_ids
  // too (modeling_llama.py:392-400), which no op of it reads but a checkpointed layer's
  // bound arguments hold to its backward (the step's end, if reentrant).
  int cos = g.Global(ModelTensor::kRopeCos, config.dtype, {Sym(1), kT, kDHead});
  int sin = g.Global(ModelTensor::kRopeSin, config.dtype, {Sym(1), kT, kDHead});
  g.Global(ModelTensor::kPositionIds, DType::kInt64, {Sym(1), kT});
  int h = g.RmsNorm("input_layernorm", x);
  // Qwen3 normalises q and k per head before the transpose:
  // q_norm(q_proj(h).view(B, T, -1, d_head)).transpose(1, 2) (modeling_qwen3.py,
  // Qwen3Attention.forward); v has no norm.
  auto project = [&](const std::string& name, SymDim heads, const char* norm) {
    int out = g.ColumnParallelLinear(name, h, kD, heads * kDHead, config.qkv_bias);
    int split = g.Op1(OpType::kView, name + ".split_heads", {out}, {.shape = {kB, kT, heads, kDHead}});
    if (norm != nullptr) split = g.RmsNorm(norm, split, kDHead);
    return g.Op1(OpType::kTranspose, name + ".transpose", {split}, {.dim = 1, .dim1 = 2});
  };
  int q = project("q_proj", kH, config.qk_norm ? "q_norm" : nullptr);
  int k = project("k_proj", kKv, config.qk_norm ? "k_norm" : nullptr);
  int v = project("v_proj", kKv, nullptr);
  const GraphBuilder::RopeAttentionOut a = g.RopeAttention(config, mode, q, k, v, cos, sin);
  int attention_out = g.RowParallelNoBias("o_proj", a.merged, kH * kDHead, kD);
  // LlamaAttention.forward's argument and locals, to its return (modeling_llama.py:
  // 206-250): hidden_states, query_states, key_states, value_states.
  g.HeldThroughHere({h, a.q, a.k, a.v});
  int x1 = g.Op1(OpType::kAdd, "residual1", {x, attention_out});
  int h2 = g.RmsNorm("post_attention_layernorm", x1);
  // LlamaMLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)), in Python's order of
  // evaluation (modeling_llama.py:164, LlamaMLP.forward): the autograd engine runs up_proj's
  // node before act_fn's.
  int gate = g.ColumnParallelLinear("gate_proj", h2, kD, kF, /*bias=*/false);
  int act = g.Op1(OpType::kSilu, "act_fn", {gate}, {}, OpKind::kSilu);
  int up = g.ColumnParallelLinear("up_proj", h2, kD, kF, /*bias=*/false);
  int product = g.Op1(OpType::kMulTensor, "mlp.mul", {act, up});
  int mlp_out = g.RowParallelNoBias("down_proj", product, kF, kD);
  g.HeldThroughHere({h2});  // LlamaMLP.forward's argument x, to its return
  int x2 = g.Op1(OpType::kAdd, "residual2", {x1, mlp_out});
  // LlamaDecoderLayer.__init__ registers self_attn, mlp, then the two norms
  // (models/llama/modeling_llama.py:273-282; Mistral's, Qwen2's and Qwen3's alike);
  // Qwen3Attention registers q_norm and k_norm after o_proj.
  std::vector<std::string> order = {"q_proj", "k_proj", "v_proj", "o_proj"};
  if (config.qk_norm) order.insert(order.end(), {"q_norm", "k_norm"});
  order.insert(order.end(), {"gate_proj", "up_proj", "down_proj", "input_layernorm",
                             "post_attention_layernorm"});
  g.RegistrationOrder(order);
  return g.Finish(x2);
}

// Final norm, LM head (tied to embed_tokens or not) and the loss.
BlockGraph BuildLlamaEpilogue(const ModelConfig& config) {
  GraphBuilder g(config);
  int x = g.Input("x", {kB, kTs, kD});
  int input_ids = g.Global(ModelTensor::kInputIds, DType::kInt64, {kB, kT});
  int h = g.RmsNorm("norm", x);
  g.DecoderReturnsHere();
  // The decoder model's output, LlamaForCausalLM's `hidden_states` local to its return.
  g.HeldToEnd(h);
  int weight = config.tie_embeddings ? g.TiedParam("embed_tokens.weight", {kV, kD})
                                     : g.Param("lm_head.weight", {kV, kD});
  // With sequence parallelism the vocabulary-parallel head gathers its input too.
  int logits = config.sp ? g.Op1(OpType::kGatherLinear, "lm_head", {h, weight},
                                 {.shape = {kB, kT, kV}}, OpKind::kMatmul)
                         : g.MatmulFolded("lm_head", h, weight, kD, kV);
  return g.Finish(g.CrossEntropy(logits, input_ids));
}


ModelConfig Llama(int64_t layers, int64_t width, int64_t heads, int64_t kv_heads,
                  int64_t intermediate, int64_t vocab, double eps) {
  ModelConfig c;
  c.family = Family::kLlama;
  c.layers = layers;
  c.width = width;
  c.heads = heads;
  c.kv_heads = kv_heads;
  c.head_dim = width / heads;
  c.intermediate = intermediate;
  c.vocab = vocab;
  c.norm_eps = eps;
  c.use_cache = true;  // LlamaConfig's default
  return c;
}


absl::StatusOr<ModelConfig> ReadLlama(const ConfigJsonReader& r, absl::string_view model_type) {
  ModelConfig c;
  c.family = Family::kLlama;
  MEMLEDGER_ASSIGN_OR_RETURN_(c.width, r.Positive("hidden_size"));
  MEMLEDGER_ASSIGN_OR_RETURN_(c.intermediate, r.Positive("intermediate_size"));
  MEMLEDGER_ASSIGN_OR_RETURN_(c.layers, r.Positive("num_hidden_layers"));
  MEMLEDGER_ASSIGN_OR_RETURN_(c.heads, r.Positive("num_attention_heads"));
  MEMLEDGER_ASSIGN_OR_RETURN_(c.kv_heads, r.Positive("num_key_value_heads", c.heads));
  MEMLEDGER_ASSIGN_OR_RETURN_(c.vocab, r.Positive("vocab_size"));
  MEMLEDGER_ASSIGN_OR_RETURN_(c.max_positions, r.Positive("max_position_embeddings", 0));
  MEMLEDGER_ASSIGN_OR_RETURN_(c.tie_embeddings, r.Bool("tie_word_embeddings", false));
  MEMLEDGER_ASSIGN_OR_RETURN_(c.use_cache, r.Bool("use_cache", true));
  MEMLEDGER_ASSIGN_OR_RETURN_(c.norm_eps, r.PositiveNumber("rms_norm_eps", 1e-6));
  if (r.Has("attention_dropout")) {
    // LlamaAttention passes it to SDPA in training, which then runs its math kernel
    // with grouped-query repeat_interleave copies: not modelled for this family yet.
    double p = 0;
    MEMLEDGER_ASSIGN_OR_RETURN_(p, r.Probability("attention_dropout"));
    if (p > 0) return r.Error("attention_dropout", "> 0 is not modelled yet (use 0.0)");
  }
  const bool qwen3 = model_type == "qwen3";
  if (!qwen3 && !r.Positive("head_dim").ok() && c.width % c.heads != 0) {
    return r.Error("hidden_size", absl::StrCat(c.width, " is not divisible by "
                                               "num_attention_heads ", c.heads,
                                               " and there is no head_dim"));
  }
  // Qwen3Config's head_dim defaults to 128, whatever the width (configuration_qwen3.py);
  // LlamaConfig's, MistralConfig's and Qwen2Config's to hidden_size / heads.
  MEMLEDGER_ASSIGN_OR_RETURN_(c.head_dim, r.Positive("head_dim", qwen3 ? 128 : c.width / c.heads));
  if (c.heads % c.kv_heads != 0) {
    return r.Error("num_attention_heads", absl::StrCat(c.heads, " is not divisible by "
                                                       "num_key_value_heads ", c.kv_heads));
  }
  if (c.head_dim % 2 != 0) {
    return r.Error("head_dim", absl::StrCat(c.head_dim, " must be even for RoPE"));
  }
  std::string act;
  MEMLEDGER_ASSIGN_OR_RETURN_(act, r.String("hidden_act", "silu"));
  if (act != "silu") return r.Error("hidden_act", absl::StrCat("must be silu, got ", act));
  bool attention_bias = false;
  MEMLEDGER_ASSIGN_OR_RETURN_(attention_bias, r.Bool("attention_bias", false));
  if (attention_bias) {
    return r.Error("attention_bias", "true (biases on q, k, v and o) is not supported");
  }
  c.qkv_bias = model_type == "qwen2";  // Qwen2 always has q, k, v biases, o has none
  c.qk_norm = qwen3;                   // Qwen3Attention's q_norm and k_norm
  if (qwen3) {
    // Qwen3Config.__post_init__ makes layers >= max_window_layers sliding only with
    // use_sliding_window; explicit layer_types may name them too. Sliding-window masks
    // are not modelled for this family yet.
    bool sliding = false;
    MEMLEDGER_ASSIGN_OR_RETURN_(sliding, r.Bool("use_sliding_window", false));
    if (sliding) return r.Error("use_sliding_window", "true is not modelled yet (use false)");
    std::vector<LayerAttention> types;
    MEMLEDGER_ASSIGN_OR_RETURN_(types, r.LayerTypes("layer_types", c.layers));
    for (LayerAttention type : types) {
      if (type == LayerAttention::kSliding) {
        return r.Error("layer_types", "'sliding_attention' is not modelled yet for this model_type");
      }
    }
  }
  return c;
}


absl::Status WriteLlama(const ModelConfig& c, ConfigJsonWriter& w) {
  if (c.qk_norm && c.qkv_bias) {
    return absl::InvalidArgumentError("q/k/v biases with q/k norms is no transformers model_type");
  }
  // Qwen2 is the Llama family with q/k/v biases, Qwen3 with q/k norms.
  w.String("model_type", c.qk_norm ? "qwen3" : c.qkv_bias ? "qwen2" : "llama");
  w.Int("hidden_size", c.width);
  w.Int("intermediate_size", c.Intermediate());
  w.Int("num_hidden_layers", c.layers);
  w.Int("num_attention_heads", c.heads);
  w.Int("num_key_value_heads", c.KvHeads());
  w.Int("head_dim", c.HeadDim());
  w.Int("vocab_size", c.vocab);
  w.Int("max_position_embeddings", c.max_positions > 0 ? c.max_positions : 2048);
  w.Double("rms_norm_eps", c.norm_eps);
  if (c.qkv_bias || c.qk_norm) w.Bool("use_sliding_window", false);
  return absl::OkStatus();
}

std::vector<std::pair<std::string, ModelConfig>> LlamaPresets() {
  // The published config.json sizes (max positions informational for RoPE models).
  ModelConfig qwen = Llama(28, 3584, 28, 4, 18944, 152064, 1e-6);
  qwen.qkv_bias = true;
  // Qwen/Qwen3-8B's config.json: head_dim 128, untied head, rms_norm_eps 1e-6.
  ModelConfig qwen3 = Llama(36, 4096, 32, 8, 12288, 151936, 1e-6);
  qwen3.head_dim = 128;
  qwen3.qk_norm = true;
  // Small enough to verify in a test: grouped-query attention (4 heads, 2 kv heads).
  ModelConfig tiny = Llama(2, 32, 4, 2, 64, 96, 1e-5);
  // Qwen3 in small: q/k norms, and 4 heads of 16 = 64 wide on a 32-wide model.
  ModelConfig tiny_qwen3 = Llama(2, 32, 4, 2, 64, 96, 1e-6);
  tiny_qwen3.head_dim = 16;
  tiny_qwen3.qk_norm = true;
  return {{"llama-2-7b", Llama(32, 4096, 32, 32, 11008, 32000, 1e-5)},
          {"llama-3-8b", Llama(32, 4096, 32, 8, 14336, 128256, 1e-5)},
          {"llama-3-70b", Llama(80, 8192, 64, 8, 28672, 128256, 1e-5)},
          {"mistral-7b", Llama(32, 4096, 32, 8, 14336, 32000, 1e-5)},
          {"qwen2.5-7b", qwen},
          {"qwen3-8b", qwen3},
          {"tiny-llama", tiny},
          {"tiny-qwen3", tiny_qwen3}};
}

}  // namespace

const FamilyDef& LlamaFamily() {
  static const FamilyDef kDef = {
      .id = Family::kLlama,
      .name = "llama",
      .decoder = true,
      .rope = true,
      .qk_norm = true,
      .graphs = [](const ModelConfig& config, AttentionMode mode) {
        return ModelGraphs{BuildLlamaPrologue(config), {BuildLlamaLayer(config, mode)}, {0},
                           BuildLlamaEpilogue(config)};
      },
      .model_types = {"llama", "mistral", "qwen2", "qwen3"},
      .read = ReadLlama,
      .write = WriteLlama,
      .presets = LlamaPresets(),
  };
  return kDef;
}

}  // namespace memledger
