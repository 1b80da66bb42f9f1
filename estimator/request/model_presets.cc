#include "estimator/request/model_presets.h"

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
    for (const auto& [preset, config] : family->presets) {
      if (preset == name) return config;
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

}  // namespace

absl::StatusOr<ModelConfig> ModelFromHfConfigJson(absl::string_view json,
                                                  absl::string_view source) {
  if (absl::Status s = CheckJsonNesting(json); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", s.message()));
  }
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
  // A key given twice: JSON leaves which one counts to the reader (Python's json keeps
  // the last, RapidJSON's FindMember finds the first), so neither is taken.
  if (std::optional<std::string> twice = DuplicateKey(doc, ""); twice.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": \"", *twice, "\" is given more than once"));
  }
  ConfigJsonReader reader(doc, source);
  if (!doc.HasMember("model_type")) return reader.Error("model_type", "is missing");
  if (!doc["model_type"].IsString()) return reader.Error("model_type", "must be a string");
  const std::string model_type = doc["model_type"].GetString();
  std::vector<std::string> known;
  for (const FamilyDef* family : Families()) {
    for (const std::string& type : family->model_types) {
      if (type != model_type) {
        known.push_back(type);
        continue;
      }
      absl::StatusOr<ModelConfig> config = family->read(reader, model_type);
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
      return config;
    }
  }
  return reader.Error("model_type", absl::StrCat("'", model_type, "' is not supported (",
                                                 absl::StrJoin(known, ", "), ")"));
}

absl::StatusOr<std::string> HfConfigJson(const ModelConfig& c) {
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
