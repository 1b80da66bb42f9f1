// The GPT-2 family: transformers' GPT2LMHeadModel (gelu_new, its dropouts), and with
// ModelConfig::megatron Megatron-LM's GPT block.
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

// GPT-2: wte(input_ids) + wpe(position_ids), position_ids = arange(T)[None].
BlockGraph BuildGpt2Prologue(const ModelConfig& config) {
  GraphBuilder g(config);
  int input_ids = g.Global(ModelTensor::kInputIds, DType::kInt64, {kB, kT});
  int position_ids = g.Global(ModelTensor::kPositionIds, DType::kInt64, {Sym(1), kT});
  int tokens = g.VocabEmbedding("wte", g.Param("wte.weight", {kV, kD}), input_ids);
  g.InputEmbeddings(tokens);  // GPT2Model.get_input_embeddings() is wte
  int positions =
      g.Op1(OpType::kEmbedding, "wpe", {g.Param("wpe.weight", {kP, kD}), position_ids});
  int embeddings = g.Op1(OpType::kAdd, "embeddings", {tokens, positions});
  // GPT2Model.forward's inputs_embeds and position_embeds live to its return
  // (modeling_gpt2.py:567-575); Megatron's embedding adds them inside its module.
  if (!config.megatron) g.HeldByDecoder({tokens, positions});
  if (config.shard.sp) {  // Megatron scatters the embeddings to the sequence-parallel region
    embeddings = g.Op1(OpType::kScatter, "embeddings.scatter", {embeddings},
                       {.shape = {kB, kTs, kD}});
  }
  return g.Finish(g.Dropout("embeddings.dropout", embeddings, config.dropout.embd));
}

// GPT2Block: fused c_attn split into q, k, v; GELU (tanh) MLP; with config.megatron,
// Megatron's dropouts on the attention probabilities and both residual branches. The
// attention width is H x d_head (= d; with tensor parallelism a rank's H / tp heads).
BlockGraph BuildGpt2Layer(const ModelConfig& config, AttentionMode mode) {
  GraphBuilder g(config);
  // The residual stream holds T tokens, or T / tp with sequence parallelism (kTs).
  int x = g.Input("x", {kB, kTs, kD});
  // GPT2Model calls each block with position_ids too (modeling_gpt2.py:606-615), which
  // checkpointed blocks hold (see BuildLlamaLayer); the embedding's node keeps them to
  // the backward's end anyway. Megatron's blocks are called without them.
  if (!config.megatron) g.Global(ModelTensor::kPositionIds, DType::kInt64, {Sym(1), kT});
  const SymDim attention_width = kH * kDHead;
  const int ln1 = g.LayerNorm("ln_1", x);
  int qkv = g.ColumnParallel("c_attn", ln1, kD, 3 * attention_width);
  // qkv.split(width, 2): three parts with one backward node.
  auto head = [&](const std::string& name, int index) {
    int part = g.Op1(OpType::kSlice, name, {qkv},
                     {.dim = 2, .start = index * attention_width, .length = attention_width,
                      .split_part = true});
    int split = g.Op1(OpType::kView, name + ".split_heads", {part}, {.shape = {kB, kT, kH, kDHead}});
    return g.Op1(OpType::kTranspose, name + ".transpose", {split}, {.dim = 1, .dim1 = 2});
  };
  int q = head("q", 0);
  int k = head("k", 1);
  int v = head("v", 2);
  if (config.KeepsKvCache()) {
    // key_states, value_states = curr_past_key_values.update(...) (modeling_gpt2.py).
    const DType keys = g.DTypeOf(k);
    k = g.KvCache("k_cache", k, keys);
    v = g.KvCache("v_cache", v, keys);
  }
  // With attention dropout the CPU's SDPA runs its math kernel (estimator/graph/sdpa_kernel.h).
  int attention = g.CausalAttention(mode, q, k, v);
  int transposed = g.Op1(OpType::kTranspose, "attention.transpose", {attention}, {.dim = 1, .dim1 = 2});
  int merged = g.Op1(OpType::kReshape, "attention.merge_heads",
                     {g.Op1(OpType::kContiguous, "attention.contiguous", {transposed})},
                     {.shape = {kB, kT, attention_width}});
  int attn_out = g.Dropout("attn.dropout",
                           g.RowParallel("attn.c_proj", merged, attention_width, kD),
                           config.dropout.resid);
  // GPT2Attention.forward's query_states, key_states and value_states, to its return
  // after resid_dropout (modeling_gpt2.py); views of c_attn's output.
  if (!config.megatron) g.HeldThroughHere({q, k, v});
  int x1 = g.Op1(OpType::kAdd, "residual1", {x, attn_out});
  // GPT2Block.forward's `attn_output` local, never rebound: to the block's return.
  if (!config.megatron) g.HeldToEnd(attn_out);
  // GPT2Block.forward's `hidden_states`, ln_1's output, until `hidden_states =
  // attn_output + residual` rebinds it; ln_2's likewise, through the MLP to its add.
  if (!config.megatron) g.HeldThroughHere({ln1});
  const int ln2 = g.LayerNorm("ln_2", x1);
  int fc = g.ColumnParallel("c_fc", ln2, kD, kF);
  // transformers' GPT-2 runs gelu_new, a chain of Python ops; Megatron's GPT one
  // gelu(approximate='tanh').
  int gelu = config.megatron ? g.Op1(OpType::kGelu, "gelu_tanh", {fc}, {}, OpKind::kGelu)
                             : g.NewGelu("gelu_new", fc);
  int mlp_out =
      g.Dropout("mlp.dropout", g.RowParallel("mlp.c_proj", gelu, kF, kD), config.dropout.resid);
  int x2 = g.Op1(OpType::kAdd, "residual2", {x1, mlp_out});
  if (!config.megatron) g.HeldThroughHere({ln2});
  return g.Finish(x2);
}

