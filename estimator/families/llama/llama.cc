// The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, and the sparse Qwen3-MoE and
// Mixtral): transformers' LlamaForCausalLM and its look-alikes, embedding to
// cross-entropy.
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/spec/checked_math.h"
#include "estimator/spec/config_json.h"
#include "estimator/families/llama/sparse_moe.h"
#include "estimator/graph/family.h"
#include "estimator/graph/decoder_model.h"
#include "estimator/graph/graph_builder.h"

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
  g.InputEmbeddings(embeddings);
  if (config.shard.sp) {  // Megatron scatters the embeddings to the sequence-parallel region
    embeddings = g.Op1(OpType::kScatter, "embeddings.scatter", {embeddings},
                       {.shape = {kB, kTs, kD}});
  }
  g.HeldByDecoder({embeddings});  // inputs_embeds (with sequence parallelism, scattered)
  return g.Finish(embeddings);
}

// LlamaDecoderLayer.forward with RoPE tables (1, T, d_head) made once per forward. With
// sequence parallelism the residual stream and the norms hold T / tp tokens (kTs), the
// q/k/v and gate/up projections all-gather them, o_proj and down_proj reduce-scatter.
// A sparse layer (Qwen3MoeDecoderLayer, MixtralDecoderLayer) runs the model's
// SparseMoeBlock (estimator/families/llama/sparse_moe.h) where a dense one runs LlamaMLP.
BlockGraph BuildLlamaLayer(const ModelConfig& config, AttentionMode mode, bool sparse,
                           const std::vector<int64_t>& load = {}) {
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
  int attention_out = g.RowParallelLinear("o_proj", a.merged, kH * kDHead, kD, config.o_bias);
  // LlamaAttention.forward's argument and locals, to its return (modeling_llama.py:
  // 206-250): hidden_states, query_states, key_states, value_states.
  g.HeldThroughHere({h, a.q, a.k, a.v});
  int x1 = g.Op1(OpType::kAdd, "residual1", {x, attention_out});
  int h2 = g.RmsNorm("post_attention_layernorm", x1);
  int mlp_out;
  if (sparse) {
    mlp_out = SparseMoeBlock(g, config, h2, load);
  } else {
    // LlamaMLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)), in Python's order of
    // evaluation (modeling_llama.py:164, LlamaMLP.forward): the autograd engine runs
    // up_proj's node before act_fn's.
    int gate = g.ColumnParallelLinear("gate_proj", h2, kD, kF, config.mlp_bias);
    int act = g.Op1(OpType::kSilu, "act_fn", {gate}, {}, OpKind::kSilu);
    int up = g.ColumnParallelLinear("up_proj", h2, kD, kF, config.mlp_bias);
    int product = g.Op1(OpType::kMulTensor, "mlp.mul", {act, up});
    mlp_out = g.RowParallelLinear("down_proj", product, kF, kD, config.mlp_bias);
  }
  g.HeldThroughHere({h2});  // the MLP's forward's argument, to its return
  int x2 = g.Op1(OpType::kAdd, "residual2", {x1, mlp_out});
  // LlamaDecoderLayer.__init__ registers self_attn, mlp, then the two norms
  // (models/llama/modeling_llama.py:273-282; Mistral's, Qwen2's and Qwen3's alike);
  // Qwen3Attention registers q_norm and k_norm after o_proj.
  std::vector<std::string> order = {"q_proj", "k_proj", "v_proj", "o_proj"};
  if (config.qk_norm) order.insert(order.end(), {"q_norm", "k_norm"});
  if (sparse) {
    for (const std::string& name : SparseMoeRegistration(config)) order.push_back(name);
  } else {
    order.insert(order.end(), {"gate_proj", "up_proj", "down_proj"});
  }
  order.insert(order.end(), {"input_layernorm", "post_attention_layernorm"});
  g.RegistrationOrder(order);
  return g.Finish(x2);
}

