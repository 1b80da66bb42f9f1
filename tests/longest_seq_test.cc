// search --longest_seq (planner/longest_seq.h): its bisection against a brute force that
// runs the layout search at every length.
#include "planner/longest_seq.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "estimator/request/run_request.h"
#include "planner/layout_search.h"
#include "tests/status_matchers.h"

namespace memledger {
namespace {

SearchOptions Options(int64_t gpus, int64_t global_batch, int64_t budget_bytes) {
  SearchRequest request;
  request.gpus = gpus;
  request.gpus_per_node = gpus;
  request.global_batch = global_batch;
  request.threads = 2;
  request.planned_layouts = 2;
  SearchOptions options = *SearchOptionsFrom(request);
  options.budget_bytes = budget_bytes;
  return options;
}

// SmallestPeakAt: the smallest memory any layout needs at `seq`, with room for every
// one: its peak, or on CUDA its reserved peak and the CUDA context (every layout is
// replayed through the allocator: --checked_layouts 10 of at most 8).
int64_t SmallestPeakAt(RunRequest request, SearchOptions options, int64_t seq) {
  request.seq = seq;
  options.budget_bytes = int64_t{1} << 40;
  absl::StatusOr<SearchResult> all = SearchLayouts(request, options);
  EXPECT_TRUE(all.ok()) << all.status();
  int64_t smallest = int64_t{1} << 40;
  for (const SearchedLayout& l : all->layouts) {
    EXPECT_TRUE(l.checked);
    smallest = std::min(smallest, all->cuda ? l.device_bytes : l.peak_bytes);
  }
  return smallest;
}

// With a budget of the smallest peak at seq 24, the lengths that fit (each searched)
// are the even ones up to the longest, on 2 GPUs (every layout of tp, pp, dp and ZeRO:
// at 24 a sequence-parallel layout needs the least, and sp needs tp to divide the
// sequence) with the odd ones below the last that fits without it; on one GPU with
// LoRA, a prefix. The bisection lands on the longest, with the search's own layouts
// there.
TEST(LongestSeqTest, BisectionFindsTheBruteForcesLongest) {
  struct Case {
    const char* name;
    int64_t gpus;
    int64_t lora_rank;
    const char* device;
  };
  for (const Case& c : {Case{"2 GPUs", 2, 0, "cpu"}, Case{"LoRA, 1 GPU", 1, 8, "cpu"}}) {
    SCOPED_TRACE(c.name);
    RunRequest request;
    request.model = "tiny-llama";
    request.layers = 4;
    request.lora_rank = c.lora_rank;
    request.device = c.device;
    const int64_t budget = SmallestPeakAt(request, Options(c.gpus, 4, 0), 24);
    const SearchOptions options = Options(c.gpus, 4, budget);
    std::vector<bool> fits = {true};  // fits[seq]; 0 unused
    int64_t longest = 0, longest_odd = 0;
    for (int64_t seq = 1; seq <= 48; ++seq) {
      request.seq = seq;
      absl::StatusOr<SearchResult> at = SearchLayouts(request, options);
      ASSERT_TRUE(at.ok() || absl::IsResourceExhausted(at.status())) << at.status();
      fits.push_back(at.ok());
      if (at.ok()) longest = seq;
      if (at.ok() && seq % 2 == 1) longest_odd = seq;
    }
    ASSERT_GE(longest, 24);
    ASSERT_LT(longest, 48);
    for (int64_t seq = 1; seq <= 48; ++seq) {
      const bool expected = c.gpus == 1 ? seq <= longest
                                        : seq <= (seq % 2 == 0 ? longest : longest_odd);
      EXPECT_EQ(fits[static_cast<size_t>(seq)], expected) << "seq " << seq;
    }
    request.seq = 999;  // ignored
    ASSERT_OK_AND_ASSIGN(SearchResult found, SearchLongestSequence(request, options, 48));
    EXPECT_EQ(found.config.seq, longest);
    EXPECT_EQ(found.longest_seq_up_to, 48);
    // The bound, then about log2 of the granules, then one length between two.
    EXPECT_LE(found.longest_seq_searches, 7);
    request.seq = longest;
    ASSERT_OK_AND_ASSIGN(SearchResult there, SearchLayouts(request, options));
    ASSERT_EQ(found.layouts.size(), there.layouts.size());
    for (size_t i = 0; i < there.layouts.size(); ++i) {
      EXPECT_EQ(found.layouts[i].flags, there.layouts[i].flags);
      EXPECT_EQ(found.layouts[i].peak_bytes, there.layouts[i].peak_bytes);
    }
  }
}

// On CUDA the caching allocator's reserve (2 MiB segments and more) and the CUDA context
// decide: with a budget of the least that seq 1,024 needs, the longest found fits, the
// next does not, and every 97th length below fits and above does not.
TEST(LongestSeqTest, OnCudaTheAllocatorsReserveDecides) {
  RunRequest request;
  request.model = "tiny-llama";
  request.layers = 4;
  request.lora_rank = 8;
  request.device = "cuda";
  const SearchOptions options = Options(1, 4, SmallestPeakAt(request, Options(1, 4, 0), 1024));
  ASSERT_OK_AND_ASSIGN(SearchResult found, SearchLongestSequence(request, options, 4096));
  const int64_t longest = found.config.seq;
  ASSERT_GE(longest, 1024);
  ASSERT_LT(longest, 4096);
  EXPECT_LE(found.longest_seq_searches, 14);  // the bound, then about log2 4096
  auto fits = [&](int64_t seq) {
    request.seq = seq;
    absl::StatusOr<SearchResult> at = SearchLayouts(request, options);
    EXPECT_TRUE(at.ok() || absl::IsResourceExhausted(at.status())) << at.status();
    return at.ok();
  };
  EXPECT_TRUE(fits(longest));
  EXPECT_FALSE(fits(longest + 1));
  for (int64_t seq = 1; seq <= 4096; seq += 97) EXPECT_EQ(fits(seq), seq <= longest) << seq;
}

// What fits at the bound is the answer in one search; GPT-2's learned positions (128 in
// tiny-gpt2) bound it whatever is asked.
TEST(LongestSeqTest, TheBoundAndTheModelsPositionsCap) {
  RunRequest request;
  request.model = "tiny-gpt2";
  ASSERT_OK_AND_ASSIGN(SearchResult found,
                       SearchLongestSequence(request, Options(1, 2, int64_t{1} << 40), 100000));
  EXPECT_EQ(found.config.seq, 128);
  EXPECT_EQ(found.longest_seq_up_to, 128);
  EXPECT_EQ(found.longest_seq_searches, 1);
}

// A bound far past what any GPU holds: lengths whose step's FLOPs or bytes overflow
// int64 fit nothing, and the answer fits while the next length does not.
TEST(LongestSeqTest, AnyBoundAnswers) {
  RunRequest request;
  request.model = "tiny-llama";
  const SearchOptions options = Options(1, 1, int64_t{1} << 30);
  ASSERT_OK_AND_ASSIGN(SearchResult found,
                       SearchLongestSequence(request, options, int64_t{1} << 62));
  const int64_t longest = found.config.seq;
  EXPECT_GT(longest, 1024);
  request.seq = longest;
  EXPECT_OK(SearchLayouts(request, options).status());
  request.seq = longest + 1;
  EXPECT_TRUE(absl::IsResourceExhausted(SearchLayouts(request, options).status()));
}

TEST(LongestSeqTest, BadBoundsAndNothingThatFitsSayWhy) {
  RunRequest request;
  request.model = "tiny-llama";
  const absl::Status zero =
      SearchLongestSequence(request, Options(1, 2, int64_t{1} << 40), 0).status();
  EXPECT_TRUE(absl::IsInvalidArgument(zero));
  EXPECT_EQ(zero.message(), "--longest_seq must be >= 1, got 0");
  const absl::Status none = SearchLongestSequence(request, Options(1, 2, 1024), 64).status();
  EXPECT_TRUE(absl::IsResourceExhausted(none)) << none;
  EXPECT_NE(none.message().find("--longest_seq: not even a sequence of 1 fits: no layout of 1 "
                                "GPUs fits"),
            std::string::npos)
      << none;
}

}  // namespace
}  // namespace memledger
