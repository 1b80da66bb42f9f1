#include "estimator/step/liveness.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/graph/block_graph.h"
#include "estimator/spec/checked_math.h"
#include "estimator/graph/family.h"
#include "estimator/step/pipeline_steps.h"
#include "estimator/spec/option_checks.h"
#include "estimator/step/segment_plan.h"
#include "estimator/step/step_ledger.h"
#include "estimator/step/simulation.h"
#include "estimator/saved/walker.h"

namespace memledger {
namespace {

using liveness_internal::Buffers;
using liveness_internal::ContiguousOf;
using liveness_internal::Handle;
using liveness_internal::MakePlan;
using liveness_internal::Memory;
using liveness_internal::ModelPlans;
using liveness_internal::NonOverlappingAndDense;
using liveness_internal::NumelOf;
using liveness_internal::Permuted;
using liveness_internal::SameLayout;
using liveness_internal::SameSizes;
using liveness_internal::SegmentPlan;
using liveness_internal::SegmentSummary;
using liveness_internal::Transposed;
using liveness_internal::Where;
using liveness_internal::WhereText;
using liveness_internal::Simulation;
using liveness_internal::TapeStretch;

// Composing a long model's peak from a short one's stretches. A layer's forward and
// backward stretches depend on its own kind (its graph's, and plain or checkpointed) and
// its neighbours' (every_k repeats them with period k, the layer pattern with its own;
// together with their least common multiple k), and on whether it is the first or the
// last. A model of 2k + 1 layers (congruent to the real count mod k) has a stretch equal
// to each real layer's: the first period [0, k - 1] stands for itself (each kind's first
// layer, and every_k's lowest checkpoint, are in it), [k, 2k - 1] for every middle
// layer, and the last for the last. A middle representative may be followed by the last
// layer, which differs from a middle one only by what follows it (the head), not by
// what it hands back; nor does a layer's stretch depend on whether the layer before it
// is the first (the planner composes any plan from first, middle and last positions
// alone). So a plain middle layer of the first period stands for its residue too
// (ShortModelOf). Verified against the whole simulation by liveness_test and ranks_test,
// and against LibTorch by verify's tests; 2k + 2 layers (the first period one longer)
// gave the same stretches.
int64_t PeriodOf(const Variant& variant, const ModelGraphs& graphs) {
  const int64_t every =
      variant.kind == VariantKind::kEveryK ? std::max<int64_t>(1, variant.every) : 1;
  return std::lcm(every, graphs.Period());  // <= kMaxEvery x the pattern's period
}

// ResidentTimeline starts a step's timeline from what is resident throughout it: on
// CUDA its tensors one by one, each its own block (or request), and the memory outside
// the allocator.
absl::StatusOr<StepTimeline> ResidentTimeline(const ModelConfig& config,
                                              const ResidentBytes& resident) {
  StepTimeline timeline;
  timeline.resident[static_cast<int>(MemoryCategory::kParameter)] = resident.parameter_bytes;
  timeline.resident[static_cast<int>(MemoryCategory::kOptimizerState)] =
      resident.optimizer_state_bytes;
  timeline.resident[static_cast<int>(MemoryCategory::kBuffer)] = resident.buffer_bytes;
  timeline.resident[static_cast<int>(MemoryCategory::kCommunication)] =
      resident.communication_bytes;
  if (config.device == Device::kCuda) {
    if (resident.tensors.empty()) {
      return absl::UnimplementedError(
          "peak memory on --device=cuda needs the resident tensors one by one");
    }
    timeline.resident_tensors = resident.tensors;
    timeline.outside_allocator_bytes = config.cuda_context_bytes;
  }
  return timeline;
}

// StretchOf is a segment's summary as a caller composes it: its net over every category
// and its rise.
StepStretch StretchOf(const SegmentSummary& summary) {
  StepStretch out;
  for (int64_t bytes : summary.net) out.net += bytes;
  out.has_rise = summary.has_rise;
  out.rise = summary.rise;
  return out;
}

// ShortModel is the short model a long one's peak is composed from: its layer count
// (congruent to the real one's mod k) and, by residue mod k, the short layer that stands
// for every real middle layer of that residue. The first period [0, k - 1] stands for
// itself and the last layer for the last.
struct ShortModel {
  int64_t layers = 0;
  std::vector<int64_t> middle;  // by residue; each in [1, layers - 2]

