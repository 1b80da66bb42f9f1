// The decoder families in LibTorch, as transformers' modules run them in fp32 (DESIGN.md,
// "Model families"): Llama (Llama 2/3, Mistral, Qwen2) and GPT-2, without dropout.
#ifndef RUNTIME_FAMILIES_H_
#define RUNTIME_FAMILIES_H_

#include <memory>

#include "estimator/config.h"
#include "runtime/model.h"

namespace memledger::runtime {

// MakeLlamaModel: embed_tokens, RoPE tables, `layers` LlamaDecoderLayers (RMSNorm,
// q/k/v/o projections with GQA via repeat_kv, SDPA, SwiGLU MLP), final RMSNorm, LM head
// (tied to embed_tokens when config.tie_embeddings) and cross-entropy.
// REQUIRES: ValidateConfig(config).ok(), config.family == kLlama.
std::shared_ptr<ModelImpl> MakeLlamaModel(const ModelConfig& config);

// MakeGpt2Model: wte + wpe, `layers` GPT2Blocks (LayerNorm, Conv1D c_attn split into
// q, k, v, SDPA, c_proj; LayerNorm, c_fc, GELU-tanh, c_proj), ln_f, LM head tied to wte,
// cross-entropy. REQUIRES: ValidateConfig(config).ok(), config.family == kGpt2.
std::shared_ptr<ModelImpl> MakeGpt2Model(const ModelConfig& config);

}  // namespace memledger::runtime

#endif  // RUNTIME_FAMILIES_H_
