// The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3): transformers' LlamaForCausalLM and
// its look-alikes, embedding to cross-entropy.
#include <optional>
#include <string>
#include <vector>

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
  int input_ids = g.Global("input_ids", DType::kInt64, {kB, kT});
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
  int cos = g.Global("rope.cos", config.dtype, {Sym(1), kT, kDHead});
  int sin = g.Global("rope.sin", config.dtype, {Sym(1), kT, kDHead});
  g.Global("position_ids", DType::kInt64, {Sym(1), kT});
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
  int cos4 = g.Op1(OpType::kUnsqueeze, "rope.cos_heads", {cos}, {.dim = 1});
  int sin4 = g.Op1(OpType::kUnsqueeze, "rope.sin_heads", {sin}, {.dim = 1});
  const int q_pre = q, k_pre = k;
  q = g.Rope("q_rope", q, cos4, sin4);
  k = g.Rope("k_rope", k, cos4, sin4);
  g.HeldThroughHere({q_pre, k_pre});  // apply_rotary_pos_emb's arguments, to its return
  if (config.KeepsKvCache()) {
    // key_states, value_states = past_key_values.update(...) (modeling_llama.py): the
    // cache's copies, the old locals rebound after both are made.
    // Under autocast the keys are fp32 (RoPE's product with fp32 cos), the values bf16.
    const DType keys = g.DTypeOf(k);
    const int k_cached = g.KvCache("k_cache", k, keys);
    const int v_cached = g.KvCache("v_cache", v, keys);
    g.HeldThroughHere({k, v});
    k = k_cached;
    v = v_cached;
  }
  const int q_embed = q, k_embed = k, value = v;
  if (config.KvHeads() < config.heads && RepeatsKv(mode, config.HeadDim())) {
    k = g.RepeatKv("k_repeat", k);
    v = g.RepeatKv("v_repeat", v);
  }
  int attention = g.CausalAttention(mode, q, k, v);
  int transposed = g.Op1(OpType::kTranspose, "attention.transpose", {attention}, {.dim = 1, .dim1 = 2});
  int merged = g.Op1(OpType::kReshape, "attention.merge_heads",
                     {g.Op1(OpType::kContiguous, "attention.contiguous", {transposed})},
                     {.shape = {kB, kT, kH * kDHead}});
  int attention_out = g.RowParallelNoBias("o_proj", merged, kH * kDHead, kD);
  // LlamaAttention.forward's argument and locals, to its return (modeling_llama.py:
  // 206-250): hidden_states, query_states, key_states, value_states.
  g.HeldThroughHere({h, q_embed, k_embed, value});
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
  int input_ids = g.Global("input_ids", DType::kInt64, {kB, kT});
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

}  // namespace

const FamilyDef& LlamaFamily() {
  static const FamilyDef kDef = {
      .id = Family::kLlama,
      .name = "llama",
      .decoder = true,
      .rope = true,
      .qk_norm = true,
      .graphs = [](const ModelConfig& config, AttentionMode mode) {
        return ModelGraphs{BuildLlamaPrologue(config), BuildLlamaLayer(config, mode),
                           BuildLlamaEpilogue(config)};
      },
  };
  return kDef;
}

}  // namespace memledger
