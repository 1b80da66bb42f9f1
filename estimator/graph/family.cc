#include "estimator/graph/family.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "estimator/graph/block_graph.h"
#include "estimator/graph/sdpa_kernel.h"

namespace memledger {

namespace {

absl::Status CheckPositive(absl::string_view flag, int64_t value) {
  if (value >= 1) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " must be >= 1, got ", value));
}

// JoinNames: "a", "a or b", "a, b or c".
std::string JoinNames(const std::vector<absl::string_view>& names,
                      absl::string_view conjunction) {
  if (names.size() < 2) return absl::StrJoin(names, "");
  return absl::StrCat(absl::StrJoin(names.begin(), names.end() - 1, ", "), " ", conjunction,
                      " ", names.back());
}

}  // namespace

absl::string_view FamilyName(Family family) { return FamilyOf(family).name; }

std::string FamilyNames(bool FamilyDef::*capability, absl::string_view conjunction) {
  std::vector<absl::string_view> names;
  for (const FamilyDef* family : Families()) {
    if (family->*capability) names.push_back(family->name);
  }
  return JoinNames(names, conjunction);
}

namespace {

std::vector<absl::string_view> PresetsWith(bool (*has)(const ModelArchitecture& architecture)) {
  std::vector<absl::string_view> names;
  for (const FamilyDef* family : Families()) {
    for (const auto& [name, config] : family->presets) {
      if (has(config)) names.push_back(name);
    }
  }
  return names;
}

}  // namespace

std::string PresetNamesWith(bool (*has)(const ModelArchitecture& architecture),
                            absl::string_view conjunction) {
  return JoinNames(PresetsWith(has), conjunction);
}

std::string MixtureOfExpertsModels() {
  std::vector<absl::string_view> names =
      PresetsWith([](const ModelArchitecture& c) { return c.moe.Sparse(); });
  names.push_back("a config.json with experts");
  return JoinNames(names, "or");
}

namespace {
std::atomic<int64_t> validate_config_calls{0};
}  // namespace

int64_t ValidateConfigCalls() { return validate_config_calls.load(std::memory_order_relaxed); }

