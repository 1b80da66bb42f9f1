// CudaAllocatorSim against hand arithmetic, and against PyTorch's own CUDA caching
// allocator: the pinned wheel's libc10_cuda.so (CUDACachingAllocator.cpp compiled) run
// over a stub libcudart.so.13 (tests/cuda_stub), fed the same allocation streams through
// raw_alloc / raw_delete, its device stats read back after every call. Built twice: as
// cuda_allocator_test, and with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True as
// cuda_allocator_expandable_test, where the real allocator maps pages through the
// stub's driver API and the simulation runs expandable.
#include "estimator/step/cuda_allocator.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include <map>

#include "c10/cuda/CUDACachingAllocator.h"
#include "c10/cuda/PeerToPeerAccess.h"
#include "estimator/predict/predict.h"
#include "estimator/predict/ranks.h"
#include "estimator/request/run_request.h"
#include "estimator/spec/config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace memledger {
namespace {

constexpr int64_t kMiB = 1 << 20;

// Expandable: this binary's allocator runs expandable segments (the environment the
// BUILD file gives it).
bool Expandable() {
  const char* conf = std::getenv("PYTORCH_CUDA_ALLOC_CONF");
  return conf != nullptr && std::string(conf) == "expandable_segments:True";
}

TEST(CudaAllocatorSimTest, RoundsEveryRequestToA512ByteBlock) {
  EXPECT_EQ(CudaRoundSize(1), 512);
  EXPECT_EQ(CudaRoundSize(512), 512);
  EXPECT_EQ(CudaRoundSize(513), 1024);
  EXPECT_EQ(CudaRoundSize(3 * kMiB - 24), 3 * kMiB);
  // Segments: 2 MiB for up to 1 MiB, 20 MiB below 10 MiB, else rounded up to 2 MiB.
  EXPECT_EQ(CudaSegmentSize(kMiB), 2 * kMiB);
  EXPECT_EQ(CudaSegmentSize(kMiB + 512), 20 * kMiB);
  EXPECT_EQ(CudaSegmentSize(10 * kMiB), 10 * kMiB);
  EXPECT_EQ(CudaSegmentSize(11 * kMiB + 512), 12 * kMiB);
}

TEST(CudaAllocatorSimTest, ExpandableSegmentsMapPagesAsNeeded) {
  CudaAllocatorSim sim(/*expandable_segments=*/true);
  // 1,000 B: the small pool's first 2 MiB page.
  const int a = sim.Malloc(1000);
  EXPECT_EQ(sim.stats().reserved.current, 2 * kMiB);
  // 3 MiB: the large pool's first 20 MiB page; the block splits at 3 MiB.
  const int b = sim.Malloc(3 * kMiB);
  EXPECT_EQ(sim.stats().reserved.current, 22 * kMiB);
  // 19 MiB: the free 17 MiB after b plus 2 MiB more, one more 20 MiB page mapped; the
  // block is exactly 19 MiB (a split at 512 B), unlike a 20 MiB segment's.
  const int c = sim.Malloc(19 * kMiB);
  EXPECT_EQ(sim.stats().reserved.current, 42 * kMiB);
  EXPECT_EQ(sim.stats().allocated.current, 1024 + 3 * kMiB + 19 * kMiB);
  // After b is freed its 3 MiB hole is too small for 18 MiB, but the 18 MiB left at the
  // end of the 40 MiB mapped hold it: no new page.
  sim.Free(b);
  const int d = sim.Malloc(18 * kMiB);
  EXPECT_EQ(sim.stats().reserved.current, 42 * kMiB);
  // 30 MiB: the free tail is empty (3 + 19 + 18 = 40 mapped); 30 MiB more of pages, two.
  const int e = sim.Malloc(30 * kMiB);
  EXPECT_EQ(sim.stats().reserved.current, 82 * kMiB);
  for (int h : {a, c, d, e}) sim.Free(h);
  EXPECT_EQ(sim.stats().allocated.current, 0);
  EXPECT_EQ(sim.stats().reserved.peak, 82 * kMiB);
}

TEST(CudaAllocatorSimTest, HandWorkedStream) {
  CudaAllocatorSim sim;
  // 1,000 B: a 1,024-B block of a new 2 MiB small segment, split from it.
  const int a = sim.Malloc(1000);
  EXPECT_EQ(sim.stats().allocated.current, 1024);
  EXPECT_EQ(sim.stats().reserved.current, 2 * kMiB);
  // 1 MiB (the largest small request) fits the segment's 2 MiB - 1 KiB remainder.
  const int b = sim.Malloc(kMiB);
  EXPECT_EQ(sim.stats().reserved.current, 2 * kMiB);
  // 3 MiB - 24 B: a 3 MiB block split from a new 20 MiB segment (17 MiB remain).
  const int c = sim.Malloc(3 * kMiB - 24);
  EXPECT_EQ(sim.stats().reserved.current, 22 * kMiB);
  EXPECT_EQ(sim.stats().allocated.current, 1024 + kMiB + 3 * kMiB);
  // 19 MiB: too big for the 17 MiB left; a 20 MiB segment whose 1 MiB remainder is not
  // above kSmallSize, so the block is the whole segment.
  const int d = sim.Malloc(19 * kMiB);
  EXPECT_EQ(sim.stats().reserved.current, 42 * kMiB);
  EXPECT_EQ(sim.stats().allocated.current, 1024 + kMiB + 3 * kMiB + 20 * kMiB);
  EXPECT_EQ(sim.Malloc(0), -1);  // no block
  // Freed, the 3 MiB block merges back into its segment's 17 MiB: 20 MiB cached, which
  // serves a 16 MiB request without a new segment.
  sim.Free(c);
  const int e = sim.Malloc(16 * kMiB);
  EXPECT_EQ(sim.stats().reserved.current, 42 * kMiB);
  for (int h : {a, b, d, e}) sim.Free(h);
  EXPECT_EQ(sim.stats().allocated.current, 0);
  EXPECT_EQ(sim.stats().allocated.peak, 1024 + kMiB + 20 * kMiB + 16 * kMiB);
  EXPECT_EQ(sim.stats().reserved.peak, 42 * kMiB);
  EXPECT_EQ(sim.stats().requested.peak, 1000 + kMiB + 19 * kMiB + 16 * kMiB);
}

// The real allocator, process-wide: emptied between streams.
class RealAllocatorTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    c10::cuda::detail::init_p2p_access_cache(1);  // expandable segments ask it
    c10::cuda::CUDACachingAllocator::init(1);
  }
  void SetUp() override {
    c10::cuda::CUDACachingAllocator::emptyCache();
    c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  }


 public:
  struct Stats {
    int64_t allocated, allocated_peak, reserved, reserved_peak;
    bool operator==(const Stats&) const = default;
  };
  static Stats Real() {
    const auto s = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    return {s.allocated_bytes[all].current, s.allocated_bytes[all].peak,
            s.reserved_bytes[all].current, s.reserved_bytes[all].peak};
  }
  static Stats Simulated(const CudaAllocatorSim& sim) {
    return {sim.stats().allocated.current, sim.stats().allocated.peak,
            sim.stats().reserved.current, sim.stats().reserved.peak};
  }
};

