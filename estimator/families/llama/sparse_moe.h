// transformers 5.23's sparse mixture-of-experts MLP as graph ops, for the families whose
// layers have one (Qwen3-MoE, Mixtral: estimator/families/llama/llama.cc).
#ifndef ESTIMATOR_FAMILIES_LLAMA_SPARSE_MOE_H_
#define ESTIMATOR_FAMILIES_LLAMA_SPARSE_MOE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "estimator/spec/config.h"
#include "estimator/graph/graph_builder.h"

namespace memledger {

// SparseMoeBlock appends config.moe's SparseMoeBlock.forward on the (B, T, d) hidden
// states `x` (the post-attention norm's output) and returns its (B, T, d) output. Its
// parameters are named "gate.weight", "experts.gate_up_proj" and "experts.down_proj".
// `load` is the tokens each expert receives (ModelConfig::ExpertLoad), which the eager
// experts' sizes are; grouped_mm's never depend on it.
int SparseMoeBlock(GraphBuilder& g, const ModelConfig& config, int x,
                   const std::vector<int64_t>& load);

// SparseMoeRegistration: the block's parameters in its modules' registration order.
std::vector<std::string> SparseMoeRegistration(const ModelConfig& config);

}  // namespace memledger

#endif  // ESTIMATOR_FAMILIES_LLAMA_SPARSE_MOE_H_
