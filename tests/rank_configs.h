// The small configs the per-rank tests share (ranks_test, data_parallel_ranks_test):
// tiny-llama at a few layers, a variant list without peaks, and the distributed issue's
// 2-layer Llama, whose ranks the real stack's witnesses measured.
#ifndef TESTS_RANK_CONFIGS_H_
#define TESTS_RANK_CONFIGS_H_

#include <cstdint>

#include "estimator/predict/predict.h"
#include "estimator/request/model_presets.h"
#include "estimator/request/run_request.h"
#include "estimator/spec/config.h"

namespace memledger {
namespace rank_configs {

inline ModelConfig TinyLlama(int64_t layers) {
  ModelConfig config = *ModelFromPreset("tiny-llama");
  config.layers = layers;
  config.batch = 2;
  config.seq = 8;
  return config;
}

inline PredictOptions Variants(const char* names) {
  PredictOptions options;
  options.variants = *ParseVariants(names, /*every=*/2, "matmul");
  options.peak = false;
  return options;
}

// The issue's 2-layer Llama (hidden 64, 4 heads, 2 kv heads, head_dim 16, intermediate
// 160, vocab 512, untied) at batch 2 per rank and seq 32, AdamW for_loop.
inline ModelConfig IssueLlama() {
  ModelConfig config = *ModelFromPreset("tiny-llama");
  config.layers = 2;
  config.width = 64;
  config.heads = 4;
  config.kv_heads = 2;
  config.head_dim = 16;
  config.intermediate = 160;
  config.vocab = 512;
  config.tie_embeddings = false;
  config.batch = 2;
  config.seq = 32;
  return config;
}

}  // namespace rank_configs
}  // namespace memledger

#endif  // TESTS_RANK_CONFIGS_H_
