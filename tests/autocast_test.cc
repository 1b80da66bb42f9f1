// What LibTorch 2.15's CPU autocast does to the ops of memledger's graphs: the evidence
// behind the estimator's autocast rules (estimator/graph/block_graph.cc, GraphBuilder::Lower).
// Matmuls and SDPA run in the autocast dtype on cast copies (weights included); pow,
// rsqrt, layer_norm, softmax and log_softmax keep their input's dtype on the CPU (CUDA
// would run them in fp32); nll_loss runs in fp32; a mixed-dtype layer norm returns its
// statistics in the weight's dtype.
#include "runtime/autocast.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tuple>

#include "runtime/saved_tensor_recorder.h"

namespace memledger::runtime {
namespace {

TEST(AutocastTest, CpuRunsMatmulsLowAndLeavesNormsAndSoftmaxAlone) {
  at::manual_seed(0);
  at::Tensor x32 = at::randn({2, 8, 4}).requires_grad_(true);
  at::Tensor x16 = at::randn({2, 8, 4}).to(at::kBFloat16).requires_grad_(true);
  at::Tensor w = at::ones({4}).requires_grad_(true), b = at::zeros({4}).requires_grad_(true);
  ScopedAutocast autocast(at::kBFloat16);
  ASSERT_EQ(CurrentAutocast(), at::kBFloat16);
  EXPECT_EQ(at::matmul(x32, x32.transpose(1, 2)).scalar_type(), at::kBFloat16);
  EXPECT_EQ(at::linear(x32, at::ones({3, 4})).scalar_type(), at::kBFloat16);
  at::Tensor q = at::randn({2, 2, 8, 4});
  EXPECT_EQ(at::scaled_dot_product_attention(q, q, q, {}, 0.0, true).scalar_type(),
            at::kBFloat16);
  EXPECT_EQ(x16.pow(2).scalar_type(), at::kBFloat16);
  EXPECT_EQ(at::rsqrt(x16).scalar_type(), at::kBFloat16);
  EXPECT_EQ(at::softmax(x16, -1).scalar_type(), at::kBFloat16);
  EXPECT_EQ(at::log_softmax(x16, -1).scalar_type(), at::kBFloat16);
  auto [out, mean, rstd] = at::native_layer_norm(x16, {4}, w, b, 1e-5);
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  EXPECT_EQ(mean.scalar_type(), at::kFloat);  // the weight's dtype
  EXPECT_EQ(rstd.scalar_type(), at::kFloat);
  at::Tensor targets = at::zeros({16}, at::kLong);
  EXPECT_EQ(at::nll_loss(at::log_softmax(x16.view({-1, 4}), -1), targets).scalar_type(),
            at::kFloat);
}

TEST(AutocastTest, ALinearKeepsCastCopiesOfItsInputAndWeight) {
  // Linear(8 -> 4) without bias on fp32 x (3, 8): autocast casts x and the weight to
  // bf16; mm keeps both copies: 3 x 8 x 2 B = 48 and 4 x 8 x 2 B = 64. The fp32
  // parameter itself is excluded from the count.
  at::Tensor x = at::randn({3, 8}).requires_grad_(true);
  at::Tensor weight = at::randn({4, 8}).requires_grad_(true);
  SavedTensorRecorder recorder({StorageKey(weight)});
  {
    ScopedSavedTensorRecording recording(&recorder);
    ScopedAutocast autocast(at::kBFloat16);
    at::linear(x, weight);
  }
  EXPECT_EQ(recorder.bytes(), 48 + 64);
  EXPECT_EQ(recorder.num_storages(), 2);
}

TEST(AutocastTest, ScopesNestAndRestore) {
  EXPECT_FALSE(CurrentAutocast().has_value());
  {
    ScopedAutocast outer(at::kHalf);
    {
      ScopedAutocast none(std::nullopt);  // a no-op scope
      ScopedAutocast inner(at::kBFloat16);
      EXPECT_EQ(CurrentAutocast(), at::kBFloat16);
    }
    EXPECT_EQ(CurrentAutocast(), at::kHalf);
  }
  EXPECT_FALSE(CurrentAutocast().has_value());
}

}  // namespace
}  // namespace memledger::runtime
