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
using liveness_internal::Modelled;
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
// last: a model of 2k + 3 layers (congruent to the real count mod k) has a stretch equal
// to each real layer's (verified against the whole simulation by liveness_test).
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

int64_t ReducedLayers(int64_t layers, const Variant& variant, int64_t k) {
  // A plan has no period: the whole model is replayed.
  if (variant.kind == VariantKind::kPlan) return layers;
  // The least r >= 2k + 3 congruent to layers mod k, in closed form (k may be any int64:
  // a loop would run up to k times); the real model itself when r would not be shorter.
  if (k > (layers - 3) / 2) return layers;  // 2k + 3 > layers
  const int64_t base = 2 * k + 3;
  return std::min(layers, base + ((layers - base) % k + k) % k);
}

// Representative is the short model's layer whose stretches equal real layer i's: the
// layer itself in the first period [0, k] (where each kind's first layer makes the
// model-level tensors only it reads into activations, and frees them in the backward),
// the last layer the last, and a middle one a layer congruent to it in [k + 1, 2k].
int64_t Representative(int64_t i, int64_t layers, int64_t reduced, int64_t k) {
  if (i <= k) return i;
  if (i == layers - 1) return reduced - 1;
  return k + 1 + ((i - k - 1) % k + k) % k;  // in [k + 1, 2k], congruent to i mod k
}

// ComposePeak walks the real model's stretches in step order, each the short model's
// representative one, and keeps the first highest moment. The middle layers (all but the
// first and the last) repeat one period of k stretches, and its cost does not grow with
// the layer count: a period's moments sit at live-at-its-start plus a fixed offset, and
// live grows by the same d from one period to the next. Over a run of periods each
// moment is highest in the last period when d > 0 and in the first when d <= 0 (first
// of equals), so the periods between the first and the last two are skipped with their
// net added at once. Every sum that could overflow is linear in the period's number,
// extreme at the ends, and the ends are walked.
absl::StatusOr<StepPeak> ComposePeak(const Simulation& simulation,
                                     const StepTimeline& short_timeline, const ModelGraphs& graphs,
                                     int64_t layers, int64_t reduced, int64_t k) {
  const auto& segments = simulation.segments();
  std::array<int64_t, kNumMemoryCategories> live = short_timeline.resident;
  int64_t total = short_timeline.resident_bytes;
  StepPeak peak;
  peak.bytes = total;
  peak.by_category = live;
  std::optional<Where> where;
  bool overflow = false;
  // What the real layers' forwards leave only in autocast's cache, freed at the head's
  // forward end in place of the short model's.
  std::array<int64_t, kNumMemoryCategories> freed_at_forward_end{};
  auto visit = [&](const SegmentSummary& s, int64_t real_layer) {
    int64_t top = 0;
    overflow = overflow || __builtin_add_overflow(total, s.rise, &top);
    if (s.has_rise && !overflow && top > peak.bytes) {
      peak.bytes = top;
      peak.phase = s.phase;
      for (int c = 0; c < kNumMemoryCategories; ++c) {
        overflow = overflow ||
                   __builtin_add_overflow(live[c], s.at_rise[c], &peak.by_category[c]);
      }
      where = s.where;
      if (real_layer >= 0 && where->segment >= 0) where->segment = real_layer;
    }
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      overflow = overflow || __builtin_add_overflow(live[c], s.net[c], &live[c]) ||
                 __builtin_add_overflow(total, s.net[c], &total) ||
                 __builtin_add_overflow(freed_at_forward_end[c], s.freed_at_forward_end[c],
                                        &freed_at_forward_end[c]);
    }
  };
  // walk visits the layers' stretches from first to last (step +1 or -1), skipping
  // whole middle periods after the second (the first, [1, k], may hold one-time
  // changes: the first layer of each kind's).
  auto walk = [&](const std::vector<SegmentSummary>& stretches, int64_t first, int64_t step) {
    const int64_t middle = layers - 2;  // ComposePeak runs only for layers > 2k + 3
    const int64_t skipped_periods = middle / k >= 4 ? middle / k - 3 : 0;
    std::array<int64_t, kNumMemoryCategories> period_start{}, period_start_freed{};
    for (int64_t n = 0, i = first; n < layers; ++n, i += step) {
      if (n == k + 1) {
        period_start = live;
        period_start_freed = freed_at_forward_end;
      }
      visit(stretches[Representative(i, layers, reduced, k)], i);
      if (n == 2 * k && skipped_periods > 0) {
        // One period walked: skip the next skipped_periods with their net bytes.
        for (int c = 0; c < kNumMemoryCategories; ++c) {
          int64_t period_net = 0, net = 0, period_freed = 0, freed = 0;
          overflow = overflow ||
                     __builtin_sub_overflow(live[c], period_start[c], &period_net) ||
                     __builtin_mul_overflow(period_net, skipped_periods, &net) ||
                     __builtin_add_overflow(live[c], net, &live[c]) ||
                     __builtin_add_overflow(total, net, &total) ||
                     __builtin_sub_overflow(freed_at_forward_end[c], period_start_freed[c],
                                            &period_freed) ||
                     __builtin_mul_overflow(period_freed, skipped_periods, &freed) ||
                     __builtin_add_overflow(freed_at_forward_end[c], freed,
                                            &freed_at_forward_end[c]);
        }
        n += skipped_periods * k;
        i += skipped_periods * k * step;
      }
    }
  };
  visit(segments.prologue, -1);
  walk(segments.forward, 0, +1);
  // The head's forward ends by clearing autocast's cache: it frees the real layers'
  // cached casts, not the short model's (its moments all come before).
  SegmentSummary head_forward = segments.head_forward;
  for (const SegmentSummary& layer : segments.forward) {
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      head_forward.net[c] += layer.freed_at_forward_end[c];  // the short model's back
    }
  }
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    overflow = overflow || __builtin_sub_overflow(head_forward.net[c], freed_at_forward_end[c],
                                                  &head_forward.net[c]);
  }
  visit(head_forward, -1);
  visit(segments.head_backward, -1);
  walk(segments.backward, layers - 1, -1);
  visit(segments.tail, -1);
  // The optimizer's step holds every layer's fp32 .grad copy with master weights, and
  // every layer's share of foreach's list: the real model's layers beyond the short
  // one's, kind by kind.
  SegmentSummary optimizer = segments.optimizer;
  for (size_t kind = 0; kind < graphs.layer_kinds.size(); ++kind) {
    const int64_t beyond = graphs.LayersOfKind(static_cast<int>(kind), 0, layers) -
                           graphs.LayersOfKind(static_cast<int>(kind), 0, reduced);
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      int64_t more = 0;
      overflow = overflow ||
                 __builtin_mul_overflow(beyond, segments.optimizer_layer_bytes[kind][c],
                                        &more) ||
                 __builtin_add_overflow(optimizer.rise, more, &optimizer.rise) ||
                 __builtin_add_overflow(optimizer.at_rise[c], more, &optimizer.at_rise[c]);
    }
  }
  visit(optimizer, -1);
  if (overflow) {
    return absl::OutOfRangeError(absl::StrCat("the step's live bytes overflow int64 for ",
                                              layers, " layers"));
  }
  peak.op = where.has_value() ? simulation.Text(*where) : "";
  return peak;
}

