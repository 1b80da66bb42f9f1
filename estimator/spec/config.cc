#include "estimator/spec/config.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "estimator/spec/checked_math.h"

namespace memledger {

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kBool:
      return "bool";
    case DType::kInt64:
      return "int64";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
    case DType::kFloat64:
      return "float64";
    case DType::kInt32:
      return "int32";
    case DType::kUInt64:
      return "uint64";
  }
  return "?";
}

absl::Status CheckLayerPeriod(absl::string_view what, int64_t period) {
  if (period <= kMaxLayerPeriod) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      what, what.empty() ? "" : " ", "makes a layer pattern of ", period,
      " layers (it repeats no sooner), more than the ", kMaxLayerPeriod,
      " a step's replay holds"));
}

absl::string_view DeviceName(Device device) {
  return device == Device::kCuda ? "cuda" : "cpu";
}

absl::StatusOr<Device> ParseDevice(absl::string_view name) {
  if (name == "cpu") return Device::kCpu;
  if (name == "cuda") return Device::kCuda;
  return absl::InvalidArgumentError(
      absl::StrCat("--device must be cpu or cuda, got '", name, "'"));
}

absl::StatusOr<int64_t> ParseCublasWorkspaceConfig(absl::string_view config) {
  // parseChosenWorkspaceSize (aten/src/ATen/cuda/CublasHandlePool.cpp) sums every
  // ":SIZE:COUNT" it finds, SIZE KiB times COUNT, and warns and falls back to the default
  // when it finds none; here the whole value must be such pairs, or it is refused.
  const std::string message = absl::StrCat(
      "--cublas_workspace_config must be CUBLAS_WORKSPACE_CONFIG's :SIZE:COUNT pairs "
      "(KiB, for example :4096:8 or :0:0), got '", config, "'");
  std::vector<absl::string_view> parts = absl::StrSplit(config, ':');
  // ":4096:8:16:8" splits into "", "4096", "8", "16", "8".
  if (parts.size() < 3 || parts.size() % 2 != 1 || !parts[0].empty()) {
    return absl::InvalidArgumentError(message);
  }
  CheckedInt64 total = 0;
  for (size_t i = 1; i < parts.size(); i += 2) {
    int64_t size = 0;
    int64_t count = 0;
    // Digits only (SimpleAtoi would take a sign or spaces), and at most 1 TiB in all.
    auto digits = [](absl::string_view s) {
      return !s.empty() && s.size() <= 9 && std::all_of(s.begin(), s.end(), absl::ascii_isdigit);
    };
    if (!digits(parts[i]) || !digits(parts[i + 1]) || !absl::SimpleAtoi(parts[i], &size) ||
        !absl::SimpleAtoi(parts[i + 1], &count)) {
      return absl::InvalidArgumentError(message);
    }
    total += CheckedInt64(size) * 1024 * count;
    if (total.overflowed() || total.value() > int64_t{1} << 40) {
      return absl::InvalidArgumentError(message);
    }
  }
  return total.value();
}

absl::string_view SdpaBackendName(SdpaBackend backend) {
  switch (backend) {
    case SdpaBackend::kAuto:
      return "auto";
    case SdpaBackend::kFlash:
      return "flash";
    case SdpaBackend::kEfficient:
      return "efficient";
    case SdpaBackend::kCudnn:
      return "cudnn";
    case SdpaBackend::kMath:
      return "math";
  }
  return "?";
}