absl::Status ValidateConfig(const ModelConfig& config) {
  validate_config_calls.fetch_add(1, std::memory_order_relaxed);
  for (const auto& [flag, value] :
       {std::pair<absl::string_view, int64_t>{"layers", config.layers},
        {"width", config.width},
        {"heads", config.heads},
        {"batch", config.batch},
        {"seq", config.seq}}) {
    if (absl::Status s = CheckPositive(flag, value); !s.ok()) return s;
  }
  for (const auto& [flag, value] :
       {std::pair<absl::string_view, int64_t>{"kv_heads", config.kv_heads},
        {"head_dim", config.head_dim},
        {"intermediate", config.intermediate},
        {"vocab", config.vocab},
        {"max_positions", config.max_positions}}) {
    if (value < 0) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, " must be >= 1, got ", value));
    }
  }
  // The patterns a config.json's lists give (a layer_types list that does not repeat);
  // those derived from a number are bounded where they are derived.
  const auto period = static_cast<int64_t>(config.layer_attention.size());
  if (absl::Status s = CheckLayerPeriod("layer_types", period); !s.ok()) return s;
  if (config.device == Device::kCuda && config.layers > kMaxCudaLayers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--layers ", config.layers, " is more than the ", kMaxCudaLayers,
        " layers a CUDA step is simulated with (tensor by tensor, through the caching "
        "allocator's blocks)"));
  }
  const FamilyDef& family = FamilyOf(config.family);
  if ((config.o_bias || config.mlp_bias) && !family.projection_biases) {
    return absl::InvalidArgumentError(absl::StrCat(
        "o_proj and MLP biases (Llama's attention_bias, mlp_bias) are modelled for the ",
        FamilyNames(&FamilyDef::projection_biases), " family, not the ", family.name, " family"));
  }
  if (family.fused_qkv) {
    // One fused projection of width d split into heads: d = heads x head_dim.
    if (config.width % config.heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat("--width ", config.width,
                                                     " is not divisible by --heads ",
                                                     config.heads));
    }
    if (config.HeadDim() * config.heads != config.width ||
        config.KvHeads() != config.heads) {
      return absl::InvalidArgumentError(absl::StrCat(
          family.name, " needs --head_dim = --width / --heads and --kv_heads = --heads"));
    }
  }
  if (config.shard.tp < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--tp must be >= 1, got ", config.shard.tp));
  }
  if (config.use_cache && !family.decoder) {  // ModelConfig::KeepsKvCache trusts this
    return absl::InvalidArgumentError(absl::StrCat(
        "use_cache (transformers' DynamicCache) is for the decoder families, not the ",
        family.name, " family"));
  }
  if (config.lora.enabled()) {
    // peft's LoRA on the nn.Linear modules of one process's transformers model.
    if (config.lora.rank > kMaxLoraRank) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--lora_rank must be from 0 to ", kMaxLoraRank, ", got ", config.lora.rank));
    }
    if (!(config.lora.dropout >= 0 && config.lora.dropout < 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--lora_dropout must be in [0, 1), got ", config.lora.dropout));
    }
    if (!family.lora || config.megatron) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--lora_rank: LoRA is modelled on the linear layers of the ",
          FamilyNames(&FamilyDef::lora), " families, not the ", family.name, " family",
          config.megatron ? "'s Megatron model" : ""));
    }
    if (config.shard.tp > 1 || config.shard.sp || config.shard.ep > 1) {
      return absl::InvalidArgumentError(
          "--lora_rank: LoRA is modelled on one process: not with --tp, --sp or --ep yet");
    }
    if (config.lora.dora && config.lora.dropout > 0 && family.lora_fan_in_fan_out) {
      // DoraLinearLayer.forward's F.linear(x, transpose(weight, fan_in_fan_out)) with a
      // dropout: peft's transpose wraps the weight in a new Parameter that requires grad
      // (utils/other.py), whose gradient of the weight's size the backward then makes.
      return absl::InvalidArgumentError(absl::StrCat(
          "--use_dora with --lora_dropout on the ", family.name,
          " family's Conv1D layers is not modelled yet (peft then wraps each transposed "
          "weight in a new Parameter, which gets a gradient of the weight's size): use "
          "--lora_dropout=0"));
    }
    if (config.moe.Sparse() && config.lora.Targets("gate")) {
      // peft 0.21.2's all-linear wraps the experts' 3-D parameters (lora.ParamWrapper) and
      // the router too.
      return absl::InvalidArgumentError(
          "--lora_targets all-linear on a mixture of experts (peft adapts the experts' "
          "parameters and the router) is not modelled yet: name the attention's and dense "
          "layers' modules");
    }
  }
  if (config.freeze.any()) {
    // Frozen parameters are modelled for one process's transformers model (Freeze).
    if (!family.decoder || config.megatron) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--freeze ", FreezeName(config.freeze), " needs a transformers model (", 
          FamilyNames(&FamilyDef::decoder), "), not the ", family.name, " family",
          config.megatron ? "'s Megatron model" : ""));
    }
    if (config.shard.tp > 1 || config.shard.sp || config.shard.ep > 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--freeze is modelled on one process: not with --tp, --sp or --ep yet"));
    }
  }
  if (config.offload_activations && (config.shard.tp > 1 || config.shard.sp ||
                                     config.shard.ep > 1)) {
    return absl::InvalidArgumentError(
        "--offload_activations is modelled on one process: not with --tp, --sp or --ep yet");
  }
  if (config.megatron && !family.megatron) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Megatron's ops (dropout, fused softmax) are modelled for the ",
        FamilyNames(&FamilyDef::megatron), " family only (--model=",
        PresetNamesWith([](const ModelArchitecture& c) { return c.megatron; }), ")"));
  }
  if (config.qk_norm && !family.qk_norm) {
    return absl::InvalidArgumentError(absl::StrCat(
        "q/k norms (Qwen3's q_norm and k_norm) are not modelled for the ", family.name,
        " family"));
  }
  if (config.shard.tp > 1) {
    if (!family.decoder) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tp: tensor parallelism is modelled for the decoder families (",
          FamilyNames(&FamilyDef::decoder), "), not the ", family.name, " family"));
    }
    // Megatron splits whole heads, kv heads, MLP columns and vocabulary rows.
    for (const auto& [flag, value] :
         {std::pair<absl::string_view, int64_t>{"heads", config.heads},
          {"kv_heads", config.KvHeads()},
          {"intermediate", config.Intermediate()},
          {"vocab", config.vocab}}) {
      if (value % config.shard.tp != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--", flag, " ", value, " is not divisible by --tp ", config.shard.tp));
      }
    }
  }
  if (config.shard.sp) {
    if (!family.decoder || config.shard.tp < 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--sp (sequence parallelism) needs --tp >= 2 and a ",
          FamilyNames(&FamilyDef::decoder), " family model"));
    }
    if (config.amp != DType::kFloat32) {
      // Megatron's gather-linear is a custom autograd Function, which autocast does not
      // enter; its casts are not modelled.
      return absl::InvalidArgumentError(
          "--sp with --amp is not modelled (the gather-linear's autocast casts); use "
          "--dtype=bf16 or fp16 instead");
    }
    if (config.seq % config.shard.tp != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--sp: --seq ", config.seq, " is not divisible by --tp ", config.shard.tp));
    }
  }
  if (config.shard.ep < 1 || config.shard.ep_rank < 0 || config.shard.ep_rank >= config.shard.ep) {
    return absl::InvalidArgumentError(
        absl::StrCat("--ep must be >= 1, got ", config.shard.ep));
  }
  if (config.shard.ep > 1 && !config.moe.Sparse()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--ep (expert parallelism) needs a mixture-of-experts model (",
        MixtureOfExpertsModels(), ")"));
  }
  if (!family.decoder) return absl::OkStatus();

  if (config.vocab < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--vocab must be >= 1 for the ", family.name, " family"));
  }
  if (config.HeadDim() < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--head_dim would be --width ", config.width, " / --heads ", config.heads,
        " = 0; give --head_dim"));
  }
  if (config.heads % config.KvHeads() != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--heads ", config.heads,
                                                   " is not divisible by --kv_heads ",
                                                   config.KvHeads()));
  }
  if (family.rope && config.HeadDim() % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--head_dim ", config.HeadDim(), " must be even (RoPE rotates pairs of halves)"));
  }
  if (family.learned_positions && config.max_positions < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_positions must be >= 1 for the ", family.name, " family"));
  }
  if (family.learned_positions && config.seq > config.max_positions) {
    return absl::InvalidArgumentError(absl::StrCat("--seq ", config.seq,
                                                   " exceeds the model's ", config.max_positions,
                                                   " learned positions"));
  }
  if (!(config.norm_eps > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the norm epsilon must be > 0, got ", config.norm_eps));
  }
  if (!config.layer_attention.empty()) {
    for (LayerAttention type : config.layer_attention) {
      if (type == LayerAttention::kSliding && config.sliding_window < 1) {
        return absl::InvalidArgumentError("sliding-window layers need a sliding_window >= 1");
      }
    }
    if (!family.layer_types) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer types (layer_types) are not modelled for the ", family.name, " family"));
    }
  }
  if (family.validate != nullptr) return family.validate(config);
  return absl::OkStatus();
}