// ComposeRankPeak is a rank's step composed from its short chunks' tape (each chunk
// replayed with `short_layers[c]` layers, congruent to its real count mod k, its first
// layer the real one): the tape's stretches in order, each layer run of a pass walked
// over the chunk's real layers (their representatives' stretches, the middle periods
// skipped as ComposePeak does), and the real rank's reduction and optimizer step (its
// every parameter's) in place of the short one's. The real layers' autocast casts,
// which the forward's end frees, replace the short ones' in the stretch after each
// forward run.
absl::StatusOr<StepPeak> ComposeRankPeak(const Simulation& simulation,
                                         const StepTimeline& short_timeline,
                                         const std::vector<TapeStretch>& tape,
                                         const std::vector<StageRange>& chunks,
                                         const std::vector<int64_t>& short_layers, int64_t k,
                                         const SegmentSummary& reduction) {
  std::array<int64_t, kNumMemoryCategories> live = short_timeline.resident;
  int64_t total = short_timeline.resident_bytes;
  StepPeak peak;
  peak.bytes = total;
  peak.by_category = live;
  std::optional<Where> where;
  bool overflow = false;
  auto add = [&](int64_t a, int64_t b) {
    int64_t sum = 0;
    overflow = overflow || __builtin_add_overflow(a, b, &sum);
    return sum;
  };
  auto visit = [&](const SegmentSummary& s, int64_t real_layer) {
    const int64_t top = add(total, s.rise);
    if (s.has_rise && !overflow && top > peak.bytes) {
      peak.bytes = top;
      peak.phase = s.phase;
      for (int c = 0; c < kNumMemoryCategories; ++c) peak.by_category[c] = add(live[c], s.at_rise[c]);
      where = s.where;
      if (real_layer >= 0 && where->segment >= 0) where->segment = real_layer;
    }
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      live[c] = add(live[c], s.net[c]);
      total = add(total, s.net[c]);
    }
  };
  // What the forward runs' layers leave only to autocast's cache: the short ones', and
  // the real ones' that replace them where the cache is cleared.
  std::array<int64_t, kNumMemoryCategories> short_freed{}, real_freed{};
  bool pending_freed = false;
  for (size_t e = 0; e < tape.size();) {
    const TapeStretch& stretch = tape[e];
    if (stretch.kind == TapeStretch::Kind::kOptimizer) {
      visit(reduction, -1);
      ++e;
      continue;
    }
    if (stretch.kind == TapeStretch::Kind::kOther) {
      SegmentSummary s = stretch.summary;
      if (pending_freed) {
        for (int c = 0; c < kNumMemoryCategories; ++c) {
          s.net[c] = add(s.net[c], short_freed[c]);
          int64_t less = 0;
          overflow = overflow || __builtin_sub_overflow(s.net[c], real_freed[c], &less);
          s.net[c] = less;
        }
        pending_freed = false;
      }
      visit(s, -1);
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
                                  stretch.layer < chunks[c].first_layer + short_layers[c])) {
      ++c;
    }
    if (c == chunks.size()) return absl::InternalError("a layer stretch outside the chunks");
    const int64_t first = chunks[c].first_layer, layers = chunks[c].layers,
                  reduced = short_layers[c];
    std::vector<const SegmentSummary*> by_layer(static_cast<size_t>(reduced), nullptr);
    for (size_t i = e; i < end; ++i) {
      const int64_t rel = tape[i].layer - first;
      if (rel < 0 || rel >= reduced) return absl::InternalError("a layer run across chunks");
      by_layer[static_cast<size_t>(rel)] = &tape[i].summary;
    }
    for (const SegmentSummary* s : by_layer) {
      if (s == nullptr) return absl::InternalError("a layer run missing a layer");
    }
    const bool forward = stretch.kind == TapeStretch::Kind::kLayerForward;
    std::array<int64_t, kNumMemoryCategories> freed{};
    if (forward) {
      short_freed = {};
      for (const SegmentSummary* s : by_layer) {
        for (int cat = 0; cat < kNumMemoryCategories; ++cat) {
          short_freed[cat] = add(short_freed[cat], s->freed_at_forward_end[cat]);
        }
      }
    }
    // The walk: every real layer in the pass's order, the middle periods after the first
    // skipped with their net (ComposePeak's argument).
    const int64_t middle = layers - 2;
    const int64_t skipped = reduced < layers && middle / k >= 4 ? middle / k - 3 : 0;
    const int64_t step = forward ? 1 : -1;
    std::array<int64_t, kNumMemoryCategories> period_start{}, period_start_freed{};
    for (int64_t n = 0, rel = forward ? 0 : layers - 1; n < layers; ++n, rel += step) {
      if (n == k + 1) {
        period_start = live;
        period_start_freed = freed;
      }
      const SegmentSummary& s =
          *by_layer[static_cast<size_t>(reduced < layers ? Representative(rel, layers, reduced, k)
                                                         : rel)];
      visit(s, first + rel);
      for (int cat = 0; cat < kNumMemoryCategories; ++cat) {
        freed[cat] = add(freed[cat], s.freed_at_forward_end[cat]);
      }
      if (n == 2 * k && skipped > 0) {
        for (int cat = 0; cat < kNumMemoryCategories; ++cat) {
          int64_t period_net = 0, net = 0, period_freed = 0, more = 0;
          overflow = overflow ||
                     __builtin_sub_overflow(live[cat], period_start[cat], &period_net) ||
                     __builtin_mul_overflow(period_net, skipped, &net) ||
                     __builtin_sub_overflow(freed[cat], period_start_freed[cat], &period_freed) ||
                     __builtin_mul_overflow(period_freed, skipped, &more);
          live[cat] = add(live[cat], net);
          total = add(total, net);
          freed[cat] = add(freed[cat], more);
        }
        n += skipped * k;
        rel += skipped * k * step;
      }
    }
    if (forward) {
      real_freed = freed;
      pending_freed = true;
    }
    e = end;
  }
  if (overflow) return absl::OutOfRangeError("the step's live bytes overflow int64");
  peak.op = where.has_value() ? simulation.Text(*where) : "";
  return peak;
}

}  // namespace

