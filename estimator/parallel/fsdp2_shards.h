// Fsdp2Units: how torch's FSDP2 (torch/distributed/fsdp/_fully_shard, torch 2.15.0)
// shards a decoder model laid out as torchtitan applies fully_shard: one unit per
// decoder layer, then the root (the embedding, the final norm and the LM head).
//
// Each parameter is its own Shard(0) (_fsdp_param.py, FSDPParam._init_sharded_param):
// torch.chunk over dim 0 into world-size pieces of ceil(dim0 / world) rows, each rank's
// padded to that (rank 0's is never short, so it holds the most: the rank predicted).
// A unit's all-gather output is world x the sum of its padded shards
// (foreach_all_gather), and each parameter's unsharded storage world x its padded shard
// (FSDPParam.init_all_gather_outputs).
//
// Example (the Llama over 2 ranks: every dim 0 even):
//   Fsdp2Unit layer = Fsdp2UnitOf(graphs.Layer(0), config, /*world=*/2);
//   layer.shard_elements  // 21,568: half of the layer's 43,136
#ifndef ESTIMATOR_PARALLEL_FSDP2_SHARDS_H_
#define ESTIMATOR_PARALLEL_FSDP2_SHARDS_H_

#include <cstdint>
#include <vector>

#include "estimator/graph/block_graph.h"
#include "estimator/spec/config.h"

namespace memledger {

// Fsdp2Unit is one fully_shard unit's parameters (a graph's, or the root's two graphs'),
// in the module's registration order (the graphs' parameter order).
struct Fsdp2Unit {
  // By parameter: (graph index within the unit, tensor), its padded shard's elements,
  // and whether its rows are padded (not a multiple of the world size).
  struct Parameter {
    int graph = 0;
    int tensor = 0;
    int64_t shard_elements = 0;
    bool padded = false;
  };
  std::vector<Parameter> parameters;
  int64_t shard_elements = 0;  // the sum: the unit's sharded parameters and gradients
};

// Fsdp2ShardElements: a parameter's padded Shard(0) over `world` ranks: ceil(dim0 /
// world) rows of its other dimensions. Fsdp2RowsPadded: dim0 is not a multiple of world.
int64_t Fsdp2ShardElements(const TensorDef& tensor, const ModelConfig& config, int64_t world);
bool Fsdp2RowsPadded(const TensorDef& tensor, const ModelConfig& config, int64_t world);

// Fsdp2UnitOf: the unit of these graphs' own parameters (not a tied weight another
// graph owns).
Fsdp2Unit Fsdp2UnitOf(const std::vector<const BlockGraph*>& graphs, const ModelConfig& config,
                      int64_t world);

}  // namespace memledger

#endif  // ESTIMATOR_PARALLEL_FSDP2_SHARDS_H_
