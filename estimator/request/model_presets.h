// The models memledger knows by name, and the reader for a Hugging Face transformers
// config.json. No network: presets are the published configs' sizes, written here.
//
// Example:
//   absl::StatusOr<ModelConfig> config = ModelFromFlag("llama-3-8b");  // or a path
//   config->batch = 1;
//   config->seq = 8192;
#ifndef ESTIMATOR_REQUEST_MODEL_PRESETS_H_
#define ESTIMATOR_REQUEST_MODEL_PRESETS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "estimator/spec/config.h"

namespace memledger {

// PresetNames lists the built-in models, family by family in the registry's order
// (FamilyDef::presets; --help and docs/flags.md list them).
std::vector<std::string> PresetNames();

// ModelFlagHelp is --model's help: every preset and every config.json model_type the
// families read, from the registry.
std::string ModelFlagHelp();

// ModelFromPreset returns the named model with the study's batch and seq; NotFound for
// an unknown name.
absl::StatusOr<ModelConfig> ModelFromPreset(absl::string_view name);

// ModelFromHfConfigJson reads a transformers config.json's text with the reader of the
// first family that lists its model_type (FamilyDef::read, each family's own keys, which
// refuses a key it does not model). Errors are InvalidArgument, one line, naming
// `source` (the file) and the key.
absl::StatusOr<ModelConfig> ModelFromHfConfigJson(absl::string_view json,
                                                  absl::string_view source);

// ConfigKeysJson reports what the reader did with each key of a config.json's text (the
// top level's, and a nested config's it reads: "text_config.hidden_size"), as JSON:
// "read" (the keys it consulted), "not_read" (key: why it does not change memory, from
// the family's FamilyDef::inert_config_keys and the keys every transformers config has)
// and "unknown" (neither: a key the reader should read or refuse). The reader's own
// errors are returned as ModelFromHfConfigJson's.
absl::StatusOr<std::string> ConfigKeysJson(absl::string_view json, absl::string_view source);

// HfConfigJson is ModelFromHfConfigJson's inverse (FamilyDef::write): the transformers
// config.json of `architecture`, which the real-stack witness builds with
// AutoModelForCausalLM.from_config. InvalidArgument for a family that writes none (the
// study) and megatron-gpt, which are not transformers models.
absl::StatusOr<std::string> HfConfigJson(const ModelArchitecture& architecture);

// ModelFromFlag is --model: a preset name, or else the path of a config.json.
absl::StatusOr<ModelConfig> ModelFromFlag(absl::string_view value);

}  // namespace memledger

#endif  // ESTIMATOR_REQUEST_MODEL_PRESETS_H_
