// Reading and writing a transformers config.json, for the families' definitions
// (estimator/families/<name>/): ConfigJsonReader reads typed keys and names the file and
// the key in each error; ConfigJsonWriter writes keys in order.
#ifndef ESTIMATOR_SPEC_CONFIG_JSON_H_
#define ESTIMATOR_SPEC_CONFIG_JSON_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/strings/string_view.h"
#include "estimator/spec/config.h"
#include "estimator/spec/status_macros.h"
#include "rapidjson/document.h"
#include "rapidjson/prettywriter.h"
#include "rapidjson/stringbuffer.h"

namespace memledger {

class ConfigJsonReader {
 public:
  // doc: the config.json's object, or one nested in it (Nested).
  ConfigJsonReader(const rapidjson::Value& doc, absl::string_view source)
      : doc_(doc),
        source_(source),
        consulted_(std::make_shared<std::set<std::string>>()),
        written_as_(std::make_shared<std::map<std::string, std::string>>()) {}

  // WrittenAs: the file gave `key`'s value under `alias` (a transformers attribute_map
  // alias, FamilyDef::config_aliases): errors about `key` name the alias the file holds.
  void WrittenAs(const std::string& key, const std::string& alias) {
    (*written_as_)[key] = alias;
  }

  // Consulted: every key a read has looked at so far, this reader's and its nested
  // readers' ("text_config.hidden_size"), present in the file or not: what --config_keys
  // reports as read.
  const std::set<std::string>& Consulted() const { return *consulted_; }
  // Consult marks `key` as read without a typed read (model_type, a key the reader
  // inspects itself).
  void Consult(absl::string_view key) const { consulted_->insert(absl::StrCat(prefix_, key)); }

  // Nested reads the object under `key` (a multimodal config's text_config): its errors
  // name the key path ("text_config.hidden_size").
  absl::StatusOr<ConfigJsonReader> Nested(const char* key) const {
    if (!Has(key)) return Error(key, "is missing");
    if (!doc_[key].IsObject()) return Error(key, "must be an object");
    ConfigJsonReader nested(doc_[key], source_);
    nested.prefix_ = absl::StrCat(prefix_, key, ".");
    nested.consulted_ = consulted_;
    nested.written_as_ = written_as_;
    return nested;
  }

  // Error: "<source>: "<key>" <what>", or "<source>: "<alias>" (an alias of <key>)
  // <what>" where the file gave the key's value under an alias (WrittenAs).
  absl::Status Error(absl::string_view key, absl::string_view what) const {
    const std::string path = absl::StrCat(prefix_, key);
    if (auto alias = written_as_->find(path); alias != written_as_->end()) {
      return absl::InvalidArgumentError(absl::StrCat(source_, ": \"", alias->second,
                                                     "\" (an alias of ", path, ") ", what));
    }
    return absl::InvalidArgumentError(absl::StrCat(source_, ": \"", path, "\" ", what));
  }

  // Positive reads a required (or, with a fallback, optional) integer >= 1.
  absl::StatusOr<int64_t> Positive(const char* key, std::optional<int64_t> fallback = {}) const {
    Consult(key);
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
    Consult(key);
    if (!doc_.HasMember(key)) return fallback;
    if (!doc_[key].IsBool()) return Error(key, "must be true or false");
    return doc_[key].GetBool();
  }

  absl::StatusOr<double> PositiveNumber(const char* key, double fallback) const {
    Consult(key);
    if (!doc_.HasMember(key)) return fallback;
    if (!doc_[key].IsNumber() || !(doc_[key].GetDouble() > 0)) {
      return Error(key, "must be a number > 0");
    }
    return doc_[key].GetDouble();
  }

  bool Has(const char* key) const {
    Consult(key);
    return doc_.HasMember(key) && !doc_[key].IsNull();
  }

  // Probability reads a number in [0, 1).
  absl::StatusOr<double> Probability(const char* key) const {
    Consult(key);
    if (!doc_[key].IsNumber() || !(doc_[key].GetDouble() >= 0) || !(doc_[key].GetDouble() < 1)) {
      return Error(key, "must be a number in [0, 1)");
    }
    return doc_[key].GetDouble();
  }

  absl::StatusOr<std::string> String(const char* key, const char* fallback) const {
    Consult(key);
    if (!doc_.HasMember(key)) return std::string(fallback);
    if (!doc_[key].IsString()) return Error(key, "must be a string");
    // Its whole length: "silu\u0000gelu" is not silu.
    return std::string(doc_[key].GetString(), doc_[key].GetStringLength());
  }

