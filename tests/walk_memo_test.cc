// The walk memo (estimator/graph/walk_memo.h) against walks that apply every op: a cached
// graph's walks, most read from its memo, equal a fresh graph's (built without a memo)
// walks at the same sizes, for every family, down to batches, sequences and head counts
// of 1; and a graph whose reshape views or copies by its sizes keeps a walk of each.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "estimator/graph/block_graph.h"
#include "estimator/spec/config.h"
#include "estimator/graph/family.h"
#include "estimator/request/model_presets.h"
#include "estimator/saved/walker.h"
#include "tests/sized_config.h"
#include "tests/status_matchers.h"

namespace memledger {
namespace {

void ExpectSameWalk(const BlockWalk& memo, const BlockWalk& fresh, const std::string& where) {
  EXPECT_EQ(memo.inner_bytes, fresh.inner_bytes) << where;
  EXPECT_EQ(memo.cache_bytes, fresh.cache_bytes) << where;
  EXPECT_EQ(memo.held_bytes, fresh.held_bytes) << where;
  EXPECT_EQ(memo.keeps_input, fresh.keeps_input) << where;
  EXPECT_EQ(memo.keeps_output, fresh.keeps_output) << where;
  EXPECT_EQ(memo.boundary_bytes, fresh.boundary_bytes) << where;
  EXPECT_EQ(memo.weight_copy_bytes, fresh.weight_copy_bytes) << where;
  EXPECT_EQ(memo.buffer_bytes, fresh.buffer_bytes) << where;
  EXPECT_EQ(memo.inner_by_dtype, fresh.inner_by_dtype) << where;
  EXPECT_EQ(memo.cache_by_dtype, fresh.cache_by_dtype) << where;
  ASSERT_EQ(memo.kept_globals.size(), fresh.kept_globals.size()) << where;
  for (size_t i = 0; i < memo.kept_globals.size(); ++i) {
    EXPECT_EQ(memo.kept_globals[i].id, fresh.kept_globals[i].id) << where;
    EXPECT_EQ(memo.kept_globals[i].bytes, fresh.kept_globals[i].bytes) << where;
    EXPECT_EQ(memo.kept_globals[i].held, fresh.kept_globals[i].held) << where;
  }
  // With record_layouts, what the step simulation replays: the memo's requires_grad and
  // keepers beside the walk's own layouts.
  ASSERT_EQ(memo.tensor_layouts.size(), fresh.tensor_layouts.size()) << where;
  for (size_t t = 0; t < memo.tensor_layouts.size(); ++t) {
    const WalkedTensor &a = memo.tensor_layouts[t], &b = fresh.tensor_layouts[t];
    EXPECT_EQ(a.storage, b.storage) << where << " tensor " << t;
    EXPECT_EQ(a.requires_grad, b.requires_grad) << where << " tensor " << t;
    EXPECT_EQ(a.layout.ShapeString(), b.layout.ShapeString()) << where << " tensor " << t;
    EXPECT_EQ(a.layout.strides, b.layout.strides) << where << " tensor " << t;
  }
  ASSERT_EQ(memo.storage_list.size(), fresh.storage_list.size()) << where;
  for (size_t s = 0; s < memo.storage_list.size(); ++s) {
    const WalkedStorage &a = memo.storage_list[s], &b = fresh.storage_list[s];
    EXPECT_EQ(a.bytes, b.bytes) << where << " storage " << s;
    EXPECT_EQ(a.owner, b.owner) << where << " storage " << s;
    EXPECT_EQ(a.node_keepers, b.node_keepers) << where << " storage " << s;
    EXPECT_EQ(a.cached, b.cached) << where << " storage " << s;
  }
}

TEST(WalkMemoTest, RememberedWalksEqualWalksThatApplyEveryOp) {
  // The walks a prediction asks for: each checkpointing choice, a first layer whose
  // input needs no grad, Megatron's core-attention recompute.
  // layouts: the step simulation's walk (WalkOptions::record_layouts).
  struct Choice {
    bool checkpointed;
    SavePolicy policy;
    bool input_requires_grad;
    bool core;
    bool layouts = false;
  };
  const std::vector<Choice> choices = {
      {false, {}, true, false},  {false, {}, false, false},
      {false, {}, true, false, true},  {false, {}, false, false, true},
      {true, {}, true, false},   {true, {}, false, false},
      {true, StudyPolicy(), true, false},
      {true, SavePolicy{OpKind::kMatmul, OpKind::kAttention}, true, false},
      {false, {}, true, true},
  };
  for (const char* preset : {"study", "tiny-llama", "tiny-gpt2", "tiny-qwen3", "tiny-gemma3",
                             "tiny-qwen3-moe"}) {
    int walks = 0, served = 0;
    for (const CheckpointImpl impl : {CheckpointImpl::kNonReentrant, CheckpointImpl::kReentrant}) {
      // The first sizes teach the memo; later ones read it where tensors share storages
      // alike, and add entries where they do not (1s).
      for (const auto& [batch, seq, heads_of_one] :
           std::vector<std::tuple<int64_t, int64_t, bool>>{
               {2, 16, false}, {3, 8, false}, {1, 16, false}, {2, 1, false}, {4, 32, false},
               {1, 1, false}, {2, 16, true}, {5, 24, true}}) {
        ASSERT_OK_AND_ASSIGN(ModelConfig preset_config, ModelFromPreset(preset));
        ModelConfig config = Sized(preset_config, batch, seq, heads_of_one);
        config.checkpoint_impl = impl;
        if (!ValidateConfig(config).ok()) continue;
        const std::shared_ptr<const ModelGraphs> cached =
            ModelGraphsFor(config, AttentionMode::kFlash);
        const ModelGraphs fresh = BuildModelGraphs(config, AttentionMode::kFlash);
        ASSERT_EQ(fresh.layer_kinds.size(), cached->layer_kinds.size());
        for (size_t kind = 0; kind < cached->layer_kinds.size(); ++kind) {
          const BlockGraph& remembering = cached->layer_kinds[kind];
          const BlockGraph& applying = fresh.layer_kinds[kind];
          ASSERT_NE(remembering.walk_memo, nullptr);
          ASSERT_EQ(applying.walk_memo, nullptr);
          const auto memo_layouts = LayoutBlock(remembering, config);
          const auto fresh_layouts = LayoutBlock(applying, config);
          ASSERT_NE(memo_layouts, nullptr);
          for (const Choice& choice : choices) {
            WalkOptions options;
            options.checkpointed = choice.checkpointed;
            options.policy = choice.policy;
            options.input_requires_grad = choice.input_requires_grad;
            options.recompute_core_attention = choice.core;
            options.record_layouts = choice.layouts;
            const std::string where =
                absl::StrCat(preset, " B", batch, " T", seq, heads_of_one ? " one head" : "",
                             " kind ", kind, " checkpointed ", choice.checkpointed,
                             " reentrant ", impl == CheckpointImpl::kReentrant,
                             choice.layouts ? " with layouts" : "");
            const size_t remembered = remembering.walk_memo->Size();
            ASSERT_OK_AND_ASSIGN(BlockWalk memo,
                                 WalkBlock(remembering, config, options, memo_layouts.get()));
            // A walk that adds no entry was served by the memo.
            if (remembering.walk_memo->Size() == remembered) ++served;
            ASSERT_OK_AND_ASSIGN(BlockWalk walked,
                                 WalkBlock(applying, config, options, fresh_layouts.get()));
            ExpectSameWalk(memo, walked, where);
            ++walks;
          }
        }
      }
    }
    // Most sizes share storages as an earlier one did: the memo served them.
    EXPECT_GT(served, walks / 2) << preset;
  }
}

// A reshape of a transposed (T, B, D) input views it when B or T is 1 and copies it
// otherwise (ATen's computeStride); mm keeps what the reshape made. So which storage is
// kept depends on the sizes through the sharing alone, and the memo must tell the two
// apart.
TEST(WalkMemoTest, StorageSharingThatSizesDecideIsPartOfTheKey) {
  BlockGraph graph;
  auto tensor = [&](const char* name, bool is_parameter, std::vector<SymDim> shape) {
    TensorDef def;
    def.name = name;
    def.is_parameter = is_parameter;
    def.shape = std::move(shape);
    graph.tensors.push_back(std::move(def));
  };
  tensor("x", false, {kB, kT, kD});
  tensor("x.t", false, {});
  tensor("x.t.reshape", false, {});
  tensor("w", true, {kD, kD});
  tensor("y", false, {});
  auto op = [&](OpType type, const char* name, std::vector<int> inputs, int output,
                OpAttributes attributes) {
    OpDef def{type, name, std::move(inputs), {output}, std::move(attributes), std::nullopt};
    graph.ops.push_back(std::move(def));
  };
  OpAttributes transpose;
  transpose.dim = 0;
  transpose.dim1 = 1;
  op(OpType::kTranspose, "t", {0}, 1, transpose);
  OpAttributes reshape;
  reshape.shape = {kT * kB, kD};
  op(OpType::kReshape, "reshape", {1}, 2, reshape);
  op(OpType::kMm, "mm", {2, 3}, 4, OpAttributes());
  graph.input = 0;
  graph.output = 4;
  graph.walk_memo = std::make_shared<WalkMemo>();
  ModelConfig config;  // the study's width, 128
  const int64_t d = config.width;
  for (const auto& [batch, seq] : std::vector<std::pair<int64_t, int64_t>>{
           {2, 3}, {1, 3}, {4, 5}, {2, 1}}) {
    config.batch = batch;
    config.seq = seq;
    const auto layouts = LayoutBlock(graph, config);
    ASSERT_NE(layouts, nullptr);
    ASSERT_OK_AND_ASSIGN(BlockWalk walk, WalkBlock(graph, config, WalkOptions(), layouts.get()));
    const bool views = batch == 1 || seq == 1;
    // Viewed, mm keeps the input's own storage; copied, the (T*B, d) fp32 copy:
    // B x T x d x 4 bytes.
    EXPECT_EQ(walk.keeps_input, views) << batch << "x" << seq;
    EXPECT_EQ(walk.inner_bytes, views ? 0 : batch * seq * d * 4) << batch << "x" << seq;
  }
  // One walk remembered per way of sharing.
  EXPECT_EQ(graph.walk_memo->Size(), 2u);
}

}  // namespace
}  // namespace memledger