// ValidateDevice: what runs SDPA's kernel on the device asked for, and what a CUDA step
// does not model yet.
absl::Status ValidateDevice(const ModelConfig& config, AttentionMode attention) {
  if (attention == AttentionMode::kMath && config.sdpa_backend != SdpaBackend::kAuto) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--sdpa_backend=", SdpaBackendName(config.sdpa_backend),
        " needs --attention=flash (SDPA's attention; --attention=math is plain ops)"));
  }
  if (config.device == Device::kCuda) {
    auto not_yet = [](absl::string_view what) {
      return absl::InvalidArgumentError(
          absl::StrCat("--device=cuda: ", what, " is not modelled yet"));
    };
    if (config.megatron) return not_yet("megatron-gpt (Megatron's fused CUDA kernels)");
    // A mixture of experts runs transformers' grouped_mm experts (integrations/moe.py,
    // _can_use_grouped_mm: sm80 and later), checked on fake CUDA; the eager experts'
    // loop follows the routing, which fake tensors cannot run.
    if (config.moe.Sparse() && config.moe.impl == ExpertsImpl::kEager) {
      return not_yet("--experts_impl=eager (the experts' loop over the routing)");
    }
    if (config.moe.Sparse() && config.shard.ep > 1) return not_yet("expert parallelism (--ep)");
    if (attention == AttentionMode::kMath) {
      return not_yet("--attention=math (plain-ops attention)");
    }
  }
  return SdpaKernelsName(config, attention).status();
}