absl::StatusOr<StepSimulator> StepSimulator::Create(const ModelConfig& config,
                                                    AttentionMode attention,
                                                    const StepOptions& options) {
  if (absl::Status s = ValidateConfig(config); !s.ok()) return s;
  if (options.cpu_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("cpu_threads must be >= 1, got ", options.cpu_threads));
  }
  auto plans = std::make_shared<ModelPlans>();
  plans->graphs = ModelGraphsFor(config, attention);
  const ModelGraphs& graphs = *plans->graphs;
  // What the simulation does not model yet, found before any work.
  std::vector<const BlockGraph*> segments = {&graphs.epilogue};
  if (graphs.prologue.has_value()) segments.push_back(&*graphs.prologue);
  for (const BlockGraph& kind : graphs.layer_kinds) segments.push_back(&kind);
  for (const BlockGraph* graph : segments) {
    for (const OpDef& op : graph->ops) {
      if (!Modelled(op.type)) {
        return absl::UnimplementedError(absl::StrCat(
            "peak memory: the step simulation does not model the backward of ",
            OpTypeName(op.type), " yet"));
      }
    }
  }
  const bool families = graphs.prologue.has_value();
  const RuleTable* rules = options.rules;
  auto make = [&](const BlockGraph& graph, bool input_requires_grad,
                  std::unique_ptr<SegmentPlan>* plan) {
    absl::StatusOr<std::unique_ptr<SegmentPlan>> made =
        MakePlan(graph, config, input_requires_grad, rules);
    if (made.ok()) *plan = *std::move(made);
    return made.status();
  };
  if (families) {
    if (absl::Status s = make(*graphs.prologue, false, &plans->prologue); !s.ok()) return s;
  }
  // The study's first layer reads the model input, which needs no gradient; the
  // families' first layer reads the embeddings.
  if (absl::Status s = make(graphs.Layer(0), families, &plans->first); !s.ok()) return s;
  plans->rest.resize(graphs.layer_kinds.size());
  for (size_t kind = 0; kind < graphs.layer_kinds.size(); ++kind) {
    if (absl::Status s = make(graphs.layer_kinds[kind], true, &plans->rest[kind]); !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = make(graphs.epilogue, true, &plans->head); !s.ok()) return s;
  return StepSimulator(config, attention, options, std::move(plans));
}