TEST_F(RealAllocatorTest, TheStubIsTheRuntimeLoaded) {
  cudaDeviceProp prop;
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  EXPECT_EQ(std::string(prop.name), "memledger stub");
}

// RandomCallsAgree replays `sequences` random sequences of 400 calls through torch's
// allocator and the simulation, checking their stats after every call: sizes across the
// pools and segment kinds (small, < 1 MiB; large below 10 MiB, 20 MiB segments; and
// above), frees of random live blocks, some right away; each request on one of `streams`
// at random (torch's raw_alloc_with_stream) where there are several.
void RandomCallsAgree(uint64_t seed, int sequences, const std::vector<cudaStream_t>& streams) {
  std::mt19937_64 random(seed);
  for (int sequence = 0; sequence < sequences; ++sequence) {
    c10::cuda::CUDACachingAllocator::emptyCache();  // as RealAllocatorTest::SetUp
    c10::cuda::CUDACachingAllocator::resetPeakStats(0);
    CudaAllocatorSim sim(Expandable());
    std::vector<std::pair<void*, int>> live;
    for (int op = 0; op < 400; ++op) {
      const bool allocate = live.empty() || random() % 100 < 55;
      if (allocate) {
        int64_t bytes = 0;
        switch (random() % 4) {
          case 0: bytes = static_cast<int64_t>(random() % 4096); break;
          case 1: bytes = static_cast<int64_t>(random() % kMiB) + 1; break;
          case 2: bytes = kMiB + static_cast<int64_t>(random() % (9 * kMiB)); break;
          default: bytes = static_cast<int64_t>(random() % (64 * kMiB)) + 1; break;
        }
        const int stream = streams.size() > 1 ? static_cast<int>(random() % streams.size()) : 0;
        void* ptr = c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(
            static_cast<size_t>(bytes), streams[static_cast<size_t>(stream)]);
        const int handle = sim.Malloc(bytes, stream);
        ASSERT_EQ(ptr == nullptr, handle < 0) << bytes;
        if (ptr != nullptr) live.emplace_back(ptr, handle);
      } else {
        const size_t i = random() % live.size();
        c10::cuda::CUDACachingAllocator::raw_delete(live[i].first);
        sim.Free(live[i].second);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      }
      ASSERT_EQ(RealAllocatorTest::Real(), RealAllocatorTest::Simulated(sim))
          << "sequence " << sequence << ", call " << op;
    }
    for (auto& [ptr, handle] : live) {
      c10::cuda::CUDACachingAllocator::raw_delete(ptr);
      sim.Free(handle);
    }
    ASSERT_EQ(RealAllocatorTest::Real(), RealAllocatorTest::Simulated(sim))
        << "sequence " << sequence << " freed";
  }
}