BlockGraph BuildGpt2Epilogue(const ModelConfig& config) {
  GraphBuilder g(config);
  int x = g.Input("x", {kB, kTs, kD});
  int input_ids = g.Global(ModelTensor::kInputIds, DType::kInt64, {kB, kT});
  int h = g.LayerNorm("ln_f", x);
  g.DecoderReturnsHere();
  g.HeldToEnd(h);  // GPT2LMHeadModel's `hidden_states` local, to its return
  int weight = g.TiedParam("wte.weight", {kV, kD});
  // With sequence parallelism the vocabulary-parallel head gathers its input too.
  int logits = config.shard.sp ? g.Op1(OpType::kGatherLinear, "lm_head", {h, weight},
                                 {.shape = {kB, kT, kV}}, OpKind::kMatmul)
                         : g.MatmulFolded("lm_head", h, weight, kD, kV);
  return g.Finish(g.CrossEntropy(logits, input_ids));
}


ModelArchitecture Gpt2(int64_t layers, int64_t width, int64_t heads, int64_t vocab,
                 int64_t positions) {
  ModelArchitecture c;
  c.family = Family::kGpt2;
  c.layers = layers;
  c.width = width;
  c.heads = heads;
  c.kv_heads = heads;
  c.head_dim = width / heads;
  c.intermediate = 4 * width;
  c.vocab = vocab;
  c.max_positions = positions;
  c.norm_eps = 1e-5;
  c.tie_embeddings = true;
  c.use_cache = true;  // GPT2Config's default
  return c;
}


absl::StatusOr<ModelArchitecture> ReadGpt2(const ConfigJsonReader& r, absl::string_view) {
  ModelArchitecture c;
  c.family = Family::kGpt2;
  MEMLEDGER_ASSIGN_OR_RETURN(c.width, r.Positive("n_embd"));
  MEMLEDGER_ASSIGN_OR_RETURN(c.layers, r.Positive("n_layer"));
  MEMLEDGER_ASSIGN_OR_RETURN(c.heads, r.Positive("n_head"));
  MEMLEDGER_ASSIGN_OR_RETURN(c.max_positions, r.Positive("n_positions"));
  MEMLEDGER_ASSIGN_OR_RETURN(c.vocab, r.Positive("vocab_size"));
  MEMLEDGER_ASSIGN_OR_RETURN(c.intermediate, r.Positive("n_inner", 4 * c.width));
  MEMLEDGER_ASSIGN_OR_RETURN(c.tie_embeddings, r.Bool("tie_word_embeddings", true));
  MEMLEDGER_ASSIGN_OR_RETURN(c.use_cache, r.Bool("use_cache", true));
  MEMLEDGER_ASSIGN_OR_RETURN(c.norm_eps, r.PositiveNumber("layer_norm_epsilon", 1e-5));
  for (auto [key, p] : {std::pair{"resid_pdrop", &c.dropout.resid},
                         std::pair{"embd_pdrop", &c.dropout.embd},
                         std::pair{"attn_pdrop", &c.dropout.attn}}) {
    *p = 0.1;  // GPT2Config's default
    if (r.Has(key)) MEMLEDGER_ASSIGN_OR_RETURN(*p, r.Probability(key));
  }
  // GPT2Config's keys that change the graphs (modeling_gpt2.py): another activation
  // (GPT2MLP's ACT2FN[activation_function]), cross-attention modules in every block,
  // and the eager attention's scaling and upcast choices. Only their defaults are
  // modelled.
  std::string activation;
  MEMLEDGER_ASSIGN_OR_RETURN(activation, r.String("activation_function", "gelu_new"));
  if (activation != "gelu_new") {
    return r.Error("activation_function", absl::StrCat("must be gelu_new, got ", activation));
  }
  for (const auto& [key, modelled] :
       {std::pair<const char*, bool>{"add_cross_attention", false},
        {"scale_attn_by_inverse_layer_idx", false},
        {"reorder_and_upcast_attn", false},
        {"scale_attn_weights", true}}) {
    bool value = modelled;
    MEMLEDGER_ASSIGN_OR_RETURN(value, r.Bool(key, modelled));
    if (value != modelled) {
      return r.Error(key, absl::StrCat(value ? "true" : "false", " is not modelled yet (use ",
                                       modelled ? "true" : "false", ")"));
    }
  }
  if (c.width % c.heads != 0) {
    return r.Error("n_embd", absl::StrCat(c.width, " is not divisible by n_head ", c.heads));
  }
  if (!c.tie_embeddings) {
    return r.Error("tie_word_embeddings", "false is not supported for gpt2 (its head is tied)");
  }
  c.kv_heads = c.heads;
  c.head_dim = c.width / c.heads;
  return c;
}