absl::StatusOr<StepTimeline> StepSimulator::Simulate(const Variant& variant,
                                                     const OptimizerSpec& optimizer,
                                                     const ResidentBytes& resident) const {
  if (absl::Status s = ValidateRun(config_, attention_, {variant}, optimizer); !s.ok()) {
    return s;
  }
  if (variant.kind == VariantKind::kCoreAttention) {
    return absl::UnimplementedError(
        "peak memory: the step simulation does not model core_attention's recompute yet");
  }
  if (config_.KeepsKvCache() && variant.CheckpointsAnyLayer()) {
    return absl::InvalidArgumentError(
        "step simulation: a model with use_cache runs a checkpointing variant without the "
        "cache; simulate it on the config with use_cache off (Predict does)");
  }
  const ModelPlans& plans = *static_cast<const ModelPlans*>(plans_.get());
  absl::StatusOr<StepTimeline> started = ResidentTimeline(config_, resident);
  if (!started.ok()) return started.status();
  StepTimeline& timeline = *started;
  // The caching allocator's blocks depend on everything before them: such a step is
  // replayed whole. Rounded requests (CudaBlocks::kRequests) compose as CPU bytes do.
  const bool allocator =
      config_.device == Device::kCuda && options_.cuda_blocks == CudaBlocks::kAllocator;
  // Without events, a long model's peak is composed from a short one's stretches: the
  // cost stops growing with layers.
  const int64_t period = PeriodOf(variant, *plans.graphs);
  const int64_t reduced = ReducedLayers(config_.layers, variant, period);
  // A data-parallel rank's reduction holds all of its layers' gradients at once (its
  // stretch grows with the layers), a second micro-batch's backward adds to .grads, and
  // a pipeline stage interleaves micro-batches: such a step is replayed whole.
  if (!options_.record_events && !allocator && reduced < config_.layers &&
      options_.rank.parallel.dp <= 1 && options_.rank.parallel.micro_batches <= 1 &&
      options_.rank.parallel.pp <= 1) {
    ModelConfig short_config = config_;
    short_config.layers = reduced;
    Simulation simulation(short_config, variant, optimizer, options_, &timeline);
    simulation.set_model_layers(config_.layers);
    if (absl::Status s = simulation.Run(plans); !s.ok()) return s;
    absl::StatusOr<StepPeak> peak =
        ComposePeak(simulation, timeline, *plans.graphs, config_.layers, reduced, period);
    if (!peak.ok()) return peak.status();
    timeline.peak = *std::move(peak);
    return std::move(timeline);
  }
  // A rank's step (data parallelism, micro-batches, a 1F1B pipeline stage) composes from
  // its chunks replayed short, pass by pass, and its own reduction (ComposeRankPeak).
  const ParallelSpec& parallel = options_.rank.parallel;
  if (!options_.record_events && !allocator && parallel.zero < 3 &&
      (parallel.dp > 1 || parallel.micro_batches > 1 || parallel.pp > 1) &&
      !(parallel.pp > 1 && parallel.schedule == PipelineSchedule::kInterleaved) &&
      config_.checkpoint_impl != CheckpointImpl::kReentrant) {
    const std::vector<StageRange> chunks =
        parallel.pp > 1 ? options_.rank.chunks : std::vector<StageRange>{WholeModel(config_)};
    std::vector<StageRange> short_chunks = chunks;
    std::vector<int64_t> short_layers;
    bool shorter = false;
    for (StageRange& chunk : short_chunks) {
      chunk.layers = ReducedLayers(chunk.layers, variant, period);
      short_layers.push_back(chunk.layers);
      shorter = shorter || chunk.layers < chunks[short_layers.size() - 1].layers;
    }
    if (shorter) {
      ModelConfig short_config = config_;
      StepOptions short_options = options_;
      if (parallel.pp > 1) {
        short_options.rank.chunks = short_chunks;
      } else {
        short_config.layers = short_layers.front();
      }
      Simulation simulation(short_config, variant, optimizer, short_options, &timeline);
      simulation.set_model_layers(config_.layers);
      std::vector<TapeStretch> tape;
      simulation.RecordTape(&tape);
      if (absl::Status s = simulation.Run(plans); !s.ok()) return s;
      // The real rank's end: its every parameter's gradient reduced and stepped.
      absl::StatusOr<StepTimeline> end = ResidentTimeline(config_, resident);
      if (!end.ok()) return end.status();
      const Variant none;
      Simulation reduction(config_, none, optimizer, options_, &*end);
      if (absl::Status s = reduction.RunReduction(plans); !s.ok()) return s;
      absl::StatusOr<StepPeak> peak =
          ComposeRankPeak(simulation, timeline, tape, chunks, short_layers, period,
                          reduction.segments().optimizer);
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
  Simulation simulation(config_, variant, optimizer, options, &timeline);
  if (absl::Status s = simulation.Run(plans); !s.ok()) return s;
  simulation.NamePeak();
  timeline.peak_reserved_bytes = simulation.reserved_peak();
  return std::move(timeline);
}

absl::StatusOr<StepStretches> StepSimulator::Stretches(const Variant& variant,
                                                       const OptimizerSpec& optimizer,
                                                       const ResidentBytes& resident) const {
  if (absl::Status s = ValidateRun(config_, attention_, {variant}, optimizer); !s.ok()) {
    return s;
  }
  if (config_.checkpoint_impl == CheckpointImpl::kReentrant && variant.kind != VariantKind::kNone) {
    // Its checkpoints hold their call arguments (shared by every layer) to the step's
    // end: when those die depends on whether any layer is checkpointed.
    return absl::UnimplementedError(
        "peak memory: the stretches of a step with --checkpoint_impl=reentrant do not "
        "compose yet (its checkpoints hold the layers' shared arguments to the step's end)");
  }
  const ModelPlans& plans = *static_cast<const ModelPlans*>(plans_.get());
  absl::StatusOr<StepTimeline> started = ResidentTimeline(config_, resident);
  if (!started.ok()) return started.status();
  StepTimeline& timeline = *started;
  StepOptions options = options_;
  options.record_events = false;
  options.cuda_blocks = CudaBlocks::kRequests;  // stretches of allocator blocks would not add
  Simulation simulation(config_, variant, optimizer, options, &timeline);
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
  if (absl::Status s = ValidateRun(config_, attention_, {Variant()}, optimizer); !s.ok()) {
    return s;
  }
  const ParallelSpec& parallel = options_.rank.parallel;
  if (parallel.pp > 1 || parallel.zero >= 3) {
    return absl::UnimplementedError(
        "peak memory: the step's end alone is modelled for one pipeline stage with ZeRO 0-2");
  }
  const ModelPlans& plans = *static_cast<const ModelPlans*>(plans_.get());
  absl::StatusOr<StepTimeline> started = ResidentTimeline(config_, resident);
  if (!started.ok()) return started.status();
  StepTimeline& timeline = *started;
  StepOptions options = options_;
  options.record_events = false;
  options.cuda_blocks = CudaBlocks::kRequests;
  const Variant none;
  Simulation simulation(config_, none, optimizer, options, &timeline);
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