  // LayerTypes reads an optional `layer_types` list: one "full_attention" or
  // "sliding_attention" per layer; empty when the key is absent.
  absl::StatusOr<std::vector<LayerAttention>> LayerTypes(const char* key, int64_t layers) const {
    std::vector<LayerAttention> out;
    if (!Has(key)) return out;
    const rapidjson::Value& types = doc_[key];
    if (!types.IsArray()) return Error(key, "must be a list of strings");
    if (types.Size() != static_cast<uint64_t>(layers)) {
      return Error(key, absl::StrCat("has ", types.Size(), " entries for ", layers, " layers"));
    }
    for (const rapidjson::Value& type : types.GetArray()) {
      if (!type.IsString()) return Error(key, "must be a list of strings");
      const absl::string_view name(type.GetString(), type.GetStringLength());
      if (name == "full_attention") {
        out.push_back(LayerAttention::kFull);
      } else if (name == "sliding_attention") {
        out.push_back(LayerAttention::kSliding);
      } else {
        return Error(key, absl::StrCat("'", name, "' is not a layer type (full_attention, "
                                       "sliding_attention)"));
      }
    }
    return out;
  }

  // LayerIndices reads an optional list of distinct layer indices in [0, layers)
  // (Qwen3-MoE's mlp_only_layers); empty when the key is absent or null.
  absl::StatusOr<std::vector<int64_t>> LayerIndices(const char* key, int64_t layers) const {
    std::vector<int64_t> out;
    if (!Has(key)) return out;
    const rapidjson::Value& list = doc_[key];
    if (!list.IsArray()) return Error(key, "must be a list of layer indices");
    for (const rapidjson::Value& index : list.GetArray()) {
      if (!index.IsInt64() || index.GetInt64() < 0 || index.GetInt64() >= layers) {
        return Error(key, absl::StrCat("must list layer indices in [0, ", layers, ")"));
      }
      out.push_back(index.GetInt64());
    }
    return out;
  }

  // RefuseRecomputedRope reads transformers 5's rope_parameters (or the older
  // rope_scaling), one object or one per layer type, as modeling_rope_utils.py builds
  // them:
  // - the type must be one ROPE_INIT_FUNCTIONS knows (modeling_rope_utils.py:669-676),
  //   spelled as it is (the lookup is case-sensitive): another only warns when the
  //   config is read, then the model's rotary embedding raises a KeyError;
  // - "dynamic" and "longrope" recompute inv_freq in every forward
  //   (dynamic_rope_update), which is not modelled;
  // - the others (default, linear, llama3, yarn, proportional) change no tensor's size:
  //   the tables stay (T, d_head), their numbers only the values. Those numbers must be
  //   numbers (a yarn factor "x" raises a TypeError when the model is built), and linear,
  //   yarn and llama3 need a factor (a KeyError when the config is read, :1153);
  // - partial_rotary_factor < 1 shortens a non-default type's inv_freq, and the
  //   model's apply_rotary_pos_emb then fails on the head's size: refused; the default
  //   type never reads it (LlamaRotaryEmbedding.compute_default_rope_parameters). A
  //   top-level partial_rotary_factor (the older spelling) is each rope object's where
  //   it has none (convert_rope_params_to_dict's setdefault, modeling_rope_utils.py:786).
  absl::Status RefuseRecomputedRope() const {
    // The top-level partial_rotary_factor, checked here whether or not a rope object
    // takes it.
    const bool top_partial = Has("partial_rotary_factor");
    if (top_partial && !(doc_["partial_rotary_factor"].IsNumber() &&
                         doc_["partial_rotary_factor"].GetDouble() > 0 &&
                         doc_["partial_rotary_factor"].GetDouble() <= 1)) {
      return Error("partial_rotary_factor", "must be a number in (0, 1]");
    }
    auto check = [this, top_partial](const ConfigJsonReader& rope) -> absl::Status {
      std::string rope_type = "default";
      for (const char* field : {"type", "rope_type"}) {  // rope_type wins (standardize)
        if (!rope.Has(field)) continue;
        MEMLEDGER_ASSIGN_OR_RETURN(rope_type, rope.String(field, "default"));
        if (rope_type == "dynamic" || rope_type == "longrope") {
          return rope.Error(field, absl::StrCat("'", rope_type, "' is not modelled yet (its ",
                                                "inv_freq is recomputed in every forward)"));
        }
        bool known = false;
        for (const char* type : {"default", "linear", "yarn", "llama3", "proportional"}) {
          known = known || rope_type == type;
        }
        if (!known) {
          return rope.Error(field, absl::StrCat(
              "'", rope_type, "' is not a RoPE type transformers builds (default, linear, ",
              "dynamic, yarn, longrope, llama3, proportional; modeling_rope_utils.py)"));
        }
      }
      for (const char* number : {"rope_theta", "factor", "original_max_position_embeddings",
                                 "low_freq_factor", "high_freq_factor", "beta_fast",
                                 "beta_slow", "attention_factor", "mscale", "mscale_all_dim",
                                 "partial_rotary_factor"}) {
        if (rope.Has(number) && !rope.doc_[number].IsNumber()) {
          return rope.Error(number, "must be a number");
        }
      }
      rope.Consult("truncate");  // yarn's, the tables' values only
      if ((rope_type == "linear" || rope_type == "yarn" || rope_type == "llama3") &&
          !rope.Has("factor")) {
        return rope.Error("factor", absl::StrCat("is missing (rope_type '", rope_type,
                                                 "' needs it)"));
      }
      const ConfigJsonReader* partial_from = rope.Has("partial_rotary_factor") ? &rope
                                             : top_partial                      ? this
                                                                                : nullptr;
      if (partial_from != nullptr) {
        const double partial = partial_from->doc_["partial_rotary_factor"].GetDouble();
        if (!(partial > 0 && partial <= 1)) {
          return rope.Error("partial_rotary_factor", "must be a number in (0, 1]");
        }
        if (partial < 1 && rope_type != "default" && rope_type != "proportional") {
          return partial_from->Error("partial_rotary_factor",
                            absl::StrCat("< 1 with rope_type '", rope_type, "' shortens "
                                         "inv_freq, which the model's RoPE then cannot apply "
                                         "to its heads (use 1.0)"));
        }
      }
      return absl::OkStatus();
    };
    for (const char* key : {"rope_scaling", "rope_parameters"}) {
      if (!Has(key)) continue;
      absl::StatusOr<ConfigJsonReader> rope = Nested(key);
      if (!rope.ok()) return rope.status();
      if (absl::Status s = check(*rope); !s.ok()) return s;
      for (const char* type : {"full_attention", "sliding_attention"}) {
        if (!rope->Has(type)) continue;
        absl::StatusOr<ConfigJsonReader> per_type = rope->Nested(type);
        if (!per_type.ok()) return per_type.status();
        if (absl::Status s = check(*per_type); !s.ok()) return s;
      }
    }
    return absl::OkStatus();
  }