absl::Status WriteGpt2(const ModelArchitecture& c, ConfigJsonWriter& w) {
  if (c.megatron) return absl::InvalidArgumentError("megatron-gpt is not a transformers model");
  w.String("model_type", "gpt2");
  w.Int("n_embd", c.width);
  w.Int("n_layer", c.layers);
  w.Int("n_head", c.heads);
  w.Int("n_inner", c.Intermediate());
  w.Int("n_positions", c.max_positions);
  w.Int("vocab_size", c.vocab);
  w.Double("layer_norm_epsilon", c.norm_eps);
  for (auto [key, p] : {std::pair{"resid_pdrop", c.dropout.resid},
                         std::pair{"embd_pdrop", c.dropout.embd},
                         std::pair{"attn_pdrop", c.dropout.attn}}) {
    w.Double(key, p);
  }
  return absl::OkStatus();
}

std::vector<std::pair<std::string, ModelArchitecture>> Gpt2Presets() {
  ModelArchitecture gpt2 = Gpt2(12, 768, 12, 50257, 1024);
  gpt2.dropout = {.resid = 0.1, .embd = 0.1, .attn = 0.1};  // openai-community/gpt2's
  // Korthikanti et al.'s setup: a GPT block with Megatron's dropouts (sizes from the
  // flags; GPT-2's by default, vocabulary padded to 51200 so that --tp up to 64
  // divides it, 2048 learned positions).
  ModelArchitecture megatron = Gpt2(12, 768, 12, 51200, 2048);
  megatron.megatron = true;
  megatron.use_cache = false;  // Megatron-LM's GPT has no DynamicCache
  return {{"gpt2", gpt2}, {"tiny-gpt2", Gpt2(2, 32, 4, 96, 128)}, {"megatron-gpt", megatron}};
}

}  // namespace

// Gpt2Family: GPT-2: learned positions, LayerNorm, fused c_attn, gelu_new, tied head,
// cross-entropy.
const FamilyDef& Gpt2Family() {
  static const FamilyDef kDef = {
      .id = Family::kGpt2,
      .name = "gpt2",
      .decoder = true,
      .fused_qkv = true,
      .learned_positions = true,
      .megatron = true,
      .dropouts = true,
      .lora = true,  // transformers' model; not its Megatron rendition (--megatron)
      .lora_modules = "c_attn, c_proj (attn.c_proj and mlp.c_proj) and c_fc",
      .lora_default_targets = "c_attn",
      .lora_fan_in_fan_out = true,
      .graphs = [](const ModelConfig& config, AttentionMode mode) {
        ModelGraphs graphs;
        graphs.prologue = BuildGpt2Prologue(config);
        graphs.layer_kinds.push_back(BuildGpt2Layer(config, mode));
        graphs.epilogue = BuildGpt2Epilogue(config);
        // GPT2Model makes its position ids before the embeddings, which read them.
        graphs.tensors_before_prologue = DecoderModelTensors(config, {&*graphs.prologue});
        return graphs;
      },
      .model_types = {"gpt2"},
      // GPT2Config.attribute_map (models/gpt2/configuration_gpt2.py:71-76).
      .config_aliases = {{"gpt2", "hidden_size", "n_embd"},
                         {"gpt2", "max_position_embeddings", "n_positions"},
                         {"gpt2", "num_attention_heads", "n_head"},
                         {"gpt2", "num_hidden_layers", "n_layer"}},
      .read = ReadGpt2,
      .write = WriteGpt2,
      .inert_config_keys =
          {{"summary_type", "GPT2DoubleHeadsModel's multiple-choice head, not the LM's"},
           {"summary_use_proj", "GPT2DoubleHeadsModel's multiple-choice head, not the LM's"},
           {"summary_activation", "GPT2DoubleHeadsModel's multiple-choice head, not the LM's"},
           {"summary_proj_to_labels",
            "GPT2DoubleHeadsModel's multiple-choice head, not the LM's"},
           {"summary_first_dropout",
            "GPT2DoubleHeadsModel's multiple-choice head, not the LM's"}},
      .presets = Gpt2Presets(),
  };
  return kDef;
}

}  // namespace memledger
