// A model family in the runtime, in one definition (runtime/families/<name>/): how
// its LibTorch model is made and how its parameters split over tensor-parallel ranks
// and group into ZeRO-3's units. What the family is (decoder or not, its capabilities)
// is the estimator's FamilyDef (estimator/graph/family.h).
#ifndef RUNTIME_FAMILY_H_
#define RUNTIME_FAMILY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"

#include "estimator/spec/config.h"
#include "runtime/model.h"

namespace memledger::runtime {

struct RuntimeFamily {
  Family id = Family{};  // set by the family's folder
  // make_model: the seeded model (BuildModel seeds LibTorch first).
  std::shared_ptr<ModelImpl> (*make_model)(const ModelConfig& config) = nullptr;
  // shard_of: tensor-parallel rank r's part of parameter `name` (named_parameters()'s
  // names) under Megatron's layout, {} when replicated; nullptr: no tensor parallelism.
  ParameterShard (*shard_of)(const ModelConfig& config, const std::string& name,
                             int64_t r) = nullptr;
  // gradient_is_partial: GradientIsPartial (runtime/model.h) for this family's names.
  bool (*gradient_is_partial)(const ModelConfig& config, const std::string& name) = nullptr;
  // prologue_prefixes: the prologue's parameters' name prefixes, ZeRO-3's prologue unit.
  std::vector<std::string> prologue_prefixes;
};

const RuntimeFamily& RuntimeFamilyOf(Family family);
// RuntimeFamilyModelled: Unimplemented (one line) for a family the runtime cannot build.
absl::Status RuntimeFamilyModelled(const ModelConfig& config);

// For the families' definitions:
// Split: rank `rank`'s n elements along `dim`.
ParameterShard Split(int64_t dim, int64_t n, int64_t rank);
// ReplicatedUnderSequenceParallelism: with config.shard.sp, a replicated parameter (a norm, a
// row-parallel bias) used on this rank's T / tp tokens only, so its gradient is partial.
bool ReplicatedUnderSequenceParallelism(const ModelConfig& config, const std::string& name);

}  // namespace memledger::runtime

#endif  // RUNTIME_FAMILY_H_
