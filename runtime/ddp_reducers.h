// DdpReducers: torch's DistributedDataParallel as a data-parallel rank without ZeRO runs
// it, with torch's own c10d::Reducer (torch/csrc/distributed/c10d/reducer.cpp, in the
// wheel's libtorch_cpu), driven as DDP's Python wrapper drives it
// (torch/nn/parallel/distributed.py, torch 2.15.0):
//  - built as _ddp_init_helper builds it: one bucket of every parameter (with
//    find_unused_parameters False the first bucketing has no limit), bucket_bytes_cap
//    and first_bucket_bytes_cap from bucket_cap_mb (_BucketCapacityConfig), the
//    gradient_as_bucket_view option; the Reducer allocates its buckets then;
//  - before each forward, _pre_forward's prepare_for_forward() and _rebuild_buckets()
//    (after the first iteration: the buckets in the gradients' ready order, under the
//    caps);
//  - before a backward that syncs, _post_forward's prepare_for_backward({}): its hooks
//    on each parameter's AccumulateGrad copy (and divide) the .grad into its bucket,
//    all-reduce each full bucket on the process group, and at the backward's end copy
//    the averages back into the .grads (or leave them as the buckets' views).
// A rank with several model chunks (interleaved pipelines) has one Reducer per chunk,
// as torch.distributed.pipelining wraps each stage's module; only each chunk's last
// micro-batch's backward syncs (the others run under no_sync).
//
// Example:
//   DdpReducers ddp(chunk_parameters, dp_group, parallel.ddp);
//   ddp.BeforeStep();
//   ... forward ...
//   ddp.BeforeSyncingBackward(chunk);
//   loss.backward();  // the Reducer's hooks run, its buckets reduced
#ifndef RUNTIME_DDP_REDUCERS_H_
#define RUNTIME_DDP_REDUCERS_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "estimator/request/parallel_spec.h"
#include "runtime/gloo_collectives.h"

namespace c10d {
class Reducer;
}

namespace memledger::runtime::distributed_internal {

class DdpReducers {
 public:
  // chunk_parameters[c]: model chunk c's parameters (each gets a gradient in its
  // backward), in the module's order.
  DdpReducers(const std::vector<std::vector<at::Tensor>>& chunk_parameters, GroupPtr group,
              const DdpOptions& options);
  ~DdpReducers();
  DdpReducers(const DdpReducers&) = delete;
  DdpReducers& operator=(const DdpReducers&) = delete;

  // BeforeStep: each Reducer's _pre_forward (prepare_for_forward, and the buckets'
  // rebuild after the first iteration, which frees the old ones first).
  void BeforeStep();
  // BeforeSyncingBackward: the next backward of `chunk` reduces its gradients.
  void BeforeSyncingBackward(size_t chunk);
  // BucketBytes: what the Reducers' buckets hold now (one element per parameter's).
  int64_t BucketBytes() const;

 private:
  std::vector<std::shared_ptr<c10d::Reducer>> reducers_;
  std::vector<std::vector<at::Tensor>> parameters_;
};

}  // namespace memledger::runtime::distributed_internal

#endif  // RUNTIME_DDP_REDUCERS_H_
