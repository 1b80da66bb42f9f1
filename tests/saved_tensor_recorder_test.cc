// Tests for runtime/saved_tensor_recorder: what the recording engine counts, and that
// nothing is recorded outside a scope.
#include "runtime/saved_tensor_recorder.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/engine.h>

#include <stdexcept>

namespace memledger::runtime {
namespace {

bool BaseEngineIsDefault() {
  return &torch::autograd::Engine::get_default_engine() ==
         &torch::autograd::Engine::get_base_engine();
}

TEST(SavedTensorRecorderTest, CountsUniqueStoragesOfAMatmulAndPowToy) {
  at::Tensor x = at::randn({3, 4});                         // input, no grad
  at::Tensor w = at::randn({4, 5}).requires_grad_(true);   // weight, a leaf
  SavedTensorRecorder recorder;
  at::Tensor loss;
  {
    ScopedSavedTensorRecording recording(&recorder);
    // MmBackward0 keeps x because w requires grad, but not w: x does not.
    at::Tensor y = at::mm(x, w);
    loss = y.pow(2).sum();  // PowBackward0 keeps y
  }
  // x: 3 x 4 x 4 B = 48; y: 3 x 5 x 4 B = 60. Total 108.
  EXPECT_EQ(recorder.bytes(), 48 + 60);
  EXPECT_EQ(recorder.num_storages(), 2);
  loss.backward();  // the hooks hand the tensors back intact
  EXPECT_TRUE(at::allclose(w.grad(), at::mm(x.t(), 2 * at::mm(x, w.detach()))));
}

TEST(SavedTensorRecorderTest, ExcludedStoragesAndViewsCountOnce) {
  at::Tensor w = at::randn({4, 4}).requires_grad_(true);
  at::Tensor x = at::randn({2, 8}).requires_grad_(true);
  SavedTensorRecorder recorder(/*excluded_storages=*/{StorageKey(w)});
  {
    ScopedSavedTensorRecording recording(&recorder);
    // Each mm keeps its view of x's storage and w (both require grad); w is excluded.
    at::Tensor a = at::mm(x.narrow(1, 0, 4), w);
    at::Tensor b = at::mm(x.narrow(1, 4, 4), w);
    (a + b).sum();
  }
  // Only x's storage: 2 x 8 x 4 B = 64, once, though packed twice.
  EXPECT_EQ(recorder.bytes(), 64);
  EXPECT_EQ(recorder.num_packs(), 4);  // x-view, w, x-view, w
}

TEST(SavedTensorRecorderTest, NothingIsRecordedAfterTheScopeEnds) {
  at::Tensor w = at::randn({4, 4}).requires_grad_(true);
  SavedTensorRecorder recorder;
  {
    ScopedSavedTensorRecording recording(&recorder);
    EXPECT_TRUE(IsRecording());
    EXPECT_FALSE(BaseEngineIsDefault());
    at::mm(w, w);
  }
  const int64_t packs = recorder.num_packs();
  const int64_t bytes = recorder.bytes();
  EXPECT_FALSE(IsRecording());
  EXPECT_TRUE(BaseEngineIsDefault());
  at::Tensor later = at::mm(w, w).exp().sum();
  later.backward();
  EXPECT_EQ(recorder.num_packs(), packs);
  EXPECT_EQ(recorder.bytes(), bytes);
}

TEST(SavedTensorRecorderTest, ScopeRestoresTheEngineWhenUnwinding) {
  SavedTensorRecorder recorder;
  try {
    ScopedSavedTensorRecording recording(&recorder);
    throw std::runtime_error("forward failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_FALSE(IsRecording());
  EXPECT_TRUE(BaseEngineIsDefault());
  // A second scope works after the first unwound.
  SavedTensorRecorder second;
  {
    ScopedSavedTensorRecording recording(&second);
    at::Tensor w = at::randn({2, 2}).requires_grad_(true);
    w.exp();  // ExpBackward0 keeps its result: 2 x 2 x 4 B = 16
  }
  EXPECT_EQ(second.bytes(), 16);
}

TEST(SavedTensorRecorderTest, UniqueStorageBytesCountsBasesOnce) {
  at::Tensor base = at::zeros({10});  // 40 B
  at::Tensor other = at::zeros({3});  // 12 B
  EXPECT_EQ(UniqueStorageBytes({base.narrow(0, 0, 2), base.narrow(0, 5, 5), other}), 52);
}

}  // namespace
}  // namespace memledger::runtime