 private:
  const rapidjson::Value& doc_;
  std::string source_;
  std::string prefix_;  // the key path to a nested object, "text_config."
  std::shared_ptr<std::set<std::string>> consulted_;  // shared with the nested readers
  // written_as_: key path -> the alias the file gave its value under (WrittenAs).
  std::shared_ptr<std::map<std::string, std::string>> written_as_;
};

class ConfigJsonWriter {
 public:
  explicit ConfigJsonWriter(rapidjson::PrettyWriter<rapidjson::StringBuffer>* w) : w_(w) {}
  void Int(const char* key, int64_t value) {
    w_->Key(key);
    w_->Int64(value);
  }
  void Double(const char* key, double value) {
    w_->Key(key);
    w_->Double(value);
  }
  void Bool(const char* key, bool value) {
    w_->Key(key);
    w_->Bool(value);
  }
  void String(const char* key, const char* value) {
    w_->Key(key);
    w_->String(value);
  }
  void Ints(const char* key, const std::vector<int64_t>& values) {
    w_->Key(key);
    w_->StartArray();
    for (int64_t value : values) w_->Int64(value);
    w_->EndArray();
  }
  void Strings(const char* key, const std::vector<std::string>& values) {
    w_->Key(key);
    w_->StartArray();
    for (const std::string& value : values) w_->String(value.c_str());
    w_->EndArray();
  }
  // LayerTypes writes ConfigJsonReader::LayerTypes' list for `architecture`'s layers.
  void LayerTypes(const char* key, const ModelArchitecture& architecture) {
    std::vector<std::string> types;
    for (int64_t i = 0; i < architecture.layers; ++i) {
      types.push_back(architecture.AttentionOf(i) == LayerAttention::kSliding ? "sliding_attention"
                                                                         : "full_attention");
    }
    Strings(key, types);
  }

 private:
  rapidjson::PrettyWriter<rapidjson::StringBuffer>* w_;
};

}  // namespace memledger

#endif  // ESTIMATOR_SPEC_CONFIG_JSON_H_
