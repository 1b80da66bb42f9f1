// The OLMo 3 family: transformers' Olmo3ForCausalLM (models/olmo3/modeling_olmo3.py,
// "M:" below), embedding to cross-entropy. What sets it apart: RMSNorm on the attention's
// and the MLP's outputs rather than their inputs, with the weight multiplied in fp32
// before the cast back; q/k norms over the whole projection; RoPE tables kept in fp32
// and apply_rotary_pos_emb casting its results back; sliding-window layers (3 of 4 by
// default) with their own tables and the sliding-window mask, as Gemma 3's.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/graph/family.h"
#include "estimator/graph/decoder_model.h"
#include "estimator/graph/graph_builder.h"
#include "estimator/spec/config_json.h"

namespace memledger {
namespace {

// OlmoRmsNorm is Olmo3RMSNorm.forward (M:53-58): hs = x.to(float32); variance =
// hs.pow(2).mean(-1, keepdim=True); hs = hs * rsqrt(variance + eps); return (weight *
// hs).to(input_dtype). Unlike LlamaRMSNorm the weight multiplies the fp32 result (a
// lower-precision weight is promoted for it) and the cast comes last. Its locals
// `variance` and `hs` and its argument x (nn.Module.__call__'s *args) live to its return.
int OlmoRmsNorm(GraphBuilder& g, const std::string& name, int x, SymDim width = kD) {
  int weight = g.Param(name + ".weight", {width});
  const auto [variance, normed] = g.RmsNormalize(name, x);
  int scaled = g.Op1(OpType::kMulTensor, name + ".scaled", {weight, normed});
  const int out = g.ToDtype(name, scaled, g.DTypeOf(x));
  g.HeldThroughHere({x, variance, normed});
  return out;
}

// Olmo3Model's embed_tokens (M:366), unscaled, and the rotary embedding's buffers:
// {type}_inv_freq and {type}_original_inv_freq, fp32, d_head / 2 each, for each layer
// type in sorted order (Olmo3RotaryEmbedding.__init__, M:275-288).
BlockGraph BuildOlmo3Prologue(const ModelConfig& config) {
  GraphBuilder g(config);
  g.RotaryBuffersPerLayerType();
  int input_ids = g.Global(ModelTensor::kInputIds, DType::kInt64, {kB, kT});
  int weight = g.Param("embed_tokens.weight", {kV, kD});
  int embeddings = g.VocabEmbedding("embed_tokens", weight, input_ids);
  g.InputEmbeddings(embeddings);
  g.HeldByDecoder({embeddings});  // Olmo3Model.forward's inputs_embeds (M:397)
  return g.Finish(embeddings);
}

// Olmo3DecoderLayer.forward (M:248-266): attention on the residual stream itself, then
// post_attention_layernorm on its output before the residual add; the MLP likewise with
// post_feedforward_layernorm. Olmo3Attention.forward (M:177-208): q_norm(q_proj(x)) and
// k_norm(k_proj(x)) over the whole projection, then v_proj; the heads' view and
// transpose; RoPE with the layer type's fp32 tables, cast back to q's and k's dtype.
BlockGraph BuildOlmo3Layer(const ModelConfig& config, AttentionMode mode,
                           LayerAttention attention) {
  GraphBuilder g(config);
  int x = g.Input("x", {kB, kT, kD});
  const bool sliding = attention == LayerAttention::kSliding;
  // Olmo3RotaryEmbedding.forward returns cos and sin in fp32, uncast (M:320-329).
  int cos = g.Global(sliding ? ModelTensor::kRopeLocalCos : ModelTensor::kRopeCos,
                     DType::kFloat32, {Sym(1), kT, kDHead});
  int sin = g.Global(sliding ? ModelTensor::kRopeLocalSin : ModelTensor::kRopeSin,
                     DType::kFloat32, {Sym(1), kT, kDHead});
  g.Global(ModelTensor::kPositionIds, DType::kInt64, {Sym(1), kT});
  auto project = [&](const std::string& name, SymDim heads, const char* norm) {
    int out = g.ColumnParallelLinear(name, x, kD, heads * kDHead, /*bias=*/false);
    if (norm != nullptr) out = OlmoRmsNorm(g, norm, out, heads * kDHead);
    int split = g.Op1(OpType::kView, name + ".split_heads", {out},
                      {.shape = {kB, kT, heads, kDHead}});
    return g.Op1(OpType::kTranspose, name + ".transpose", {split}, {.dim = 1, .dim1 = 2});
  };
  int q = project("q_proj", kH, "q_norm");
  int k = project("k_proj", kKv, "k_norm");
  int v = project("v_proj", kKv, nullptr);
  const int mask = g.SlidingWindowMask(sliding);
  const GraphBuilder::RopeAttentionOut a =
      g.RopeAttention(config, mode, q, k, v, cos, sin, mask, /*cast_back=*/true);
  int projected = g.RowParallelLinear("o_proj", a.merged, kH * kDHead, kD, /*bias=*/false);
  // Olmo3Attention.forward's locals, to its return.
  g.HeldThroughHere({a.q, a.k, a.v});
  int x1 = g.Op1(OpType::kAdd, "residual1",
                 {x, OlmoRmsNorm(g, "post_attention_layernorm", projected)});
  // Olmo3MLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)) (M:224), silu.
  int gate = g.ColumnParallelLinear("gate_proj", x1, kD, kF, /*bias=*/false);
  int act = g.Op1(OpType::kSilu, "act_fn", {gate}, {}, OpKind::kSilu);
  int up = g.ColumnParallelLinear("up_proj", x1, kD, kF, /*bias=*/false);
  int product = g.Op1(OpType::kMulTensor, "mlp.mul", {act, up});
  int mlp_out = g.RowParallelLinear("down_proj", product, kF, kD, /*bias=*/false);
  g.HeldThroughHere({x1});  // Olmo3MLP.forward's argument, to its return
  int x2 = g.Op1(OpType::kAdd, "residual2",
                 {x1, OlmoRmsNorm(g, "post_feedforward_layernorm", mlp_out)});
  // Olmo3DecoderLayer.__init__ (M:233-236): self_attn (q, k, v, o, q_norm, k_norm; M:149-
  // 162), mlp, then the two norms.
  g.RegistrationOrder({"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "gate_proj",
                       "up_proj", "down_proj", "post_attention_layernorm",
                       "post_feedforward_layernorm"});
  return g.Finish(x2);
}

// Olmo3Model's final norm (M:438), the LM head (untied by default) and the loss.
BlockGraph BuildOlmo3Epilogue(const ModelConfig& config) {
  GraphBuilder g(config);
  int x = g.Input("x", {kB, kT, kD});
  int input_ids = g.Global(ModelTensor::kInputIds, DType::kInt64, {kB, kT});
  return g.Finish(g.CausalLmHead(OlmoRmsNorm(g, "norm", x), input_ids));
}

// Graphs: one layer kind per attention span the pattern has.
ModelGraphs BuildOlmo3Graphs(const ModelConfig& config, AttentionMode mode) {
  return GraphsByLayerAttention(
      config, BuildOlmo3Prologue(config), BuildOlmo3Epilogue(config),
      [&](LayerAttention type) { return BuildOlmo3Layer(config, mode, type); });
}

// What OLMo 3 models that the shared checks do not refuse.
absl::Status ValidateOlmo3(const ModelConfig& config) {
  if (config.shard.tp > 1) {
    // Its q/k norms span every head: Megatron's split of the heads is not its layout
    // (transformers' own tp plan gathers q, k and v, configuration_olmo3.py).
    return absl::InvalidArgumentError(
        "--tp with olmo3 is not modelled yet (its q/k norms span all the heads)");
  }
  if (config.layer_attention.empty()) {
    return absl::InvalidArgumentError("olmo3 needs its layers' attention types");
  }
  return absl::OkStatus();
}

// Olmo3Config (configuration_olmo3.py, "C:"): its keys and defaults (C:65-99); without
// layer_types, layer i is full attention iff (i + 1) % 4 == 0 (C:93-96). rope_scaling's
// linear and yarn types change no tensor's size (the tables stay (T, d_head)).
absl::StatusOr<ModelArchitecture> ReadOlmo3(const ConfigJsonReader& r, absl::string_view) {
  ModelArchitecture c;
  c.family = Family::kOlmo3;
  MEMLEDGER_ASSIGN_OR_RETURN(c.width, r.Positive("hidden_size", 4096));
  MEMLEDGER_ASSIGN_OR_RETURN(c.intermediate, r.Positive("intermediate_size", 11008));
  MEMLEDGER_ASSIGN_OR_RETURN(c.layers, r.Positive("num_hidden_layers", 32));
  MEMLEDGER_ASSIGN_OR_RETURN(c.heads, r.Positive("num_attention_heads", 32));
  MEMLEDGER_ASSIGN_OR_RETURN(c.kv_heads, r.Positive("num_key_value_heads", c.heads));
  if (c.width % c.heads != 0 && !r.Has("head_dim")) {
    return r.Error("hidden_size", absl::StrCat(c.width, " is not divisible by "
                                               "num_attention_heads ", c.heads));
  }
  MEMLEDGER_ASSIGN_OR_RETURN(c.head_dim, r.Positive("head_dim", c.width / c.heads));
  MEMLEDGER_ASSIGN_OR_RETURN(c.vocab, r.Positive("vocab_size", 50304));
  MEMLEDGER_ASSIGN_OR_RETURN(c.max_positions, r.Positive("max_position_embeddings", 2048));
  // RoPE's positions are not learned: max_position_embeddings bounds nothing here.
  c.max_positions = 0;
  MEMLEDGER_ASSIGN_OR_RETURN(c.tie_embeddings, r.Bool("tie_word_embeddings", false));
  MEMLEDGER_ASSIGN_OR_RETURN(c.use_cache, r.Bool("use_cache", true));
  MEMLEDGER_ASSIGN_OR_RETURN(c.norm_eps, r.PositiveNumber("rms_norm_eps", 1e-5));
  MEMLEDGER_ASSIGN_OR_RETURN(c.sliding_window, r.Positive("sliding_window", 4096));
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
  bool flag = false;
  MEMLEDGER_ASSIGN_OR_RETURN(flag, r.Bool("attention_bias", false));
  if (flag) return r.Error("attention_bias", "true (biases on q, k, v and o) is not supported");
  if (r.Has("attention_dropout")) {
    double p = 0;
    MEMLEDGER_ASSIGN_OR_RETURN(p, r.Probability("attention_dropout"));
    if (p > 0) return r.Error("attention_dropout", "> 0 is not modelled yet (use 0.0)");
  }
  // dynamic_rope_update (M:318) recomputes inv_freq in every forward for the "dynamic"
  // and "longrope" types: not modelled (ConfigJsonReader::RefuseRecomputedRope).
  if (absl::Status s = r.RefuseRecomputedRope(); !s.ok()) return s;
  std::vector<LayerAttention> types;
  MEMLEDGER_ASSIGN_OR_RETURN(types, r.LayerTypes("layer_types", c.layers));
  if (types.empty()) {
    for (int64_t i = 0; i < std::min<int64_t>(4, c.layers); ++i) {
      types.push_back((i + 1) % 4 != 0 ? LayerAttention::kSliding : LayerAttention::kFull);
    }
  }
  c.layer_attention = SmallestPeriod(types);
  if (r.Has("layer_types") && c.layer_attention.size() > 1 &&
      c.layer_attention.size() == types.size()) {
    c.layer_types_layers = c.layers;  // names each layer; no period to extend
  }
  return c;
}

absl::Status WriteOlmo3(const ModelArchitecture& c, ConfigJsonWriter& w) {
  w.String("model_type", "olmo3");
  w.Int("hidden_size", c.width);
  w.Int("intermediate_size", c.Intermediate());
  w.Int("num_hidden_layers", c.layers);
  w.Int("num_attention_heads", c.heads);
  w.Int("num_key_value_heads", c.KvHeads());
  w.Int("head_dim", c.HeadDim());
  w.Int("vocab_size", c.vocab);
  w.Double("rms_norm_eps", c.norm_eps);
  w.Int("sliding_window", c.sliding_window);
  w.LayerTypes("layer_types", c);
  return absl::OkStatus();
}

ModelArchitecture Olmo3(int64_t layers, int64_t width, int64_t heads, int64_t kv_heads,
                  int64_t intermediate, int64_t vocab, double eps) {
  ModelArchitecture c;
  c.family = Family::kOlmo3;
  c.layers = layers;
  c.width = width;
  c.heads = heads;
  c.kv_heads = kv_heads;
  c.head_dim = width / heads;
  c.intermediate = intermediate;
  c.vocab = vocab;
  c.norm_eps = eps;
  c.tie_embeddings = false;
  c.use_cache = true;
  c.sliding_window = 4096;
  c.layer_attention = {LayerAttention::kSliding, LayerAttention::kSliding,
                       LayerAttention::kSliding, LayerAttention::kFull};
  return c;
}

std::vector<std::pair<std::string, ModelArchitecture>> Olmo3Presets() {
  // allenai's OLMo 3 base models, as their config.json files are reported (not read here;
  // see docs/families.md): 7B, 32 layers of 4096, 32 heads (no grouping), MLP 11008; 32B,
  // 64 layers of 5120, 40 heads over 8 kv heads, MLP 27648; both a vocabulary of 100278,
  // rms_norm_eps 1e-6, window 4096, 3 sliding : 1 full, untied.
  // Small enough to verify in a test: 4 layers (one period), 4 heads of 16 over 2.
  ModelArchitecture tiny = Olmo3(4, 64, 4, 2, 128, 128, 1e-6);
  tiny.sliding_window = 512;
  return {{"olmo-3-7b", Olmo3(32, 4096, 32, 32, 11008, 100278, 1e-6)},
          {"olmo-3-32b", Olmo3(64, 5120, 40, 8, 27648, 100278, 1e-6)},
          {"tiny-olmo3", tiny}};
}

}  // namespace

// Olmo3Family: OLMo 3: RMSNorm after attention and the MLP, q/k norms over the whole
// projections, fp32 RoPE tables, sliding-window and full layers.
const FamilyDef& Olmo3Family() {
  static const FamilyDef kDef = {
      .id = Family::kOlmo3,
      .name = "olmo3",
      .decoder = true,
      .rope = true,
      .layer_types = true,
      .lora = true,
      .lora_default_targets = nullptr,  // peft 0.21.2 lists none for olmo3
      .graphs = BuildOlmo3Graphs,
      .validate = ValidateOlmo3,
      .model_types = {"olmo3"},
      .read = ReadOlmo3,
      .write = WriteOlmo3,
      .presets = Olmo3Presets(),
  };
  return kDef;
}

}  // namespace memledger
