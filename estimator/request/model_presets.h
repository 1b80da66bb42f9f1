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

// PresetNames lists the built-in models, family by family (FamilyDef::presets): study,
// llama-2-7b, llama-3-8b, llama-3-70b, mistral-7b, qwen2.5-7b, qwen3-8b, tiny-llama,
// tiny-qwen3, gpt2, tiny-gpt2, megatron-gpt.
std::vector<std::string> PresetNames();

// ModelFromPreset returns the named model with the study's batch and seq; NotFound for
// an unknown name.
absl::StatusOr<ModelConfig> ModelFromPreset(absl::string_view name);

// ModelFromHfConfigJson reads a transformers config.json's text: model_type llama,
// mistral, qwen2 or qwen3 (hidden_size, intermediate_size, num_hidden_layers,
// num_attention_heads, optional num_key_value_heads, head_dim, vocab_size,
// tie_word_embeddings, rms_norm_eps, max_position_embeddings, hidden_act; for qwen3
// head_dim defaults to 128 and use_sliding_window and layer_types must leave every
// layer full attention) or gpt2
// (n_embd, n_layer, n_head, n_positions, vocab_size, optional n_inner,
// layer_norm_epsilon, tie_word_embeddings, and resid_pdrop, embd_pdrop, attn_pdrop into
// ModelConfig::dropout, 0.1 each when missing, as GPT2Config), and for both use_cache
// (true when missing). Errors are
// InvalidArgument, one line, naming
// `source` (the file) and the key.
absl::StatusOr<ModelConfig> ModelFromHfConfigJson(absl::string_view json,
                                                  absl::string_view source);

// HfConfigJson is ModelFromHfConfigJson's inverse for the decoder families: the
// transformers config.json of `config` (model_type llama, qwen2 with q/k/v biases, qwen3
// with q/k norms;
// gpt2 with its dropouts at config.dropout), which the real-stack
// witness builds with AutoModelForCausalLM.from_config. InvalidArgument for the study
// and megatron-gpt, which are not transformers models.
absl::StatusOr<std::string> HfConfigJson(const ModelConfig& config);

// ModelFromFlag is --model: a preset name, or else the path of a config.json.
absl::StatusOr<ModelConfig> ModelFromFlag(absl::string_view value);

}  // namespace memledger

#endif  // ESTIMATOR_REQUEST_MODEL_PRESETS_H_