  // Representative is the short layer whose stretches equal real layer i's (of `real`).
  int64_t Representative(int64_t i, int64_t real) const {
    if (layers >= real || i < static_cast<int64_t>(middle.size())) return i;
    if (i == real - 1) return layers - 1;
    return middle[static_cast<size_t>(i % static_cast<int64_t>(middle.size()))];
  }
};

// ShortestCongruent is the least r >= at_least congruent to layers mod k, in closed form
// (k may be any int64: a loop would run up to k times); the real model itself when r
// would not be shorter.
int64_t ShortestCongruent(int64_t layers, int64_t at_least, int64_t k) {
  if (at_least >= layers) return layers;
  return std::min(layers, at_least + ((layers - at_least) % k + k) % k);
}

// StandardShortModel has 2k + 1 layers or more, its middle representatives [k, 2k - 1]:
// a pipeline rank's chunk, whose first period need not be the model's.
ShortModel StandardShortModel(int64_t layers, const Variant& variant, int64_t k) {
  ShortModel model;
  // A plan has no period: the whole model is replayed.
  model.layers = variant.kind == VariantKind::kPlan || k > (layers - 1) / 2
                     ? layers
                     : ShortestCongruent(layers, 2 * k + 1, k);
  for (int64_t r = 0; r < k && model.layers < layers; ++r) model.middle.push_back(k + r);
  return model;
}

// ShortModelOf is a whole model's shortest: a layer of the first period is a middle layer
// already, whose stretches stand for its residue's (the planner composes any plan from
// first, middle and last positions alone, whatever the layer before a middle one is),
// unless it is the first of its kind (which makes and frees the tensors only its kind
// reads) or its kind's lowest checkpointed layer (whose frame holds the model-level
// tensors its kind reads, for every later checkpoint of them). The other residues take
// the second period's. So every_2 replays 4 layers where the standard model has 6 (for
// an even count), and every_4 on a 5:1 pattern of two kinds at least 19 where it had at
// least 25 (43 layers: 19 where it had 31).
// With k = 1 (one kind of layer, one choice for all: none, full, selective) the last
// layer stands for the middle ones too, and 2 layers are replayed where 3 were. A middle
// layer's neighbours are layers like it; the last one's are a layer like it and the
// head. What follows a layer does not change its own stretches: what keeps its output
// does so in the follower's stretch, and its backward starts from its output's gradient,
// summed in the follower's. liveness_test checks this family by family: the last
// layer's stretches are the middle ones' (TheLastLayersStretchesAreTheMiddleOnes).
ShortModel ShortModelOf(int64_t layers, const Variant& variant, const ModelGraphs& graphs,
                        int64_t k) {
  // A plan has no period, and a model of 2k layers or fewer has no shorter one: the whole
  // model is replayed.
  if (variant.kind == VariantKind::kPlan || k > (layers - 1) / 2) return {layers, {}};
  ShortModel model;
  model.middle.resize(static_cast<size_t>(k));
  // Per kind, whether a layer of it (a checkpointed one) came before layer r.
  std::vector<bool> seen(graphs.layer_kinds.size(), false);
  std::vector<bool> checkpointed(graphs.layer_kinds.size(), false);
  int64_t highest = 0;
  for (int64_t r = 0; r < k; ++r) {
    const size_t kind = static_cast<size_t>(graphs.KindOf(r));
    const bool lowest_checkpoint = variant.IsCheckpointed(r) && !checkpointed[kind];
    const bool stands_alone = r >= 1 && seen[kind] && !lowest_checkpoint;
    seen[kind] = true;
    checkpointed[kind] = checkpointed[kind] || variant.IsCheckpointed(r);
    model.middle[static_cast<size_t>(r)] = stands_alone ? r : k + r;
    highest = std::max(highest, model.middle[static_cast<size_t>(r)]);
  }
  // The last after them all; with k = 1 it is the middle one.
  model.layers = ShortestCongruent(layers, k == 1 ? highest + 1 : highest + 2, k);
  if (model.layers >= layers) return {layers, {}};
  return model;
}

// Composer walks a long step's stretches in order, each a short replay's, and keeps the
// first highest moment: live bytes by category, the total, and what the forward's layers
// leave only to autocast's cast cache (freed_at_forward_end), all overflow-checked.
class Composer {
 public:
  explicit Composer(const StepTimeline& short_timeline)
      : live_(short_timeline.resident), total_(short_timeline.resident_bytes) {
    peak_.bytes = total_;
    peak_.by_category = live_;
  }

  // Visit adds a stretch; `real_layer` (>= 0) names a layer stretch's real layer.
  void Visit(const SegmentSummary& s, int64_t real_layer) {
    const int64_t top = Add(total_, s.rise);
    if (s.has_rise && !overflow_ && top > peak_.bytes) {
      peak_.bytes = top;
      peak_.phase = s.phase;
      for (int c = 0; c < kNumMemoryCategories; ++c) {
        peak_.by_category[c] = Add(live_[c], s.at_rise[c]);
      }
      where_ = s.where;
      if (real_layer >= 0 && where_->segment >= 0) where_->segment = real_layer;
    }
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      live_[c] = Add(live_[c], s.net[c]);
      total_ = Add(total_, s.net[c]);
      freed_[c] = Add(freed_[c], s.freed_at_forward_end[c]);
    }
  }

