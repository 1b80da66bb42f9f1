#include "estimator/model_presets.h"

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "estimator/input_file.h"
#include "rapidjson/document.h"
#include "rapidjson/prettywriter.h"
#include "rapidjson/stringbuffer.h"
#include "rapidjson/error/en.h"

namespace memledger {
namespace {

struct Preset {
  const char* name;
  ModelConfig config;
};

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

ModelConfig Gpt2(int64_t layers, int64_t width, int64_t heads, int64_t vocab,
                 int64_t positions) {
  ModelConfig c;
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

const std::vector<Preset>& Presets() {
  static const auto* const kPresets = [] {
    auto* presets = new std::vector<Preset>;
    presets->push_back({"study", ModelConfig()});
    // The published config.json sizes (max positions informational for RoPE models).
    ModelConfig gpt2 = Gpt2(12, 768, 12, 50257, 1024);
    gpt2.dropout = {.resid = 0.1, .embd = 0.1, .attn = 0.1};  // openai-community/gpt2's
    presets->push_back({"gpt2", gpt2});
    presets->push_back({"llama-2-7b", Llama(32, 4096, 32, 32, 11008, 32000, 1e-5)});
    presets->push_back({"llama-3-8b", Llama(32, 4096, 32, 8, 14336, 128256, 1e-5)});
    presets->push_back({"llama-3-70b", Llama(80, 8192, 64, 8, 28672, 128256, 1e-5)});
    presets->push_back({"mistral-7b", Llama(32, 4096, 32, 8, 14336, 32000, 1e-5)});
    ModelConfig qwen = Llama(28, 3584, 28, 4, 18944, 152064, 1e-6);
    qwen.qkv_bias = true;
    presets->push_back({"qwen2.5-7b", qwen});
    // Qwen/Qwen3-8B's config.json: head_dim 128, untied head, rms_norm_eps 1e-6.
    ModelConfig qwen3 = Llama(36, 4096, 32, 8, 12288, 151936, 1e-6);
    qwen3.head_dim = 128;
    qwen3.qk_norm = true;
    presets->push_back({"qwen3-8b", qwen3});
    // Small enough to verify in a test: grouped-query attention (4 heads, 2 kv heads).
    presets->push_back({"tiny-llama", Llama(2, 32, 4, 2, 64, 96, 1e-5)});
    presets->push_back({"tiny-gpt2", Gpt2(2, 32, 4, 96, 128)});
    // Qwen3 in small: q/k norms, and 4 heads of 16 = 64 wide on a 32-wide model.
    ModelConfig tiny_qwen3 = Llama(2, 32, 4, 2, 64, 96, 1e-6);
    tiny_qwen3.head_dim = 16;
    tiny_qwen3.qk_norm = true;
    presets->push_back({"tiny-qwen3", tiny_qwen3});
    // Korthikanti et al.'s setup: a GPT block with Megatron's dropouts (sizes from the
    // flags; GPT-2's by default, vocabulary padded to 51200 so that --tp up to 64
    // divides it, 2048 learned positions).
    ModelConfig megatron = Gpt2(12, 768, 12, 51200, 2048);
    megatron.megatron = true;
    megatron.use_cache = false;  // Megatron-LM's GPT has no DynamicCache
    presets->push_back({"megatron-gpt", megatron});
    return presets;
  }();
  return *kPresets;
}

// Reader reads typed keys of one config.json, naming the file and key in errors.
class Reader {
 public:
  Reader(const rapidjson::Document& doc, absl::string_view source)
      : doc_(doc), source_(source) {}

  absl::Status Error(absl::string_view key, absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": \"", key, "\" ", what));
  }

  // Positive reads a required (or, with a fallback, optional) integer >= 1.
  absl::StatusOr<int64_t> Positive(const char* key, std::optional<int64_t> fallback = {}) const {
    if (!doc_.HasMember(key) || doc_[key].IsNull()) {
      if (fallback.has_value()) return *fallback;
      return Error(key, "is missing");
    }
    const rapidjson::Value& value = doc_[key];
    if (!value.IsInt64()) return Error(key, "must be an integer");
    if (value.GetInt64() < 1) {
      return Error(key, absl::StrCat("must be >= 1, got ", value.GetInt64()));
    }
    return value.GetInt64();
  }

  absl::StatusOr<bool> Bool(const char* key, bool fallback) const {
    if (!doc_.HasMember(key)) return fallback;
    if (!doc_[key].IsBool()) return Error(key, "must be true or false");
    return doc_[key].GetBool();
  }