TEST_F(RealAllocatorTest, AgreesOnRandomStreamsAfterEveryCall) {
  RandomCallsAgree(20261202, 24, {nullptr});  // the default stream
}

// Three streams, as FSDP2's collectives use (estimator/step/data_parallel_fsdp2.cc; the
// stub's streams are distinct handles). The real allocator's pools are ordered by stream
// first and reuse a block only for its own stream: the simulation agrees after every
// call, with and without expandable segments.
TEST_F(RealAllocatorTest, AgreesOnRandomCallsOverThreeStreams) {
  std::vector<cudaStream_t> streams = {nullptr, nullptr, nullptr};  // the default first
  ASSERT_EQ(cudaStreamCreateWithPriority(&streams[1], 0, 0), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithPriority(&streams[2], 0, 0), cudaSuccess);
  RandomCallsAgree(20261207, 12, streams);
}

// A block freed on one stream is not reused by another, by hand: 1 MiB on stream 1, freed;
// then 1 MiB on the default stream takes a second 2 MiB segment (4 MiB reserved), and
// 1 MiB again on stream 1 the first block (still 4 MiB).
TEST(CudaAllocatorSimTest, ABlockServesOnlyItsOwnStream) {
  CudaAllocatorSim sim;
  sim.Free(sim.Malloc(kMiB, /*stream=*/1));
  EXPECT_EQ(sim.stats().reserved.current, 2 * kMiB);
  const int on_default = sim.Malloc(kMiB, 0);
  EXPECT_EQ(sim.stats().reserved.current, 4 * kMiB);
  const int again = sim.Malloc(kMiB, 1);
  EXPECT_EQ(sim.stats().reserved.current, 4 * kMiB);
  EXPECT_EQ(sim.stats().allocated.current, 2 * kMiB);
  sim.Free(on_default);
  sim.Free(again);
}

