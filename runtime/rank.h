// One rank process of the rank runtime (runtime/distributed.h): its shard of the model,
// its process groups, Megatron's pipeline schedule over its micro-batches, the
// gradients' reduction and its ZeRO stage's optimizer step, each variant verified and
// then counted by the allocator; it reports through its result files (rank_exchange.h).
#ifndef RUNTIME_RANK_H_
#define RUNTIME_RANK_H_

#include <cstdint>
#include <string>

#include "estimator/spec/config.h"
#include "estimator/request/parallel_spec.h"
#include "runtime/distributed.h"

namespace memledger::runtime::distributed_internal {

// RunRank runs rank `rank` of the run whose files are in `dir`. Throws c10::Error or
// std::exception on failure (RunRankWorker reports them).
void RunRank(const ModelConfig& config, const ParallelSpec& parallel,
             const DistributedRequest& request, const std::string& dir, int64_t rank);

}  // namespace memledger::runtime::distributed_internal

#endif  // RUNTIME_RANK_H_
