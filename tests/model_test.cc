// The model code releases every intermediate at its last use, as Python's reference
// counting does in the equivalent PyTorch module (docs/DESIGN.md, "Peak memory"): measured
// with the counting allocator on a graph-free forward, where nothing is saved, so any
// C++ scope that keeps a tensor alive shows up in the peak.
#include "runtime/model.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "estimator/spec/config.h"
#include "runtime/counting_allocator.h"

namespace memledger::runtime {
namespace {

// One study block, width 8, 2 heads (d_head 4), batch 1, seq 4, fp32, one thread,
// without grad. (B, T, d) = 128 B. By hand, live bytes after each op when each tensor
// dies after its last reader:
//   ln1: out 128 + mean 16 + rstd 16 = 160, the statistics die (no reader) -> 128
//   qkv: +384 -> 512, ln1 out dies -> 384
//   SDPA: out 128, lse 32, workspace 160 (1 thread x (4x4 + 2x4 + 4x4) floats) -> 704,
//         workspace and lse die, then qkv -> 128
//   proj: +128 -> 256, SDPA out dies -> 128;  residual: +128 -> 256, proj out dies -> 128
//   ln2: 160 more -> 288 -> 256;  fc1: +512 -> 768, ln2 out dies -> 640
//   gelu: +512 -> 1152 (the peak), fc1 out dies -> 640;  fc2: +128 -> 768, gelu out dies
//   -> 256;  output: +128 -> 384, then the residual and fc2's output die -> 128.
// Any named local kept to the end of forward() (ln1's or fc1's output, qkv, ...) would
// raise the peak or leave more than the output alive.
TEST(ModelTest, GraphFreeBlockForwardFreesEachIntermediateAtItsLastUse) {
  ModelConfig tiny = StudyModel(/*layers=*/1, /*width=*/8, /*heads=*/2,
                                /*batch=*/1, /*seq=*/4);
  ModelAndInput built = BuildModel(tiny, /*seed=*/0);
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  int64_t peak = 0, after = 0;
  {
    at::NoGradGuard no_grad;
    ScopedCountingAllocator counting;
    at::Tensor out =
        built.model->layer(0)->forward(built.input, {}, AttentionMode::kFlash, nullptr);
    peak = counting.peak_bytes();
    after = counting.live_bytes();
  }
  at::set_num_threads(threads);
  EXPECT_EQ(peak, 1152);
  EXPECT_EQ(after, 128);
}

}  // namespace
}  // namespace memledger::runtime