// ReplayPeaks replays a predicted step's requests to the allocator through torch's own,
// each on its stream (a stub stream per number but the default's 0), and returns what
// it reports.
RealAllocatorTest::Stats ReplayThroughTorch(const StepTimeline& timeline) {
  c10::cuda::CUDACachingAllocator::emptyCache();
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  static std::map<int, cudaStream_t> streams = {{0, nullptr}};
  std::map<int32_t, void*> live;
  for (const StepTimeline::AllocatorCall& call : timeline.allocator_calls) {
    if (call.bytes > 0) {
      EXPECT_EQ(live.count(call.id), 0u);
      if (streams.count(call.stream) == 0) {
        EXPECT_EQ(cudaStreamCreateWithPriority(&streams[call.stream], 0, 0), cudaSuccess);
      }
      live[call.id] = c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(
          static_cast<size_t>(call.bytes), streams[call.stream]);
    } else {
      EXPECT_EQ(live.count(call.id), 1u);
      c10::cuda::CUDACachingAllocator::raw_delete(live[call.id]);
      live.erase(call.id);
    }
  }
  const RealAllocatorTest::Stats real = RealAllocatorTest::Real();
  for (auto& [id, ptr] : live) c10::cuda::CUDACachingAllocator::raw_delete(ptr);
  return real;
}

