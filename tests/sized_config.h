// Test configs at degenerate sizes: the walk memo and the plans' shared structures are
// keyed by which tensors share a storage, which batches, sequences and head counts of 1
// change (a transpose that is contiguous, a reshape that views).
#ifndef TESTS_SIZED_CONFIG_H_
#define TESTS_SIZED_CONFIG_H_

#include <cstdint>

#include "estimator/spec/config.h"

namespace memledger {

// Sized is `config` at batch `batch` and sequence `seq`, with one head (and kv head) of
// the whole width when `one_head`.
inline ModelConfig Sized(ModelConfig config, int64_t batch, int64_t seq, bool one_head) {
  config.batch = batch;
  config.seq = seq;
  if (one_head) {
    config.heads = 1;
    config.kv_heads = 1;
    config.head_dim = config.width;
  }
  return config;
}

}  // namespace memledger

#endif  // TESTS_SIZED_CONFIG_H_
