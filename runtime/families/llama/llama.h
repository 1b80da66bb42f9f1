// The Llama family's parameter names under Megatron's tensor-parallel layout, which
// Gemma 3's share (runtime/families/gemma3/): q/k/v, gate/up and the vocabulary rows
// split by output, o_proj and down_proj by input, q_norm's and k_norm's gradients
// all-reduced. Only the families' folders include it; shared code asks the RuntimeFamily.
#ifndef RUNTIME_FAMILIES_LLAMA_LLAMA_H_
#define RUNTIME_FAMILIES_LLAMA_LLAMA_H_

#include <cstdint>
#include <string>

#include "estimator/spec/config.h"
#include "runtime/model.h"

namespace memledger::runtime {

// LlamaShardOf is RuntimeFamily::shard_of for the Llama family's names.
ParameterShard LlamaShardOf(const ModelConfig& config, const std::string& name, int64_t r);
// LlamaGradientIsPartial is RuntimeFamily::gradient_is_partial for them.
bool LlamaGradientIsPartial(const ModelConfig& config, const std::string& name);

}  // namespace memledger::runtime

#endif  // RUNTIME_FAMILIES_LLAMA_LLAMA_H_
