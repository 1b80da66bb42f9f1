#include "planner/stage_traffic.h"

#include <cstdint>
#include <memory>
#include <vector>

#include "estimator/graph/block_graph.h"

namespace memledger {

int64_t TpAllReduces(const std::vector<StageRange>& chunks, const Variant& variant) {
  int64_t n = 0;
  for (const StageRange& chunk : chunks) {
    for (int64_t i = chunk.first_layer; i < chunk.first_layer + chunk.layers; ++i) {
      n += variant.At(i).checkpointed ? 6 : 4;
    }
    n += (chunk.prologue ? 1 : 0) + (chunk.head ? 1 : 0);
  }
  return n;
}

int64_t EpAllToAlls(const ModelConfig& config, const std::vector<StageRange>& chunks,
                    const Variant& variant) {
  int64_t n = 0;
  for (const StageRange& chunk : chunks) {
    for (int64_t i = chunk.first_layer; i < chunk.first_layer + chunk.layers; ++i) {
      if (config.moe.IsSparse(i)) n += variant.At(i).checkpointed ? 6 : 4;
    }
  }
  return n;
}

int64_t ExpertParameters(const ModelConfig& config, AttentionMode attention,
                         const std::vector<StageRange>& chunks) {
  const std::shared_ptr<const ModelGraphs> graphs = ModelGraphsFor(config, attention);
  int64_t n = 0;
  for (const StageRange& chunk : chunks) {
    for (int64_t i = chunk.first_layer; i < chunk.first_layer + chunk.layers; ++i) {
      const BlockGraph& layer = graphs->Layer(i);
      for (int t : layer.Parameters()) {
        if (layer.tensors[t].expert_shard) n += TensorElements(layer.tensors[t], config).value();
      }
    }
  }
  return n;
}

}  // namespace memledger
