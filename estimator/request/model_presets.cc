#include "estimator/request/model_presets.h"

#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "estimator/spec/checked_math.h"
#include "estimator/spec/config_json.h"
#include "estimator/graph/family.h"
#include "estimator/spec/input_file.h"
#include "rapidjson/document.h"
#include "rapidjson/error/en.h"
#include "rapidjson/prettywriter.h"
#include "rapidjson/stringbuffer.h"

namespace memledger {

// The families' presets and model types live in their definitions
// (estimator/families/<name>/); these functions ask every family in turn.

std::vector<std::string> PresetNames() {
  std::vector<std::string> names;
  for (const FamilyDef* family : Families()) {
    for (const auto& [name, config] : family->presets) names.push_back(name);
  }
  return names;
}

std::string ModelFlagHelp() {
  std::vector<std::string> types;
  for (const FamilyDef* family : Families()) {
    types.insert(types.end(), family->model_types.begin(), family->model_types.end());
  }
  return absl::StrCat(
      "The model: a built-in name (", absl::StrJoin(PresetNames(), ", "),
      ") or the path of a transformers config.json (model_type ", absl::StrJoin(types, ", "),
      "), of a multimodal checkpoint its text model (text_config). The size flags below "
      "override its sizes.");
}

absl::StatusOr<ModelConfig> ModelFromPreset(absl::string_view name) {
  for (const FamilyDef* family : Families()) {
    for (const auto& [preset, architecture] : family->presets) {
      if (preset == name) return ModelConfigOf(architecture);
    }
  }
  return absl::NotFoundError(absl::StrCat("no built-in model '", name, "' (known: ",
                                          absl::StrJoin(PresetNames(), ", "), ")"));
}

namespace {

// DuplicateKey: the first key an object of `value` holds twice, with its path
// ("text_config.hidden_size"); nullopt if none. CheckJsonNesting bounds the recursion.
std::optional<std::string> DuplicateKey(const rapidjson::Value& value, const std::string& path) {
  if (value.IsArray()) {
    for (const rapidjson::Value& item : value.GetArray()) {
      if (std::optional<std::string> found = DuplicateKey(item, path); found.has_value()) {
        return found;
      }
    }
    return std::nullopt;
  }
  if (!value.IsObject()) return std::nullopt;
  std::set<std::string_view> seen;
  for (const auto& member : value.GetObject()) {
    const std::string_view name(member.name.GetString(), member.name.GetStringLength());
    const std::string key = path.empty() ? std::string(name) : path + "." + std::string(name);
    if (!seen.insert(name).second) return key;
    if (std::optional<std::string> found = DuplicateKey(member.value, key); found.has_value()) {
      return found;
    }
  }
  return std::nullopt;
}

// ApplyConfigAliases gives each alias of `model_type`'s configuration class (ConfigAlias)
// its place: the value of the alias or of its key, whichever transformers keeps, under
// the key, and the alias dropped; `reader` names the alias in errors about the key.
void ApplyConfigAliases(const FamilyDef& family, absl::string_view model_type,
                        rapidjson::Document& doc, ConfigJsonReader& reader) {
  for (const ConfigAlias& a : family.config_aliases) {
    if (a.model_type != model_type || !doc.HasMember(a.alias.c_str())) continue;
    const bool key_given = doc.HasMember(a.key.c_str());
    if (!(key_given && a.alias_is_field)) {
      rapidjson::Value value(doc[a.alias.c_str()], doc.GetAllocator());
      if (key_given) {
        doc[a.key.c_str()] = value;
      } else {
        doc.AddMember(rapidjson::Value(a.key.c_str(), doc.GetAllocator()), value,
                      doc.GetAllocator());
      }
      reader.WrittenAs(a.key, a.alias);
    }
    doc.RemoveMember(a.alias.c_str());
  }
}

// AliasReason: why --config_keys does not count `key` of a config.json as read, where an
// alias decides: it lost to its alias, or (an alias) to its key; nullopt otherwise.
std::optional<std::string> AliasReason(const FamilyDef& family, absl::string_view model_type,
                                       const rapidjson::Value& doc, absl::string_view key) {
  for (const ConfigAlias& a : family.config_aliases) {
    if (a.model_type != model_type || !doc.HasMember(a.alias.c_str()) ||
        !doc.HasMember(a.key.c_str())) {
      continue;
    }
    if (key == a.key && !a.alias_is_field) {
      return absl::StrCat("its alias ", a.alias, " is given too and wins (set after it, "
                          "transformers' configuration_utils.py:500-507)");
    }
    if (key == a.alias && a.alias_is_field) {
      return absl::StrCat("an alias of ", a.key, ", which is given too and wins (the alias is "
                          "the class's field, set before the key)");
    }
  }
  return std::nullopt;
}

}  // namespace

// ReadHfConfig is ModelFromHfConfigJson, telling `consulted` (if given) which keys the
// reader consulted and `family_out` whose reader it was.
absl::StatusOr<ModelConfig> ReadHfConfig(absl::string_view json, absl::string_view source,
                                         std::set<std::string>* consulted,
                                         const FamilyDef** family_out,
                                         rapidjson::Document* parsed);

absl::StatusOr<ModelConfig> ModelFromHfConfigJson(absl::string_view json,
                                                  absl::string_view source) {
  rapidjson::Document doc;
  return ReadHfConfig(json, source, nullptr, nullptr, &doc);
}

namespace {

// kCommonInertKeys: what every transformers configuration (PretrainedConfig and its
// generation and tokenizer fields) holds that changes no training step's memory.
constexpr std::pair<const char*, const char*> kCommonInertKeys[] = {
    {"_name_or_path", "where the config came from"},
    {"architectures", "the model class's name; the model_type decides the graphs"},
    {"model_type", "read first: it chooses the family's reader"},
    {"transformers_version", "the writer's version"},
    {"dtype", "the checkpoint's storage dtype; --dtype and --amp decide the step's"},
    {"torch_dtype", "the checkpoint's storage dtype; --dtype and --amp decide the step's"},
    {"initializer_range", "initial values only"},
    {"id2label", "labels of a classification head, not the causal LM's"},
    {"label2id", "labels of a classification head, not the causal LM's"},
    {"problem_type", "a classification head's loss, not the causal LM's"},
    {"is_encoder_decoder", "false for every causal LM memledger reads"},
    {"chunk_size_feed_forward", "0 in these models' configs; no modeling file here reads it"},
    {"output_attentions", "returns attention weights (no graph here asks for them)"},
    {"output_hidden_states", "returns every layer's hidden states, which the step keeps anyway"},
    {"return_dict", "the output's container"},
    {"bos_token_id", "a token id"},
    {"eos_token_id", "a token id"},
    {"pad_token_id", "a token id (the embedding's padding_idx keeps every row)"},
    {"tokenizer_class", "the tokenizer"},
    {"auto_map", "remote-code class names"},
};

// InertReason: why `key` (its nested path stripped) changes no memory for `family`;
// nullptr where neither list has it.
const char* InertReason(const FamilyDef& family, absl::string_view key) {
  const size_t dot = key.rfind('.');
  const absl::string_view name = dot == absl::string_view::npos ? key : key.substr(dot + 1);
  for (const auto& [inert, why] : family.inert_config_keys) {
    if (inert == key || inert == name) return why.c_str();
  }
  for (const auto& [inert, why] : kCommonInertKeys) {
    if (name == inert) return why;
  }
  return nullptr;
}

}  // namespace

absl::StatusOr<std::string> ConfigKeysJson(absl::string_view json, absl::string_view source) {
  std::set<std::string> consulted;
  const FamilyDef* family = nullptr;
  rapidjson::Document doc;
  absl::StatusOr<ModelConfig> config = ReadHfConfig(json, source, &consulted, &family, &doc);
  if (!config.ok()) return config.status();
  std::vector<std::string> read, unknown;
  std::vector<std::pair<std::string, std::string>> not_read;
  const std::string model_type(doc["model_type"].GetString(),
                               doc["model_type"].GetStringLength());
  // An alias is read where its key is: the reader sees the key.
  std::map<std::string, std::string> key_of_alias;
  for (const ConfigAlias& a : family->config_aliases) {
    if (a.model_type == model_type) key_of_alias[a.alias] = a.key;
  }
  // The keys present: the top level's, and a nested object's the reader entered.
  auto visit = [&](auto& self, const rapidjson::Value& object, const std::string& prefix) -> void {
    for (const auto& member : object.GetObject()) {
      const std::string key = prefix + std::string(member.name.GetString(),
                                                   member.name.GetStringLength());
      const bool entered =
          member.value.IsObject() &&
          consulted.lower_bound(key + ".") != consulted.end() &&
          consulted.lower_bound(key + ".")->rfind(key + ".", 0) == 0;
      const auto alias = prefix.empty() ? key_of_alias.find(key) : key_of_alias.end();
      std::optional<std::string> overridden =
          prefix.empty() ? AliasReason(*family, model_type, doc, key) : std::nullopt;
      if (entered) {
        self(self, member.value, key + ".");
      } else if (overridden.has_value()) {
        not_read.emplace_back(key, *overridden);
      } else if (consulted.count(key) > 0 ||
                 (alias != key_of_alias.end() && consulted.count(alias->second) > 0)) {
        read.push_back(key);
      } else if (const char* why = InertReason(
                     *family, alias != key_of_alias.end() ? alias->second : key);
                 why != nullptr) {
        not_read.emplace_back(key, why);
      } else {
        unknown.push_back(key);
      }
    }
  };
  visit(visit, doc, "");
  rapidjson::StringBuffer buffer;
  rapidjson::PrettyWriter<rapidjson::StringBuffer> w(buffer);
  w.SetIndent(' ', 2);
  w.StartObject();
  w.Key("file");
  w.String(std::string(source).c_str());
  w.Key("family");
  w.String(std::string(family->name).c_str());
  w.Key("read");
  w.StartArray();
  for (const std::string& key : read) w.String(key.c_str());
  w.EndArray();
  w.Key("not_read");
  w.StartObject();
  for (const auto& [key, why] : not_read) {
    w.Key(key.c_str());
    w.String(why.c_str());
  }
  w.EndObject();
  w.Key("unknown");
  w.StartArray();
  for (const std::string& key : unknown) w.String(key.c_str());
  w.EndArray();
  // The configuration class's attribute_map: each alias and the key it sets.
  w.Key("aliases");
  w.StartObject();
  for (const auto& [alias, key] : key_of_alias) {
    w.Key(alias.c_str());
    w.String(key.c_str());
  }
  w.EndObject();
  w.EndObject();
  return std::string(buffer.GetString()) + "\n";
}

absl::StatusOr<ModelConfig> ReadHfConfig(absl::string_view json, absl::string_view source,
                                         std::set<std::string>* consulted,
                                         const FamilyDef** family_out,
                                         rapidjson::Document* parsed) {
  rapidjson::Document& doc = *parsed;
  if (absl::Status s = CheckJsonNesting(json); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", s.message()));
  }
  // Strings must be UTF-8 (a config.json is; transformers' json.load decodes it so).
  doc.Parse<rapidjson::kParseValidateEncodingFlag>(json.data(), json.size());
  if (doc.HasParseError()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": not JSON (", rapidjson::GetParseError_En(doc.GetParseError()),
                     " at offset ", doc.GetErrorOffset(), ")"));
  }
  if (!doc.IsObject()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));
  }
  // A key given twice: JSON leaves which one counts to the reader (Python's json keeps
  // the last, RapidJSON's FindMember finds the first), so neither is taken.
  if (std::optional<std::string> twice = DuplicateKey(doc, ""); twice.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": \"", *twice, "\" is given more than once"));
  }
  const ConfigJsonReader file_reader(doc, source);
  if (!doc.HasMember("model_type")) return file_reader.Error("model_type", "is missing");
  if (!doc["model_type"].IsString()) {
    return file_reader.Error("model_type", "must be a string");
  }
  // Its whole length: "llama\u0000x" is no model_type, not llama.
  const std::string model_type(doc["model_type"].GetString(),
                               doc["model_type"].GetStringLength());
  std::vector<std::string> known;
  for (const FamilyDef* family : Families()) {
    for (const std::string& type : family->model_types) {
      if (type != model_type) {
        known.push_back(type);
        continue;
      }
      // The reader reads the keys transformers' configuration class stores: an alias's
      // value under its key (the file itself stays as it is, for --config_keys).
      rapidjson::Document stored;
      stored.CopyFrom(doc, stored.GetAllocator());
      ConfigJsonReader reader(stored, source);
      ApplyConfigAliases(*family, model_type, stored, reader);
      absl::StatusOr<ModelArchitecture> config = family->read(reader, model_type);
      reader.Consult("model_type");
      if (consulted != nullptr) *consulted = reader.Consulted();
      if (family_out != nullptr) *family_out = family;
      if (!config.ok()) return config.status();
      // The embedding's bytes (fp32 parameter, gradient and two moments: 16 per weight)
      // must fit int64, or no bucket can be counted; say so here, naming the file's key
      // (the prediction's own overflow message knows no file).
      const CheckedInt64 embedding = CheckedInt64(config->vocab) * config->width * 16;
      if (embedding.overflowed()) {
        return reader.Error("vocab_size",
                            absl::StrCat(config->vocab, " x hidden size ", config->width,
                                         ": the embedding's bytes overflow int64"));
      }
      return ModelConfigOf(*config);
    }
  }
  return file_reader.Error("model_type",
                           absl::StrCat("'", model_type, "' is not supported (",
                                        absl::StrJoin(known, ", "), ")"));
}

absl::StatusOr<std::string> HfConfigJson(const ModelArchitecture& c) {
  const FamilyDef& family = FamilyOf(c.family);
  if (family.write == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("the ", family.name,
                                                   " is not a transformers model"));
  }
  rapidjson::StringBuffer buffer;
  rapidjson::PrettyWriter<rapidjson::StringBuffer> w(buffer);
  w.StartObject();
  ConfigJsonWriter writer(&w);
  if (absl::Status s = family.write(c, writer); !s.ok()) return s;
  writer.Bool("tie_word_embeddings", c.tie_embeddings);
  writer.Bool("use_cache", c.use_cache);
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
