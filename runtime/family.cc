#include "runtime/family.h"

#include <string>

namespace memledger::runtime {

// The families, each defined in its own file under runtime/families/.
const RuntimeFamily& StudyRuntimeFamily();
const RuntimeFamily& LlamaRuntimeFamily();
const RuntimeFamily& Gpt2RuntimeFamily();

const RuntimeFamily& RuntimeFamilyOf(Family family) {
  switch (family) {
    case Family::kStudy:
      return StudyRuntimeFamily();
    case Family::kLlama:
      return LlamaRuntimeFamily();
    case Family::kGpt2:
      return Gpt2RuntimeFamily();
  }
  return StudyRuntimeFamily();
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
