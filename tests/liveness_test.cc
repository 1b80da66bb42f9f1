// Tests for estimator/step/liveness (the training step's timeline and peak). The tiny block's
// peak is hand arithmetic below; runtime_test measures the same config in LibTorch and
// expects the same number, and verify_grid_test compares the two on many configs.
#include "estimator/graph/family.h"
#include "estimator/step/liveness.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "estimator/spec/config.h"
#include "estimator/request/model_presets.h"
#include "estimator/predict/predict.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "tests/sized_config.h"
#include "tests/status_matchers.h"

namespace memledger {
namespace {

// One study block, width 8, 2 heads (d_head 4), batch 1, seq 4: 4 tokens; fp32; SGD
// without momentum (no optimizer state, no step temporaries); one CPU thread.
ModelConfig TinyBlock() {
  return StudyModel(/*layers=*/1, /*width=*/8, /*heads=*/2,
                    /*batch=*/1, /*seq=*/4);
}

OptimizerSpec PlainSgd() {
  OptimizerSpec sgd;
  sgd.kind = OptimizerKind::kSgd;
  return sgd;
}

int64_t Category(const StepPeak& peak, MemoryCategory category) {
  return peak.by_category[static_cast<int>(category)];
}

// The tiny block's step by hand. (B, T, d) = 32 elements = 128 B; parameters 12d^2 + 13d
// = 872 = 3488 B; the input 128 B: resident 3616 B.
// Forward (step bytes): ln1 out + mean + rstd 160, qkv 384, SDPA out 128 + lse 32 (its
// workspace, 1 thread x (4x4 + 2x4 + 4x4) floats = 160 B, comes and goes), proj 128,
// residual 128 (proj freed), ln2 160, fc1 512, gelu 512, fc2 128, output 128 (fc2 freed),
// pow 128, loss 4 (pow freed after mean): 2148 held after the forward.
// Backward: seed 4 -> 2152; mean's grad 128 and pow's three 128 B temporaries come and go
// (the output is released) -> 2152 with g (128), the output's gradient;
// fc2: dX 512, dW 1024, db 32 -> 3720, gelu out released -> 3208; gelu: 512 in, 512 and
// 512 out -> 2696; fc1: 128 + 1024 + 128 -> 3976, then -512 (gelu's grad) -128 (ln2 out)
// -> 3336; ln2: 128 + 64 + (64 workspace) then its input, statistics and the added dX go
// -> 3112; proj: 128 + 256 + 32, g dies -> 3400; SDPA: 3 x 128 + 128 workspace + 16 row
// sums = 3928 at most, then its grad_out, qkv, lse and out go -> 3112; the selects' zeros
// (384 each, accumulated in place) and split_heads' copy come and go -> 3112;
// qkv: dX 128, dW 768, db 96 -> 4104: the peak, in qkv's AddmmBackward0.
// At that moment: gradients of fc2, fc1, ln2 and proj (1056 + 1152 + 64 + 288 = 2560),
// activations ln1 out + mean + rstd (160), temporaries qkv's three gradients, its
// incoming 384, the loss and the seed (128 + 768 + 96 + 384 + 4 + 4 = 1384).
TEST(SimulateStepTest, TinyBlockPeakByHand) {
  const ModelConfig config = TinyBlock();
  StepOptions options;
  options.cpu_threads = 1;
  ASSERT_OK_AND_ASSIGN(StepTimeline t,
                       SimulateStep(config, AttentionMode::kFlash, Variant(), PlainSgd(),
                                    ResidentBytes{3488, 0}, options));
  EXPECT_EQ(t.resident_bytes, 3616);
  EXPECT_EQ(t.peak.bytes, 3616 + 4104);
  EXPECT_EQ(t.peak.phase, StepPhase::kBackward);
  EXPECT_EQ(t.peak.op, "layer 0 qkv (AddmmBackward0)");
  EXPECT_EQ(Category(t.peak, MemoryCategory::kParameter), 3488);
  EXPECT_EQ(Category(t.peak, MemoryCategory::kInput), 128);
  EXPECT_EQ(Category(t.peak, MemoryCategory::kOptimizerState), 0);
  EXPECT_EQ(Category(t.peak, MemoryCategory::kGradient), 2560);
  EXPECT_EQ(Category(t.peak, MemoryCategory::kActivation), 160);
  EXPECT_EQ(Category(t.peak, MemoryCategory::kTemporary), 1384);
}

// Replaying the recorded events reproduces the reported peak, and the step ends with
// exactly every parameter's gradient and the loss on top of what was resident.
TEST(SimulateStepTest, EventsReplayToThePeakForEveryVariant) {
  const ModelConfig config;  // the study's default
  ASSERT_OK_AND_ASSIGN(std::vector<Variant> variants,
                       ParseVariants("none,full,every_k,selective", 2, "matmul"));
  PredictOptions predict;
  predict.peak = false;
  ASSERT_OK_AND_ASSIGN(Prediction p, Predict(config, predict));
  for (const Variant& variant : variants) {
    ASSERT_OK_AND_ASSIGN(StepTimeline t,
                         SimulateStep(config, AttentionMode::kFlash, variant, OptimizerSpec(),
                                      ResidentBytes{p.param_bytes, p.optimizer_state_bytes,
                                                    p.buffer_bytes},
                                      StepOptions()));
    int64_t live = t.resident_bytes, peak = live, peak_event = -1;
    std::array<int64_t, kNumMemoryCategories> by_category = t.resident;
    for (size_t i = 0; i < t.events.size(); ++i) {
      live += t.events[i].bytes;
      by_category[static_cast<int>(t.events[i].category)] += t.events[i].bytes;
      if (live > peak) {
        peak = live;
        peak_event = static_cast<int64_t>(i);
      }
      ASSERT_GE(by_category[static_cast<int>(t.events[i].category)], 0) << i;
    }
    EXPECT_EQ(peak, t.peak.bytes) << variant.Name();
    EXPECT_EQ(peak_event, t.peak.event) << variant.Name();
    int64_t categories = 0;
    for (int64_t bytes : t.peak.by_category) categories += bytes;
    EXPECT_EQ(categories, t.peak.bytes) << variant.Name();
    // After the step: gradients (= parameter bytes in fp32) and the 4-byte loss.
    EXPECT_EQ(live - t.resident_bytes, p.grad_bytes + 4) << variant.Name();
    EXPECT_EQ(by_category[static_cast<int>(MemoryCategory::kGradient)], p.grad_bytes);
    EXPECT_EQ(by_category[static_cast<int>(MemoryCategory::kActivation)], 0) << variant.Name();
  }
}

// A tensor-parallel rank's vocabulary ops, by hand from Megatron-LM's algorithms
// (tensor_parallel/layers.py VocabParallelEmbedding, cross_entropy.py): tiny-llama
// (width 32, vocabulary 96) over tp = 2 at batch 2, seq 8: N = 16 tokens, 48 rows each.
// - The cross-entropy works on the (16, 48) fp32 logits in place: it allocates only
//   its loss (4 B), the masked targets (16 x 8 = 128) and the target mask (16), the row
//   max, the target logits and the sums of exp (16 x 4 = 64 each): 340 B, none of them
//   the logits' 3,072; its backward turns the kept softmax into the gradient: nothing.
// - The embedding's backward zeroes other ranks' rows in a copy of the (2, 8, 32)
//   gradient (2,048 B), then makes the 48 x 32 rows' gradient (6,144 B).
TEST(SimulateStepTest, VocabularyParallelOpsAllocateWhatMegatronsDo) {
  ModelConfig config = *ModelFromPreset("tiny-llama");
  config.batch = 2;
  config.seq = 8;
  config.shard.tp = 2;
  StepOptions options;
  options.record_events = true;
  ASSERT_OK_AND_ASSIGN(StepTimeline t,
                       SimulateStep(config, AttentionMode::kFlash, Variant(), PlainSgd(),
                                    ResidentBytes{}, options));
  auto allocated = [&](const std::string& label, StepPhase phase) {
    std::vector<int64_t> bytes;
    for (const TimelineEvent& e : t.events) {
      if (e.phase == phase && e.bytes > 0 && !e.relabel && t.op_labels[e.op] == label) {
        bytes.push_back(e.bytes);
      }
    }
    std::sort(bytes.begin(), bytes.end());
    return bytes;
  };
  EXPECT_EQ(allocated("head loss.vocab_parallel", StepPhase::kForward),
            (std::vector<int64_t>{4, 16, 64, 64, 64, 128}));
  // The node runs (its label is there), allocating nothing.
  const std::string backward = "head loss.vocab_parallel (VocabParallelCrossEntropy)";
  EXPECT_NE(std::find(t.op_labels.begin(), t.op_labels.end(), backward), t.op_labels.end());
  EXPECT_EQ(allocated(backward, StepPhase::kBackward), std::vector<int64_t>{});
  EXPECT_EQ(allocated("embedding embed_tokens (VocabParallelEmbedding)", StepPhase::kBackward),
            (std::vector<int64_t>{2048, 6144}));
}

// Without events a long model's peak is composed from a short model's stretches; it is
// the whole simulation's, byte for byte, category by category, and at the same op.
TEST(SimulateStepTest, ComposedPeakEqualsTheWholeSimulation) {
  ASSERT_OK_AND_ASSIGN(ModelConfig llama, ModelFromPreset("tiny-llama"));
  ASSERT_OK_AND_ASSIGN(ModelConfig gpt2, ModelFromPreset("tiny-gpt2"));
  ModelConfig study = StudyModel(/*layers=*/1, /*width=*/32, /*heads=*/2,
                                 /*batch=*/2, /*seq=*/16);
  ASSERT_OK_AND_ASSIGN(
      std::vector<Variant> variants,
      ParseVariants("none,full,every_k,selective", /*every=*/2, "matmul"));
  for (int64_t every : {3, 5}) {
    Variant v;
    v.kind = VariantKind::kEveryK;
    v.every = every;
    variants.push_back(v);
  }
  int compared = 0;
  int masters_at_peak = 0;
  for (ModelConfig config : {study, llama, gpt2}) {
    for (AttentionMode attention : {AttentionMode::kFlash, AttentionMode::kMath}) {
      for (int64_t layers : {6, 7, 12, 14, 19, 40}) {
        config.layers = layers;
        // Under autocast a checkpointed layer's weight casts stay in the cast cache until
        // the forward's end: the head's forward frees as many as the real model made.
        config.amp = layers % 2 == 0 ? DType::kBFloat16 : DType::kFloat32;
        for (const Variant& variant : variants) {
          StepOptions whole, composed;
          composed.record_events = false;
          // With master weights (on a bf16 model) the optimizer's step holds every
          // layer's fp32 gradient copy; at batch 1 and seq 2 the step peaks there.
          OptimizerSpec optimizer;
          ModelConfig run = config;
          // transformers' use_cache (the families' default) holds every layer's keys and
          // values to the forward's end without checkpointing; it is off otherwise.
          run.use_cache = config.use_cache && !variant.CheckpointsAnyLayer();
          if (layers == 7 || layers == 19) {
            optimizer.master_weights = true;
            run.dtype = DType::kBFloat16;
            run.batch = 1;
            run.seq = 2;
          }
          ASSERT_OK_AND_ASSIGN(StepTimeline a, SimulateStep(run, attention, variant,
                                                            optimizer, ResidentBytes{},
                                                            whole));
          ASSERT_OK_AND_ASSIGN(StepTimeline b, SimulateStep(run, attention, variant,
                                                            optimizer, ResidentBytes{},
                                                            composed));
          if (optimizer.master_weights) {
            masters_at_peak += a.peak.phase == StepPhase::kOptimizer;
          }
          const std::string what = absl::StrCat(FamilyName(config.family), " ",
                                                AttentionModeName(attention), " L", layers,
                                                " amp ", DTypeName(config.amp), " ",
                                                variant.Name());
          EXPECT_EQ(a.peak.bytes, b.peak.bytes) << what;
          EXPECT_EQ(a.peak.by_category, b.peak.by_category) << what;
          EXPECT_EQ(a.peak.phase, b.peak.phase) << what;
          EXPECT_EQ(a.peak.op, b.peak.op) << what;
          ++compared;
        }
      }
    }
  }
  EXPECT_EQ(compared, 3 * 2 * 6 * 6);
  EXPECT_GT(masters_at_peak, 0);  // the composed optimizer step is compared at the peak
}

// With every layer alike (one kind, one choice: none, full or selective) the composed
// peak replays 2 layers, the last standing for the middle ones (liveness.cc,
// ShortModelOf). That holds if what follows a layer (a layer like it, or the head) does
// not change the layer's own stretches. Checked on whole replays of 4 layers: the last
// layer's forward and backward stretches (net and rise) are those of the middle layers 1
// and 2, for each family with such layers, both attentions, fp32 and bf16 autocast,
// tensor parallelism with sequence parallelism, and CUDA's rounded requests. (Reentrant
// checkpoints' stretches are not cut per layer; their composed peaks are compared in
// EveryKComposesFromItsShortestModel.)
TEST(SimulateStepTest, TheLastLayersStretchesAreTheMiddleOnes) {
  ModelConfig study = StudyModel(/*layers=*/4, /*width=*/32, /*heads=*/2,
                                 /*batch=*/2, /*seq=*/16);
  std::vector<std::pair<std::string, ModelConfig>> models = {{"study", study}};
  for (const char* preset : {"tiny-llama", "tiny-gpt2", "tiny-qwen3", "tiny-qwen3-moe"}) {
    ASSERT_OK_AND_ASSIGN(ModelConfig model, ModelFromPreset(preset));
    models.emplace_back(preset, model);
  }
  ASSERT_OK_AND_ASSIGN(std::vector<Variant> variants,
                       ParseVariants("none,full,selective", /*every=*/1, "matmul"));
  auto same = [](const StepStretch& a, const StepStretch& b) {
    return a.net == b.net && a.has_rise == b.has_rise && (!a.has_rise || a.rise == b.rise);
  };
  int compared = 0;
  for (const auto& [name, model] : models) {
    for (int setting = 0; setting < 5; ++setting) {
      // 0: CPU, flash; 1: math; 2: bf16 autocast; 3: tp 2 with sp (the study and the
      // mixture of experts have no tensor-parallel form: fp32 master weights on bf16
      // instead); 4: CUDA's rounded requests under bf16 autocast (the mixture of experts
      // is modelled on the CPU only: its eager experts instead).
      ModelConfig run = model;
      run.layers = 4;
      AttentionMode attention = setting == 1 ? AttentionMode::kMath : AttentionMode::kFlash;
      OptimizerSpec optimizer;
      if (setting == 2 || setting == 4) run.amp = DType::kBFloat16;
      if (setting == 3 && (model.family == study.family || model.moe.Sparse())) {
        run.dtype = DType::kBFloat16;
        optimizer.master_weights = true;
      } else if (setting == 3) {
        run.shard.tp = 2;
        run.shard.sp = true;
      }
      if (setting == 4 && model.moe.Sparse()) {
        run.moe.impl = ExpertsImpl::kEager;
      } else if (setting == 4) {
        run.device = Device::kCuda;
      }
      StepOptions options;
      options.record_events = false;
      options.cuda_blocks = CudaBlocks::kRequests;
      for (const Variant& variant : variants) {
        run.use_cache = model.use_cache && !variant.CheckpointsAnyLayer();
        SCOPED_TRACE(absl::StrCat(name, " setting ", setting, " ", variant.Name()));
        PredictOptions buckets;
        buckets.optimizer = optimizer;
        buckets.variants = {Variant()};
        buckets.peak = false;
        buckets.attention = attention;
        ASSERT_OK_AND_ASSIGN(Prediction p, Predict(run, buckets));
        ASSERT_OK_AND_ASSIGN(StepSimulator simulator,
                             StepSimulator::Create(run, attention, options));
        ASSERT_OK_AND_ASSIGN(StepStretches s,
                             simulator.Stretches(variant, optimizer, ResidentOf(p)));
        ASSERT_EQ(s.forward.size(), 4u);
        ASSERT_EQ(s.backward.size(), 4u);
        for (size_t middle : {1, 2}) {
          EXPECT_TRUE(same(s.forward[3], s.forward[middle])) << "forward of " << middle;
          EXPECT_TRUE(same(s.backward[3], s.backward[middle])) << "backward of " << middle;
          EXPECT_EQ(s.forward_freed[3], s.forward_freed[middle]) << "freed by " << middle;
        }
        // Not a trivial match: a layer's forward leaves what its backward needs. (With the
        // first layer in place of a middle one, 46 of these checks failed.)
        EXPECT_GT(s.forward[3].net, 0);
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, 5 * 5 * 3);
}

// Gemma 3's layers differ (5 sliding : 1 global, each reading its own RoPE tables): the
// composed peak replays 2m + 1 layers for m = lcm(k, 6) and must equal the whole
// simulation at every layer count, variant and precision, use_cache included.
// ExpectComposedPeakIsTheWhole: the composed peak of `run` (a short model's replay) is
// the whole simulation's: its bytes, categories and op.
void ExpectComposedPeakIsTheWhole(const ModelConfig& run, const Variant& variant,
                                  const std::string& what) {
  StepOptions whole, composed;
  composed.record_events = false;
  ASSERT_OK_AND_ASSIGN(StepTimeline a, SimulateStep(run, AttentionMode::kFlash, variant,
                                                    OptimizerSpec(), ResidentBytes{}, whole));
  ASSERT_OK_AND_ASSIGN(StepTimeline b, SimulateStep(run, AttentionMode::kFlash, variant,
                                                    OptimizerSpec(), ResidentBytes{}, composed));
  EXPECT_EQ(a.peak.bytes, b.peak.bytes) << what;
  EXPECT_EQ(a.peak.by_category, b.peak.by_category) << what;
  EXPECT_EQ(a.peak.op, b.peak.op) << what;
}

TEST(SimulateStepTest, ComposedPeakOfLayersThatDifferEqualsTheWholeSimulation) {
  ASSERT_OK_AND_ASSIGN(ModelConfig gemma, ModelFromPreset("tiny-gemma3"));
  ASSERT_OK_AND_ASSIGN(std::vector<Variant> variants,
                       ParseVariants("none,full,every_k,selective", /*every=*/4, ""));
  int compared = 0;
  for (int64_t layers : {7, 16, 29, 40, 43}) {
    for (DType amp : {DType::kFloat32, DType::kBFloat16}) {
      for (const Variant& variant : variants) {
        ModelConfig run = gemma;
        run.layers = layers;
        run.amp = amp;
        run.batch = 2;
        run.seq = 16;
        run.use_cache = !variant.CheckpointsAnyLayer();
        ExpectComposedPeakIsTheWhole(
            run, variant, absl::StrCat("L", layers, " amp ", DTypeName(amp), " ", variant.Name()));
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, 5 * 2 * 4);
}

// ExpectSameStep: `run` simulated event by event with the pinned rules (plans shared
// through the memo) and with a copy of them (plans of its own), the same step.
void ExpectSameStep(const ModelConfig& run, AttentionMode attention, const Variant& variant,
                    const RuleTable& copy, const std::string& what) {
  StepOptions shared, fresh;
  fresh.rules = &copy;
  ASSERT_OK_AND_ASSIGN(StepTimeline a, SimulateStep(run, attention, variant, OptimizerSpec(),
                                                    ResidentBytes{}, shared));
  ASSERT_OK_AND_ASSIGN(StepTimeline b, SimulateStep(run, attention, variant, OptimizerSpec(),
                                                    ResidentBytes{}, fresh));
  EXPECT_EQ(a.peak.bytes, b.peak.bytes) << what;
  EXPECT_EQ(a.peak.op, b.peak.op) << what;
  ASSERT_EQ(a.events.size(), b.events.size()) << what;
  for (size_t e = 0; e < a.events.size(); ++e) {
    EXPECT_EQ(a.events[e].bytes, b.events[e].bytes) << what << " event " << e;
    EXPECT_EQ(a.events[e].category, b.events[e].category) << what << " event " << e;
  }
}

// A cached graph's segment plans share what they derive from the graph and its storages
// (segment_plan.h, SegmentStructure) with every later config whose tensors share storages
// alike; a copy of the pinned rules makes the simulation derive its own. Across sizes
// that share storages differently (batches, sequences and head counts of 1, under math
// attention), both give the same step, event by event (sharing a structure between
// storages that differ fails it).
TEST(SimulateStepTest, PlansSharedAcrossSizesReplayLikeFreshOnes) {
  const RuleTable copy = RuleTable::Pinned();
  ASSERT_OK_AND_ASSIGN(std::vector<Variant> variants,
                       ParseVariants("none,full,every_k,selective", /*every=*/2, ""));
  const std::vector<std::tuple<int64_t, int64_t, bool>> sizes = {
      {2, 16, false}, {3, 8, false}, {1, 16, false}, {2, 1, false},
      {1, 1, false},  {4, 32, false}, {2, 16, true},  {1, 1, true}};
  int compared = 0;
  for (const char* preset :
       {"study", "tiny-llama", "tiny-gpt2", "tiny-qwen3", "tiny-gemma3", "tiny-qwen3-moe"}) {
    for (const auto& [batch, seq, heads_of_one] : sizes) {
      ASSERT_OK_AND_ASSIGN(ModelConfig preset_config, ModelFromPreset(preset));
      ModelConfig config = Sized(preset_config, batch, seq, heads_of_one);
      config.layers = 3;
      config.amp = batch % 2 == 0 ? DType::kBFloat16 : DType::kFloat32;
      if (!ValidateConfig(config).ok()) continue;
      for (const Variant& variant : variants) {
        for (AttentionMode attention : {AttentionMode::kFlash, AttentionMode::kMath}) {
          ModelConfig run = config;
          run.use_cache = config.use_cache && !variant.CheckpointsAnyLayer();
          ExpectSameStep(run, attention, variant, copy,
                         absl::StrCat(preset, " B", batch, " T", seq,
                                      heads_of_one ? " one head " : " ", variant.Name(), " ",
                                      AttentionModeName(attention)));
          ++compared;
        }
      }
    }
  }
  EXPECT_GT(compared, 300);
}

// ExpectEveryKComposes: every_k on `model` at `layers` (batch 2, seq 16, without the
// cache) composes to the whole simulation's peak.
void ExpectEveryKComposes(ModelConfig run, int64_t every, int64_t layers, CheckpointImpl impl,
                          DType amp) {
  run.layers = layers;
  run.batch = 2;
  run.seq = 16;
  run.use_cache = false;
  run.checkpoint_impl = impl;
  run.amp = amp;
  Variant variant;
  variant.kind = VariantKind::kEveryK;
  variant.every = every;
  ExpectComposedPeakIsTheWhole(
      run, variant,
      absl::StrCat(FamilyName(run.family), " L", layers, " every_", every, " ",
                   CheckpointImplName(impl), " amp ", DTypeName(amp)));
}

// every_k composes from its shortest model: a layer of the first period (not the first of
// its kind, nor its kind's lowest checkpoint) stands for its residue's middle layers, so
// every_2 on 8 layers replays 4 and every_4 on Gemma's 5:1 pattern at least 19 instead of
// at least 25 (liveness.cc, ShortModelOf), and every_1 (every layer checkpointed) 2
// layers, the last standing for the middle ones. At every count from the shortest up
// (each residue mod k, so the last layer is plain or checkpointed), both checkpoint
// implementations (reentrant ones' stretches are not cut per layer, so
// TheLastLayersStretchesAreTheMiddleOnes cannot check them) and both precisions, the
// composed peak is the whole simulation's.
TEST(SimulateStepTest, EveryKComposesFromItsShortestModel) {
  ASSERT_OK_AND_ASSIGN(ModelConfig llama, ModelFromPreset("tiny-llama"));
  ASSERT_OK_AND_ASSIGN(ModelConfig gemma, ModelFromPreset("tiny-gemma3"));
  ASSERT_OK_AND_ASSIGN(ModelConfig gpt2, ModelFromPreset("tiny-gpt2"));
  int compared = 0;
  for (const ModelConfig& model : {llama, gpt2, gemma}) {
    const bool is_gemma = model.family == gemma.family;
    for (int64_t every : {1, 2, 3, 4}) {
      const int64_t period = is_gemma ? std::lcm<int64_t>(every, 6) : every;
      for (int64_t layers = period + 2; layers <= 3 * period + 3; ++layers) {
        for (CheckpointImpl impl : {CheckpointImpl::kNonReentrant, CheckpointImpl::kReentrant}) {
          ExpectEveryKComposes(model, every, layers, impl,
                               layers % 2 == 0 ? DType::kBFloat16 : DType::kFloat32);
          ++compared;
        }
      }
    }
  }
  // Counts k + 2 .. 3k + 3 for period k: 2k + 2 of them. llama and gpt2 (k = every):
  // 4 + 6 + 8 + 10; Gemma (k = lcm(every, 6) = 6, 6, 6, 12): 14 + 14 + 14 + 26; each
  // twice (impls).
  EXPECT_EQ(compared, 2 * 2 * (4 + 6 + 8 + 10) + 2 * (14 + 14 + 14 + 26));
}

// Checkpointed layers of the first period stand for their residues too, but for a kind's
// lowest checkpoint (whose frame would hold what only its kind reads). With every_7 on
// Gemma 3 (m = 42) the checkpointed sliding layers 7 to 28 stand for theirs; the first
// checkpointed global layer, 35, is kept as itself (Gemma's global layers read no such
// tensor: there it is only conservative) and its residue takes 77. Counts where the
// short model (80 to 89 layers) is shorter, both precisions.
TEST(SimulateStepTest, CheckpointedFirstPeriodLayersStandForTheirResidues) {
  ASSERT_OK_AND_ASSIGN(ModelConfig gemma, ModelFromPreset("tiny-gemma3"));
  int compared = 0;
  for (int64_t layers : {122, 125, 131}) {
    for (DType amp : {DType::kFloat32, DType::kBFloat16}) {
      ExpectEveryKComposes(gemma, /*every=*/7, layers, CheckpointImpl::kNonReentrant, amp);
      ++compared;
    }
  }
  EXPECT_EQ(compared, 6);
}

// Dense and sparse layers (a period of one dense, two sparse), the eager experts with one
// kind per routing row: the composed peak replays what the whole simulation does.
TEST(SimulateStepTest, ComposedPeakOfSparseLayersEqualsTheWholeSimulation) {
  ASSERT_OK_AND_ASSIGN(ModelConfig moe, ModelFromPreset("tiny-qwen3-moe"));
  moe.moe.sparse_layers = {false, true, true};
  ASSERT_OK_AND_ASSIGN(std::vector<Variant> variants,
                       ParseVariants("none,full,every_k,selective", /*every=*/2, ""));
  int compared = 0;
  for (int64_t layers : {7, 16, 29}) {
    for (int routing = 0; routing < 3; ++routing) {  // grouped_mm, eager balanced, given
      for (const Variant& variant : variants) {
        ModelConfig run = moe;
        run.layers = layers;
        run.batch = 2;
        run.seq = 8;  // 32 (token, expert) pairs over 4 experts
        run.use_cache = !variant.CheckpointsAnyLayer();
        if (routing > 0) run.moe.impl = ExpertsImpl::kEager;
        if (routing == 2) {
          // A row per sparse layer, rotating the load so that neighbours differ.
          run.moe.routing = RoutingSource::kGiven;
          const std::vector<int64_t> loads[] = {{16, 8, 8, 0}, {2, 10, 4, 16}, {8, 8, 8, 8}};
          for (int64_t l = 0; l < run.SparseLayers(); ++l) {
            run.moe.routing_rows.push_back(loads[l % 3]);
          }
        }
        ExpectComposedPeakIsTheWhole(
            run, variant, absl::StrCat("L", layers, " routing ", routing, " ", variant.Name()));
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, 3 * 3 * 4);
}

// On --device=cuda, counting each storage as its request rounded to 512 B
// (CudaBlocks::kRequests) composes as the CPU's bytes do, and equals what the caching
// allocator's simulation (checked against PyTorch's own allocator in
// cuda_allocator_expandable_test) reports as max_memory_allocated with expandable
// segments, which split every block to its rounded size. Without them a large block
// keeps up to 1 MiB past its request, so the allocator's peak is at least this.
TEST(SimulateStepTest, CudaRequestsComposeToTheExpandableAllocatorsPeak) {
  ASSERT_OK_AND_ASSIGN(ModelConfig llama, ModelFromPreset("tiny-llama"));
  ASSERT_OK_AND_ASSIGN(ModelConfig gpt2, ModelFromPreset("tiny-gpt2"));
  ASSERT_OK_AND_ASSIGN(ModelConfig gemma, ModelFromPreset("tiny-gemma3"));
  ModelConfig study = StudyModel(/*layers=*/1, /*width=*/64, /*heads=*/2,
                                 /*batch=*/2, /*seq=*/64);
  ASSERT_OK_AND_ASSIGN(std::vector<Variant> variants,
                       ParseVariants("none,full,every_k,selective", /*every=*/3, ""));
  int compared = 0;
  int above = 0;  // the plain allocator's peak above the requests'
  for (ModelConfig config : {study, llama, gpt2, gemma}) {
    for (int64_t layers : {7, 16}) {
      for (const Variant& variant : variants) {
        ModelConfig run = config;
        run.device = Device::kCuda;
        run.layers = layers;
        run.dtype = layers == 7 ? DType::kBFloat16 : DType::kFloat32;
        run.amp = layers == 16 ? DType::kBFloat16 : DType::kFloat32;
        run.use_cache = config.use_cache && !variant.CheckpointsAnyLayer();
        OptimizerSpec optimizer;  // AdamW, foreach on CUDA
        PredictOptions buckets;
        buckets.optimizer = optimizer;
        buckets.variants = {Variant()};
        buckets.peak = false;
        ASSERT_OK_AND_ASSIGN(Prediction p, Predict(run, buckets));
        const ResidentBytes resident = ResidentOf(p);
        StepOptions composed, whole, blocks;
        composed.record_events = false;
        composed.cuda_blocks = whole.cuda_blocks = CudaBlocks::kRequests;
        const std::string what = absl::StrCat(FamilyName(config.family), " L", layers, " ",
                                              DTypeName(run.dtype), " amp ",
                                              DTypeName(run.amp), " ", variant.Name());
        ASSERT_OK_AND_ASSIGN(StepTimeline a, SimulateStep(run, AttentionMode::kFlash, variant,
                                                          optimizer, resident, composed));
        ASSERT_OK_AND_ASSIGN(StepTimeline b, SimulateStep(run, AttentionMode::kFlash, variant,
                                                          optimizer, resident, whole));
        ASSERT_OK_AND_ASSIGN(StepTimeline plain, SimulateStep(run, AttentionMode::kFlash,
                                                              variant, optimizer, resident,
                                                              blocks));
        run.expandable_segments = true;
        ASSERT_OK_AND_ASSIGN(StepTimeline expandable,
                             SimulateStep(run, AttentionMode::kFlash, variant, optimizer,
                                          resident, blocks));
        EXPECT_EQ(a.peak.bytes, b.peak.bytes) << what;
        EXPECT_EQ(a.peak.by_category, b.peak.by_category) << what;
        EXPECT_EQ(a.peak.op, b.peak.op) << what;
        EXPECT_EQ(b.peak.bytes, expandable.peak.bytes) << what;
        EXPECT_GE(plain.peak.bytes, b.peak.bytes) << what;
        EXPECT_EQ(a.peak_reserved_bytes, 0) << what;  // no allocator, no segments
        above += plain.peak.bytes > b.peak.bytes;
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, 4 * 2 * 4);
  std::printf("the plain allocator peaked above the requests in %d of %d\n", above, compared);
}

// A composed peak skips the repeating middle layers, so any layer count costs the same:
// here 3e9 + 40 (past int32). Its expected value comes from the whole simulation of
// short models: once the peak moves with the model's end, L and L + k layers differ by
// the same d as L + k and L + 2k, so L + n k layers peak at peak(L) + n d, in the same
// op, which names layer L + n k - 1 when the short models' ops name their last layer.
TEST(SimulateStepTest, ComposedPeakOfBillionsOfLayersExtrapolatesTheWholeSimulation) {
  const ModelConfig study = StudyModel(/*layers=*/1, /*width=*/32, /*heads=*/2,
                                       /*batch=*/2, /*seq=*/16);
  ASSERT_OK_AND_ASSIGN(std::vector<Variant> variants,
                       ParseVariants("none,full,every_k,selective", /*every=*/3, "matmul"));
  constexpr int64_t kShort = 40;
  constexpr int64_t kPeriods = 1000000000;
  for (const Variant& variant : variants) {
    const int64_t k = variant.kind == VariantKind::kEveryK ? variant.every : 1;
    auto peak_of = [&](int64_t layers, bool whole) -> StepPeak {
      ModelConfig config = study;
      config.layers = layers;
      StepOptions options;
      options.record_events = whole;
      absl::StatusOr<StepTimeline> t = SimulateStep(config, AttentionMode::kFlash, variant,
                                                    OptimizerSpec(), ResidentBytes{}, options);
      EXPECT_TRUE(t.ok()) << t.status();
      return t.ok() ? t->peak : StepPeak();
    };
    const StepPeak a = peak_of(kShort, true);
    const StepPeak b = peak_of(kShort + k, true);
    const StepPeak c = peak_of(kShort + 2 * k, true);
    const int64_t d = b.bytes - a.bytes;
    ASSERT_EQ(c.bytes - b.bytes, d) << variant.Name() << ": not linear yet at " << kShort;
    const StepPeak huge = peak_of(kShort + kPeriods * k, false);
    EXPECT_EQ(huge.bytes, a.bytes + kPeriods * d) << variant.Name();
    for (int cat = 0; cat < kNumMemoryCategories; ++cat) {
      const int64_t dc = b.by_category[cat] - a.by_category[cat];
      ASSERT_EQ(c.by_category[cat] - b.by_category[cat], dc) << variant.Name();
      EXPECT_EQ(huge.by_category[cat], a.by_category[cat] + kPeriods * dc) << variant.Name();
    }
    EXPECT_EQ(huge.phase, a.phase) << variant.Name();
    // The op: the same, or the same in the model's last layer.
    auto in_last_layer = [&](int64_t layers) {
      return absl::StrReplaceAll(a.op, {{absl::StrCat("layer ", kShort - 1, " "),
                                         absl::StrCat("layer ", layers - 1, " ")}});
    };
    if (a.op == b.op) {
      EXPECT_EQ(huge.op, a.op) << variant.Name();
    } else {
      ASSERT_EQ(b.op, in_last_layer(kShort + k)) << variant.Name() << ": " << a.op;
      EXPECT_EQ(huge.op, in_last_layer(kShort + kPeriods * k)) << variant.Name();
    }
  }
}

// every_k with k above the layer count checkpoints layer 0 alone; its peak is that of
// the plan saying so layer by layer (a plan replays every layer: no period, no short
// model). k beyond kMaxEvery is refused.
TEST(SimulateStepTest, EveryKOfAHugeKIsThePlanOfItsOneCheckpoint) {
  ModelConfig config = *ModelFromPreset("tiny-gpt2");
  config.layers = 7;
  // transformers runs a checkpointing variant without use_cache: the simulation of a
  // config with it says so.
  Variant full;
  full.kind = VariantKind::kFull;
  EXPECT_STATUS(SimulateStep(config, AttentionMode::kFlash, full, OptimizerSpec(),
                             ResidentBytes{}, {}),
                absl::StatusCode::kInvalidArgument, "use_cache");
  config.use_cache = false;  // both variants checkpoint a layer
  Variant every;
  every.kind = VariantKind::kEveryK;
  every.every = kMaxEvery + 1;
  EXPECT_STATUS(SimulateStep(config, AttentionMode::kFlash, every, OptimizerSpec(),
                             ResidentBytes{}, {}),
                absl::StatusCode::kInvalidArgument, "must be between 1 and 1024, got 1025");
  every.every = kMaxEvery;
  std::vector<LayerChoice> choices(7);
  choices[0].checkpointed = true;
  const Variant plan = PlanVariant(choices);
  StepOptions composed;
  composed.record_events = false;
  ASSERT_OK_AND_ASSIGN(StepTimeline a, SimulateStep(config, AttentionMode::kFlash, every,
                                                    OptimizerSpec(), ResidentBytes{}, composed));
  ASSERT_OK_AND_ASSIGN(StepTimeline b, SimulateStep(config, AttentionMode::kFlash, plan,
                                                    OptimizerSpec(), ResidentBytes{}, composed));
  EXPECT_EQ(a.peak.bytes, b.peak.bytes);
  EXPECT_EQ(a.peak.by_category, b.peak.by_category);
}

// Checkpointing lowers the peak on the default config: full < every_2 < none.
TEST(SimulateStepTest, CheckpointingLowersThePeak) {
  PredictOptions options;
  ASSERT_OK_AND_ASSIGN(options.variants, ParseVariants("none,full,every_k", 2, "matmul"));
  ASSERT_OK_AND_ASSIGN(Prediction p, Predict(ModelConfig(), options));
  ASSERT_TRUE(p.variants[0].peak && p.variants[1].peak && p.variants[2].peak);
  EXPECT_LT(p.variants[1].peak->bytes, p.variants[2].peak->bytes);
  EXPECT_LT(p.variants[2].peak->bytes, p.variants[0].peak->bytes);
}

// The planner's stretches compose under autocast, what the forward's end frees given
// per layer: the study's layer (d = 128) casts its linears' biases, 3d + d + 4d + d =
// 1,152 elements, to bf16 (2,304 B), which no backward node keeps (addmm's backward
// needs no bias), and a checkpointed layer also its weights, fc1's and fc2's 2 x 4 d^2
// = 131,072 elements and the attention's qkv and out projections' 3 d^2 + d^2 = 65,536,
// 393,216 B more (a plain layer's backward nodes keep those). With master weights the stretches
// compose too, the optimizer's fp32 gradient copies given per layer: the study's layer
// holds 12 d^2 + 13 d = 198,272 parameters, whose fp32 copies are 793,088 B.
TEST(SimulateStepTest, WhatIsNotModelledYetIsUnimplementedWithTheReason) {
  ModelConfig config;
  config.amp = DType::kBFloat16;
  ASSERT_OK_AND_ASSIGN(StepSimulator autocast,
                       StepSimulator::Create(config, AttentionMode::kFlash, StepOptions()));
  absl::StatusOr<StepStretches> stretches =
      autocast.Stretches(*ParseVariants("every_k", 2, "matmul")->begin(), OptimizerSpec(),
                         ResidentBytes{});
  ASSERT_OK(stretches.status());
  EXPECT_EQ(stretches->forward_freed,
            (std::vector<int64_t>{395520, 2304, 395520, 2304, 395520, 2304}));

  config.amp = DType::kFloat32;
  config.dtype = DType::kBFloat16;
  OptimizerSpec master;
  master.master_weights = true;
  ASSERT_OK_AND_ASSIGN(StepSimulator bf16,
                       StepSimulator::Create(config, AttentionMode::kFlash, StepOptions()));
  stretches = bf16.Stretches(Variant(), master, ResidentBytes{});
  ASSERT_OK(stretches.status());
  EXPECT_EQ(stretches->optimizer_layer_bytes, std::vector<int64_t>{793088});
}

// A bf16 model's scalars are converted to bf16: torch.optim's for-loop AdamW
// (adam.py:545) holds, at fc2's 128 x 512 weight (131,072 B in bf16), the root and the
// quotient of exp_avg_sq.sqrt() / bc2 and the wrapped divisor, 2 x 131,072 + 8 + 2, and
// the last tensor's denom, fc1's bias (512 x 2 B = 1,024), beside the loss the caller
// still holds (a bf16 scalar, 2 B): 263,180 B of temporaries (fp32 scalars would make it
// 263,182; fc1's weight after ln2's bias gives only 256 + 262,144 + 10 + 2). With 4
// layers, batch 2 and seq 16 the activations are small and the step peaks there.
TEST(SimulateStepTest, ABf16ModelsOptimizerStepWrapsBf16Scalars) {
  ModelConfig config;
  config.layers = 4;
  config.batch = 2;
  config.seq = 16;
  config.dtype = DType::kBFloat16;
  PredictOptions options;
  options.variants = {Variant()};
  ASSERT_OK_AND_ASSIGN(Prediction p, Predict(config, options));
  ASSERT_TRUE(p.variants[0].peak.has_value()) << p.variants[0].peak_unavailable;
  const StepPeak& peak = *p.variants[0].peak;
  EXPECT_EQ(peak.phase, StepPhase::kOptimizer);
  EXPECT_EQ(peak.by_category[static_cast<int>(MemoryCategory::kTemporary)], 263180);
}

// Every bucket fits int64 but the step's sum does not: one block of width 8 on 1.44e16
// tokens saves 2,272 B per 4 tokens (8.18e18 B in all) and, in fc2's backward, holds
// its gradients beside them (about 2,784 B per 4 tokens, 1.0e19 > 2^63).
TEST(SimulateStepTest, AStepThatOverflowsInt64IsOutOfRange) {
  const ModelConfig huge = StudyModel(/*layers=*/1, /*width=*/8, /*heads=*/2,
                                      /*batch=*/3600000000000000, /*seq=*/4);
  PredictOptions options;
  options.variants = {Variant()};
  absl::StatusOr<Prediction> p = Predict(huge, options);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kOutOfRange) << p.status();
  EXPECT_NE(p.status().message().find("overflow int64"), std::string::npos) << p.status();
  options.peak = false;  // the buckets alone fit
  ASSERT_OK_AND_ASSIGN(Prediction buckets, Predict(huge, options));
  EXPECT_EQ(buckets.variants[0].saved_bytes, 8179200000000000000);
}

TEST(SimulateStepTest, BadInputIsInvalidArgument) {
  StepOptions options;
  options.cpu_threads = 0;
  EXPECT_EQ(SimulateStep(ModelConfig(), AttentionMode::kFlash, Variant(), OptimizerSpec(),
                         ResidentBytes{}, options)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  ModelConfig bad;
  bad.width = 0;
  EXPECT_EQ(SimulateStep(bad, AttentionMode::kFlash, Variant(), OptimizerSpec(),
                         ResidentBytes{}, {})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace memledger