absl::StatusOr<SdpaBackend> ParseSdpaBackend(absl::string_view name) {
  for (SdpaBackend backend : {SdpaBackend::kAuto, SdpaBackend::kFlash, SdpaBackend::kEfficient,
                              SdpaBackend::kCudnn, SdpaBackend::kMath}) {
    if (name == SdpaBackendName(backend)) return backend;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--sdpa_backend must be auto, flash, efficient, cudnn or math, got '", name, "'"));
}

absl::StatusOr<DType> ParseModelDType(absl::string_view name) {
  if (name == "fp32") return DType::kFloat32;
  if (name == "bf16") return DType::kBFloat16;
  if (name == "fp16") return DType::kFloat16;
  return absl::InvalidArgumentError(
      absl::StrCat("--dtype must be fp32, bf16 or fp16, got '", name, "'"));
}

absl::StatusOr<DType> ParseAmp(absl::string_view name) {
  if (name == "none") return DType::kFloat32;
  if (name == "bf16") return DType::kBFloat16;
  if (name == "fp16") return DType::kFloat16;
  return absl::InvalidArgumentError(
      absl::StrCat("--amp must be none, bf16 or fp16, got '", name, "'"));
}

absl::string_view AmpName(DType amp) {
  return amp == DType::kFloat32 ? "none" : ModelDTypeName(amp);
}

absl::string_view ModelDTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "fp32";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat16:
      return "fp16";
    case DType::kBool:
    case DType::kInt64:
    case DType::kFloat64:
    case DType::kInt32:
    case DType::kUInt64:
      break;  // never a model's dtype
  }
  return "?";
}

absl::string_view OptimizerName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdamW:
      return "adamw";
    case OptimizerKind::kAdam:
      return "adam";
    case OptimizerKind::kSgd:
      return "sgd";
  }
  return "?";
}

absl::StatusOr<OptimizerKind> ParseOptimizer(absl::string_view name) {
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kAdam, OptimizerKind::kSgd}) {
    if (name == OptimizerName(kind)) return kind;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--optimizer must be adamw, adam or sgd, got '", name, "'"));
}

absl::string_view CheckpointImplName(CheckpointImpl impl) {
  return impl == CheckpointImpl::kReentrant ? "reentrant" : "non_reentrant";
}

absl::StatusOr<CheckpointImpl> ParseCheckpointImpl(absl::string_view name) {
  if (name == "non_reentrant") return CheckpointImpl::kNonReentrant;
  if (name == "reentrant") return CheckpointImpl::kReentrant;
  return absl::InvalidArgumentError(absl::StrCat(
      "--checkpoint_impl must be non_reentrant or reentrant, got '", name, "'"));
}

std::string FreezeName(const Freeze& freeze) {
  std::vector<absl::string_view> parts;
  if (freeze.embeddings) parts.push_back("embeddings");
  if (freeze.lm_head) parts.push_back("lm_head");
  return absl::StrJoin(parts, ",");
}

absl::StatusOr<Freeze> ParseFreeze(absl::string_view list) {
  Freeze freeze;
  if (list.empty() || list == "none") return freeze;
  for (absl::string_view part : absl::StrSplit(list, ',')) {
    if (part == "embeddings") {
      freeze.embeddings = true;
    } else if (part == "lm_head") {
      freeze.lm_head = true;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "--freeze lists embeddings and lm_head (comma-separated) or none, got '",
          part, "'",
          absl::StartsWith(part, "layers") ? ": frozen decoder layers are not modelled yet"
                                           : ""));
    }
  }
  return freeze;
}

std::string LoraTargetsName(const Lora& lora) { return absl::StrJoin(lora.targets, ","); }

absl::StatusOr<std::vector<std::string>> ParseLoraTargets(absl::string_view list) {
  std::vector<std::string> targets;
  for (absl::string_view part : absl::StrSplit(list, ',')) {
    const bool name = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) {
      return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.';
    });
    if (part != "all-linear" && !name) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--lora_targets lists module names (q_proj,v_proj) or all-linear, got '", list,
          "'"));
    }
    targets.emplace_back(part);
  }
  if (targets.size() > 1 &&
      std::find(targets.begin(), targets.end(), "all-linear") != targets.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--lora_targets all-linear stands alone, got '", list, "'"));
  }
  return targets;
}

