// The layout search (planner/layout_search.h): its time model against hand arithmetic,
// and its layouts against a brute force that predicts every layout's ranks in full.
#include "planner/layout_search.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "estimator/spec/config.h"
#include "estimator/graph/family.h"
#include "estimator/request/parallel_spec.h"
#include "estimator/predict/predict.h"
#include "estimator/predict/ranks.h"
#include "estimator/request/run_request.h"
#include "planner/step_time.h"
#include "tests/status_matchers.h"

namespace memledger {
namespace {

// Round numbers: 1 PFLOP/s, NVLink 100 GB/s, the network 10 GB/s, memory 1 TB/s.
GpuSpec RoundGpu() {
  GpuSpec gpu;
  gpu.name = "round";
  gpu.bf16_flops = 1e15;
  gpu.fp32_flops = 1e14;
  gpu.memory_gib = 1;
  gpu.memory_bandwidth = 1e12;
  gpu.nvlink_bandwidth = 1e11;
  gpu.network_bandwidth = 1e10;
  return gpu;
}

// tp 2 x pp 2 x dp 2 on nodes of 4: the data group (2 x 2 = 4 GPUs) within a node, the
// stages across two. Activations (1, 1000, 1000) in bf16: 2e6 B.
StepTimeInput RoundLayout() {
  StepTimeInput in;
  in.tp = 2;
  in.pp = 2;
  in.dp = 2;  // ZeRO 1: the parameters whole
  in.micro_batches = 4;
  in.gpus_per_node = 4;
  in.seq = 1000;
  in.width = 1000;
  in.activation_element_bytes = 2;
  in.parameter_element_bytes = 2;
  in.low_precision_matmul = true;
  in.stage_flops = 1'000'000'000'000;  // 1e12
  in.tp_all_reduces = 10;
  in.stage_parameters = 1'000'000'000;  // 2e9 B
  in.stepped_elements = 500'000'000;    // ZeRO-1's half: 1e9 B
  in.optimizer_state_bytes = 6'000'000'000;
  return in;
}

TEST(StepTimeTest, OneFOneBByHand) {
  const StepTime t = PredictStepTime(RoundGpu(), 0.5, RoundLayout());
  // compute: 1e12 / (1e15 x 0.5) = 2 ms per micro-batch;
  // tp: 10 all-reduces x 2 x (1/2) x 2e6 B / 1e11 = 0.2 ms;
  // pp: 2 transfers, each of a rank's half (1e6 B) over the network (8 GPUs > a node
  // of 4) / 1e10 = 0.1 ms and the all-gather of the other half over NVLink, (1/2) x 2e6
  // / 1e11 = 0.01 ms: 0.22 ms; slot 2.42 ms; 4 micro-batches; the bubble one slot.
  EXPECT_DOUBLE_EQ(t.compute_s, 4 * 2e-3);
  EXPECT_DOUBLE_EQ(t.tp_s, 4 * 2e-4);
  EXPECT_DOUBLE_EQ(t.pp_s, 4 * 2.2e-4);
  EXPECT_DOUBLE_EQ(t.zero3_s, 0);
  EXPECT_DOUBLE_EQ(t.bubble_s, 2.42e-3);
  // dp: 2 x (1/2) x 2e9 B over NVLink (the group spans 4 GPUs) / 1e11 = 20 ms.
  EXPECT_DOUBLE_EQ(t.dp_s, 0.02);
  // optimizer: (3 x 1e9 + 2 x 6e9) B / 1e12 = 15 ms.
  EXPECT_DOUBLE_EQ(t.optimizer_s, 0.015);
  EXPECT_NEAR(t.total_s, 8e-3 + 8e-4 + 8.8e-4 + 2.42e-3 + 0.02 + 0.015, 1e-12);
}

TEST(StepTimeTest, ZeroThreeInterleavedAndSequenceParallelByHand) {
  StepTimeInput in = RoundLayout();
  in.gathers_parameters = true;  // ZeRO 3
  in.virtual_stages = 2;
  in.sp = true;
  const StepTime t = PredictStepTime(RoundGpu(), 0.5, in);
  // pp: 2 x 2 chunks x 1e6 B (the sequence's half, no all-gather) / 1e10 = 0.4 ms;
  // zero3: 3 x (1/2) x 2e9 / 1e11 = 30 ms per micro-batch; no reduction at the end;
  // the bubble half a slot.
  EXPECT_DOUBLE_EQ(t.pp_s, 4 * 4e-4);
  EXPECT_DOUBLE_EQ(t.zero3_s, 4 * 0.03);
  EXPECT_DOUBLE_EQ(t.dp_s, 0);
  EXPECT_DOUBLE_EQ(t.bubble_s, 0.5 * (2e-3 + 2e-4 + 4e-4 + 0.03));
}

TEST(StepTimeTest, OneNodeTalksOverNvlinkAndFp32UsesItsPeak) {
  StepTimeInput in = RoundLayout();
  in.gpus_per_node = 8;  // all 8 GPUs in one node
  in.low_precision_matmul = false;
  const StepTime t = PredictStepTime(RoundGpu(), 0.5, in);
  EXPECT_DOUBLE_EQ(t.pp_s, 4 * 2 * (1e6 / 1e11 + 0.5 * 2e6 / 1e11));
  EXPECT_DOUBLE_EQ(t.compute_s, 4 * 1e12 / (1e14 * 0.5));
}

// Expert parallelism: tp 1 x pp 1 x dp 8 with ep 4 on nodes of 4 GPUs, zero 0. The
// stage has 3 sparse layers, one checkpointed: 3 x 4 + 2 = 14 all-to-alls per
// micro-batch, each of (1 x 1000 tokens x 2 experts per token) rows of 1000 bf16.
TEST(StepTimeTest, ExpertParallelAllToAllsAndTheExpertsOwnReductionByHand) {
  StepTimeInput in = RoundLayout();
  in.tp = 1;
  in.pp = 1;
  in.dp = 8;
  in.ep = 4;
  in.ep_all_to_alls = 14;
  in.routed_rows = 2000;
  in.expert_parameters = 600'000'000;  // of the 1e9: 1.2e9 B of experts, 0.8e9 B rest
  StepTime t = PredictStepTime(RoundGpu(), 0.5, in);
  // ep: 14 x (3/4) x (2000 x 1000 x 2 B = 4e6 B) / 1e11 (the group's 4 GPUs are one
  // node) = 0.42 ms per micro-batch, 4 micro-batches.
  EXPECT_DOUBLE_EQ(t.ep_s, 4 * 14 * 0.75 * 4e6 / 1e11);
  // dp: the rest over the 8 ranks, 2 x (7/8) x 0.8e9 B, and the experts over the
  // 8 / 4 = 2 ranks holding the same ones, 2 x (1/2) x 1.2e9 B, across nodes (8 GPUs
  // > 4): / 1e10.
  EXPECT_DOUBLE_EQ(t.dp_s, (2 * 0.875 * 0.8e9 + 2 * 0.5 * 1.2e9) / 1e10);
  // No pipeline: no bubble; the slot's ep is in the step.
  EXPECT_DOUBLE_EQ(t.bubble_s, 0);
  EXPECT_NEAR(t.total_s, t.compute_s + t.tp_s + t.ep_s + t.dp_s + t.optimizer_s, 1e-12);
  // An expert-parallel group across nodes talks over the network.
  in.ep = 8;
  in.gpus_per_node = 4;
  t = PredictStepTime(RoundGpu(), 0.5, in);
  EXPECT_DOUBLE_EQ(t.ep_s, 4 * 14 * 0.875 * 4e6 / 1e10);
}

TEST(StepTimeTest, PresetsNameTheirSource) {
  for (const char* name : {"h100", "h200", "a100"}) {
    ASSERT_OK_AND_ASSIGN(GpuSpec gpu, GpuPreset(name));
    EXPECT_GT(gpu.bf16_flops, gpu.fp32_flops);
    EXPECT_FALSE(gpu.source.empty());
  }
  const absl::Status unknown = GpuPreset("v100").status();
  EXPECT_TRUE(absl::IsInvalidArgument(unknown));
  EXPECT_EQ(unknown.message(), "--gpu must be one of h100, h200, a100, got 'v100'");
}

// tiny-llama at 4 layers, seq 8, on 4 GPUs with a global batch of 4.
RunRequest Tiny() {
  RunRequest request;
  request.model = "tiny-llama";
  request.layers = 4;
  request.seq = 8;
  return request;
}

SearchOptions TinyOptions(int64_t budget) {
  SearchOptions options;
  options.gpus = 4;
  options.gpus_per_node = 4;
  options.global_batch = 4;
  options.budget_bytes = budget;
  options.gpu = RoundGpu();
  options.max_virtual_stages = 2;
  options.threads = 2;
  // The standard variants only: the brute force below knows no per-stage plans
  // (search_cli_test checks those against predict and LibTorch).
  options.planned_layouts = 0;
  return options;
}

using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, bool, int64_t, int64_t, std::string>;

// BruteForce predicts every layout's ranks with their peaks (no bound, no pruning), as
// the search's definition reads: tp x pp x dp = 4, pp dividing 4 layers, dp x mbs x m =
// 4, interleaving (v = 2) where each stage's layers and the micro-batches allow, ZeRO
// 0-3 with dp > 1, sp with tp > 1; returns each variant's most loaded peak.
// RankPeaks: a layout's most loaded allocated peak and, on CUDA, its ranks' largest
// reserved peak (the caching allocator's simulation).
struct RankPeaks {
  int64_t allocated = 0;
  int64_t reserved = 0;
};

std::map<Key, RankPeaks> BruteForceOf(const RunRequest& request) {
  const RunSpec base = *RunSpecFromRequest(request);
  std::map<Key, RankPeaks> peaks;
  for (int64_t tp : {1, 2, 4}) {
    for (int64_t pp : {1, 2, 4}) {
      if (4 % (tp * pp) != 0) continue;
      const int64_t dp = 4 / (tp * pp);
      for (int64_t mbs = 1; mbs <= 4 / dp; ++mbs) {
        if ((4 / dp) % mbs != 0) continue;
        const int64_t m = 4 / dp / mbs;
        for (int64_t v : {1, 2}) {
          if (v == 2 && (pp == 1 || (4 / pp) % 2 != 0 || m % pp != 0)) continue;
          for (int64_t zero = 0; zero <= (dp > 1 ? 3 : 0); ++zero) {
            for (bool sp : {false, true}) {
              if (sp && tp == 1) continue;
              ParallelSpec parallel{dp, pp, v, m, zero,
                                    v > 1 ? PipelineSchedule::kInterleaved
                                          : PipelineSchedule::k1F1B,
                                    {}, {}, tp, sp};
              ModelConfig config = base.config;
              config.shard = ShardOf(parallel);
              config.batch = mbs;
              if (!ValidateConfig(config).ok() || !ValidateParallel(config, parallel).ok() ||
                  !ValidateRun(config, base.attention, base.variants, base.optimizer).ok()) {
                continue;
              }
              PredictOptions options;
              options.variants = base.variants;
              absl::StatusOr<RanksPrediction> ranks = PredictRanks(config, parallel, options);
              if (!ranks.ok()) continue;
              for (size_t i = 0; i < base.variants.size(); ++i) {
                RankPeaks peak;
                for (const RankKind& kind : ranks->kinds) {
                  const VariantPrediction& held = kind.variants[i].held;
                  EXPECT_TRUE(held.peak.has_value()) << held.peak_unavailable;
                  if (!held.peak.has_value()) continue;
                  peak.allocated = std::max(peak.allocated, held.peak->bytes);
                  peak.reserved = std::max(peak.reserved, held.peak_reserved_bytes);
                  // The search's bound: parameters, state and the saved tensors in flight
                  // are live together, so they never exceed the peak.
                  EXPECT_LE(kind.param_bytes + kind.optimizer_state_bytes + held.saved_bytes,
                            held.peak->bytes);
                }
                peaks[{tp, pp, dp, zero, sp, mbs, v, base.variants[i].Name()}] = peak;
              }
            }
          }
        }
      }
    }
  }
  return peaks;
}

std::map<Key, int64_t> BruteForce() {
  std::map<Key, int64_t> allocated;
  for (const auto& [key, peaks] : BruteForceOf(Tiny())) allocated[key] = peaks.allocated;
  return allocated;
}

Key KeyOf(const SearchedLayout& l) {
  return {l.tp, l.pp, l.dp, l.zero, l.sp, l.micro_batch_size, l.virtual_stages,
          l.checkpoint.Name()};
}

TEST(LayoutSearchTest, KeepsExactlyTheLayoutsThatFitFastestFirst) {
  const std::map<Key, int64_t> all = BruteForce();
  ASSERT_GT(all.size(), 100u);
  // A budget between the smallest and the largest peak: some fit, some do not.
  std::vector<int64_t> peaks;
  for (const auto& [key, peak] : all) peaks.push_back(peak);
  std::sort(peaks.begin(), peaks.end());
  const int64_t budget = peaks[peaks.size() / 2];
  std::map<Key, int64_t> expected;
  for (const auto& [key, peak] : all) {
    if (peak <= budget) expected[key] = peak;
  }
  ASSERT_OK_AND_ASSIGN(SearchResult result, SearchLayouts(Tiny(), TinyOptions(budget)));
  std::map<Key, int64_t> found;
  for (const SearchedLayout& l : result.layouts) {
    EXPECT_EQ(l.micro_batches * l.micro_batch_size * l.dp, 4);
    found[KeyOf(l)] = l.peak_bytes;
  }
  EXPECT_EQ(found, expected);
  EXPECT_EQ(result.too_big, static_cast<int64_t>(all.size() - expected.size()));
  EXPECT_EQ(result.candidates, result.too_big + result.invalid + result.unmodelled +
                                   static_cast<int64_t>(result.layouts.size()));
  EXPECT_EQ(result.unmodelled, 0);
  // Fewer simulated than enumerated: the bound ruled some out unsimulated.
  EXPECT_LT(result.simulated, static_cast<int64_t>(all.size() / 4));
  // Fastest first; the front: every layout with a lower peak than all faster ones.
  int64_t lowest = std::numeric_limits<int64_t>::max();
  for (size_t i = 0; i < result.layouts.size(); ++i) {
    const SearchedLayout& l = result.layouts[i];
    if (i > 0) {
      EXPECT_GE(l.time.total_s, result.layouts[i - 1].time.total_s);
    }
    EXPECT_EQ(l.front, l.peak_bytes < lowest) << i;
    lowest = std::min(lowest, l.peak_bytes);
    EXPECT_GT(l.time.compute_s, 0);
    EXPECT_GT(l.tflops_per_gpu, 0);
  }
}

// On --device=cuda the search counts each storage as its request (rounded to 512 B),
// then replays the best layouts through the caching allocator's simulation until
// checked_layouts fit. With expandable segments the allocator splits every block to
// size, so the requests are its allocated bytes exactly: every layout's peak, checked
// or not, equals the brute force's replay through the allocator (PredictRanks'
// default), and each checked one's device bytes are its reserved peak plus the CUDA
// context.
TEST(LayoutSearchTest, OnCudaRequestsFindTheLayoutsAndTheAllocatorChecksTheBest) {
  RunRequest request = Tiny();
  request.device = "cuda";
  request.expandable_segments = true;
  const std::map<Key, RankPeaks> all = BruteForceOf(request);
  ASSERT_GT(all.size(), 100u);
  const int64_t context = RunSpecFromRequest(request)->config.cuda_context_bytes;
  ASSERT_GT(context, 0);
  SearchOptions options = TinyOptions(int64_t{1} << 30);
  options.checked_layouts = 6;
  ASSERT_OK_AND_ASSIGN(SearchResult result, SearchLayouts(request, options));
  EXPECT_TRUE(result.cuda);
  EXPECT_EQ(result.outside_allocator_bytes, context);
  EXPECT_EQ(result.layouts.size(), all.size());  // 1 GiB holds every one
  int64_t checked = 0;
  for (size_t i = 0; i < result.layouts.size(); ++i) {
    const SearchedLayout& l = result.layouts[i];
    const RankPeaks& expected = all.at(KeyOf(l));
    EXPECT_EQ(l.peak_bytes, expected.allocated) << l.flags;
    EXPECT_EQ(l.checked, i < 6) << l.flags;  // nothing dropped: the best 6
    if (!l.checked) continue;
    ++checked;
    EXPECT_EQ(l.peak_reserved_bytes, expected.reserved) << l.flags;
    EXPECT_EQ(l.device_bytes, expected.reserved + context) << l.flags;
  }
  EXPECT_EQ(checked, 6);
  EXPECT_EQ(result.checked, 6);
  EXPECT_EQ(result.dropped_when_checked, 0);
}

// Without expandable segments the allocator may reserve more than the requests: a
// budget that the requests of the fastest layouts fit but their reserve does not drops
// them, and every layout kept as checked fits by its replay.
TEST(LayoutSearchTest, OnCudaTheAllocatorsReserveDropsWhatOnlyTheRequestsFit) {
  RunRequest request = Tiny();
  request.device = "cuda";
  // Long enough that the layouts' blocks leave the small pool (1 MiB and under) and
  // their reserves differ.
  request.seq = 8192;
  const std::map<Key, RankPeaks> all = BruteForceOf(request);
  const int64_t context = RunSpecFromRequest(request)->config.cuda_context_bytes;
  SearchOptions roomy = TinyOptions(int64_t{1} << 30);
  roomy.checked_layouts = 0;
  ASSERT_OK_AND_ASSIGN(SearchResult unchecked, SearchLayouts(request, roomy));
  // A budget that the fastest layout's requests fit and its reserve does not
  // (reserved >= allocated >= requests), and that at least 4 layouts' reserve fits: the
  // largest such device size of some layout.
  const SearchedLayout& fastest = unchecked.layouts.front();
  EXPECT_FALSE(fastest.checked);
  const int64_t fastest_device = all.at(KeyOf(fastest)).reserved + context;
  int64_t budget = -1;
  for (const auto& [key, peaks] : all) {
    const int64_t device = peaks.reserved + context;
    if (device >= fastest_device || fastest.peak_bytes + context > device) continue;
    int64_t fitting = 0;
    for (const auto& [other, other_peaks] : all) {
      fitting += other_peaks.reserved + context <= device;
    }
    if (fitting >= 4) budget = std::max(budget, device);
  }
  ASSERT_GT(budget, 0) << "no budget between the fastest layout's requests and reserve";
  SearchOptions options = TinyOptions(budget);
  options.checked_layouts = 4;
  ASSERT_OK_AND_ASSIGN(SearchResult result, SearchLayouts(request, options));
  EXPECT_GE(result.dropped_when_checked, 1);
  EXPECT_EQ(result.checked, 4 + result.dropped_when_checked);
  int64_t checked = 0;
  for (const SearchedLayout& l : result.layouts) {
    EXPECT_NE(l.flags, fastest.flags);
    if (!l.checked) continue;
    const RankPeaks& expected = all.at(KeyOf(l));
    EXPECT_EQ(l.peak_bytes, expected.allocated) << l.flags;
    EXPECT_EQ(l.device_bytes, expected.reserved + context) << l.flags;
    EXPECT_LE(l.device_bytes, budget) << l.flags;
    ++checked;
  }
  EXPECT_EQ(checked, 4);
}

TEST(LayoutSearchTest, ConstraintsKeepTheLayoutsThatMeetThem) {
  ASSERT_OK_AND_ASSIGN(SearchResult all, SearchLayouts(Tiny(), TinyOptions(int64_t{1} << 30)));
  SearchOptions options = TinyOptions(int64_t{1} << 30);
  options.fixed.tp = 2;
  options.fixed.zero = 0;
  options.fixed.micro_batch_size = 1;
  ASSERT_OK_AND_ASSIGN(SearchResult fixed, SearchLayouts(Tiny(), options));
  std::vector<std::string> expected, found;
  for (const SearchedLayout& l : all.layouts) {
    if (l.tp == 2 && l.zero == 0 && l.micro_batch_size == 1) expected.push_back(l.flags);
  }
  for (const SearchedLayout& l : fixed.layouts) found.push_back(l.flags);
  ASSERT_FALSE(expected.empty());
  EXPECT_EQ(found, expected);
  options.fixed.tp = 3;  // no layout of 4 GPUs
  EXPECT_TRUE(absl::IsInvalidArgument(SearchLayouts(Tiny(), options).status()));
}

TEST(LayoutSearchTest, FlagsSayTheLayout) {
  ASSERT_OK_AND_ASSIGN(SearchResult result, SearchLayouts(Tiny(), TinyOptions(int64_t{1} << 30)));
  for (const SearchedLayout& l : result.layouts) {
    RunRequest request = Tiny();
    request.batch = l.micro_batch_size;
    request.tp = l.tp;
    request.sp = l.sp;
    request.dp = l.dp;
    request.pp = l.pp;
    request.zero = l.zero;
    request.micro_batches = l.micro_batches;
    request.virtual_stages = l.virtual_stages;
    request.schedule = l.virtual_stages > 1 ? "interleaved" : "1f1b";
    request.variants = l.checkpoint.Name();
    EXPECT_EQ(l.flags, RequestFlags(request));
  }
  // One by hand.
  RunRequest request = Tiny();
  request.batch = 2;
  request.tp = 2;
  request.sp = true;
  request.dp = 2;
  request.micro_batches = 1;
  request.zero = 3;
  request.variants = "every_2";
  EXPECT_EQ(RequestFlags(request),
            "--model=tiny-llama --batch=2 --seq=8 --layers=4 --variants=every_2 --tp=2 --sp "
            "--dp=2 --zero=3");
}

TEST(LayoutSearchTest, NoLayoutFitsNamesTheSmallestPeak) {
  const std::map<Key, int64_t> all = BruteForce();
  int64_t smallest = std::numeric_limits<int64_t>::max();
  for (const auto& [key, peak] : all) smallest = std::min(smallest, peak);
  absl::StatusOr<SearchResult> result = SearchLayouts(Tiny(), TinyOptions(1024));
  ASSERT_TRUE(absl::IsResourceExhausted(result.status())) << result.status();
  EXPECT_NE(result.status().message().find("(" + std::to_string(smallest) + " bytes)"),
            std::string::npos)
      << result.status();
}

// search --fsdp lays out torch's FSDP2 over every GPU (fully_shard is modelled without
// tp, pp or ep): 4 ranks of the global batch of 4, one micro-batch of 1 sequence each,
// for each variant. Each listed layout's peak is predict's for it (its flags rebuilt here
// by hand: --dp=4 --fsdp --batch=1).
TEST(LayoutSearchTest, FsdpLaysOutFsdp2OverEveryGpu) {
  RunRequest request = Tiny();
  request.fsdp = true;
  ASSERT_OK_AND_ASSIGN(SearchResult result, SearchLayouts(request, TinyOptions(1 << 30)));
  EXPECT_EQ(result.layouts.size(), 4u);  // none, full, every_k, selective
  ASSERT_FALSE(result.layouts.empty());
  for (const SearchedLayout& l : result.layouts) {
    EXPECT_TRUE(l.fsdp);
    EXPECT_EQ((std::tuple{l.tp, l.pp, l.dp, l.zero, l.ep}), (std::tuple{1, 1, 4, 0, 1}));
    EXPECT_NE(l.flags.find("--fsdp"), std::string::npos) << l.flags;
    RunRequest alone = Tiny();
    alone.fsdp = true;
    alone.dp = 4;
    alone.batch = l.micro_batch_size;
    alone.micro_batches = l.micro_batches;
    ASSERT_OK_AND_ASSIGN(RunSpec spec, RunSpecFromRequest(alone));
    PredictOptions options;
    options.variants = {l.checkpoint};
    options.peak = true;
    ASSERT_OK_AND_ASSIGN(RanksPrediction ranks,
                         PredictRanks(spec.config, spec.parallel, options));
    ASSERT_TRUE(ranks.kinds[0].variants[0].held.peak.has_value());
    EXPECT_EQ(l.peak_bytes, ranks.kinds[0].variants[0].held.peak->bytes) << l.flags;
    // The rank steps its quarter of the parameters (RankShards::optimizer_state), not
    // all of them: the step time's optimizer reads and writes 3 x the shard's fp32
    // bytes and 2 x its state's at the round GPU's 1e12 B/s (planner/step_time.h).
    const double shard = static_cast<double>((result.n_params + 3) / 4);
    EXPECT_DOUBLE_EQ(
        l.time.optimizer_s,
        (3 * shard * 4 + 2 * static_cast<double>(ranks.kinds[0].optimizer_state_bytes)) / 1e12)
        << l.flags;
  }
  RunRequest mixed = request;
  mixed.mp_param_dtype = "bf16";
  mixed.dtype = "bf16";
  SearchOptions one = TinyOptions(1 << 30);
  one.gpus = 1;
  for (const auto& [bad, options, message] :
       {std::tuple{mixed, TinyOptions(1 << 30),
                   "--mp_param_dtype: FSDP2's mixed precision is modelled over fp32 parameters"},
        std::tuple{request, one, "--fsdp shards over the data-parallel ranks: it needs --gpus > 1"}}) {
    absl::StatusOr<SearchResult> refused = SearchLayouts(bad, options);
    EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << message;
    EXPECT_NE(refused.status().message().find(message), std::string::npos) << refused.status();
  }
}

// The search validates its request once and each layout once: a candidate's config, its
// layout and its run where it is enumerated (its two predictions and its FLOPs take the
// proof), and again only where the allocator re-checks it on CUDA (its flags as predict
// reads them). Before, each candidate's config was checked some 30 times (the FLOPs
// walked each segment through a validating entry): 1,681 for these 51 layouts.
TEST(LayoutSearchTest, ValidatesTheRequestOnceAndEachLayoutOnce) {
  for (const bool cuda : {false, true}) {
    SCOPED_TRACE(cuda ? "cuda" : "cpu");
    RunRequest request = Tiny();
    if (cuda) request.device = "cuda";
    const int64_t configs = ValidateConfigCalls(), layouts = ValidateParallelCalls();
    ASSERT_OK_AND_ASSIGN(SearchResult result, SearchLayouts(request, TinyOptions(1 << 30)));
    const int64_t shapes = result.candidates / 4;  // none, full, every_k, selective each
    EXPECT_EQ(result.planned, 0);
    EXPECT_EQ(result.checked, cuda ? 10 : 0);
    EXPECT_EQ(ValidateConfigCalls() - configs, 1 + shapes + result.checked);
    // A layout whose config is refused (tp not dividing the heads) never reaches its own.
    EXPECT_LE(ValidateParallelCalls() - layouts, shapes + result.checked);
    EXPECT_GT(ValidateParallelCalls() - layouts, result.checked);
  }
}

TEST(LayoutSearchTest, BadInputNamesTheFlag) {
  struct Case {
    SearchOptions options;
    RunRequest request;
    const char* message;
  };
  SearchOptions twelve = TinyOptions(1 << 30);
  twelve.gpus = 12;
  twelve.gpus_per_node = 8;
  SearchOptions odd_batch = TinyOptions(1 << 30);
  odd_batch.gpus = 4;
  odd_batch.global_batch = 3;
  odd_batch.gpus_per_node = 1;  // tp 1; pp 1, 2 or 4 (4 layers): dp 4, 2 or 1
  RunRequest lopsided = Tiny();
  lopsided.layers = 3;  // pp 1 only: dp 4 must divide the batch of 3
  SearchOptions no_mfu = TinyOptions(1 << 30);
  no_mfu.mfu = 0;
  RunRequest with_tp = Tiny();
  with_tp.tp = 2;
  RunRequest with_zero = Tiny();
  with_zero.zero = 1;
  RunRequest with_ep = Tiny();
  with_ep.ep = 2;
  RunRequest bad_model = Tiny();
  bad_model.model = "no-such-model";
  for (const Case& c :
       {Case{twelve, Tiny(), "--gpus 12 is not a multiple of --gpus_per_node 8"},
        Case{odd_batch, lopsided, "--global_batch 3 fits no layout of 4 GPUs"},
        Case{no_mfu, Tiny(), "--mfu must be in (0, 1], got 0"},
        Case{TinyOptions(1 << 30), with_tp, "--tp: the search chooses the layout"},
        Case{TinyOptions(1 << 30), with_zero, "--zero: the search chooses the layout"},
        Case{TinyOptions(1 << 30), with_ep, "--ep: the search chooses the layout"},
        Case{TinyOptions(1 << 30), bad_model, "--model"}}) {
    absl::StatusOr<SearchResult> result = SearchLayouts(c.request, c.options);
    EXPECT_TRUE(absl::IsInvalidArgument(result.status())) << c.message;
    EXPECT_NE(result.status().message().find(c.message), std::string::npos)
        << result.status();
  }
}

}  // namespace
}  // namespace memledger
