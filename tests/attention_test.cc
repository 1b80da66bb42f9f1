// Tests for runtime/attention: flash and math agree, flash's backward matches finite
// differences, and flash keeps PyTorch's memory layout.
#include "runtime/attention.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

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

TEST(AttentionTest, FlashAndMathAgreeInValueAndGradient) {
  Qkv in = MakeQkv(at::kFloat, /*batch=*/2, /*heads=*/2, /*seq=*/5, /*head_dim=*/3);
  at::Tensor weights = at::randn({2, 2, 5, 3});
  at::Tensor flash = FlashAttention(in.q, in.k, in.v);
  at::Tensor math = MathAttention(in.q, in.k, in.v);
  EXPECT_TRUE(at::allclose(flash, math, /*rtol=*/1e-5, /*atol=*/1e-6));
  std::vector<at::Tensor> inputs = {in.q, in.k, in.v};
  auto flash_grads = torch::autograd::grad({(flash * weights).sum()}, inputs);
  auto math_grads = torch::autograd::grad({(math * weights).sum()}, inputs);
  for (int i = 0; i < 3; ++i) {
    EXPECT_LE((flash_grads[i] - math_grads[i]).abs().max().item<double>(), 1e-5) << i;
  }
}

TEST(AttentionTest, FlashBackwardMatchesFiniteDifferences) {
  Qkv in = MakeQkv(at::kDouble, /*batch=*/1, /*heads=*/2, /*seq=*/3, /*head_dim=*/2);
  at::Tensor weights = at::randn({1, 2, 3, 2}, at::kDouble);
  std::vector<at::Tensor> inputs = {in.q, in.k, in.v};
  auto analytic =
      torch::autograd::grad({(FlashAttention(in.q, in.k, in.v) * weights).sum()}, inputs);
  const double eps = 1e-6;
  for (int which = 0; which < 3; ++which) {
    at::Tensor flat = inputs[which].detach().clone().reshape({-1});
    for (int64_t i = 0; i < flat.numel(); ++i) {
      auto loss_at = [&](double delta) {
        at::Tensor shifted = flat.clone();
        shifted[i] += delta;
        std::vector<at::Tensor> x = {in.q.detach(), in.k.detach(), in.v.detach()};
        x[which] = shifted.view(inputs[which].sizes());
        return (FlashAttentionForward(x[0], x[1], x[2]).out * weights).sum().item<double>();
      };
      const double numeric = (loss_at(eps) - loss_at(-eps)) / (2 * eps);
      EXPECT_NEAR(analytic[which].reshape({-1})[i].item<double>(), numeric, 1e-7)
          << "input " << which << " element " << i;
    }
  }
}

TEST(AttentionTest, FlashOutputsAreTransposedTokenMajorBuffers) {
  Qkv in = MakeQkv(at::kFloat, /*batch=*/2, /*heads=*/3, /*seq=*/4, /*head_dim=*/5);
  FlashOutputs outputs = FlashAttentionForward(in.q, in.k, in.v);
  EXPECT_EQ(outputs.out.sizes(), (std::vector<int64_t>{2, 3, 4, 5}));
  EXPECT_TRUE(outputs.out.transpose(1, 2).is_contiguous());
  EXPECT_TRUE(outputs.lse.transpose(1, 2).is_contiguous());
  // out: 2 x 4 x 3 x 5 x 4 B = 480; lse: 2 x 4 x 3 x 4 B = 96.
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
}

}  // namespace
}  // namespace memledger::runtime