  // WalkLayers visits real layers [first, first + layers) in a pass's order (forward:
  // first to last), layer i as its representative among the short replay's `reduced`
  // (by_layer[i - first]'s). The middle layers (all but the first and the last) repeat
  // one period of k stretches: a period's moments sit at live-at-its-start plus a fixed
  // offset, and live grows by the same d from one period to the next, so over a run of
  // periods each moment is highest in the last when d > 0 and in the first when d <= 0
  // (first of equals). The periods between the first and the last two are skipped with
  // their net added at once; every sum that could overflow is linear in the period's
  // number, extreme at the ends, and the ends are walked.
  void WalkLayers(const std::vector<const SegmentSummary*>& by_layer, int64_t first,
                  int64_t layers, const ShortModel& model, int64_t k, bool forward) {
    const int64_t middle = layers - 2;
    const int64_t skipped = model.layers < layers && middle / k >= 4 ? middle / k - 3 : 0;
    const int64_t step = forward ? 1 : -1;
    std::array<int64_t, kNumMemoryCategories> period_start{}, period_start_freed{};
    for (int64_t n = 0, i = forward ? 0 : layers - 1; n < layers; ++n, i += step) {
      if (n == k + 1) {
        period_start = live_;
        period_start_freed = freed_;
      }
      Visit(*by_layer[static_cast<size_t>(model.Representative(i, layers))], first + i);
      if (n == 2 * k && skipped > 0) {
        for (int c = 0; c < kNumMemoryCategories; ++c) {
          int64_t period_net = 0, net = 0, period_freed = 0, freed = 0;
          overflow_ = overflow_ ||
                      __builtin_sub_overflow(live_[c], period_start[c], &period_net) ||
                      __builtin_mul_overflow(period_net, skipped, &net) ||
                      __builtin_sub_overflow(freed_[c], period_start_freed[c], &period_freed) ||
                      __builtin_mul_overflow(period_freed, skipped, &freed);
          live_[c] = Add(live_[c], net);
          total_ = Add(total_, net);
          freed_[c] = Add(freed_[c], freed);
        }
        n += skipped * k;
        i += skipped * k * step;
      }
    }
  }

  // TakeFreed: what the layers visited since the last call left only to the cast cache.
  std::array<int64_t, kNumMemoryCategories> TakeFreed() {
    std::array<int64_t, kNumMemoryCategories> freed = freed_;
    freed_ = {};
    return freed;
  }
  // Replacing: `s` with the real layers' cached casts freed (`real`) in place of the
  // short replay's (`short_freed`), as the forward's end frees the cache.
  SegmentSummary Replacing(SegmentSummary s,
                           const std::array<int64_t, kNumMemoryCategories>& short_freed,
                           const std::array<int64_t, kNumMemoryCategories>& real) {
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      int64_t net = 0;
      overflow_ = overflow_ || __builtin_sub_overflow(Add(s.net[c], short_freed[c]), real[c], &net);
      s.net[c] = net;
    }
    return s;
  }
  void AddOverflow(bool overflow) { overflow_ = overflow_ || overflow; }

  absl::StatusOr<StepPeak> Peak(const Simulation& simulation, const std::string& what) {
    if (overflow_) {
      return absl::OutOfRangeError(absl::StrCat("the step's live bytes overflow int64 ", what));
    }
    peak_.op = where_.has_value() ? simulation.Text(*where_) : "";
    return peak_;
  }

 private:
  int64_t Add(int64_t a, int64_t b) {
    int64_t sum = 0;
    overflow_ = overflow_ || __builtin_add_overflow(a, b, &sum);
    return sum;
  }

  std::array<int64_t, kNumMemoryCategories> live_;
  int64_t total_;
  std::array<int64_t, kNumMemoryCategories> freed_{};
  StepPeak peak_;
  std::optional<Where> where_;
  bool overflow_ = false;
};

// ShortFreed sums what the short replay's layer stretches leave only to the cast cache.
std::array<int64_t, kNumMemoryCategories> ShortFreed(
    const std::vector<const SegmentSummary*>& by_layer) {
  std::array<int64_t, kNumMemoryCategories> freed{};
  for (const SegmentSummary* s : by_layer) {
    for (int c = 0; c < kNumMemoryCategories; ++c) freed[c] += s->freed_at_forward_end[c];
  }
  return freed;
}

