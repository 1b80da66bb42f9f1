// Tests for runtime/attention: flash mode is PyTorch's CPU flash kernel, it keeps what
// the estimator says (q, k, v, out and logsumexp, laid out token-major), flash and math
// agree, and the selective-cache path has the real kernel's gradients.
#include "runtime/attention.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include <vector>

#include "runtime/saved_tensor_recorder.h"

namespace memledger::runtime {
namespace {

struct Qkv {
  at::Tensor q, k, v;
};

Qkv MakeQkv(at::ScalarType dtype, int64_t batch, int64_t heads, int64_t seq,
            int64_t head_dim) {
  at::manual_seed(7);
  // Like the block's: views of one (B, T, 3, H, dh) tensor.
  at::Tensor qkv = at::randn({batch, seq, 3, heads, head_dim}, at::dtype(dtype))
                       .requires_grad_(true);
  at::Tensor parts = qkv.permute({2, 0, 3, 1, 4});
  return {parts.select(0, 0), parts.select(0, 1), parts.select(0, 2)};
}

double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

TEST(AttentionTest, FlashIsTheCpuFlashKernel) {
  Qkv in = MakeQkv(at::kFloat, /*batch=*/2, /*heads=*/2, /*seq=*/5, /*head_dim=*/3);
  at::Tensor out = FlashAttention(in.q, in.k, in.v);
  ASSERT_NE(out.grad_fn(), nullptr);
  EXPECT_EQ(out.grad_fn()->name(), "ScaledDotProductFlashAttentionForCpuBackward0");
}

TEST(AttentionTest, FlashAndMathAgreeInValueAndGradient) {
  Qkv in = MakeQkv(at::kFloat, /*batch=*/2, /*heads=*/2, /*seq=*/5, /*head_dim=*/3);
  at::Tensor weights = at::randn({2, 2, 5, 3});
  at::Tensor flash = FlashAttention(in.q, in.k, in.v);
  at::Tensor math = MathAttention(in.q, in.k, in.v);
  EXPECT_TRUE(at::allclose(flash, math, /*rtol=*/1e-5, /*atol=*/1e-6));
  std::vector<at::Tensor> inputs = {in.q, in.k, in.v};
  auto flash_grads = torch::autograd::grad({(flash * weights).sum()}, inputs);
  auto math_grads = torch::autograd::grad({(math * weights).sum()}, inputs);
  for (int i = 0; i < 3; ++i) EXPECT_LE(MaxAbsDiff(flash_grads[i], math_grads[i]), 1e-5) << i;
}

TEST(AttentionTest, CachedFlashHasTheKernelsOutputAndGradients) {
  Qkv in = MakeQkv(at::kFloat, /*batch=*/2, /*heads=*/3, /*seq=*/6, /*head_dim=*/4);
  at::Tensor weights = at::randn({2, 3, 6, 4});
  std::vector<at::Tensor> inputs = {in.q, in.k, in.v};
  at::Tensor direct = FlashAttention(in.q, in.k, in.v);
  FlashOutputs cached;
  {
    at::NoGradGuard no_grad;  // as selective checkpointing fills its cache
    cached = FlashAttentionOutputs(in.q, in.k, in.v);
  }
  at::Tensor replayed = FlashAttentionFromCache(in.q, in.k, in.v, cached);
  // No copy: a new tensor on the cached storage, so that the cached tensor itself never
  // takes the replay's node as its grad_fn.
  EXPECT_TRUE(replayed.is_alias_of(cached.out));
  EXPECT_FALSE(replayed.is_same(cached.out));
  EXPECT_FALSE(cached.out.requires_grad());
  EXPECT_EQ(MaxAbsDiff(direct, replayed), 0.0);
  auto direct_grads = torch::autograd::grad({(direct * weights).sum()}, inputs);
  auto replayed_grads = torch::autograd::grad({(replayed * weights).sum()}, inputs);
  // The same kernel on the same saved tensors: bit-identical.
  for (int i = 0; i < 3; ++i) EXPECT_EQ(MaxAbsDiff(direct_grads[i], replayed_grads[i]), 0.0) << i;
}

TEST(AttentionTest, FlashOutputsAreTransposedTokenMajorBuffers) {
  Qkv in = MakeQkv(at::kFloat, /*batch=*/2, /*heads=*/3, /*seq=*/4, /*head_dim=*/5);
  FlashOutputs outputs = FlashAttentionOutputs(in.q, in.k, in.v);
  EXPECT_EQ(outputs.out.sizes(), (std::vector<int64_t>{2, 3, 4, 5}));
  EXPECT_EQ(outputs.lse.sizes(), (std::vector<int64_t>{2, 3, 4}));
  EXPECT_TRUE(outputs.out.transpose(1, 2).is_contiguous());
  EXPECT_TRUE(outputs.lse.transpose(1, 2).is_contiguous());
  // out: 2 x 4 x 3 x 5 x 4 B = 480; lse (fp32): 2 x 4 x 3 x 4 B = 96.
  EXPECT_EQ(StorageBytes(outputs.out), 480);
  EXPECT_EQ(StorageBytes(outputs.lse), 96);
}

TEST(AttentionTest, FlashKeepsQkvOutAndLogsumexpOnly) {
  // B=2, T=4, H=3, dh=5, d=15. Kept: the qkv storage 2 x 4 x 45 x 4 B = 1440,
  // out 2 x 4 x 15 x 4 B = 480, lse 2 x 4 x 3 x 4 B = 96: 2016 bytes, no T x T matrix.
  Qkv in = MakeQkv(at::kFloat, /*batch=*/2, /*heads=*/3, /*seq=*/4, /*head_dim=*/5);
  SavedTensorRecorder recorder;
  {
    ScopedSavedTensorRecording recording(&recorder);
    FlashAttention(in.q, in.k, in.v);
  }
  EXPECT_EQ(recorder.bytes(), 1440 + 480 + 96);
  EXPECT_EQ(recorder.num_storages(), 3);
}

}  // namespace
}  // namespace memledger::runtime
