#include "runtime/ddp_reducers.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <string>
#include <unordered_map>
#include <utility>

#include "estimator/parallel/ddp_buckets.h"

namespace memledger::runtime::distributed_internal {

DdpReducers::DdpReducers(const std::vector<std::vector<at::Tensor>>& chunk_parameters,
                         GroupPtr group, const DdpOptions& options)
    : parameters_(chunk_parameters) {
  const DdpBucketCaps caps = DdpBucketCapsOf(options.bucket_cap_mb);
  // The Reducer takes a ProcessGroup: Gloo as its CPU backend, as
  // init_process_group("gloo") builds it (distributed_c10d.py, _new_process_group_helper).
  auto process_group = c10::make_intrusive<c10d::ProcessGroup>(group->getRank(), group->getSize());
  process_group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, group);
  process_group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  for (const std::vector<at::Tensor>& parameters : chunk_parameters) {
    TORCH_CHECK(!parameters.empty(), "DDP over a model chunk without parameters");
    // _ddp_init_helper: compute_bucket_size_limits gives [sys.maxsize] without
    // find_unused_parameters, so the first bucketing is one bucket of every parameter
    // (then reversed, a no-op for one bucket).
    std::vector<size_t> all(parameters.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    reducers_.push_back(std::make_shared<c10d::Reducer>(
        parameters, std::vector<std::vector<size_t>>{all}, process_group,
        /*expect_sparse_gradients=*/std::vector<bool>(parameters.size(), false),
        /*bucket_bytes_cap=*/caps.rest, /*find_unused_parameters=*/false,
        options.gradient_as_bucket_view, /*param_names=*/std::unordered_map<size_t, std::string>{},
        /*first_bucket_bytes_cap=*/caps.first, /*skip_all_reduce_unused_params=*/false,
        /*use_python_reducer=*/false,
        // bucket_size_limits_for_rebuilding: empty, the Reducer's own {first, cap}.
        /*bucket_bytes_cap_list=*/std::vector<int64_t>{}));
  }
}

DdpReducers::~DdpReducers() = default;

void DdpReducers::BeforeStep() {
  for (const auto& reducer : reducers_) {
    reducer->prepare_for_forward();
    reducer->rebuild_buckets();  // true once, after the first iteration
  }
}

void DdpReducers::BeforeSyncingBackward(size_t chunk) {
  // _post_forward without find_unused_parameters: prepare_for_backward([]).
  reducers_.at(chunk)->prepare_for_backward({});
}

int64_t DdpReducers::BucketBytes() const {
  int64_t bytes = 0;
  for (const auto& reducer : reducers_) {
    for (const c10d::GradBucket& bucket : reducer->get_grad_buckets(/*return_zero_tensors=*/false)) {
      bytes += static_cast<int64_t>(bucket.getBuffer().nbytes());
    }
  }
  return bytes;
}

}  // namespace memledger::runtime::distributed_internal