// ComposePeak is one process's step composed from a short model's stretches (its
// prologue, each layer's forward, the head's forward and backward, each layer's
// backward, the tail, the optimizer's step): the layers walked over the real ones, the
// head's forward freeing the real layers' cached casts, and the optimizer's step holding
// every real layer's share (optimizer_layer_bytes, kind by kind).
absl::StatusOr<StepPeak> ComposePeak(const Simulation& simulation,
                                     const StepTimeline& short_timeline, const ModelGraphs& graphs,
                                     int64_t layers, const ShortModel& model, int64_t k) {
  const auto& segments = simulation.segments();
  Composer composer(short_timeline);
  composer.Visit(segments.prologue, -1);
  std::vector<const SegmentSummary*> forward, backward;
  forward.reserve(segments.forward.size());
  backward.reserve(segments.backward.size());
  for (const SegmentSummary& s : segments.forward) forward.push_back(&s);
  for (const SegmentSummary& s : segments.backward) backward.push_back(&s);
  composer.TakeFreed();
  composer.WalkLayers(forward, 0, layers, model, k, /*forward=*/true);
  const std::array<int64_t, kNumMemoryCategories> real_freed = composer.TakeFreed();
  composer.Visit(composer.Replacing(segments.head_forward, ShortFreed(forward), real_freed), -1);
  composer.Visit(segments.head_backward, -1);
  composer.WalkLayers(backward, 0, layers, model, k, /*forward=*/false);
  composer.Visit(segments.tail, -1);
  SegmentSummary optimizer = segments.optimizer;
  for (size_t kind = 0; kind < graphs.layer_kinds.size(); ++kind) {
    const int64_t beyond = graphs.LayersOfKind(static_cast<int>(kind), 0, layers) -
                           graphs.LayersOfKind(static_cast<int>(kind), 0, model.layers);
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      int64_t more = 0;
      composer.AddOverflow(
          __builtin_mul_overflow(beyond, segments.optimizer_layer_bytes[kind][c], &more) ||
          __builtin_add_overflow(optimizer.rise, more, &optimizer.rise) ||
          __builtin_add_overflow(optimizer.at_rise[c], more, &optimizer.at_rise[c]));
    }
  }
  composer.Visit(optimizer, -1);
  return composer.Peak(simulation, absl::StrCat("for ", layers, " layers"));
}

// ComposeRankPeak is a rank's step composed from its short chunks' tape (each chunk
// replayed as `short_models[c]`, its first layer the real one): the tape's stretches in
// order, each pass's layer run walked over the chunk's real layers, the stretch after a
// forward run freeing the real layers' cached casts, and the real rank's reduction and
// optimizer step (its every parameter's) in place of the short one's.
absl::StatusOr<StepPeak> ComposeRankPeak(const Simulation& simulation,
                                         const StepTimeline& short_timeline,
                                         const std::vector<TapeStretch>& tape,
                                         const std::vector<StageRange>& chunks,
                                         const std::vector<ShortModel>& short_models, int64_t k,
                                         const SegmentSummary& reduction) {
  Composer composer(short_timeline);
  std::optional<std::pair<std::array<int64_t, kNumMemoryCategories>,
                          std::array<int64_t, kNumMemoryCategories>>>
      cache_freed;  // a forward run's (short, real), until the stretch that frees them
  for (size_t e = 0; e < tape.size();) {
    const TapeStretch& stretch = tape[e];
    if (stretch.kind == TapeStretch::Kind::kOptimizer) {
      composer.Visit(reduction, -1);
      ++e;
      continue;
    }
    if (stretch.kind == TapeStretch::Kind::kOther) {
      if (cache_freed.has_value()) {
        composer.Visit(
            composer.Replacing(stretch.summary, cache_freed->first, cache_freed->second), -1);
        cache_freed.reset();
      } else {
        composer.Visit(stretch.summary, -1);
      }
      ++e;
      continue;
    }
    // A run: one pass's layer stretches of one chunk, consecutive.
    size_t end = e;
    while (end < tape.size() && tape[end].kind == stretch.kind && tape[end].pass == stretch.pass) {
      ++end;
    }
    size_t c = 0;
    while (c < chunks.size() && !(stretch.layer >= chunks[c].first_layer &&
                                  stretch.layer < chunks[c].first_layer + short_models[c].layers)) {
      ++c;
    }
    if (c == chunks.size()) return absl::InternalError("a layer stretch outside the chunks");
    const int64_t first = chunks[c].first_layer;
    const int64_t short_layers = short_models[c].layers;
    std::vector<const SegmentSummary*> by_layer(static_cast<size_t>(short_layers), nullptr);
    for (size_t i = e; i < end; ++i) {
      const int64_t rel = tape[i].layer - first;
      if (rel < 0 || rel >= short_layers) {
        return absl::InternalError("a layer run across chunks");
      }
      by_layer[static_cast<size_t>(rel)] = &tape[i].summary;
    }
    for (const SegmentSummary* s : by_layer) {
      if (s == nullptr) return absl::InternalError("a layer run missing a layer");
    }
    const bool forward = stretch.kind == TapeStretch::Kind::kLayerForward;
    composer.TakeFreed();
    composer.WalkLayers(by_layer, first, chunks[c].layers, short_models[c], k, forward);
    if (forward) cache_freed.emplace(ShortFreed(by_layer), composer.TakeFreed());
    e = end;
  }
  return composer.Peak(simulation, "on this rank");
}

}  // namespace