absl::string_view OptimizerImplName(OptimizerImpl impl) {
  switch (impl) {
    case OptimizerImpl::kForLoop:
      return "for_loop";
    case OptimizerImpl::kForeach:
      return "foreach";
    case OptimizerImpl::kFused:
      return "fused";
  }
  return "?";
}

absl::StatusOr<OptimizerImpl> ParseOptimizerImpl(absl::string_view name, Device device) {
  // torch/optim/optimizer.py, _default_to_fused_or_foreach: foreach for CUDA tensors
  // (never fused by default), the for-loop on CPU ones.
  if (name == "auto") {
    return device == Device::kCuda ? OptimizerImpl::kForeach : OptimizerImpl::kForLoop;
  }
  for (OptimizerImpl impl :
       {OptimizerImpl::kForLoop, OptimizerImpl::kForeach, OptimizerImpl::kFused}) {
    if (name == OptimizerImplName(impl)) return impl;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--optimizer_impl must be auto, for_loop, foreach or fused, got '", name, "'"));
}

bool RepeatsKv(AttentionMode mode, int64_t head_dim) {
  return mode == AttentionMode::kMath || head_dim > 256;
}

absl::string_view AttentionModeName(AttentionMode mode) {
  return mode == AttentionMode::kFlash ? "flash" : "math";
}

absl::StatusOr<AttentionMode> ParseAttentionMode(absl::string_view name) {
  if (name == "flash") return AttentionMode::kFlash;
  if (name == "math") return AttentionMode::kMath;
  return absl::InvalidArgumentError(
      absl::StrCat("--attention must be flash or math, got '", name, "'"));
}

absl::string_view OpKindName(OpKind kind) {
  switch (kind) {
    case OpKind::kMatmul:
      return "matmul";
    case OpKind::kAttention:
      return "attention";
    case OpKind::kLayerNorm:
      return "layer_norm";
    case OpKind::kGelu:
      return "gelu";
    case OpKind::kSilu:
      return "silu";
  }
  return "?";
}

absl::StatusOr<SavePolicy> ParseSavePolicy(absl::string_view names) {
  SavePolicy policy;
  for (absl::string_view name : absl::StrSplit(names, ',', absl::SkipWhitespace())) {
    name = absl::StripAsciiWhitespace(name);
    bool known = false;
    for (int i = 0; i < kNumOpKinds; ++i) {
      if (name == OpKindName(static_cast<OpKind>(i))) {
        policy.Add(static_cast<OpKind>(i));
        known = true;
      }
    }
    if (!known) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--policy: unknown op kind '", name,
          "' (known: matmul, attention, layer_norm, gelu, silu)"));
    }
  }
  return policy;
}

std::string SavePolicyName(const SavePolicy& policy) {
  std::vector<absl::string_view> names;
  for (int i = 0; i < kNumOpKinds; ++i) {
    if (policy.Saves(static_cast<OpKind>(i))) names.push_back(OpKindName(static_cast<OpKind>(i)));
  }
  return absl::StrJoin(names, ",");
}

std::string Variant::Name() const {
  switch (kind) {
    case VariantKind::kNone:
      return "none";
    case VariantKind::kFull:
      return "full";
    case VariantKind::kEveryK:
      return absl::StrCat("every_", every);
    case VariantKind::kSelective:
      return "selective";
    case VariantKind::kPlan:
      return "plan";
    case VariantKind::kCoreAttention:
      return "core_attention";
  }
  return "?";
}

bool Variant::CheckpointsAnyLayer() const {
  if (kind != VariantKind::kPlan) return IsCheckpointed(0);
  for (const LayerChoice& choice : layers) {
    if (choice.checkpointed) return true;
  }
  return false;
}

