#include "estimator/config.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace memledger {
namespace {

absl::Status CheckPositive(absl::string_view flag, int64_t value) {
  if (value >= 1) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " must be >= 1, got ", value));
}

}  // namespace

absl::Status ValidateConfig(const ModelConfig& config) {
  for (const auto& [flag, value] :
       {std::pair<absl::string_view, int64_t>{"layers", config.layers},
        {"width", config.width},
        {"heads", config.heads},
        {"batch", config.batch},
        {"seq", config.seq}}) {
    if (absl::Status s = CheckPositive(flag, value); !s.ok()) return s;
  }
  if (config.width % config.heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--width ", config.width,
                                                   " is not divisible by --heads ",
                                                   config.heads));
  }
  return absl::OkStatus();
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
  }
  return "?";
}

bool SavePolicy::Saves(OpKind kind) const {
  switch (kind) {
    case OpKind::kMatmul:
      return matmul;
    case OpKind::kAttention:
      return attention;
    case OpKind::kLayerNorm:
      return layer_norm;
    case OpKind::kGelu:
      return gelu;
  }
  return false;
}

absl::StatusOr<SavePolicy> ParseSavePolicy(absl::string_view names) {
  SavePolicy policy;
  policy.matmul = false;
  for (absl::string_view name : absl::StrSplit(names, ',', absl::SkipWhitespace())) {
    name = absl::StripAsciiWhitespace(name);
    if (name == "matmul") {
      policy.matmul = true;
    } else if (name == "attention") {
      policy.attention = true;
    } else if (name == "layer_norm") {
      policy.layer_norm = true;
    } else if (name == "gelu") {
      policy.gelu = true;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "--policy: unknown op kind '", name,
          "' (known: matmul, attention, layer_norm, gelu)"));
    }
  }
  return policy;
}

std::string SavePolicyName(const SavePolicy& policy) {
  std::vector<absl::string_view> names;
  for (OpKind kind :
       {OpKind::kMatmul, OpKind::kAttention, OpKind::kLayerNorm, OpKind::kGelu}) {
    if (policy.Saves(kind)) names.push_back(OpKindName(kind));
  }
  return absl::StrJoin(names, ",");
}

absl::Status ValidatePolicy(const SavePolicy& policy, AttentionMode mode) {
  if (policy.attention && mode != AttentionMode::kFlash) {
    return absl::InvalidArgumentError(
        "--policy attention needs --attention=flash (math attention has no single op)");
  }
  return absl::OkStatus();
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
  }
  return "?";
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
  }
  return false;
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
                       "' (known: none, full, every_k, every_<k>, selective)"));
    }
    for (const Variant& seen : variants) {
      if (seen.Name() == variant.Name()) {
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

}  // namespace memledger
