#include "runtime/family.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/graph/family.h"

namespace memledger::runtime {

// The families, each defined in its own file under runtime/families/.
const RuntimeFamily& StudyRuntimeFamily();
const RuntimeFamily& LlamaRuntimeFamily();
const RuntimeFamily& Gpt2RuntimeFamily();
const RuntimeFamily& Gemma3RuntimeFamily();

const RuntimeFamily& RuntimeFamilyOf(Family family) {
  switch (family) {
    case Family::kStudy:
      return StudyRuntimeFamily();
    case Family::kLlama:
      return LlamaRuntimeFamily();
    case Family::kGpt2:
      return Gpt2RuntimeFamily();
    case Family::kGemma3:
      return Gemma3RuntimeFamily();
  }
  return StudyRuntimeFamily();
}

absl::Status RuntimeFamilyModelled(const ModelConfig& config) {
  if (RuntimeFamilyOf(config.family).make_model != nullptr) return absl::OkStatus();
  return absl::UnimplementedError(absl::StrCat(
      "the LibTorch runtime has no ", FamilyName(config.family),
      " model yet: predict it, or measure it with the real transformers model "
      "(verify/witness.py)"));
}

ParameterShard Split(int64_t dim, int64_t n, int64_t rank) {
  return ParameterShard{dim, {{rank * n, n}}};
}

ParameterShard ShardOf(const ModelConfig& config, const std::string& name, int64_t r) {
  const auto shard_of = RuntimeFamilyOf(config.family).shard_of;
  if (config.tp == 1 || shard_of == nullptr) return {};
  return shard_of(config, name, r);
}

bool ReplicatedUnderSequenceParallelism(const ModelConfig& config, const std::string& name) {
  return config.sp && ShardOf(config, name, 0).pieces.empty();
}

bool GradientIsPartial(const ModelConfig& config, const std::string& name) {
  const auto partial = RuntimeFamilyOf(config.family).gradient_is_partial;
  return partial != nullptr && partial(config, name);
}

}  // namespace memledger::runtime
