#include "runtime/family.h"

#include <array>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/graph/family.h"

namespace memledger::runtime {

// The families the runtime measures (runtime/families/families.inc), each defined in its
// folder under runtime/families/.
#define MEMLEDGER_RUNTIME_FAMILY(name) const RuntimeFamily& name##RuntimeFamily();
#include "runtime/families/families.inc"
#undef MEMLEDGER_RUNTIME_FAMILY

namespace {

// Registered: by Family, each registered family's entry; a family without one has the
// empty entry (no make_model), which RuntimeFamilyModelled refuses.
const std::array<const RuntimeFamily*, kNumFamilies>& Registered() {
  static const std::array<const RuntimeFamily*, kNumFamilies> kFamilies = [] {
    static const RuntimeFamily kNone;
    std::array<const RuntimeFamily*, kNumFamilies> families;
    families.fill(&kNone);
    for (const RuntimeFamily* family : {
#define MEMLEDGER_RUNTIME_FAMILY(name) &name##RuntimeFamily(),
#include "runtime/families/families.inc"
#undef MEMLEDGER_RUNTIME_FAMILY
         }) {
      families[static_cast<size_t>(family->id)] = family;
    }
    return families;
  }();
  return kFamilies;
}

}  // namespace

const RuntimeFamily& RuntimeFamilyOf(Family family) {
  return *Registered()[static_cast<size_t>(family)];
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
  if (config.shard.tp == 1 || shard_of == nullptr) return {};
  return shard_of(config, name, r);
}

bool ReplicatedUnderSequenceParallelism(const ModelConfig& config, const std::string& name) {
  return config.shard.sp && ShardOf(config, name, 0).pieces.empty();
}

bool GradientIsPartial(const ModelConfig& config, const std::string& name) {
  const auto partial = RuntimeFamilyOf(config.family).gradient_is_partial;
  return partial != nullptr && partial(config, name);
}

}  // namespace memledger::runtime
