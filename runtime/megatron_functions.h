// Megatron-LM's tensor- and sequence-parallel autograd functions (f and g, the
// vocabulary-parallel embedding and cross-entropy, scatter, reduce-scatter and the
// gather-linear) over one tensor-parallel Gloo group, as the model's TensorParallel.
#ifndef RUNTIME_MEGATRON_FUNCTIONS_H_
#define RUNTIME_MEGATRON_FUNCTIONS_H_

#include <cstdint>
#include <memory>

#include "runtime/gloo_collectives.h"
#include "runtime/model.h"

namespace memledger::runtime::distributed_internal {

// MakeGlooTensorParallel: rank `rank` of `size` in `group`, with Megatron's sequence
// parallelism or not.
std::unique_ptr<TensorParallel> MakeGlooTensorParallel(GroupPtr group, int64_t rank,
                                                       int64_t size, bool sequence_parallel);

}  // namespace memledger::runtime::distributed_internal

#endif  // RUNTIME_MEGATRON_FUNCTIONS_H_
