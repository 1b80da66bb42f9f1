// A model family in one definition (estimator/families/<name>/): its graphs and the
// capabilities that set it apart, which the shared code asks instead of naming
// families; and the validation every entry point runs, which asks them.
//
// Example:
//   const FamilyDef& family = FamilyOf(config.family);
//   if (family.decoder) ...  // token ids in, cross-entropy out
#ifndef ESTIMATOR_GRAPH_FAMILY_H_
#define ESTIMATOR_GRAPH_FAMILY_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "estimator/graph/block_graph.h"
#include "estimator/spec/config.h"

namespace memledger {

class ConfigJsonReader;  // estimator/spec/config_json.h
class ConfigJsonWriter;

// ConfigAlias is one entry of a transformers configuration class's attribute_map: a
// config.json key (`alias`) that PreTrainedConfig.__setattr__ stores under another
// (`key`) (transformers/configuration_utils.py:653-656). When a config.json gives both,
// the one that is not a dataclass field of the class wins: fields are set first in
// __init__ (configuration_utils.py:157-165), the other keys after, in __post_init__
// (500-507), overwriting. For most classes the field is `key`, so the alias wins;
// `alias_is_field` marks a class whose field is the alias (Qwen3MoeConfig's
// num_experts), where `key` wins.
struct ConfigAlias {
  std::string model_type;
  std::string alias;
  std::string key;
  bool alias_is_field = false;
};

struct FamilyDef {
  Family id = Family{};  // set by the family's folder
  absl::string_view name;  // "study", "llama", "gpt2"
  // decoder: a causal LM from token ids to cross-entropy (embedding, layers, final norm,
  // LM head), as transformers builds it, with a vocabulary and tensor parallelism; the
  // study's stack takes its hidden states as input and ends in x.pow(2).mean().
  bool decoder = false;
  // fused_qkv: one projection of width d split into the heads: head_dim = width / heads
  // and kv_heads = heads.
  bool fused_qkv = false;
  // rope: rotary tables made once per forward for every layer (an even head_dim).
  bool rope = false;
  // learned_positions: a position embedding of max_positions rows (seq <= it).
  bool learned_positions = false;
  bool qk_norm = false;   // may have Qwen3's q/k norms (ModelConfig::qk_norm)
  // projection_biases: o_proj and the MLP may have biases (ModelConfig::o_bias, mlp_bias).
  bool projection_biases = false;
  // layer_types: its layers' attention spans differ (ModelConfig::layer_attention).
  bool layer_types = false;
  bool megatron = false;  // has Megatron-LM's rendition (ModelConfig::megatron)
  // dropouts: transformers' dropout probabilities are modelled (ModelConfig::dropout).
  bool dropouts = false;
  // lora: its projections are nn.Linear modules (GraphBuilder::NnLinear) or GPT-2's
  // Conv1D (GraphBuilder::Conv1D), which peft's LoRA adapts (ModelConfig::lora);
  // lora_modules names them for --lora_targets' errors.
  bool lora = false;
  const char* lora_modules =
      "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj and down_proj";
  // lora_default_targets: peft's target_modules when none are given
  // (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, peft/utils/constants.py);
  // nullptr where peft has none and asks for them.
  const char* lora_default_targets = "q_proj,v_proj";
  // lora_fan_in_fan_out: the adapted layers are GPT-2's Conv1D, weight (in, out), which
  // peft wraps with fan_in_fan_out (tuners/lora/layer.py, dispatch_default).
  bool lora_fan_in_fan_out = false;
  // graphs builds the family's segments (estimator/graph/graph_builder.h).
  ModelGraphs (*graphs)(const ModelConfig& config, AttentionMode mode) = nullptr;
  // validate: the family's own checks after ValidateConfig's (what it does not model
  // yet, one line each); nullptr for none.
  absl::Status (*validate)(const ModelConfig& config) = nullptr;
  // model_types: the transformers config.json model_type values it reads, with `read`
  // (errors name the file and the key); `write` is HfConfigJson's body for it (after the
  // model_type, before tie_word_embeddings and use_cache), nullptr for a model that is
  // not transformers'.
  std::vector<std::string> model_types = {};
  // config_aliases: the attribute_map of each of its model_types' configuration classes
  // (tests/config_keys_test.py checks them against transformers' own). `read` sees the
  // key each alias sets, never the alias.
  std::vector<ConfigAlias> config_aliases = {};
  absl::StatusOr<ModelArchitecture> (*read)(const ConfigJsonReader& r,
                                            absl::string_view model_type) = nullptr;
  absl::Status (*write)(const ModelArchitecture& architecture, ConfigJsonWriter& w) = nullptr;
  // inert_config_keys: the keys of its transformers configuration classes that `read`
  // does not read because they change no memory, each with why (--config_keys reports
  // them; tests/config_keys_test.py walks the classes' attributes against them).
  std::vector<std::pair<std::string, std::string>> inert_config_keys = {};
  // expected_parameters: the parameter count in closed form where the family has one
  // (the study's layers (12 d^2 + 13 d)), which the graphs and the runtime's model must
  // agree with; nullopt where it overflows int64; nullptr for none.
  std::optional<int64_t> (*expected_parameters)(const ModelConfig& config) = nullptr;
  // presets: its built-in models (--model=NAME), the architectures alone (a run takes
  // the study's batch and seq unless told otherwise).
  std::vector<std::pair<std::string, ModelArchitecture>> presets = {};
};

const FamilyDef& FamilyOf(Family family);
// Families: every family, in Family's order.
const std::vector<const FamilyDef*>& Families();
absl::string_view FamilyName(Family family);  // FamilyOf(family).name
// FamilyNames: the names of the families with `capability`, in the registry's order,
// the last after `conjunction`: "llama, gpt2 or gemma3" (for messages and help, which
// name no family themselves).
std::string FamilyNames(bool FamilyDef::*capability, absl::string_view conjunction = "or");
// PresetNamesWith: the built-in models (FamilyDef::presets) whose config `has` it, joined
// as FamilyNames joins: "megatron-gpt".
std::string PresetNamesWith(bool (*has)(const ModelArchitecture& architecture),
                            absl::string_view conjunction = "or");
// MixtureOfExpertsModels: the models a flag for experts applies to, from the registry:
// "qwen3-30b-a3b, mixtral-8x7b, tiny-qwen3-moe or a config.json with experts".
std::string MixtureOfExpertsModels();

// ValidateConfig returns InvalidArgument naming the offending flag, e.g.
// "--width 130 is not divisible by --heads 4" or "--heads 32 is not divisible by
// --kv_heads 5". Every entry point (predict, runtime, verify) calls it.
absl::Status ValidateConfig(const ModelConfig& config);
// ValidateConfigCalls: how many times ValidateConfig has run in this process, for the
// test that a prediction validates its config once.
int64_t ValidateConfigCalls();

// ValidConfig is a ModelConfig that ValidateConfig accepted: what an entry point (a
// prediction, a step simulator) hands the walks, plans and simulations under it, which
// take it without checking it again. Only Of and ValidateRun make one; a change that no
// check can refuse keeps the proof (WithoutCache).
//
// Example:
//   absl::StatusOr<ValidConfig> valid = ValidateRun(config, attention, variants);
//   if (!valid.ok()) return valid.status();
//   absl::StatusOr<BlockWalk> walk = WalkBlock(graph, *valid, options);
class ValidConfig {
 public:
  // Of: `config` if ValidateConfig accepts it, else ValidateConfig's error.
  static absl::StatusOr<ValidConfig> Of(const ModelConfig& config);
  const ModelConfig& config() const { return config_; }
  const ModelConfig& operator*() const { return config_; }
  const ModelConfig* operator->() const { return &config_; }
  // WithoutCache: the same model without transformers' DynamicCache (use_cache off, as
  // a checkpointed variant and a rank run it).
  ValidConfig WithoutCache() const {
    ValidConfig without = *this;
    without.config_.use_cache = false;
    return without;
  }
  // ForExpertRank: the same model as one expert-parallel rank of its layout sees it.
  // REQUIRES: 0 <= group < RoutedGroups() and 0 <= rank < shard.ep (ValidateConfig's range).
  ValidConfig ForExpertRank(int64_t group, int64_t rank) const {
    ValidConfig on_rank = *this;
    on_rank.config_.shard.ep_group = group;
    on_rank.config_.shard.ep_rank = rank;
    return on_rank;
  }
  // AsOneProcess: the whole model in one process: every expert, on expert-parallel rank
  // 0's routing (its rows route a whole batch, as one process's do).
  ValidConfig AsOneProcess() const {
    ValidConfig whole = *this;
    MoeSpec& moe = whole.config_.moe;
    if (config_.shard.ep > 1 && moe.routing == RoutingSource::kGiven) {
      moe.routing_rows.resize(static_cast<size_t>(config_.SparseLayers()));
    }
    whole.config_.shard.ep = 1;
    whole.config_.shard.ep_group = 0;
    whole.config_.shard.ep_rank = 0;
    return whole;
  }
  // InParameterDType: the same model with its parameters in `dtype` (FSDP2's
  // MixedPrecisionPolicy's param_dtype). REQUIRES: fp32, bf16 or fp16 and no autocast
  // (ValidateParallel's rule for the policy).
  ValidConfig InParameterDType(DType dtype) const {
    ValidConfig in_dtype = *this;
    in_dtype.config_.dtype = dtype;
    return in_dtype;
  }