RunSpec CudaSpec(const char* model, const char* dtype, const char* sdpa_backend,
                 int64_t seq = 64) {
  RunRequest request;
  request.model = model;
  if (const size_t at = request.model.find(" --tp="); at != std::string::npos) {
    request.tp = std::stoll(request.model.substr(at + 6));  // a tensor-parallel rank's
    request.model = request.model.substr(0, at);
  }
  request.dtype = dtype;
  request.sdpa_backend = sdpa_backend;
  request.device = "cuda";
  request.expandable_segments = Expandable();
  request.batch = 2;
  request.seq = seq;
  absl::StatusOr<RunSpec> spec = RunSpecFromRequest(request);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

PredictOptions TimelineOptions(const RunSpec& spec) {
  PredictOptions options;
  options.attention = spec.attention;
  options.variants = spec.variants;
  options.optimizer = spec.optimizer;
  options.timeline = true;
  return options;
}

// predict --device=cuda's step, its requests to the allocator replayed through torch's
// own: the allocated and reserved peaks it reports are the prediction's peak_bytes and
// peak_reserved_bytes, for every variant, family and SDPA kernel here.
TEST_F(RealAllocatorTest, ThePredictedStepsPeaksAreWhatTorchsAllocatorReports) {
  struct Case {
    const char* model;
    const char* dtype;
    const char* sdpa_backend;
  };
  int replayed = 0;
  for (const Case& c : {Case{"study", "bf16", "flash"}, Case{"study", "fp32", "efficient"},
                        Case{"tiny-llama --tp=2", "bf16", "auto"},
                        Case{"tiny-llama", "bf16", "cudnn"}, Case{"tiny-llama", "fp32", "math"},
                        Case{"tiny-gpt2", "fp16", "flash"}, Case{"tiny-gemma3", "bf16", "auto"}}) {
    // tiny-gemma3 past its window of 512: the sliding layers' mask, efficient attention.
    const RunSpec spec = CudaSpec(c.model, c.dtype, c.sdpa_backend,
                                  std::string(c.model) == "tiny-gemma3" ? 1024 : 64);
    ASSERT_EQ(spec.config.shard.tp,
              std::string(c.model).find("--tp=2") != std::string::npos ? 2 : 1);
    absl::StatusOr<Prediction> p = Predict(spec.config, TimelineOptions(spec));
    ASSERT_TRUE(p.ok()) << p.status();
    for (const VariantPrediction& v : p->variants) {
      SCOPED_TRACE(absl::StrCat(c.model, " ", c.dtype, " ", c.sdpa_backend, " ",
                                v.variant.Name()));
      ASSERT_TRUE(v.peak.has_value()) << v.peak_unavailable;
      ASSERT_NE(v.timeline, nullptr);
      const Stats real = ReplayThroughTorch(*v.timeline);
      EXPECT_EQ(real.allocated_peak, v.peak->bytes);
      EXPECT_EQ(real.reserved_peak, v.peak_reserved_bytes);
      ++replayed;
    }
  }
  EXPECT_EQ(replayed, 28);
}

// The same for every kind of rank of data-parallel (ZeRO 0, 1 and 3) and pipeline
// layouts: each rank's step, its resident tensors first, through torch's allocator.
// FSDP2's ranks too, whose collectives allocate on streams of their own (over 2 ranks, 3
// with padded rows, and 4 resharded to 2 after the forward under a MixedPrecisionPolicy).
TEST_F(RealAllocatorTest, TheRanksPeaksAreWhatTorchsAllocatorReports) {
  int replayed = 0;
  FsdpOptions fsdp{true, true, 0, std::nullopt, std::nullopt};
  FsdpOptions fsdp_mixed{true, true, 2, DType::kBFloat16, DType::kFloat32};
  FsdpOptions fsdp_offload = fsdp_mixed;
  fsdp_offload.reshard_after_forward_ranks = 0;
  fsdp_offload.offload = true;
  for (const ParallelSpec& parallel :
       {ParallelSpec{2, 1, 1, 1, 0, PipelineSchedule::k1F1B, {}, {}},
        ParallelSpec{2, 1, 1, 1, 1, PipelineSchedule::k1F1B, {}, {}},
        ParallelSpec{2, 1, 1, 1, 3, PipelineSchedule::k1F1B, {}, {}},
        ParallelSpec{1, 2, 1, 4, 0, PipelineSchedule::k1F1B, {}, {}},
        ParallelSpec{2, 1, 1, 1, 0, PipelineSchedule::k1F1B, {}, fsdp},
        ParallelSpec{3, 1, 1, 1, 0, PipelineSchedule::k1F1B, {}, fsdp},
        ParallelSpec{4, 1, 1, 1, 0, PipelineSchedule::k1F1B, {}, fsdp_mixed},
        ParallelSpec{2, 1, 1, 1, 0, PipelineSchedule::k1F1B, {}, fsdp_offload}}) {
    // FSDP2's MixedPrecisionPolicy runs over fp32 parameters.
    const RunSpec spec =
        CudaSpec("tiny-llama", parallel.fsdp.param_dtype.has_value() ? "fp32" : "bf16", "auto");
    absl::StatusOr<RanksPrediction> ranks =
        PredictRanks(spec.config, parallel, TimelineOptions(spec));
    ASSERT_TRUE(ranks.ok()) << ranks.status();
    for (const RankKind& kind : ranks->kinds) {
      for (const RankVariant& v : kind.variants) {
        SCOPED_TRACE(absl::StrCat("dp ", parallel.dp, " zero ", parallel.zero, " pp ",
                                  parallel.pp, " stage ", kind.stage, " ",
                                  v.held.variant.Name()));
        ASSERT_TRUE(v.held.peak.has_value()) << v.held.peak_unavailable;
        ASSERT_NE(v.held.timeline, nullptr);
        const Stats real = ReplayThroughTorch(*v.held.timeline);
        EXPECT_EQ(real.allocated_peak, v.held.peak->bytes);
        EXPECT_EQ(real.reserved_peak, v.held.peak_reserved_bytes);
        ++replayed;
      }
    }
  }
  // 3 ZeRO and 4 FSDP2 layouts of one kind of rank, pp 2 of two; 4 variants.
  EXPECT_EQ(replayed, (3 + 2 + 4) * 4);
}

// Where an FSDP2 rank's buffers go on CUDA, by hand, for the issue's Llama over 2 ranks
// (tests/issue_llama.py; every dim 0 even): the all-gather outputs on the all-gather
// copy-in stream, world x a unit's shards, fp32: the root's (embedding, final norm,
// lm_head: 65,600 elements, 32,800 a rank) 262,400 B, a layer's (43,136 elements, 21,568
// a rank) 172,544 B, in the forward's order (root, layer 0, layer 1) and the backward's
// (the root, layer 1 prefetched, layer 0 prefetched); the sharded gradients on the
// reduce-scatter stream, a rank's shards: layer 1's and layer 0's 86,272 B, the root's
// 131,200 B. The kernels' metadata, on the default stream: a layer's copy-out 648 B and
// reduce-scatter copy-in 800 B (its 9 parameters' shards of 2,048, 1,024, 1,024, 2,048,
// 5,120, 5,120, 5,120, 32 and 32 elements are 4 + 2 + 2 + 4 + 10 + 10 + 10 + 1 + 1 = 44
// blocks of 2,048 B; 8 x (4 x 9 + 1 + 44) and 8 x (6 x 9 + 2 + 44)).
// IssueLlamaFsdpOnCuda: the issue's Llama (tests/testdata/issue_llama.config.json) over
// 2 FSDP2 ranks on CUDA, `offload` its CPUOffloadPolicy: rank 0's kind, its variant
// `none` with its timeline.
absl::StatusOr<RankKind> IssueLlamaFsdpOnCuda(const std::string& offload) {
  RunRequest request;
  request.model = "tests/testdata/issue_llama.config.json";
  request.device = "cuda";
  request.batch = 2;
  request.seq = 32;
  request.dp = 2;
  request.fsdp = true;
  request.offload = offload;
  request.variants = "none";
  absl::StatusOr<RunSpec> spec = RunSpecFromRequest(request);
  if (!spec.ok()) return spec.status();
  absl::StatusOr<RanksPrediction> ranks =
      PredictRanks(spec->config, spec->parallel, TimelineOptions(*spec));
  if (!ranks.ok()) return ranks.status();
  return ranks->kinds[0];
}

// AllocationsByStream: a rank's requests to the allocator, by stream, in order.
std::map<int, std::vector<int64_t>> AllocationsByStream(const RankVariant& rank) {
  std::map<int, std::vector<int64_t>> by_stream;
  for (const StepTimeline::AllocatorCall& call : rank.held.timeline->allocator_calls) {
    if (call.bytes > 0) by_stream[call.stream].push_back(call.bytes);
  }
  return by_stream;
}

TEST(FsdpOnCudaTest, EachBufferOnItsStream) {
  absl::StatusOr<RankKind> kind = IssueLlamaFsdpOnCuda("none");
  ASSERT_TRUE(kind.ok()) << kind.status();
  const RankVariant& rank = kind->variants[0];
  ASSERT_TRUE(rank.held.peak.has_value()) << rank.held.peak_unavailable;
  std::map<int, std::vector<int64_t>> by_stream = AllocationsByStream(rank);
  EXPECT_EQ(by_stream[kFsdpAllGatherStream],
            (std::vector<int64_t>{262400, 172544, 172544, 262400, 172544, 172544}));
  EXPECT_EQ(by_stream[kFsdpReduceScatterStream],
            (std::vector<int64_t>{86272, 86272, 131200}));
  const std::vector<int64_t>& on_default = by_stream[kDefaultStream];
  EXPECT_EQ(std::count(on_default.begin(), on_default.end(), 648), 4);  // 2 layers, twice
  EXPECT_EQ(std::count(on_default.begin(), on_default.end(), 800), 2);
  EXPECT_EQ(by_stream.size(), 3u);
}

// Under CPUOffloadPolicy (--offload=cpu), by hand: the shards (303,744 B), their
// gradients (303,744 B) and AdamW's state (607,488 B of moments and 21 four-byte steps,
// CPU tensors' as torch.optim keeps them) are host memory: 1,215,060 B, none of it among
// the device's resident tensors. Each all-gather first copies its unit's shards to the
// device on the all-gather stream, one request per parameter (a layer's 9 sum to 86,272
// B, the root's 3 to 131,200 B), then its output as before: 6 gathers, 4 of a layer and 2
// of the root, 48 requests. The reduce-scatter outputs are on their stream as before, now
// freed once copied to the host.
TEST(FsdpOnCudaTest, CpuOffloadKeepsTheShardsOnTheHost) {
  absl::StatusOr<RankKind> kind = IssueLlamaFsdpOnCuda("cpu");
  ASSERT_TRUE(kind.ok()) << kind.status();
  EXPECT_EQ(kind->host_bytes, 303744 + 303744 + 607488 + 21 * 4);
  const RankVariant& rank = kind->variants[0];
  ASSERT_TRUE(rank.held.peak.has_value()) << rank.held.peak_unavailable;
  for (const ResidentTensor& t : rank.held.timeline->resident_tensors) {
    EXPECT_TRUE(t.category == MemoryCategory::kBuffer || t.category == MemoryCategory::kInput)
        << t.name;
  }
  std::map<int, std::vector<int64_t>> by_stream = AllocationsByStream(rank);
  const std::vector<int64_t>& gathers = by_stream[kFsdpAllGatherStream];
  ASSERT_EQ(gathers.size(), 48u);
  // Between outputs: the copies of one gather.
  std::vector<int64_t> copied, outputs;
  int64_t sum = 0;
  for (int64_t bytes : gathers) {
    if (bytes == 262400 || bytes == 172544) {
      copied.push_back(sum);
      outputs.push_back(bytes);
      sum = 0;
    } else {
      sum += bytes;
    }
  }
  EXPECT_EQ(outputs, (std::vector<int64_t>{262400, 172544, 172544, 262400, 172544, 172544}));
  EXPECT_EQ(copied, (std::vector<int64_t>{131200, 86272, 86272, 131200, 86272, 86272}));
  EXPECT_EQ(by_stream[kFsdpReduceScatterStream],
            (std::vector<int64_t>{86272, 86272, 131200}));
}

// --cublas_workspace_config reads CUBLAS_WORKSPACE_CONFIG as parseChosenWorkspaceSize
// does: SIZE KiB times COUNT, summed over the pairs.
TEST(CublasWorkspaceTest, ConfigIsSizeTimesCountKibSummed) {
  EXPECT_EQ(*ParseCublasWorkspaceConfig(":4096:8"), 4096 * 1024 * 8);  // 32 MiB
  // The pre-Hopper default: 8 MiB + 128 KiB = 8,519,680 B.
  EXPECT_EQ(*ParseCublasWorkspaceConfig(":4096:2:16:8"), 8519680);
  EXPECT_EQ(*ParseCublasWorkspaceConfig(":0:0"), 0);
  for (const char* bad : {"", "4096:8", ":4096", ":4096:8:", ":-1:8", ": 4:8", ":4x:8",
                          ":1000000000:1", ":999999999:999999999"}) {
    absl::StatusOr<int64_t> parsed = ParseCublasWorkspaceConfig(bad);
    EXPECT_FALSE(parsed.ok()) << bad;
    EXPECT_THAT(std::string(parsed.status().message()),
                testing::HasSubstr("--cublas_workspace_config must be")) << bad;
  }
}

// Each GEMM asks the allocator for the workspace after its output and frees it (a
// request of exactly its size): the issue's Llama in one process, variant none, runs
// 15 GEMMs forward (q, k, v, o, gate, up and down in each of 2 layers, and lm_head) and
// two for each backward (the input's gradient, every input requiring grad, and the
// weight's): 45. :7:3 is 21,504 B, no tensor's size here; :0:0 asks for none.
TEST(CublasWorkspaceTest, EachGemmRequestsTheConfiguredWorkspace) {
  auto calls = [](const std::string& config) {
    RunRequest request;
    request.model = "tests/testdata/issue_llama.config.json";
    request.device = "cuda";
    request.sdpa_backend = "efficient";
    request.batch = 2;
    request.seq = 32;
    request.variants = "none";
    request.cublas_workspace_config = config;
    absl::StatusOr<RunSpec> spec = RunSpecFromRequest(request);
    EXPECT_TRUE(spec.ok()) << spec.status();
    absl::StatusOr<Prediction> p = Predict(spec->config, TimelineOptions(*spec));
    EXPECT_TRUE(p.ok()) << p.status();
    std::vector<int64_t> sizes;
    for (const StepTimeline::AllocatorCall& call : p->variants[0].timeline->allocator_calls) {
      if (call.bytes > 0) sizes.push_back(call.bytes);
    }
    return sizes;
  };
  const std::vector<int64_t> with = calls(":7:3");
  const std::vector<int64_t> without = calls(":0:0");
  EXPECT_EQ(std::count(with.begin(), with.end(), 7 * 1024 * 3), 45);
  EXPECT_EQ(with.size(), without.size() + 45);
  // Not on the CPU, where no cuBLAS runs.
  RunRequest cpu;
  cpu.model = "tiny-llama";
  cpu.cublas_workspace_config = ":0:0";
  EXPECT_THAT(std::string(RunSpecFromRequest(cpu).status().message()),
              testing::HasSubstr("--cublas_workspace_config sizes cuBLAS's workspace: it "
                                 "needs --device=cuda"));
}

}  // namespace
}  // namespace memledger