bool Variant::IsCheckpointed(int64_t index) const {
  switch (kind) {
    case VariantKind::kNone:
      return false;
    case VariantKind::kFull:
    case VariantKind::kSelective:
      return true;
    case VariantKind::kEveryK:
      return index % every == 0;
    case VariantKind::kPlan:
      return index >= 0 && index < static_cast<int64_t>(layers.size()) &&
             layers[index].checkpointed;
    case VariantKind::kCoreAttention:
      return false;
  }
  return false;
}

SavePolicy Variant::PolicyAt(int64_t index) const {
  if (kind == VariantKind::kSelective) return policy;
  if (kind == VariantKind::kPlan && IsCheckpointed(index)) return layers[index].policy;
  return SavePolicy();
}

Variant PlanVariant(std::vector<LayerChoice> layers) {
  Variant variant;
  variant.kind = VariantKind::kPlan;
  variant.layers = std::move(layers);
  return variant;
}

std::string LayerChoice::Name() const {
  if (!checkpointed) return "none";
  if (policy.empty()) return "full";
  return absl::StrCat("selective:", SavePolicyName(policy));
}

absl::StatusOr<LayerChoice> ParseLayerChoice(absl::string_view name) {
  LayerChoice choice;
  if (name == "none") return choice;
  choice.checkpointed = true;
  if (name == "full") return choice;
  absl::string_view policy = name;
  if (absl::ConsumePrefix(&policy, "selective:")) {
    absl::StatusOr<SavePolicy> parsed = ParseSavePolicy(policy);
    if (!parsed.ok()) return parsed.status();
    choice.policy = *parsed;
    return choice;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown layer choice '", name, "' (known: none, full, selective:<op kinds>)"));
}

absl::StatusOr<std::vector<Variant>> ParseVariants(absl::string_view names, int64_t every,
                                                   absl::string_view policy) {
  if (every < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--every must be >= 1, got ", every));
  }
  absl::StatusOr<SavePolicy> save_policy = ParseSavePolicy(policy);
  if (!save_policy.ok()) return save_policy.status();

  std::vector<Variant> variants;
  for (absl::string_view name : absl::StrSplit(names, ',', absl::SkipWhitespace())) {
    name = absl::StripAsciiWhitespace(name);
    Variant variant;
    if (name == "none") {
      variant.kind = VariantKind::kNone;
    } else if (name == "full") {
      variant.kind = VariantKind::kFull;
    } else if (name == "selective") {
      variant.kind = VariantKind::kSelective;
      variant.policy = *save_policy;
    } else if (name == "core_attention") {
      variant.kind = VariantKind::kCoreAttention;
    } else if (name == "every_k") {
      variant.kind = VariantKind::kEveryK;
      variant.every = every;
    } else if (absl::string_view k = name; absl::ConsumePrefix(&k, "every_")) {
      int64_t parsed = 0;
      if (!absl::SimpleAtoi(k, &parsed) || parsed < 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--variants: '", name, "' needs a whole number k >= 1 after every_"));
      }
      variant.kind = VariantKind::kEveryK;
      variant.every = parsed;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--variants: unknown variant '", name,
                       "' (known: none, full, every_k, every_<k>, selective, core_attention)"));
    }
    for (const Variant& seen : variants) {
      // The same name: the same kind and, for every_k, the same k.
      if (seen.kind == variant.kind &&
          (variant.kind != VariantKind::kEveryK || seen.every == variant.every)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--variants: '", variant.Name(), "' is listed twice"));
      }
    }
    variants.push_back(variant);
  }
  if (variants.empty()) {
    return absl::InvalidArgumentError("--variants must name at least one variant");
  }
  return variants;
}

std::vector<Variant> DefaultVariants() {
  Variant none, full, every_2, selective;
  full.kind = VariantKind::kFull;
  every_2.kind = VariantKind::kEveryK;
  every_2.every = 2;
  selective.kind = VariantKind::kSelective;
  return {none, full, every_2, selective};
}

StageRange WholeModel(const ModelConfig& config) {
  return StageRange{0, config.layers, true, true};
}

}  // namespace memledger
