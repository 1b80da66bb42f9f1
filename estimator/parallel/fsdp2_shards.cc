#include "estimator/parallel/fsdp2_shards.h"

#include "estimator/graph/shape.h"

namespace memledger {

int64_t Fsdp2ShardElements(const TensorDef& tensor, const ModelConfig& config, int64_t world) {
  const SymbolValues symbols(config);
  if (tensor.shape.empty()) return 1;  // a 0-dim parameter is replicated whole
  // The model's parameter count fits int64 (ValidateConfig), and a shard is at most it.
  CheckedInt64 rest = 1;
  for (size_t d = 1; d < tensor.shape.size(); ++d) rest *= tensor.shape[d].Evaluate(symbols);
  const int64_t rows = tensor.shape[0].Evaluate(symbols).value();
  return (CheckedInt64((rows + world - 1) / world) * rest).value();
}

bool Fsdp2RowsPadded(const TensorDef& tensor, const ModelConfig& config, int64_t world) {
  if (tensor.shape.empty()) return false;
  return tensor.shape[0].Evaluate(SymbolValues(config)).value() % world != 0;
}

Fsdp2Unit Fsdp2UnitOf(const std::vector<const BlockGraph*>& graphs, const ModelConfig& config,
                      int64_t world) {
  Fsdp2Unit unit;
  for (size_t g = 0; g < graphs.size(); ++g) {
    const BlockGraph& graph = *graphs[g];
    graph.ForEachParameter([&](int t) {
      if (graph.tensors[t].is_tied) return;
      const int64_t shard = Fsdp2ShardElements(graph.tensors[t], config, world);
      unit.parameters.push_back({static_cast<int>(g), t, shard,
                                 Fsdp2RowsPadded(graph.tensors[t], config, world)});
      unit.shard_elements += shard;
    });
  }
  return unit;
}

}  // namespace memledger
