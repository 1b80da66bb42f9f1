// The data-parallel program of torch's DistributedDataParallel (TorchDdp): its buckets
// are resident (estimator/parallel/ddp_buckets.h sizes them), and its Reducer's hooks
// reduce the .grads in each chunk's last backward (the others under no_sync, as
// torch.distributed.pipelining's stages and gradient accumulation run them).
#include <memory>

#include "estimator/step/data_parallel_program.h"

namespace memledger::liveness_internal {
namespace {

class Ddp : public DataParallelProgram {
 public:
  using DataParallelProgram::DataParallelProgram;

  void LastBackward(bool last) override { syncing_ = last; }

  // The Reducer's hook on the parameter's AccumulateGrad node runs once the .grad is
  // accumulated (reducer.cpp, autograd_hook -> mark_variable_ready_dense): with no comm
  // hook, at::mul_out(bucket_view, grad, wrapped_scalar_tensor(1. / div_factor_)), an
  // 8-byte double converted to the gradient's dtype (Memory::ScalarOp); with
  // gradient_as_bucket_view, grad = bucket_view, and the .grad's own storage dies. The
  // bucket's all-reduce works in place on it (ProcessGroupGloo's and NCCL's buffers are
  // not ATen's); without the view, finalize_backward copies the averages back into the
  // .grads in place (copy_bucket_to_grad: grad.copy_(bucket_view)).
  void GradientAccumulated(const ParameterKey& parameter, DType dtype) override {
    if (!syncing_) return;
    memory().ScalarOp(dtype);
    if (!parallel().ddp.gradient_as_bucket_view) return;
    int& storage = grads().at(parameter);
    const int64_t bytes = memory().bytes(storage);
    memory().Unref(storage);
    // A view of the resident bucket: its bytes are the bucket's, counted there.
    storage = memory().Adopt(bytes, MemoryCategory::kCommunication);
  }

  // Reduced in the backward, into the buckets and back: the step is one process's.
  absl::Status ReduceAndStep() override { return OptimizerStep(GradientNumels()); }
  bool SyncsInLastBackward() const override { return true; }
  bool StepIsOneProcess() const override { return true; }

 private:
  bool syncing_ = false;
};

}  // namespace

std::unique_ptr<DataParallelProgram> MakeDdpProgram(Simulation& simulation) {
  return std::make_unique<Ddp>(simulation);
}

}  // namespace memledger::liveness_internal