absl::StatusOr<ValidConfig> ValidConfig::Of(const ModelConfig& config) {
  if (absl::Status s = ValidateConfig(config); !s.ok()) return s;
  return ValidConfig(config);
}

absl::StatusOr<ValidConfig> ValidateRun(const ModelConfig& config, AttentionMode attention,
                                        const std::vector<Variant>& variants,
                                        const OptimizerSpec& optimizer) {
  absl::StatusOr<ValidConfig> valid = ValidConfig::Of(config);
  if (!valid.ok()) return valid.status();
  if (absl::Status s = ValidateRunOf(*valid, attention, variants, optimizer); !s.ok()) return s;
  return valid;
}

absl::Status ValidateRunOf(const ValidConfig& valid, AttentionMode attention,
                           const std::vector<Variant>& variants,
                           const OptimizerSpec& optimizer) {
  const ModelConfig& config = *valid;
  if (absl::Status s = ValidateDevice(config, attention); !s.ok()) return s;
  if (config.lora.enabled()) {
    const FamilyDef& family = FamilyOf(config.family);
    // peft refuses targets that match no module ("Target modules ... not found in the
    // base model", tuners/tuners_utils.py, inject_adapter).
    const std::shared_ptr<const ModelGraphs> graphs = ModelGraphsFor(config, attention);
    bool adapted = false;
    for (const BlockGraph& kind : graphs->layer_kinds) {
      for (const TensorDef& tensor : kind.tensors) {
        adapted = adapted || (tensor.is_parameter && absl::StrContains(tensor.name, ".lora_A."));
      }
    }
    if (!adapted) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--lora_targets ", LoraTargetsName(config.lora),
          ": no linear layer of the model has that name (peft: target modules not found in "
          "the base model); the layers' are ", family.lora_modules, ", or all-linear"));
    }
  }
  if (config.SlidingWindowMasked() && attention == AttentionMode::kMath) {
    // masking_utils.py, _ignore_causal_mask_sdpa: from seq >= sliding_window on, the
    // sliding layers attend through a mask, modelled for SDPA's flash kernel.
    return absl::InvalidArgumentError(absl::StrCat(
        "--attention=math with the sliding-window mask (--seq ", config.seq,
        " >= sliding_window ", config.sliding_window, ") is not modelled yet: use flash"));
  }
  if (config.megatron && attention != AttentionMode::kMath) {
    return absl::InvalidArgumentError(
        "megatron-gpt needs --attention=math: Megatron's core attention keeps the "
        "dropped-out probabilities (the CPU flash kernel has no dropout)");
  }
  if (config.dtype != DType::kFloat32 && config.dtype != DType::kBFloat16 &&
      config.dtype != DType::kFloat16) {
    return absl::InvalidArgumentError("--dtype must be fp32, bf16 or fp16");
  }
  if (config.amp != DType::kFloat32 && config.amp != DType::kBFloat16 &&
      config.amp != DType::kFloat16) {
    return absl::InvalidArgumentError("--amp must be none, bf16 or fp16");
  }
  if (config.amp != DType::kFloat32 && config.dtype != DType::kFloat32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--amp=", AmpName(config.amp), " needs --dtype=fp32: autocast runs an fp32 model "
        "(its master parameters) in lower precision, not a ", ModelDTypeName(config.dtype),
        " one"));
  }
  if (!(optimizer.momentum >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--momentum must be >= 0, got ", optimizer.momentum));
  }
  if (optimizer.momentum > 0 && optimizer.kind != OptimizerKind::kSgd) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--momentum applies to --optimizer=sgd, not ", OptimizerName(optimizer.kind)));
  }
  if (optimizer.master_weights && config.lora.enabled()) {
    return absl::InvalidArgumentError(
        "--master_weights with --lora_rank: peft's adapters, all that trains, are fp32 "
        "already (autocast_adapter_dtype), their own masters");
  }
  if (optimizer.master_weights && config.dtype == DType::kFloat32) {
    return absl::InvalidArgumentError(
        "--master_weights needs --dtype=bf16 or fp16 (fp32 parameters are their own "
        "masters)");
  }
  if (variants.empty()) {
    return absl::InvalidArgumentError("--variants must name at least one variant");
  }
  for (size_t i = 0; i < variants.size(); ++i) {
    const Variant& variant = variants[i];
    for (size_t j = 0; j < i; ++j) {
      if (variants[j].Name() == variant.Name()) {
        return absl::InvalidArgumentError(
            absl::StrCat("--variants: '", variant.Name(), "' is listed twice"));
      }
    }
    if (variant.kind == VariantKind::kEveryK &&
        (variant.every < 1 || variant.every > kMaxEvery)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--every (k of every_k, or every_<k>) must be between 1 and ", kMaxEvery,
          ", got ", variant.every));
    }
    if (variant.kind == VariantKind::kSelective) {
      if (absl::Status s = ValidatePolicy(variant.policy, attention, config); !s.ok()) {
        return s;
      }
      // torch.utils.checkpoint's context_fn (create_selective_checkpoint_contexts) runs
      // only without reentrancy.
      if (config.checkpoint_impl == CheckpointImpl::kReentrant && !variant.policy.empty()) {
        return absl::InvalidArgumentError(
            "--variants selective needs --checkpoint_impl=non_reentrant (torch's selective "
            "checkpointing runs only there)");
      }
    }
    if (variant.kind == VariantKind::kCoreAttention && attention != AttentionMode::kMath) {
      return absl::InvalidArgumentError(
          "--variants core_attention recomputes math attention's core: it needs "
          "--attention=math");
    }
    if (variant.kind == VariantKind::kPlan) {
      if (static_cast<int64_t>(variant.layers.size()) != config.layers) {
        return absl::InvalidArgumentError(
            absl::StrCat("the plan has ", variant.layers.size(), " layer choices but --layers is ",
                         config.layers));
      }
      for (const LayerChoice& choice : variant.layers) {
        if (!choice.checkpointed) continue;
        if (absl::Status s = ValidatePolicy(choice.policy, attention, config); !s.ok()) {
          return s;
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidatePolicy(const SavePolicy& policy, AttentionMode mode,
                            const ModelConfig& config) {
  if (policy.Saves(OpKind::kAttention) && mode != AttentionMode::kFlash) {
    return absl::InvalidArgumentError(
        "--policy attention needs --attention=flash (math attention has no single op)");
  }
  // The model's own op kinds: those of its layer graph's ops.
  const std::shared_ptr<const ModelGraphs> graphs = ModelGraphsFor(config, mode);
  SavePolicy present;
  for (const BlockGraph& kind : graphs->layer_kinds) {
    for (const OpDef& op : kind.ops) {
      if (op.policy_kind.has_value()) present.Add(*op.policy_kind);
    }
  }
  bool all_present = true;
  for (int k = 0; k < kNumOpKinds; ++k) {
    const OpKind kind = static_cast<OpKind>(k);
    all_present = all_present && (!policy.Saves(kind) || present.Saves(kind));
  }
  if (all_present) return absl::OkStatus();
  std::vector<std::string> missing, has;
  for (int k = 0; k < kNumOpKinds; ++k) {
    const OpKind kind = static_cast<OpKind>(k);
    if (present.Saves(kind)) has.emplace_back(OpKindName(kind));
    if (policy.Saves(kind) && !present.Saves(kind)) missing.emplace_back(OpKindName(kind));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--policy ", absl::StrJoin(missing, ","), missing.size() == 1 ? " is not an op" : " are not ops",
      " of this ", FamilyOf(config.family).name, " model (its layers' policy ops: ",
      absl::StrJoin(has, ", "), ")"));
}

}  // namespace memledger