  absl::StatusOr<double> PositiveNumber(const char* key, double fallback) const {
    if (!doc_.HasMember(key)) return fallback;
    if (!doc_[key].IsNumber() || !(doc_[key].GetDouble() > 0)) {
      return Error(key, "must be a number > 0");
    }
    return doc_[key].GetDouble();
  }

  bool Has(const char* key) const { return doc_.HasMember(key) && !doc_[key].IsNull(); }

  // Probability reads a number in [0, 1).
  absl::StatusOr<double> Probability(const char* key) const {
    if (!doc_[key].IsNumber() || !(doc_[key].GetDouble() >= 0) || !(doc_[key].GetDouble() < 1)) {
      return Error(key, "must be a number in [0, 1)");
    }
    return doc_[key].GetDouble();
  }

  // AllFullAttention checks an optional `layer_types` list: one "full_attention" entry
  // per layer (sliding windows are not modelled for these families).
  absl::Status AllFullAttention(const char* key, int64_t layers) const {
    if (!Has(key)) return absl::OkStatus();
    const rapidjson::Value& types = doc_[key];
    if (!types.IsArray()) return Error(key, "must be a list of strings");
    if (types.Size() != static_cast<uint64_t>(layers)) {
      return Error(key, absl::StrCat("has ", types.Size(), " entries for ", layers, " layers"));
    }
    for (const rapidjson::Value& type : types.GetArray()) {
      if (!type.IsString()) return Error(key, "must be a list of strings");
      const absl::string_view name(type.GetString(), type.GetStringLength());
      if (name == "full_attention") continue;
      if (name == "sliding_attention") {
        return Error(key, "'sliding_attention' is not modelled yet for this model_type");
      }
      return Error(key, absl::StrCat("'", name, "' is not a layer type (full_attention, "
                                     "sliding_attention)"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> String(const char* key, const char* fallback) const {
    if (!doc_.HasMember(key)) return std::string(fallback);
    if (!doc_[key].IsString()) return Error(key, "must be a string");
    return std::string(doc_[key].GetString());
  }

 private:
  const rapidjson::Document& doc_;
  std::string source_;
};

#define MEMLEDGER_ASSIGN_OR_RETURN_(lhs, expr) \
  do {                                         \
    auto result_ = (expr);                     \
    if (!result_.ok()) return result_.status(); \
    lhs = *result_;                            \
  } while (0)

absl::StatusOr<ModelConfig> ReadLlama(const Reader& r, absl::string_view model_type) {
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
    if (absl::Status s = r.AllFullAttention("layer_types", c.layers); !s.ok()) return s;
  }
  return c;
}

absl::StatusOr<ModelConfig> ReadGpt2(const Reader& r) {
  ModelConfig c;
  c.family = Family::kGpt2;
  MEMLEDGER_ASSIGN_OR_RETURN_(c.width, r.Positive("n_embd"));
  MEMLEDGER_ASSIGN_OR_RETURN_(c.layers, r.Positive("n_layer"));
  MEMLEDGER_ASSIGN_OR_RETURN_(c.heads, r.Positive("n_head"));
  MEMLEDGER_ASSIGN_OR_RETURN_(c.max_positions, r.Positive("n_positions"));
  MEMLEDGER_ASSIGN_OR_RETURN_(c.vocab, r.Positive("vocab_size"));
  MEMLEDGER_ASSIGN_OR_RETURN_(c.intermediate, r.Positive("n_inner", 4 * c.width));
  MEMLEDGER_ASSIGN_OR_RETURN_(c.tie_embeddings, r.Bool("tie_word_embeddings", true));
  MEMLEDGER_ASSIGN_OR_RETURN_(c.use_cache, r.Bool("use_cache", true));
  MEMLEDGER_ASSIGN_OR_RETURN_(c.norm_eps, r.PositiveNumber("layer_norm_epsilon", 1e-5));
  for (auto [key, p] : {std::pair{"resid_pdrop", &c.dropout.resid},
                         std::pair{"embd_pdrop", &c.dropout.embd},
                         std::pair{"attn_pdrop", &c.dropout.attn}}) {
    *p = 0.1;  // GPT2Config's default
    if (r.Has(key)) MEMLEDGER_ASSIGN_OR_RETURN_(*p, r.Probability(key));
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

}  // namespace

std::vector<std::string> PresetNames() {
  std::vector<std::string> names;
  for (const Preset& preset : Presets()) names.push_back(preset.name);
  return names;
}

absl::StatusOr<ModelConfig> ModelFromPreset(absl::string_view name) {
  for (const Preset& preset : Presets()) {
    if (preset.name == name) return preset.config;
  }
  return absl::NotFoundError(absl::StrCat("no built-in model '", name, "' (known: ",
                                          absl::StrJoin(PresetNames(), ", "), ")"));
}

absl::StatusOr<ModelConfig> ModelFromHfConfigJson(absl::string_view json,
                                                  absl::string_view source) {
  rapidjson::Document doc;
  doc.Parse(json.data(), json.size());
  if (doc.HasParseError()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": not JSON (", rapidjson::GetParseError_En(doc.GetParseError()),
                     " at offset ", doc.GetErrorOffset(), ")"));
  }
  if (!doc.IsObject()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));
  }
  Reader reader(doc, source);
  if (!doc.HasMember("model_type")) return reader.Error("model_type", "is missing");
  if (!doc["model_type"].IsString()) return reader.Error("model_type", "must be a string");
  const std::string model_type = doc["model_type"].GetString();
  absl::StatusOr<ModelConfig> config;
  if (model_type == "llama" || model_type == "mistral" || model_type == "qwen2" ||
      model_type == "qwen3") {
    config = ReadLlama(reader, model_type);
  } else if (model_type == "gpt2") {
    config = ReadGpt2(reader);
  } else {
    return reader.Error("model_type", absl::StrCat("'", model_type,
                                                   "' is not supported (llama, mistral, "
                                                   "qwen2, qwen3, gpt2)"));
  }
  return config;
}

absl::StatusOr<std::string> HfConfigJson(const ModelConfig& c) {
  if (c.family == Family::kStudy || c.megatron) {
    return absl::InvalidArgumentError(absl::StrCat(
        c.megatron ? "megatron-gpt" : "the study", " is not a transformers model"));
  }
  rapidjson::StringBuffer buffer;
  rapidjson::PrettyWriter<rapidjson::StringBuffer> w(buffer);
  w.StartObject();
  auto integer = [&](const char* key, int64_t value) {
    w.Key(key);
    w.Int64(value);
  };
  if (c.family == Family::kGpt2) {
    w.Key("model_type");
    w.String("gpt2");
    integer("n_embd", c.width);
    integer("n_layer", c.layers);
    integer("n_head", c.heads);
    integer("n_inner", c.Intermediate());
    integer("n_positions", c.max_positions);
    integer("vocab_size", c.vocab);
    w.Key("layer_norm_epsilon");
    w.Double(c.norm_eps);
    for (auto [key, p] : {std::pair{"resid_pdrop", c.dropout.resid},
                           std::pair{"embd_pdrop", c.dropout.embd},
                           std::pair{"attn_pdrop", c.dropout.attn}}) {
      w.Key(key);
      w.Double(p);
    }
  } else {
    w.Key("model_type");
    // Qwen2 is the Llama family with q/k/v biases, Qwen3 with q/k norms.
    w.String(c.qk_norm ? "qwen3" : c.qkv_bias ? "qwen2" : "llama");
    integer("hidden_size", c.width);
    integer("intermediate_size", c.Intermediate());
    integer("num_hidden_layers", c.layers);
    integer("num_attention_heads", c.heads);
    integer("num_key_value_heads", c.KvHeads());
    integer("head_dim", c.HeadDim());
    integer("vocab_size", c.vocab);
    integer("max_position_embeddings", c.max_positions > 0 ? c.max_positions : 2048);
    w.Key("rms_norm_eps");
    w.Double(c.norm_eps);
    if (c.qk_norm && c.qkv_bias) {
      return absl::InvalidArgumentError(
          "q/k/v biases with q/k norms is no transformers model_type");
    }
    if (c.qkv_bias || c.qk_norm) {
      w.Key("use_sliding_window");
      w.Bool(false);
    }
  }
  w.Key("tie_word_embeddings");
  w.Bool(c.tie_embeddings);
  w.Key("use_cache");
  w.Bool(c.use_cache);
  w.EndObject();
  return std::string(buffer.GetString());
}

absl::StatusOr<ModelConfig> ModelFromFlag(absl::string_view value) {
  absl::StatusOr<ModelConfig> preset = ModelFromPreset(value);
  if (preset.ok()) return preset;
  absl::StatusOr<std::string> text = ReadInputFile(std::string(value), "--model", kMaxJsonBytes);
  if (absl::IsNotFound(text.status())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--model: '", value, "' is neither a built-in model (",
        absl::StrJoin(PresetNames(), ", "), ") nor a readable config.json"));
  }
  if (!text.ok()) return text.status();
  return ModelFromHfConfigJson(*text, value);
}

}  // namespace memledger
