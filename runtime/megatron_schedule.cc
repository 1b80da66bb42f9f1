#include "runtime/megatron_schedule.h"

#include <algorithm>

namespace memledger::runtime::distributed_internal {

std::vector<StageRange> ChunksOf(const ModelConfig& config, const ParallelSpec& parallel,
                                 int64_t stage) {
  const int64_t chunks = parallel.pp * parallel.virtual_stages;
  const int64_t per_chunk = config.layers / chunks;
  std::vector<StageRange> ranges;
  for (int64_t c = 0; c < parallel.virtual_stages; ++c) {
    const int64_t g = c * parallel.pp + stage;
    ranges.push_back(StageRange{g * per_chunk, per_chunk, /*prologue=*/g == 0,
                                /*head=*/g == chunks - 1});
  }
  return ranges;
}

std::vector<ScheduleStep> MegatronOrder(const ParallelSpec& p, int64_t stage) {
  const int64_t m = p.micro_batches, v = p.virtual_stages, pp = p.pp;
  const int64_t group = pp * v, total = m * v;
  int64_t warmup = 0;
  if (p.schedule == PipelineSchedule::k1F1B) {
    warmup = std::min(pp - stage - 1, m);
  } else {
    warmup = m == pp ? total : std::min((pp - stage - 1) * 2 + (v - 1) * pp, total);
  }
  auto micro_batch = [&](int64_t k) { return (k / group) * pp + k % pp; };
  auto forward = [&](int64_t k) { return ScheduleStep{true, micro_batch(k), (k % group) / pp}; };
  auto backward = [&](int64_t k) {
    return ScheduleStep{false, micro_batch(k), v - 1 - (k % group) / pp};
  };
  std::vector<ScheduleStep> order;
  for (int64_t k = 0; k < warmup; ++k) order.push_back(forward(k));
  for (int64_t k = 0; k < total - warmup; ++k) {
    order.push_back(forward(warmup + k));
    order.push_back(backward(k));
  }
  for (int64_t k = total - warmup; k < total; ++k) order.push_back(backward(k));
  return order;
}

}  // namespace memledger::runtime::distributed_internal