 private:
  explicit ValidConfig(const ModelConfig& config) : config_(config) {}
  ModelConfig config_;
};

// ValidatePolicy rejects op kinds the model's layers do not have, which its graph says:
// "attention" names the flash op, which math mode has not; RMSNorm is plain ops (no
// layer_norm), Llama's activation is silu and transformers' GPT-2's gelu_new plain ops
// (no gelu; megatron-gpt has one). REQUIRES: ValidateConfig(config).ok().
absl::Status ValidatePolicy(const SavePolicy& policy, AttentionMode mode,
                            const ModelConfig& config);

// ValidateRun is the one validation path for a run, shared by predict, the runtime and
// verify: the config, a non-empty list of distinct variants, every_k's k >= 1, each
// selective policy against the attention mode and family, a plan's one choice per
// layer, and the optimizer (momentum
// for SGD only, master weights for low precision only).
absl::StatusOr<ValidConfig> ValidateRun(const ModelConfig& config, AttentionMode attention,
                                        const std::vector<Variant>& variants,
                                        const OptimizerSpec& optimizer = OptimizerSpec());
// ValidateRunOf: ValidateRun for a config already validated (everything but the config's
// own checks).
absl::Status ValidateRunOf(const ValidConfig& config, AttentionMode attention,
                           const std::vector<Variant>& variants,
                           const OptimizerSpec& optimizer = OptimizerSpec());

}  // namespace memledger

#endif  // ESTIMATOR_GRAPH_FAMILY_H_