absl::StatusOr<StepSimulator> StepSimulator::Create(const ModelConfig& model,
                                                    AttentionMode attention,
                                                    const StepOptions& options,
                                                    const ModelLayouts& layouts) {
  absl::StatusOr<ValidConfig> valid = ValidConfig::Of(model);
  if (!valid.ok()) return valid.status();
  return Create(*valid, attention, options, layouts);
}

absl::StatusOr<StepSimulator> StepSimulator::Create(const ValidConfig& valid,
                                                    AttentionMode attention,
                                                    const StepOptions& options,
                                                    const ModelLayouts& layouts) {
  const ModelConfig& config = *valid;
  if (absl::Status s = CheckCpuThreads(options.cpu_threads); !s.ok()) return s;
  auto plans = std::make_shared<ModelPlans>();
  plans->graphs = ModelGraphsFor(config, attention);
  const ModelGraphs& graphs = *plans->graphs;
  const bool families = graphs.prologue.has_value();
  const RuleTable* rules = options.rules;
  auto make = [&](const BlockGraph& graph, bool input_requires_grad,
                  std::unique_ptr<SegmentPlan>* plan,
                  const std::shared_ptr<const BlockLayouts>& laid_out = nullptr,
                  bool hooked = false) {
    absl::StatusOr<std::unique_ptr<SegmentPlan>> made =
        MakePlan(graph, valid, input_requires_grad, rules, laid_out.get(), hooked);
    if (made.ok()) *plan = *std::move(made);
    return made.status();
  };
  if (families) {
    if (absl::Status s = make(*graphs.prologue, false, &plans->prologue, layouts.prologue);
        !s.ok()) {
      return s;
    }
    if (graphs.HookedPrologueDiffers()) {
      if (absl::Status s = make(*graphs.prologue, false, &plans->hooked_prologue,
                                layouts.prologue, /*hooked=*/true);
          !s.ok()) {
        return s;
      }
    }
  }
  for (const auto& [graph, plan] :
       {std::pair{&graphs.tensors_before_prologue, &plans->tensors_before_prologue},
        std::pair{&graphs.tensors_after_prologue, &plans->tensors_after_prologue}}) {
    if (graph->ops.empty()) continue;
    if (absl::Status s = make(*graph, false, plan); !s.ok()) return s;
  }
  plans->rest.resize(graphs.layer_kinds.size());
  for (size_t kind = 0; kind < graphs.layer_kinds.size(); ++kind) {
    const std::shared_ptr<const BlockLayouts> laid_out =
        kind < layouts.layer_kinds.size() ? layouts.layer_kinds[kind] : nullptr;
    if (absl::Status s = make(graphs.layer_kinds[kind], true, &plans->rest[kind], laid_out);
        !s.ok()) {
      return s;
    }
  }
  // The study's first layer reads the model input, which needs no gradient: a plan of
  // its own, as the families' does when their embeddings are frozen (without the hook of
  // a variant that checkpoints). Otherwise the first layer reads what requires grad, as
  // every other layer does: its kind's plan.
  if (!graphs.FirstInputRequiresGrad(/*checkpointing=*/false)) {
    if (absl::Status s = make(graphs.Layer(0), false, &plans->first_without_grad); !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = make(graphs.epilogue, true, &plans->head, layouts.epilogue); !s.ok()) {
    return s;
  }
  return StepSimulator(valid, attention, options, std::move(plans));
}

namespace {

// OffloadedBytes is what save_on_cpu holds in host memory when the forward returns
// (DeviceOptions::offload_activations; the hooks are off in the backward): a copy of
// each SavedVariable outside the checkpoints (SegmentStructure::packed_tensors, at its
// sizes' bytes), and each non-reentrant checkpoint's input (save_inputs packs it before
// the checkpoint's own hook is entered). A selective checkpoint's cache bypasses the
// hooks (checkpoint.py, respect_saved_tensors_hooks's default) and stays on the device.
int64_t OffloadedBytes(const ModelPlans& plans, const Variant& variant, int64_t layers) {
  auto bytes_of = [](const SegmentPlan& plan, int t) {
    return CheckedInt64(NumelOf(plan.walk.tensor_layouts[t].layout)) *
           ElementSizeBytes(plan.graph->tensors[t].dtype);
  };
  auto packed = [&](const SegmentPlan* plan) {
    CheckedInt64 bytes = 0;
    if (plan == nullptr) return bytes;
    for (const std::vector<int>& tensors : plan->structure->packed_tensors) {
      for (int t : tensors) bytes += bytes_of(*plan, t);
    }
    return bytes;
  };
  const ModelGraphs& graphs = *plans.graphs;
  const bool checkpointing = variant.CheckpointsAnyLayer();
  CheckedInt64 total = packed(plans.Prologue(checkpointing)) + packed(plans.head.get());
  std::vector<std::optional<CheckedInt64>> by_kind(plans.rest.size());
  for (int64_t i = 0; i < layers; ++i) {
    const int kind = graphs.KindOf(i);
    const SegmentPlan* plan = i == 0 ? plans.First(checkpointing) : plans.rest[kind].get();
    if (variant.IsCheckpointed(i)) {
      total += bytes_of(*plan, plan->graph->input);
    } else if (i == 0) {
      total += packed(plan);
    } else {
      if (!by_kind[kind].has_value()) by_kind[kind] = packed(plan);
      total += *by_kind[kind];
    }
  }
  return total.overflowed() ? -1 : total.value();
}

}  // namespace

absl::StatusOr<StepTimeline> StepSimulator::Simulate(const Variant& variant,
                                                     const OptimizerSpec& optimizer,
                                                     const ResidentBytes& resident) const {
  if (absl::Status s = ValidateRunOf(config_, attention_, {variant}, optimizer); !s.ok()) {
    return s;
  }
  if (variant.kind == VariantKind::kCoreAttention) {
    return absl::UnimplementedError(
        "peak memory: the step simulation does not model core_attention's recompute yet");
  }
  if (config_->KeepsKvCache() && variant.CheckpointsAnyLayer()) {
    return absl::InvalidArgumentError(
        "step simulation: a model with use_cache runs a checkpointing variant without the "
        "cache; simulate it on the config with use_cache off (Predict does)");
  }
  const ModelPlans& plans = *plans_;
  absl::StatusOr<StepTimeline> started = ResidentTimeline(*config_, resident);
  if (!started.ok()) return started.status();
  StepTimeline& timeline = *started;
  if (config_->offload_activations) {
    timeline.offloaded_bytes = OffloadedBytes(plans, variant, config_->layers);
  }
  // The caching allocator's blocks depend on everything before them: such a step is
  // replayed whole. Rounded requests (CudaBlocks::kRequests) compose as CPU bytes do.
  const bool allocator =
      config_->device == Device::kCuda && options_.cuda_blocks == CudaBlocks::kAllocator;
  // Without events, a long model's peak is composed from a short one's stretches: the
  // cost stops growing with layers.
  const int64_t period = PeriodOf(variant, *plans.graphs);
  // A probe's layers are not the model's pattern: its first period is not the model's.
  const ShortModel model =
      options_.layer_kinds.empty()
          ? ShortModelOf(config_->layers, variant, *plans.graphs, period)
          : StandardShortModel(config_->layers, variant, period);
  // A data-parallel rank's reduction holds all of its layers' gradients at once (its
  // stretch grows with the layers), a second micro-batch's backward adds to .grads, and
  // a pipeline stage interleaves micro-batches: such a step is replayed whole.
  if (!options_.record_events && !allocator && model.layers < config_->layers &&
      options_.rank.parallel.dp <= 1 && options_.rank.parallel.micro_batches <= 1 &&
      options_.rank.parallel.pp <= 1) {
    ModelConfig short_config = *config_;
    short_config.layers = model.layers;
    Simulation simulation(short_config, variant, optimizer, options_, &timeline);
    simulation.set_model_layers(config_->layers);
    if (absl::Status s = simulation.Run(plans); !s.ok()) return s;
    absl::StatusOr<StepPeak> peak =
        ComposePeak(simulation, timeline, *plans.graphs, config_->layers, model, period);
    if (!peak.ok()) return peak.status();
    timeline.peak = *std::move(peak);
    return std::move(timeline);
  }
  // A rank's step (data parallelism, micro-batches, a pipeline stage's chunks) composes
  // from its chunks replayed short, pass by pass, and its own reduction (ComposeRankPeak).
  // Where its data-parallel program composes so (ComposesFromPasses); other steps are
  // replayed whole.
  const ParallelSpec& parallel = options_.rank.parallel;
  if (!options_.record_events && !allocator &&
      liveness_internal::ComposesFromPasses(DataParallelOf(parallel)) &&
      (parallel.dp > 1 || parallel.micro_batches > 1 || parallel.pp > 1) &&
      config_->checkpoint_impl != CheckpointImpl::kReentrant) {
    const std::vector<StageRange> chunks =
        parallel.pp > 1 ? options_.rank.chunks : std::vector<StageRange>{WholeModel(*config_)};
    std::vector<StageRange> short_chunks = chunks;
    std::vector<ShortModel> short_models;
    bool shorter = false;
    for (StageRange& chunk : short_chunks) {
      short_models.push_back(StandardShortModel(chunk.layers, variant, period));
      shorter = shorter || short_models.back().layers < chunk.layers;
      chunk.layers = short_models.back().layers;
    }
    if (shorter) {
      ModelConfig short_config = *config_;
      StepOptions short_options = options_;
      if (parallel.pp > 1) {
        short_options.rank.chunks = short_chunks;
      } else {
        short_config.layers = short_models.front().layers;
      }
      Simulation simulation(short_config, variant, optimizer, short_options, &timeline);
      simulation.set_model_layers(config_->layers);
      simulation.set_model_chunks(chunks);
      std::vector<TapeStretch> tape;
      simulation.RecordTape(&tape);
      if (absl::Status s = simulation.Run(plans); !s.ok()) return s;
      absl::StatusOr<SegmentSummary> reduction = RankEnd(plans, optimizer, resident);
      if (!reduction.ok()) return reduction.status();
      absl::StatusOr<StepPeak> peak =
          ComposeRankPeak(simulation, timeline, tape, chunks, short_models, period, *reduction);
      if (!peak.ok()) return peak.status();
      timeline.peak = *std::move(peak);
      return std::move(timeline);
    }
  }
  StepOptions options = options_;
  if (allocator) {
    // Every allocation goes through the allocator's simulation, none peeked at.
    options.record_events = true;
  }
  Simulation simulation(*config_, variant, optimizer, options, &timeline);
  if (absl::Status s = simulation.Run(plans); !s.ok()) return s;
  simulation.NamePeak();
  timeline.peak_reserved_bytes = simulation.reserved_peak();
  return std::move(timeline);
}

absl::StatusOr<SegmentSummary> StepSimulator::RankEnd(const ModelPlans& plans,
                                                      const OptimizerSpec& optimizer,
                                                      const ResidentBytes& resident) const {
  // The rank's stage and chunks (its parameters) decide its step's end.
  auto same_rank = [](const RankStep& a, const RankStep& b) {
    if (a.stage != b.stage || a.chunks.size() != b.chunks.size()) return false;
    for (size_t c = 0; c < a.chunks.size(); ++c) {
      const StageRange &x = a.chunks[c], &y = b.chunks[c];
      if (x.first_layer != y.first_layer || x.layers != y.layers || x.prologue != y.prologue ||
          x.head != y.head) {
        return false;
      }
    }
    return true;
  };
  std::lock_guard<std::mutex> lock(plans.reductions_mutex);
  for (const ModelPlans::Reduction& r : plans.reductions) {
    if (r.optimizer == optimizer && same_rank(r.rank, options_.rank)) return r.stretch;
  }
  absl::StatusOr<StepTimeline> end = ResidentTimeline(*config_, resident);
  if (!end.ok()) return end.status();
  const Variant none;
  Simulation reduction(*config_, none, optimizer, options_, &*end);
  if (absl::Status s = reduction.RunReduction(plans); !s.ok()) return s;
  plans.reductions.push_back({optimizer, options_.rank, reduction.segments().optimizer});
  return reduction.segments().optimizer;
}

std::vector<LayerGlobals> StepSimulator::LayerGlobalsOf() const {
  const ModelPlans& plans = *plans_;
  std::vector<LayerGlobals> out;
  for (const std::unique_ptr<SegmentPlan>& plan : plans.rest) {
    LayerGlobals globals;
    for (const WalkedStorage& storage : plan->walk.storage_list) {
      if (!storage.is_global) continue;
      const ModelTensor id = plan->graph->tensors[storage.owner].global;
      (storage.node_keepers > 0 ? globals.kept : globals.held_when_checkpointed).push_back(id);
    }
    out.push_back(std::move(globals));
  }
  return out;
}

absl::Status StepSimulator::ValidateProbe(const Variant& variant,
                                          const OptimizerSpec& optimizer) const {
  const std::vector<int>& kinds = options_.layer_kinds;
  if (kinds.empty()) return ValidateRunOf(config_, attention_, {variant}, optimizer);
  if (absl::Status s = ValidateRunOf(config_, attention_, {Variant()}, optimizer); !s.ok()) {
    return s;
  }
  const size_t count = ModelGraphsFor(*config_, attention_)->layer_kinds.size();
  for (int kind : kinds) {
    if (kind < 0 || static_cast<size_t>(kind) >= count) {
      return absl::InvalidArgumentError(
          absl::StrCat("step probe: the model has no layer kind ", kind));
    }
  }
  if (variant.kind != VariantKind::kPlan || variant.layers.size() != kinds.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step probe: a probe of ", kinds.size(), " layers takes a plan of as many choices"));
  }
  for (const LayerChoice& choice : variant.layers) {
    if (!choice.checkpointed) continue;
    if (absl::Status s = ValidatePolicy(choice.policy, attention_, *config_); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<StepStretches> StepSimulator::Stretches(const Variant& variant,
                                                       const OptimizerSpec& optimizer,
                                                       const ResidentBytes& resident) const {
  if (absl::Status s = ValidateProbe(variant, optimizer); !s.ok()) return s;
  // A probe (Probe) runs its own layers, of the model's kinds.
  ModelConfig config = *config_;
  if (!options_.layer_kinds.empty()) {
    config.layers = static_cast<int64_t>(options_.layer_kinds.size());
    // Whether the prologue makes the sliding-window mask is the model's: every attention
    // span its layers have, within the probe's length (at least the 2 kinds there are).
    std::vector<LayerAttention> spans;
    for (LayerAttention span : config_->LayerAttentionPeriod()) {
      if (std::find(spans.begin(), spans.end(), span) == spans.end()) spans.push_back(span);
    }
    config.layer_attention = spans;
  }
  if (config_->checkpoint_impl == CheckpointImpl::kReentrant &&
      variant.kind != VariantKind::kNone) {
    // Its checkpoints hold their call arguments (shared by every layer) to the step's
    // end: when those die depends on whether any layer is checkpointed.
    return absl::UnimplementedError(
        "peak memory: the stretches of a step with --checkpoint_impl=reentrant do not "
        "compose yet (its checkpoints hold the layers' shared arguments to the step's end)");
  }
  const ModelPlans& plans = *plans_;
  absl::StatusOr<StepTimeline> started = ResidentTimeline(*config_, resident);
  if (!started.ok()) return started.status();
  StepTimeline& timeline = *started;
  StepOptions options = options_;
  options.record_events = false;
  options.cuda_blocks = CudaBlocks::kRequests;  // stretches of allocator blocks would not add
  Simulation simulation(config, variant, optimizer, options, &timeline);
  if (absl::Status s = simulation.Run(plans); !s.ok()) return s;
  const auto stretch = StretchOf;
  const Simulation::Segments& segments = simulation.segments();
  StepStretches out;
  out.resident_bytes = timeline.resident_bytes;
  out.prologue = stretch(segments.prologue);
  for (const SegmentSummary& s : segments.forward) {
    out.forward.push_back(stretch(s));
    int64_t freed = 0;
    for (int64_t bytes : s.freed_at_forward_end) freed += bytes;
    out.forward_freed.push_back(freed);
  }
  out.head_forward = stretch(segments.head_forward);
  out.head_backward = stretch(segments.head_backward);
  for (const SegmentSummary& s : segments.backward) out.backward.push_back(stretch(s));
  out.tail = stretch(segments.tail);
  out.optimizer = stretch(segments.optimizer);
  for (const std::array<int64_t, kNumMemoryCategories>& kind : segments.optimizer_layer_bytes) {
    int64_t bytes = 0;
    for (int64_t b : kind) bytes += b;
    out.optimizer_layer_bytes.push_back(bytes);
  }
  return out;
}

absl::StatusOr<StepStretch> StepSimulator::ReductionStretch(const OptimizerSpec& optimizer,
                                                            const ResidentBytes& resident) const {
  if (absl::Status s = ValidateRunOf(config_, attention_, {Variant()}, optimizer); !s.ok()) {
    return s;
  }
  const ParallelSpec& parallel = options_.rank.parallel;
  if (parallel.pp > 1 ||
      !liveness_internal::ReducesAtStepEnd(DataParallelOf(parallel))) {
    return absl::UnimplementedError(
        "peak memory: the step's end alone is modelled for one pipeline stage whose "
        "gradients are reduced after its backward (ZeRO 0-2)");
  }
  const ModelPlans& plans = *plans_;
  absl::StatusOr<StepTimeline> started = ResidentTimeline(*config_, resident);
  if (!started.ok()) return started.status();
  StepTimeline& timeline = *started;
  StepOptions options = options_;
  options.record_events = false;
  options.cuda_blocks = CudaBlocks::kRequests;
  const Variant none;
  Simulation simulation(*config_, none, optimizer, options, &timeline);
  if (absl::Status s = simulation.RunReduction(plans); !s.ok()) return s;
  return StretchOf(simulation.segments().optimizer);
}

absl::StatusOr<StepTimeline> SimulateStep(const ModelConfig& config, AttentionMode attention,
                                          const Variant& variant,
                                          const OptimizerSpec& optimizer,
                                          const ResidentBytes& resident,
                                          const StepOptions& options) {
  absl::StatusOr<StepSimulator> simulator = StepSimulator::Create(config, attention, options);
  if (!simulator.ok()) return simulator.status();
  return simulator->Simulate(variant, optimizer, resident);
}

const char* MemoryCategoryName(MemoryCategory category) {
  switch (category) {
    case MemoryCategory::kParameter: return "parameter";
    case MemoryCategory::kGradient: return "gradient";
    case MemoryCategory::kOptimizerState: return "optimizer_state";
    case MemoryCategory::kActivation: return "activation";
    case MemoryCategory::kTemporary: return "temporary";
    case MemoryCategory::kInput: return "input";
    case MemoryCategory::kBuffer: return "buffer";
    case MemoryCategory::kCommunication: return "communication";
  }
  return "?";
}

const char* StepPhaseName(StepPhase phase) {
  switch (phase) {
    case StepPhase::kForward: return "forward";
    case StepPhase::kBackward: return "backward";
    case StepPhase::kOptimizer: return "optimizer";
  }
  return "?";
}

}  // namespace memledger