// Final norm, LM head (tied to embed_tokens or not) and the loss.
BlockGraph BuildLlamaEpilogue(const ModelConfig& config) {
  GraphBuilder g(config);
  int x = g.Input("x", {kB, kTs, kD});
  int input_ids = g.Global(ModelTensor::kInputIds, DType::kInt64, {kB, kT});
  return g.Finish(g.CausalLmHead(g.RmsNorm("norm", x), input_ids));
}


ModelArchitecture Llama(int64_t layers, int64_t width, int64_t heads, int64_t kv_heads,
                  int64_t intermediate, int64_t vocab, double eps) {
  ModelArchitecture c;
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


// ReadMoe reads a sparse model's experts: Qwen3MoeConfig's num_local_experts (its
// num_experts is an alias, FamilyDef::config_aliases), num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
// decoder_sparse_step and mlp_only_layers (configuration_qwen3_moe.py; layer i is sparse
// iff it is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0,
// Qwen3MoeDecoderLayer.__init__), or MixtralConfig's num_local_experts and
// num_experts_per_tok over intermediate_size, every layer sparse.
absl::StatusOr<MoeSpec> ReadMoe(const ConfigJsonReader& r, int64_t layers,
                                int64_t intermediate, bool mixtral) {
  MoeSpec moe;
  bool aux_loss = false;
  MEMLEDGER_ASSIGN_OR_RETURN(aux_loss, r.Bool("output_router_logits", false));
  if (aux_loss) {
    return r.Error("output_router_logits", "true (the load-balancing loss) is not modelled yet");
  }
  if (mixtral) {
    moe.block = MoeBlock::kMixtral;
    MEMLEDGER_ASSIGN_OR_RETURN(moe.experts, r.Positive("num_local_experts", 8));
    MEMLEDGER_ASSIGN_OR_RETURN(moe.top_k, r.Positive("num_experts_per_tok", 2));
    moe.intermediate = intermediate;
    moe.norm_topk_prob = true;
    if (r.Has("router_jitter_noise")) {
      double jitter = 0;
      MEMLEDGER_ASSIGN_OR_RETURN(jitter, r.Probability("router_jitter_noise"));
      if (jitter > 0) return r.Error("router_jitter_noise", "> 0 is not modelled yet (use 0.0)");
    }
    if (r.Has("sliding_window")) {
      return r.Error("sliding_window", "is not modelled yet for mixtral (use null)");
    }
  } else {
    MEMLEDGER_ASSIGN_OR_RETURN(moe.experts, r.Positive("num_local_experts", 128));
    MEMLEDGER_ASSIGN_OR_RETURN(moe.top_k, r.Positive("num_experts_per_tok", 8));
    MEMLEDGER_ASSIGN_OR_RETURN(moe.intermediate, r.Positive("moe_intermediate_size", 768));
    MEMLEDGER_ASSIGN_OR_RETURN(moe.norm_topk_prob, r.Bool("norm_topk_prob", false));
    int64_t step = 1;
    MEMLEDGER_ASSIGN_OR_RETURN(step, r.Positive("decoder_sparse_step", 1));
    MEMLEDGER_ASSIGN_OR_RETURN(moe.dense_layers, r.LayerIndices("mlp_only_layers", layers));
    moe.sparse_step = step;
    if (absl::Status s = moe.DeriveSparseLayers(layers); !s.ok()) {
      return r.Error("num_hidden_layers", absl::StrCat(layers, ": ", s.message()));
    }
  }
  if (moe.top_k > moe.experts) {
    return r.Error("num_experts_per_tok", absl::StrCat(moe.top_k, " exceeds the ",
                                                      moe.experts, " experts"));
  }
  return moe;
}

absl::StatusOr<ModelArchitecture> ReadLlama(const ConfigJsonReader& r, absl::string_view model_type) {
  ModelArchitecture c;
  c.family = Family::kLlama;
  MEMLEDGER_ASSIGN_OR_RETURN(c.width, r.Positive("hidden_size"));
  MEMLEDGER_ASSIGN_OR_RETURN(c.intermediate, r.Positive("intermediate_size"));
  MEMLEDGER_ASSIGN_OR_RETURN(c.layers, r.Positive("num_hidden_layers"));
  MEMLEDGER_ASSIGN_OR_RETURN(c.heads, r.Positive("num_attention_heads"));
  MEMLEDGER_ASSIGN_OR_RETURN(c.kv_heads, r.Positive("num_key_value_heads", c.heads));
  MEMLEDGER_ASSIGN_OR_RETURN(c.vocab, r.Positive("vocab_size"));
  MEMLEDGER_ASSIGN_OR_RETURN(c.max_positions, r.Positive("max_position_embeddings", 0));
  MEMLEDGER_ASSIGN_OR_RETURN(c.tie_embeddings, r.Bool("tie_word_embeddings", false));
  MEMLEDGER_ASSIGN_OR_RETURN(c.use_cache, r.Bool("use_cache", true));
  MEMLEDGER_ASSIGN_OR_RETURN(c.norm_eps, r.PositiveNumber("rms_norm_eps", 1e-6));
  if (r.Has("attention_dropout")) {
    // LlamaAttention passes it to SDPA in training, which then runs its math kernel
    // with grouped-query repeat_interleave copies: not modelled for this family yet.
    double p = 0;
    MEMLEDGER_ASSIGN_OR_RETURN(p, r.Probability("attention_dropout"));
    if (p > 0) return r.Error("attention_dropout", "> 0 is not modelled yet (use 0.0)");
  }
  const bool qwen3 = model_type == "qwen3";
  const bool qwen3_moe = model_type == "qwen3_moe";
  const bool mixtral = model_type == "mixtral";
  if (!qwen3 && !r.Positive("head_dim").ok() && c.width % c.heads != 0) {
    return r.Error("hidden_size", absl::StrCat(c.width, " is not divisible by "
                                               "num_attention_heads ", c.heads,
                                               " and there is no head_dim"));
  }
  // Qwen3Config's head_dim defaults to 128, whatever the width (configuration_qwen3.py);
  // LlamaConfig's, MistralConfig's, Qwen2Config's, Qwen3MoeConfig's and MixtralConfig's
  // to hidden_size / heads.
  MEMLEDGER_ASSIGN_OR_RETURN(c.head_dim, r.Positive("head_dim", qwen3 ? 128 : c.width / c.heads));
  if (c.heads % c.kv_heads != 0) {
    return r.Error("num_attention_heads", absl::StrCat(c.heads, " is not divisible by "
                                                       "num_key_value_heads ", c.kv_heads));
  }
  if (c.head_dim % 2 != 0) {
    return r.Error("head_dim", absl::StrCat(c.head_dim, " must be even for RoPE"));
  }
  std::string act;
  MEMLEDGER_ASSIGN_OR_RETURN(act, r.String("hidden_act", "silu"));
  if (act != "silu") return r.Error("hidden_act", absl::StrCat("must be silu, got ", act));
  // LlamaAttention's q/k/v/o_proj take bias=config.attention_bias, LlamaMLP's
  // gate/up/down_proj bias=config.mlp_bias (modeling_llama.py:158-160, 219-229); Qwen3's
  // and Qwen3-MoE's attention reads attention_bias too (modeling_qwen3.py:217-228,
  // modeling_qwen3_moe.py:134-145), their MLPs and Mistral's, Qwen2's and Mixtral's
  // projections have fixed biases (Qwen2: q, k and v, modeling_qwen2.py:181-184).
  const bool reads_attention_bias = model_type == "llama" || qwen3 || qwen3_moe;
  if (reads_attention_bias) {
    bool attention_bias = false;
    MEMLEDGER_ASSIGN_OR_RETURN(attention_bias, r.Bool("attention_bias", false));
    c.qkv_bias = c.o_bias = attention_bias;
  }
  if (model_type == "llama") MEMLEDGER_ASSIGN_OR_RETURN(c.mlp_bias, r.Bool("mlp_bias", false));
  if (absl::Status s = r.RefuseRecomputedRope(); !s.ok()) return s;
  if (model_type == "mistral" && r.Has("sliding_window")) {
    // MistralConfig's window: from seq >= it on transformers masks every layer
    // (ValidateLlama refuses that); shorter sequences attend as without one.
    MEMLEDGER_ASSIGN_OR_RETURN(c.sliding_window, r.Positive("sliding_window"));
  }
  if (model_type == "qwen2") c.qkv_bias = true;  // Qwen2 always has q, k, v biases, o none
  c.qk_norm = qwen3 || qwen3_moe;      // Qwen3Attention's q_norm and k_norm
  if (qwen3_moe || mixtral) {
    MEMLEDGER_ASSIGN_OR_RETURN(c.moe, ReadMoe(r, c.layers, c.intermediate, mixtral));
  }
  if (qwen3 || qwen3_moe || model_type == "qwen2") {
    // Qwen2Config's and Qwen3Config's __post_init__ make layers >= max_window_layers
    // sliding only with use_sliding_window; explicit layer_types may name them too.
    // Sliding-window masks are not modelled for this family yet.
    bool sliding = false;
    MEMLEDGER_ASSIGN_OR_RETURN(sliding, r.Bool("use_sliding_window", false));
    if (sliding) return r.Error("use_sliding_window", "true is not modelled yet (use false)");
    std::vector<LayerAttention> types;
    MEMLEDGER_ASSIGN_OR_RETURN(types, r.LayerTypes("layer_types", c.layers));
    for (LayerAttention type : types) {
      if (type == LayerAttention::kSliding) {
        return r.Error("layer_types", "'sliding_attention' is not modelled yet for this model_type");
      }
    }
  }
  return c;
}


absl::Status WriteLlama(const ModelArchitecture& c, ConfigJsonWriter& w) {
  // Which model_type builds these projections: attention_bias is q, k, v and o together
  // (llama, qwen3, qwen3_moe), Qwen2 q, k and v alone; only llama has mlp_bias.
  const bool attention_bias = c.qkv_bias && c.o_bias;
  if (c.o_bias && !c.qkv_bias) {
    return absl::InvalidArgumentError("an o_proj bias without q/k/v biases is no transformers "
                                      "model_type");
  }
  if (c.qk_norm && c.qkv_bias && !attention_bias) {
    return absl::InvalidArgumentError("q/k/v biases with q/k norms is no transformers model_type");
  }
  if (c.mlp_bias && (c.qk_norm || c.moe.Sparse() || (c.qkv_bias && !attention_bias))) {
    return absl::InvalidArgumentError("MLP biases are llama's alone (no q/k norms, experts, or "
                                      "q/k/v biases without the o_proj's)");
  }
  const bool mixtral = c.moe.Sparse() && c.moe.block == MoeBlock::kMixtral;
  if (mixtral && (c.qk_norm || c.qkv_bias || !c.moe.sparse_layers.empty() ||
                  c.moe.intermediate != c.Intermediate())) {
    return absl::InvalidArgumentError(
        "a mixtral model has every layer sparse, experts as wide as intermediate_size, and "
        "no q/k norms or biases");
  }
  if (c.moe.Sparse() && !mixtral && !c.qk_norm) {
    return absl::InvalidArgumentError("a qwen3_moe model has q/k norms");
  }
  // Qwen2 is the Llama family with q/k/v biases, Qwen3 with q/k norms; Qwen3-MoE and
  // Mixtral are sparse.
  const char* model_type = mixtral                        ? "mixtral"
                           : c.moe.Sparse()               ? "qwen3_moe"
                           : c.qk_norm                    ? "qwen3"
                           : c.qkv_bias && !c.o_bias      ? "qwen2"
                                                          : "llama";
  w.String("model_type", model_type);
  if (attention_bias) w.Bool("attention_bias", true);
  if (c.mlp_bias) w.Bool("mlp_bias", true);
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
  if (mixtral) {
    w.Int("num_local_experts", c.moe.experts);
    w.Int("num_experts_per_tok", c.moe.top_k);
  } else if (c.moe.Sparse()) {
    w.Int("num_local_experts", c.moe.experts);
    w.Int("num_experts_per_tok", c.moe.top_k);
    w.Int("moe_intermediate_size", c.moe.intermediate);
    w.Bool("norm_topk_prob", c.moe.norm_topk_prob);
    std::vector<int64_t> dense;
    for (int64_t i = 0; i < c.layers; ++i) {
      if (!c.moe.IsSparse(i)) dense.push_back(i);
    }
    w.Ints("mlp_only_layers", dense);
  }
  return absl::OkStatus();
}

std::vector<std::pair<std::string, ModelArchitecture>> LlamaPresets() {
  // The published config.json sizes (max positions informational for RoPE models).
  ModelArchitecture qwen = Llama(28, 3584, 28, 4, 18944, 152064, 1e-6);
  qwen.qkv_bias = true;
  // Qwen/Qwen3-8B's config.json: head_dim 128, untied head, rms_norm_eps 1e-6.
  ModelArchitecture qwen3 = Llama(36, 4096, 32, 8, 12288, 151936, 1e-6);
  qwen3.head_dim = 128;
  qwen3.qk_norm = true;
  // Small enough to verify in a test: grouped-query attention (4 heads, 2 kv heads).
  ModelArchitecture tiny = Llama(2, 32, 4, 2, 64, 96, 1e-5);
  // Qwen3 in small: q/k norms, and 4 heads of 16 = 64 wide on a 32-wide model.
  ModelArchitecture tiny_qwen3 = Llama(2, 32, 4, 2, 64, 96, 1e-6);
  tiny_qwen3.head_dim = 16;
  tiny_qwen3.qk_norm = true;
  // Qwen/Qwen3-30B-A3B's config.json: 48 layers, 128 experts (8 per token) of width 768,
  // head_dim 128, norm_topk_prob true, untied.
  ModelArchitecture qwen3_moe = Llama(48, 2048, 32, 4, 6144, 151936, 1e-6);
  qwen3_moe.head_dim = 128;
  qwen3_moe.qk_norm = true;
  qwen3_moe.moe = {.experts = 128, .top_k = 8, .intermediate = 768, .norm_topk_prob = true};
  // mistralai/Mixtral-8x7B-v0.1's config.json: 8 experts (2 per token) of width 14336.
  ModelArchitecture mixtral = Llama(32, 4096, 32, 8, 14336, 32000, 1e-5);
  mixtral.moe = {.experts = 8, .top_k = 2, .intermediate = 14336, .block = MoeBlock::kMixtral};
  // Small: 4 experts (2 per token) of width 32 on Qwen3-MoE's tiny attention.
  ModelArchitecture tiny_moe = tiny_qwen3;
  tiny_moe.moe = {.experts = 4, .top_k = 2, .intermediate = 32, .norm_topk_prob = true};
  // meta-llama/Llama-3.1-8B's config.json: Llama 3's sizes and 131,072 positions; its
  // llama3 rope scaling changes how inv_freq is computed, not a tensor's size.
  ModelArchitecture llama31 = Llama(32, 4096, 32, 8, 14336, 128256, 1e-5);
  llama31.max_positions = 131072;
  return {{"llama-2-7b", Llama(32, 4096, 32, 32, 11008, 32000, 1e-5)},
          {"llama-3-8b", Llama(32, 4096, 32, 8, 14336, 128256, 1e-5)},
          {"llama-3.1-8b", llama31},
          {"llama-3-70b", Llama(80, 8192, 64, 8, 28672, 128256, 1e-5)},
          {"mistral-7b", Llama(32, 4096, 32, 8, 14336, 32000, 1e-5)},
          {"qwen2.5-7b", qwen},
          {"qwen3-8b", qwen3},
          {"qwen3-30b-a3b", qwen3_moe},
          {"mixtral-8x7b", mixtral},
          {"tiny-llama", tiny},
          {"tiny-qwen3", tiny_qwen3},
          {"tiny-qwen3-moe", tiny_moe}};
}

// The layers' kinds: dense, and with a mixture of experts sparse, in the period of
// moe.sparse_layers. The eager experts' sizes are each layer's routing: a kind per
// distinct tokens-per-expert row, over all the layers when rows are given.
ModelGraphs BuildLlamaGraphs(const ModelConfig& config, AttentionMode mode) {
  ModelGraphs graphs;
  graphs.prologue = BuildLlamaPrologue(config);
  graphs.pattern.clear();
  graphs.epilogue = BuildLlamaEpilogue(config);
  const bool routed = config.RoutingSizesGraphs();
  if (routed && config.moe.routing == RoutingSource::kGiven) {
    std::map<std::vector<int64_t>, int> kind_of_load;
    int dense = -1;
    std::vector<int> per_layer;
    for (int64_t i = 0, sparse_index = 0; i < config.layers; ++i) {
      if (!config.moe.IsSparse(i)) {
        if (dense < 0) {
          dense = static_cast<int>(graphs.layer_kinds.size());
          graphs.layer_kinds.push_back(BuildLlamaLayer(config, mode, false));
        }
        per_layer.push_back(dense);
        continue;
      }
      const std::vector<int64_t> load = config.RunLoad(sparse_index++);
      auto [it, inserted] =
          kind_of_load.emplace(load, static_cast<int>(graphs.layer_kinds.size()));
      if (inserted) graphs.layer_kinds.push_back(BuildLlamaLayer(config, mode, true, load));
      per_layer.push_back(it->second);
    }
    graphs.pattern = SmallestPeriod(per_layer);
    graphs.tensors_after_prologue = DecoderModelTensors(config, graphs.layer_kinds);
    return graphs;
  }
  const std::vector<bool> sparse = !config.moe.Sparse()             ? std::vector<bool>{false}
                                   : config.moe.sparse_layers.empty() ? std::vector<bool>{true}
                                                                      : config.moe.sparse_layers;
  // Balanced and worst routings give every sparse layer the same load.
  const std::vector<int64_t> load = routed ? config.RunLoad(0) : std::vector<int64_t>{};
  int kinds[2] = {-1, -1};  // dense, sparse: their index in layer_kinds
  for (bool layer_sparse : sparse) {
    int& kind = kinds[layer_sparse];
    if (kind < 0) {
      kind = static_cast<int>(graphs.layer_kinds.size());
      graphs.layer_kinds.push_back(BuildLlamaLayer(config, mode, layer_sparse, load));
    }
    graphs.pattern.push_back(kind);
  }
  graphs.tensors_after_prologue = DecoderModelTensors(config, graphs.layer_kinds);
  return graphs;
}

// The eager experts' graphs have an op chain per expert, and a given routing a layer
// kind per row: bounds that keep a graph small (DeepSeek-V3 has 256 experts).
constexpr int64_t kMaxEagerExperts = 4096;
constexpr int64_t kMaxRoutedLayers = 65536;

// ValidateLlama: what the sparse models' graphs do not model yet, one line each.
absl::Status ValidateLlama(const ModelConfig& config) {
  if (config.sliding_window > 0 && config.seq >= config.sliding_window) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--seq ", config.seq, ": a sliding window (the config's sliding_window ",
        config.sliding_window, ") masks every layer from there on, which is not modelled "
        "yet for the llama family (use a shorter --seq, or sliding_window null)"));
  }
  const MoeSpec& moe = config.moe;
  if (!moe.Sparse()) return absl::OkStatus();
  if (moe.top_k < 1 || moe.top_k > moe.experts || moe.intermediate < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a mixture of experts needs 1 <= experts per token (", moe.top_k, ") <= experts (",
        moe.experts, ") and an expert width >= 1 (", moe.intermediate, ")"));
  }
  if (config.shard.tp > 1) {
    return absl::InvalidArgumentError(
        "tensor parallelism of a mixture of experts is not modelled yet (use --tp=1)");
  }
  if (config.shard.ep > 1 && moe.experts % config.shard.ep != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--ep ", config.shard.ep, " does not divide the ", moe.experts, " experts"));
  }
  if (moe.impl == ExpertsImpl::kEager && moe.experts > kMaxEagerExperts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--experts_impl=eager is modelled for up to ", kMaxEagerExperts, " experts (a graph "
        "op chain per expert), not ", moe.experts));
  }
  if (moe.routing == RoutingSource::kGiven && config.layers > kMaxRoutedLayers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--routing=PATH is modelled for up to ", kMaxRoutedLayers, " layers, not ",
        config.layers));
  }
  if (moe.routing == RoutingSource::kGiven) {
    // One row per sparse layer, each expert receiving at most every token once, the row
    // summing to the (token, expert) pairs.
    // Checked: a row's counts come from a file (--routing), near INT64_MAX if it says so.
    const CheckedInt64 checked_pairs = CheckedInt64(config.batch) * config.seq * moe.top_k;
    if (checked_pairs.overflowed()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--routing: batch x seq x ", moe.top_k, " experts per token overflows int64"));
    }
    const int64_t tokens = config.batch * config.seq, pairs = checked_pairs.value();
    const int64_t sparse = config.SparseLayers();
    const int64_t rows = static_cast<int64_t>(moe.routing_rows.size());
    if (rows != sparse && (config.shard.ep == 1 || rows % (config.shard.ep * sparse) != 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--routing has ", rows, " rows for the model's ", sparse, " sparse layers",
          config.shard.ep > 1 ? absl::StrCat(" (or a multiple of ", config.shard.ep * sparse,
                                    ", every --ep rank's of each expert-parallel group)")
                     : ""));
    }
    for (size_t l = 0; l < moe.routing_rows.size(); ++l) {
      const std::vector<int64_t>& row = moe.routing_rows[l];
      CheckedInt64 sum = 0;
      bool in_range = row.size() == static_cast<size_t>(moe.experts);
      for (int64_t n : row) {
        in_range = in_range && n >= 0 && n <= tokens;
        sum += n;
      }
      if (!in_range || sum.overflowed() || sum.value() != pairs) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--routing row ", l, " must give each of the ", moe.experts,
            " experts 0 to ", tokens, " tokens, ", pairs, " in all (batch x seq x ",
            moe.top_k, ")"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

// LlamaFamily: Llama 2/3, Mistral, Qwen2, Qwen3 and their sparse mixtures of experts:
// embedding, RMSNorm, RoPE, GQA, SwiGLU, head, cross-entropy.
const FamilyDef& LlamaFamily() {
  static const FamilyDef kDef = {
      .id = Family::kLlama,
      .name = "llama",
      .decoder = true,
      .rope = true,
      .qk_norm = true,
      .projection_biases = true,
      .lora = true,
      .graphs = BuildLlamaGraphs,
      .validate = ValidateLlama,
      .model_types = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"},
      // MixtralConfig.attribute_map (configuration_mixtral.py:65) and Qwen3MoeConfig's
      // (configuration_qwen3_moe.py:51-53), whose dataclass field is num_experts (:101).
      .config_aliases = {{"mixtral", "num_experts", "num_local_experts"},
                         {"qwen3_moe", "num_experts", "num_local_experts",
                          /*alias_is_field=*/true}},
      .read = ReadLlama,
      .write = WriteLlama,
      .inert_config_keys =
          {{"pretraining_tp", "Meta's pretraining sliced the projections; transformers "
                              "5.23's modeling_llama.py never reads it"},
           {"max_window_layers", "picks the sliding layers only with use_sliding_window, "
                                 "which is refused"},
           {"sliding_window", "Qwen's window, used only by sliding layers "
                              "(use_sliding_window or sliding_attention, refused)"},
           {"router_aux_loss_coef", "weighs the load-balancing loss, which "
                                    "output_router_logits (refused) would add"},
           {"attention_bias", "read by llama, qwen3 and qwen3_moe; mistral's, qwen2's and "
                              "mixtral's projections have fixed biases"},
           {"mlp_bias", "read by llama alone; the other model types' MLPs have no biases"}},
      .presets = LlamaPresets(),
  };
  return kDef;
}

}  // namespace memledger
