// The Gemma 3 family: transformers' Gemma3ForCausalLM, the text model of Gemma 3
// (models/gemma3/modeling_gemma3.py), embedding to cross-entropy. Its layers are of two
// kinds, sliding-window and global, which differ in the RoPE tables they read.
#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/spec/config_json.h"
#include "estimator/graph/family.h"
#include "estimator/graph/decoder_model.h"
#include "estimator/graph/graph_builder.h"

namespace memledger {
namespace {

// GemmaRmsNorm is Gemma3RMSNorm.forward: output = _norm(x.float()), _norm(x) =
// x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps); output = output * (1.0 +
// weight.float()); output.type_as(x). Unlike LlamaRMSNorm it scales in fp32 by 1 + w (a
// new (width) tensor every call, which the product keeps) and casts last; its locals die
// at their last use (no `variance` held to the return). Its argument x lives to the
// return: nn.Module.__call__'s *args tuple holds it (torch/nn/modules/module.py,
// _wrapped_call_impl and _call_impl), so a fresh input (the sandwich norms' projections,
// the q/k norms' heads) outlives the upcast under bf16 and autocast.
int GemmaRmsNorm(GraphBuilder& g, const std::string& name, int x, SymDim width = kD) {
  int weight = g.Param(name + ".weight", {width});
  const int normed = g.RmsNormalize(name, x).normed;
  int weight32 = g.ToDtype(name + ".weight_upcast", weight, DType::kFloat32);
  int one_plus = g.Op1(OpType::kAddScalar, name + ".one_plus", {weight32});
  int scaled = g.Op1(OpType::kMulTensor, name + ".scaled", {normed, one_plus});
  const int out = g.ToDtype(name, scaled, g.DTypeOf(x));
  g.HeldThroughHere({x});
  return out;
}

// Gemma3TextScaledWordEmbedding: embedding(input_ids) * embed_scale.to(weight.dtype),
// embed_scale a 0-dim buffer (sqrt(hidden_size)) made in the default dtype, the model's
// (.to returns it itself), which MulBackward0 keeps. The rotary embedding's buffers:
// {type}_inv_freq and {type}_original_inv_freq, fp32, d_head / 2 each, for each layer
// type the model has (Gemma3RotaryEmbedding.__init__).
BlockGraph BuildGemma3Prologue(const ModelConfig& config) {
  GraphBuilder g(config);
  g.RotaryBuffersPerLayerType();
  int scale = g.Buffer("embed_tokens.embed_scale", config.dtype, {});
  int input_ids = g.Global(ModelTensor::kInputIds, DType::kInt64, {kB, kT});
  int weight = g.Param("embed_tokens.weight", {kV, kD});
  int embeddings = g.VocabEmbedding("embed_tokens", weight, input_ids);
  int scaled = g.Op1(OpType::kMulTensor, "embed_tokens.scale", {embeddings, scale});
  g.InputEmbeddings(scaled);  // Gemma3TextScaledWordEmbedding returns the scaled lookup
  if (config.shard.sp) {  // Megatron scatters the embeddings to the sequence-parallel region
    scaled = g.Op1(OpType::kScatter, "embeddings.scatter", {scaled}, {.shape = {kB, kTs, kD}});
  }
  g.HeldByDecoder({scaled});  // Gemma3TextModel.forward's inputs_embeds (scattered with sp)
  return g.Finish(scaled);
}

// Gemma3DecoderLayer.forward: sandwich norms around attention and the MLP; q_norm and
// k_norm on the transposed heads (Gemma3Attention.forward normalises after the
// transpose); RoPE with the layer type's tables. With sequence parallelism the residual
// stream and the sandwich norms hold T / tp tokens (kTs), as Llama's do.
BlockGraph BuildGemma3Layer(const ModelConfig& config, AttentionMode mode,
                            LayerAttention attention) {
  GraphBuilder g(config);
  int x = g.Input("x", {kB, kTs, kD});
  const bool sliding = attention == LayerAttention::kSliding;
  int cos = g.Global(sliding ? ModelTensor::kRopeLocalCos : ModelTensor::kRopeCos, config.dtype,
                     {Sym(1), kT, kDHead});
  int sin = g.Global(sliding ? ModelTensor::kRopeLocalSin : ModelTensor::kRopeSin, config.dtype,
                     {Sym(1), kT, kDHead});
  g.Global(ModelTensor::kPositionIds, DType::kInt64, {Sym(1), kT});
  int h = GemmaRmsNorm(g, "input_layernorm", x);
  auto project = [&](const std::string& name, SymDim heads) {
    int out = g.ColumnParallelLinear(name, h, kD, heads * kDHead, /*bias=*/false);
    int split = g.Op1(OpType::kView, name + ".split_heads", {out},
                      {.shape = {kB, kT, heads, kDHead}});
    return g.Op1(OpType::kTranspose, name + ".transpose", {split}, {.dim = 1, .dim1 = 2});
  };
  // Gemma3Attention.forward projects q, k and v first, then normalises q and k
  // (modeling_gemma3.py:341-346); Qwen3 normalises each as it projects it.
  int q = project("q_proj", kH);
  int k = project("k_proj", kKv);
  int v = project("v_proj", kKv);
  q = GemmaRmsNorm(g, "q_norm", q, kDHead);
  k = GemmaRmsNorm(g, "k_norm", k, kDHead);
  const int mask = g.SlidingWindowMask(sliding);
  const GraphBuilder::RopeAttentionOut a =
      g.RopeAttention(config, mode, q, k, v, cos, sin, mask);
  int projected = g.RowParallelLinear("o_proj", a.merged, kH * kDHead, kD, /*bias=*/false);
  // Gemma3Attention.forward's argument and locals, to its return.
  g.HeldThroughHere({h, a.q, a.k, a.v});
  int x1 = g.Op1(OpType::kAdd, "residual1", {x, GemmaRmsNorm(g, "post_attention_layernorm",
                                                             projected)});
  int h2 = GemmaRmsNorm(g, "pre_feedforward_layernorm", x1);
  // Gemma3MLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)), act_fn GELUTanh:
  // gelu(x, approximate="tanh") (activations.py), one op that keeps its input.
  int gate = g.ColumnParallelLinear("gate_proj", h2, kD, kF, /*bias=*/false);
  int act = g.Op1(OpType::kGelu, "act_fn", {gate}, {}, OpKind::kGelu);
  int up = g.ColumnParallelLinear("up_proj", h2, kD, kF, /*bias=*/false);
  int product = g.Op1(OpType::kMulTensor, "mlp.mul", {act, up});
  int mlp_out = g.RowParallelLinear("down_proj", product, kF, kD, /*bias=*/false);
  g.HeldThroughHere({h2});  // Gemma3MLP.forward's argument x, to its return
  int x2 = g.Op1(OpType::kAdd, "residual2",
                 {x1, GemmaRmsNorm(g, "post_feedforward_layernorm", mlp_out)});
  // Gemma3DecoderLayer.__init__: self_attn (q, k, v, o, q_norm, k_norm), mlp, then the
  // four norms.
  g.RegistrationOrder({"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "gate_proj",
                       "up_proj", "down_proj", "input_layernorm", "post_attention_layernorm",
                       "pre_feedforward_layernorm", "post_feedforward_layernorm"});
  return g.Finish(x2);
}

// Final norm, LM head (tied to embed_tokens by default) and the loss; Gemma 3's
// final_logit_softcapping is null (the config.json reader refuses another).
BlockGraph BuildGemma3Epilogue(const ModelConfig& config) {
  GraphBuilder g(config);
  int x = g.Input("x", {kB, kTs, kD});
  int input_ids = g.Global(ModelTensor::kInputIds, DType::kInt64, {kB, kT});
  return g.Finish(g.CausalLmHead(GemmaRmsNorm(g, "norm", x), input_ids));
}

// Graphs: one layer kind per attention span the pattern has.
ModelGraphs BuildGemma3Graphs(const ModelConfig& config, AttentionMode mode) {
  return GraphsByLayerAttention(
      config, BuildGemma3Prologue(config), BuildGemma3Epilogue(config),
      [&](LayerAttention type) { return BuildGemma3Layer(config, mode, type); });
}

// Gemma3TextConfig (configuration_gemma3.py): layer_types, or without it
// sliding_window_pattern (default 6): layer i is full iff (i + 1) % pattern == 0.
// A published Gemma 3 checkpoint's config.json is the multimodal Gemma3Config
// (model_type "gemma3"): its text model is its text_config, which memledger models
// (Gemma3ForConditionalGeneration's language model; the vision tower is not).
absl::StatusOr<ModelArchitecture> ReadGemma3(const ConfigJsonReader& outer, absl::string_view type) {
  std::optional<ConfigJsonReader> text;
  if (type == "gemma3") {
    absl::StatusOr<ConfigJsonReader> nested = outer.Nested("text_config");
    if (!nested.ok()) return nested.status();
    text.emplace(*std::move(nested));
    std::string inner;
    MEMLEDGER_ASSIGN_OR_RETURN(inner, text->String("model_type", "gemma3_text"));
    if (inner != "gemma3_text") {
      return text->Error("model_type", absl::StrCat("must be gemma3_text, got ", inner));
    }
  }
  const ConfigJsonReader& r = text.has_value() ? *text : outer;
  ModelArchitecture c;
  c.family = Family::kGemma3;
  MEMLEDGER_ASSIGN_OR_RETURN(c.width, r.Positive("hidden_size", 2304));
  MEMLEDGER_ASSIGN_OR_RETURN(c.intermediate, r.Positive("intermediate_size", 9216));
  MEMLEDGER_ASSIGN_OR_RETURN(c.layers, r.Positive("num_hidden_layers", 26));
  MEMLEDGER_ASSIGN_OR_RETURN(c.heads, r.Positive("num_attention_heads", 8));
  MEMLEDGER_ASSIGN_OR_RETURN(c.kv_heads, r.Positive("num_key_value_heads", 4));
  MEMLEDGER_ASSIGN_OR_RETURN(c.head_dim, r.Positive("head_dim", 256));
  MEMLEDGER_ASSIGN_OR_RETURN(c.vocab, r.Positive("vocab_size", 262208));
  MEMLEDGER_ASSIGN_OR_RETURN(c.max_positions, r.Positive("max_position_embeddings", 0));
  MEMLEDGER_ASSIGN_OR_RETURN(c.tie_embeddings, r.Bool("tie_word_embeddings", true));
  if (text.has_value()) {
    // Gemma3ForConditionalGeneration ties lm_head to the language model's embed_tokens
    // by its own config's key, the multimodal one's (modeling_utils.py,
    // get_expanded_tied_weights_keys: self.config.tie_word_embeddings), not
    // text_config's; Gemma3Config's default is true (configuration_gemma3.py).
    MEMLEDGER_ASSIGN_OR_RETURN(c.tie_embeddings, outer.Bool("tie_word_embeddings", true));
  }
  MEMLEDGER_ASSIGN_OR_RETURN(c.use_cache, r.Bool("use_cache", true));
  MEMLEDGER_ASSIGN_OR_RETURN(c.norm_eps, r.PositiveNumber("rms_norm_eps", 1e-6));
  MEMLEDGER_ASSIGN_OR_RETURN(c.sliding_window, r.Positive("sliding_window", 4096));
  if (c.heads % c.kv_heads != 0) {
    return r.Error("num_attention_heads", absl::StrCat(c.heads, " is not divisible by "
                                                       "num_key_value_heads ", c.kv_heads));
  }
  if (c.head_dim % 2 != 0) {
    return r.Error("head_dim", absl::StrCat(c.head_dim, " must be even for RoPE"));
  }
  std::string act;
  MEMLEDGER_ASSIGN_OR_RETURN(act, r.String("hidden_activation", "gelu_pytorch_tanh"));
  if (act != "gelu_pytorch_tanh") {
    return r.Error("hidden_activation", absl::StrCat("must be gelu_pytorch_tanh, got ", act));
  }
  bool flag = false;
  MEMLEDGER_ASSIGN_OR_RETURN(flag, r.Bool("attention_bias", false));
  if (flag) return r.Error("attention_bias", "true (biases on q, k, v and o) is not supported");
  if (absl::Status s = r.RefuseRecomputedRope(); !s.ok()) return s;
  MEMLEDGER_ASSIGN_OR_RETURN(flag, r.Bool("use_bidirectional_attention", false));
  if (flag) return r.Error("use_bidirectional_attention", "true is not modelled yet (use false)");
  for (const char* key : {"final_logit_softcapping", "attn_logit_softcapping"}) {
    if (r.Has(key)) return r.Error(key, "is not modelled yet (Gemma 3's is null)");
  }
  if (r.Has("attention_dropout")) {
    double p = 0;
    MEMLEDGER_ASSIGN_OR_RETURN(p, r.Probability("attention_dropout"));
    if (p > 0) return r.Error("attention_dropout", "> 0 is not modelled yet (use 0.0)");
  }
  std::vector<LayerAttention> types;
  MEMLEDGER_ASSIGN_OR_RETURN(types, r.LayerTypes("layer_types", c.layers));
  if (types.empty()) {
    int64_t pattern = 6;
    MEMLEDGER_ASSIGN_OR_RETURN(pattern, r.Positive("sliding_window_pattern", 6));
    // Past the model's layers every layer slides: one period of one layer.
    const int64_t length = pattern > c.layers ? 1 : pattern;
    if (absl::Status s = CheckLayerPeriod("", length); !s.ok()) {
      return r.Error("sliding_window_pattern", absl::StrCat(pattern, " ", s.message()));
    }
    for (int64_t i = 0; i < length; ++i) {
      types.push_back((i + 1) % pattern != 0 ? LayerAttention::kSliding : LayerAttention::kFull);
    }
  }
  c.layer_attention = SmallestPeriod(types);
  if (r.Has("layer_types") && c.layer_attention.size() > 1 &&
      c.layer_attention.size() == types.size()) {
    c.layer_types_layers = c.layers;  // names each layer; no period to extend
  }
  return c;
}

absl::Status WriteGemma3(const ModelArchitecture& c, ConfigJsonWriter& w) {
  w.String("model_type", "gemma3_text");
  w.Int("hidden_size", c.width);
  w.Int("intermediate_size", c.Intermediate());
  w.Int("num_hidden_layers", c.layers);
  w.Int("num_attention_heads", c.heads);
  w.Int("num_key_value_heads", c.KvHeads());
  w.Int("head_dim", c.HeadDim());
  w.Int("vocab_size", c.vocab);
  w.Int("max_position_embeddings", c.max_positions > 0 ? c.max_positions : 131072);
  w.Double("rms_norm_eps", c.norm_eps);
  w.Int("sliding_window", c.sliding_window);
  w.LayerTypes("layer_types", c);
  return absl::OkStatus();
}

ModelArchitecture Gemma3(int64_t layers, int64_t width, int64_t heads, int64_t kv_heads,
                   int64_t head_dim, int64_t intermediate, int64_t vocab, int64_t window) {
  ModelArchitecture c;
  c.family = Family::kGemma3;
  c.layers = layers;
  c.width = width;
  c.heads = heads;
  c.kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.intermediate = intermediate;
  c.vocab = vocab;
  c.norm_eps = 1e-6;
  c.tie_embeddings = true;
  c.use_cache = true;
  c.sliding_window = window;
  c.layer_attention.assign(5, LayerAttention::kSliding);
  c.layer_attention.push_back(LayerAttention::kFull);
  return c;
}

std::vector<std::pair<std::string, ModelArchitecture>> Gemma3Presets() {
  // google/gemma-3-27b-pt's text_config: 62 layers of 5376, 32 heads of 128 over 16 kv
  // heads, intermediate 21504, vocabulary 262208, window 1024, 5 sliding : 1 full.
  // Small enough to verify in a test: 6 layers (one period), 4 heads of 16 over 2.
  return {{"gemma-3-27b", Gemma3(62, 5376, 32, 16, 128, 21504, 262208, 1024)},
          {"tiny-gemma3", Gemma3(6, 32, 4, 2, 16, 64, 96, 512)}};
}

}  // namespace

// Gemma3Family: Gemma 3's text model: a scaled embedding, sandwich (1 + w) RMSNorms,
// q/k norms, GeGLU-tanh, sliding-window and global layers with their own RoPE tables.
const FamilyDef& Gemma3Family() {
  static const FamilyDef kDef = {
      .id = Family::kGemma3,
      .name = "gemma3",
      .decoder = true,
      .rope = true,
      .layer_types = true,
      .lora = true,
      .graphs = BuildGemma3Graphs,
      .model_types = {"gemma3_text", "gemma3"},
      // Gemma3Config.attribute_map (configuration_gemma3.py:196-200); Gemma3TextConfig
      // has none.
      .config_aliases = {{"gemma3", "image_token_id", "image_token_index"},
                         {"gemma3", "boi_token_id", "boi_token_index"},
                         {"gemma3", "eoi_token_id", "eoi_token_index"}},
      .read = ReadGemma3,
      .write = WriteGemma3,
      .inert_config_keys =
          {{"query_pre_attn_scalar", "the attention's scaling, query_pre_attn_scalar ** "
                                     "-0.5: a number, no tensor"},
           {"_sliding_window_pattern", "what layer_types was derived from; layer_types "
                                       "is read"},
           {"vision_config", "the vision tower's: the text model is what is modelled"},
           {"mm_tokens_per_image", "the vision tower's image tokens (not modelled)"},
           {"boi_token_index", "a token id of the image inputs"},
           {"eoi_token_index", "a token id of the image inputs"},
           {"image_token_index", "a token id of the image inputs"}},
      .presets = Gemma3Presets(),
  };
  return kDef;
}

}  // namespace memledger
