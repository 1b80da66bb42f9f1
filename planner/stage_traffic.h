// StageTraffic: what one rank of a parallel layout's pipeline stage communicates per
// micro-batch, counted from its chunks and checkpointing: the step-time model's inputs
// (planner/step_time.h) beyond FLOPs.
//
// Example:
//   int64_t n = TpAllReduces(kind.chunks, variant);  // Megatron's (b, s, h) all-reduces
#ifndef PLANNER_STAGE_TRAFFIC_H_
#define PLANNER_STAGE_TRAFFIC_H_

#include <cstdint>
#include <vector>

#include "estimator/spec/config.h"

namespace memledger {

// TpAllReduces: Megatron's tensor-parallel all-reduces of (b, s, h) per micro-batch over
// a stage's chunks: two forward (attention and MLP outputs) and two backward (their
// inputs' gradients) per layer, two more per checkpointed layer (its forward rerun), and
// one each for the embeddings' output and the head's input gradient.
int64_t TpAllReduces(const std::vector<StageRange>& chunks, const Variant& variant);

// EpAllToAlls: expert parallelism's all-to-alls per micro-batch over a stage's chunks:
// transformers' AllToAllEP makes two in each sparse layer's forward (the routed tokens
// out, the results back), their two reverses in its backward, and two more where a
// checkpointed layer reruns its forward.
int64_t EpAllToAlls(const ModelConfig& config, const std::vector<StageRange>& chunks,
                    const Variant& variant);

// ExpertParameters: the elements of an expert-parallel rank's experts
// (TensorDef::expert_shard) in its chunks, which the ranks holding the same experts
// reduce apart from the rest.
int64_t ExpertParameters(const ModelConfig& config, AttentionMode attention,
                         const std::vector<StageRange>& chunks);

}  // namespace memledger

#endif  // PLANNER_STAGE_TRAFFIC_H_
