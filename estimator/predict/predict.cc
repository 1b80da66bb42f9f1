#include "estimator/predict/predict.h"

#include <algorithm>
#include <array>
#include <deque>
#include <cstdint>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/spec/checked_math.h"
#include "estimator/spec/option_checks.h"
#include "estimator/spec/status_macros.h"
#include "estimator/graph/family.h"

namespace memledger {
namespace {

// BlockWalks memoizes the layer walks of one Predict call: a layer's walk depends only
// on its kind (its graph), whether it is checkpointed (and with which policy) and whether
// its input requires grad (every layer's but the first's may not:
// ModelGraphs::FirstInputRequiresGrad).
class BlockWalks {
 public:
  BlockWalks(const ModelGraphs& graphs, const ValidConfig& config, bool breakdown,
             const RuleTable* rules)
      : graphs_(graphs), config_(config), breakdown_(breakdown), rules_(rules),
        layouts_(graphs.layer_kinds.size()) {}

  const ModelGraphs& graphs() const { return graphs_; }

  // Get walks a layer of `kind`; `core`: Megatron's selective recompute of the core
  // attention (for a layer that is not checkpointed).
  absl::StatusOr<const BlockWalk*> Get(int kind, bool checkpointed, const SavePolicy& policy,
                                       bool input_requires_grad, bool core = false) {
    core = core && !checkpointed;
    for (Entry& entry : entries_) {
      if (entry.kind == kind && entry.checkpointed == checkpointed &&
          entry.input_requires_grad == input_requires_grad &&
          entry.core == core && (!checkpointed || entry.policy == policy)) {
        return &entry.walk;
      }
    }
    WalkOptions options;
    options.checkpointed = checkpointed;
    options.recompute_core_attention = core;
    options.input_requires_grad = input_requires_grad;
    options.policy = policy;
    options.record_storages = breakdown_;
    options.rules = rules_;
    const BlockGraph& graph = graphs_.layer_kinds[kind];
    absl::StatusOr<BlockWalk> walk = WalkBlock(graph, config_, options, LayoutsOf(kind).get());
    if (!walk.ok()) return walk.status();
    entries_.push_back(
        Entry{kind, checkpointed, input_requires_grad, core, policy, *std::move(walk)});
    return &entries_.back().walk;
  }

  // LayoutsOf: a kind's layouts, which every walk of it (and the step simulator's plan)
  // starts from: made once. Null if they failed (a walk says why).
  const std::shared_ptr<const BlockLayouts>& LayoutsOf(int kind) {
    Layouts& layouts = layouts_[kind];
    if (!layouts.laid_out) {
      layouts.layouts = LayoutBlock(graphs_.layer_kinds[kind], config_);
      layouts.laid_out = true;
    }
    return layouts.layouts;
  }

 private:
  struct Entry {
    int kind;
    bool checkpointed;
    bool input_requires_grad;
    bool core;
    SavePolicy policy;
    BlockWalk walk;
  };
  struct Layouts {
    std::shared_ptr<const BlockLayouts> layouts;  // null if they failed (walks say why)
    bool laid_out = false;
  };
  const ModelGraphs& graphs_;
  const ValidConfig& config_;
  bool breakdown_;
  const RuleTable* rules_;
  std::vector<Layouts> layouts_;  // by kind
  std::deque<Entry> entries_;  // deque: Get's pointers stay valid
};

// Segments are the prologue and epilogue walks of one Predict call, and their layouts.
// hooked_prologue: the prologue's walk under enable_input_require_grads' hook, which the
// variants that checkpoint have; made only where it differs (the embeddings frozen).
struct Segments {
  std::optional<BlockWalk> prologue, hooked_prologue;
  // Prologue: the prologue's walk for a variant that checkpoints (`checkpointing`) or not.
  const std::optional<BlockWalk>& Prologue(bool checkpointing) const {
    return checkpointing && hooked_prologue.has_value() ? hooked_prologue : prologue;
  }
  BlockWalk epilogue;
  std::shared_ptr<const BlockLayouts> prologue_layouts, epilogue_layouts;
};

// Congruent returns how many i in [lo, hi] have i % k == r (lo >= 0, 0 <= r < k).
int64_t Congruent(int64_t lo, int64_t hi, int64_t r, int64_t k) {
  if (hi < lo) return 0;
  auto upto = [&](int64_t x) { return x < r ? 0 : (x - r) / k + 1; };  // in [0, x]
  return upto(hi) - (lo == 0 ? 0 : upto(lo - 1));
}

// ByDtype is a byte count split by dtype (indexed by DType).
using ByDtype = std::array<CheckedInt64, kNumDTypes>;

// GlobalBytes adds each model-level storage once, to the first segment that saves it,
// and to its dtype in `by_dtype`; those only held by checkpoints' call arguments
// (KeptGlobal::held) it counts apart, once, in HeldOnlyBytes().
class GlobalBytes {
 public:
  explicit GlobalBytes(ByDtype& by_dtype) : by_dtype_(by_dtype) {}

  // BytesOf is the bytes of a model-level storage some segment keeps; 0 if none does.
  int64_t BytesOf(ModelTensor id) const {
    for (size_t i = 0; i < seen_.size(); ++i) {
      if (seen_[i] == id) return seen_bytes_[i];
    }
    return 0;
  }

  CheckedInt64 Add(const BlockWalk& walk) {
    CheckedInt64 added = 0;
    for (const KeptGlobal& global : walk.kept_globals) {
      if (global.held) {
        held_.push_back(global);
        continue;
      }
      if (Contains(seen_, global.id)) continue;
      seen_.push_back(global.id);
      seen_bytes_.push_back(global.bytes);
      added += global.bytes;
      by_dtype_[static_cast<int>(global.dtype)] += global.bytes;
    }
    return added;
  }

  // HeldOnlyBytes: the held globals no segment saves, each once.
  CheckedInt64 HeldOnlyBytes() const {
    CheckedInt64 bytes = 0;
    Ids counted = seen_;
    for (const KeptGlobal& global : held_) {
      if (Contains(counted, global.id)) continue;
      counted.push_back(global.id);
      bytes += global.bytes;
    }
    return bytes;
  }

 private:
  // A model has a few model-level tensors (token and position ids, RoPE's tables, a
  // mask): kept inline, as the census of every variant lists them again.
  using Ids = absl::InlinedVector<ModelTensor, 8>;
  static bool Contains(const Ids& ids, ModelTensor id) {
    return std::find(ids.begin(), ids.end(), id) != ids.end();
  }

  ByDtype& by_dtype_;
  Ids seen_;
  absl::InlinedVector<int64_t, 8> seen_bytes_;
  absl::InlinedVector<KeptGlobal, 8> held_;
};

// LayerCensus is the decoder stack as kinds of layers: each kind's walk and how many
// layers are of it (the first layer is its own kind), and how many of the boundaries
// between two layers are kept (one layer's output, the next one's input: one storage).
struct LayerCensus {
  struct Kind {
    const BlockWalk* walk = nullptr;
    bool checkpointed = false;
    bool input_requires_grad = true;
    int64_t count = 0;
    int layer_kind = 0;  // into ModelGraphs::layer_kinds
  };
  std::vector<Kind> kinds;  // kinds[0]: the first layer
  int64_t kept_boundaries = 0;  // among boundaries 1..L-1
  const BlockWalk* last = nullptr;
};

bool SharedKept(const BlockWalk& before, const BlockWalk& after) {
  return before.keeps_output || after.keeps_input;
}

// PeriodicCensus counts a variant other than a plan in closed form over the model's
// layers [lo, lo + n) (all of them, or a pipeline stage's). The first is its own kind;
// the others repeat with period m, the least common multiple of the variant's k (layer i
// checkpointed iff i % k == 0; 1 for full and selective) and the layer pattern's period,
// so a layer's walk and the pair it forms with the next depend on i % m only: the counts
// are of residues (any int64 layer count), and the cost grows with m, not with n.
absl::StatusOr<LayerCensus> PeriodicCensus(const Variant& variant, int64_t lo, int64_t n,
                                           BlockWalks& walks) {
  const ModelGraphs& graphs = walks.graphs();
  // `none` and core_attention checkpoint no layer; core_attention recomputes each layer's
  // core attention instead.
  const bool checkpoints =
      variant.kind != VariantKind::kNone && variant.kind != VariantKind::kCoreAttention;
  const bool core = variant.kind == VariantKind::kCoreAttention;
  const int64_t k = variant.kind == VariantKind::kEveryK ? variant.every : 1;
  const int64_t m = std::lcm(k, graphs.Period());
  const SavePolicy policy = variant.PolicyAt(0);
  const bool first_input_grad = graphs.FirstInputRequiresGrad(variant.CheckpointsAnyLayer());
  auto walk_of = [&](int64_t i, bool first) {
    return walks.Get(graphs.KindOf(i), checkpoints && i % k == 0, policy,
                     !first || first_input_grad, core);
  };
  absl::StatusOr<const BlockWalk*> first = walk_of(lo, /*first=*/lo == 0);
  if (!first.ok()) return first.status();
  LayerCensus census;
  census.kinds.push_back({*first, checkpoints && lo % k == 0, lo != 0 || first_input_grad, 1,
                          graphs.KindOf(lo)});
  const int64_t hi = lo + n - 1;  // the last layer
  census.last = *first;
  // One period of layers after the first (fewer when the stage is shorter): each stands
  // for the layers congruent to it mod m.
  for (int64_t i = lo + 1; i <= std::min(hi, lo + m); ++i) {
    absl::StatusOr<const BlockWalk*> walk = walk_of(i, /*first=*/false);
    if (!walk.ok()) return walk.status();
    const int64_t count = Congruent(lo + 1, hi, i % m, m);
    auto kind = std::find_if(census.kinds.begin() + 1, census.kinds.end(),
                             [&](const LayerCensus::Kind& c) { return c.walk == *walk; });
    if (kind == census.kinds.end()) {
      census.kinds.push_back({*walk, checkpoints && i % k == 0, true, count, graphs.KindOf(i)});
    } else {
      kind->count += count;
    }
    if (i % m == hi % m) census.last = *walk;
    // The boundary between the first layer and the next.
    if (i == lo + 1 && SharedKept(**first, **walk)) census.kept_boundaries += 1;
  }
  // The boundaries after layers j in [lo + 1, hi - 1], by j's residue: between j's walk
  // and j + 1's.
  for (int64_t j = lo + 1; j <= std::min(hi - 1, lo + m); ++j) {
    absl::StatusOr<const BlockWalk*> before = walk_of(j, false);
    absl::StatusOr<const BlockWalk*> after = walk_of(j + 1, false);
    if (!before.ok()) return before.status();
    if (!after.ok()) return after.status();
    if (SharedKept(**before, **after)) {
      census.kept_boundaries += Congruent(lo + 1, hi - 1, j % m, m);
    }
  }
  return census;
}

// PlanCensus counts a plan layer by layer (a plan lists every layer).
absl::StatusOr<LayerCensus> PlanCensus(const Variant& variant, int64_t lo, int64_t n,
                                       BlockWalks& walks) {
  LayerCensus census;
  const BlockWalk* previous = nullptr;
  const bool first_input_grad =
      walks.graphs().FirstInputRequiresGrad(variant.CheckpointsAnyLayer());
  for (int64_t i = lo; i < lo + n; ++i) {
    const LayerChoice choice = variant.At(i);
    const bool input_requires_grad = i != 0 || first_input_grad;
    absl::StatusOr<const BlockWalk*> walk = walks.Get(
        walks.graphs().KindOf(i), choice.checkpointed, choice.policy, input_requires_grad);
    if (!walk.ok()) return walk.status();
    auto kind = std::find_if(census.kinds.begin(), census.kinds.end(),
                             [&](const LayerCensus::Kind& k) { return k.walk == *walk; });
    if (kind == census.kinds.end()) {
      census.kinds.push_back({*walk, choice.checkpointed, input_requires_grad, 1,
                              walks.graphs().KindOf(i)});
    } else {
      ++kind->count;
    }
    if (previous != nullptr && SharedKept(*previous, **walk)) ++census.kept_boundaries;
    previous = *walk;
  }
  census.last = previous;
  return census;
}

// PredictVariant adds up the kept storages of the model (or of one pipeline stage's
// part of it) for one variant: each kind of layer times its count, and each kept
// boundary storage once.
absl::StatusOr<VariantPrediction> PredictVariant(const Variant& variant,
                                                 const ModelConfig& config,
                                                 const Segments& whole, bool breakdown,
                                                 BlockWalks& walks,
                                                 const StageRange& stage) {
  const int64_t layers = stage.layers;
  absl::StatusOr<LayerCensus> counted =
      variant.kind == VariantKind::kPlan
          ? PlanCensus(variant, stage.first_layer, layers, walks)
          : PeriodicCensus(variant, stage.first_layer, layers, walks);
  if (!counted.ok()) return counted.status();
  const LayerCensus& census = *counted;
  const BlockWalk& f = *census.kinds[0].walk;
  // The stage's segments: a stage without the embedding receives its input (a leaf
  // that requires grad, kept if its first layer keeps it); one without the head sends
  // its output (kept only if its last layer keeps it).
  Segments segments;
  if (stage.prologue) segments.prologue = whole.Prologue(variant.CheckpointsAnyLayer());
  BlockWalk no_head;
  const BlockWalk& epilogue = stage.head ? whole.epilogue : no_head;

  CheckedInt64 layer_bytes = 0;
  CheckedInt64 cache = 0;
  for (const LayerCensus::Kind& kind : census.kinds) {
    layer_bytes += CheckedInt64(kind.count) *
                   (CheckedInt64(kind.walk->inner_bytes) + kind.walk->cache_bytes);
    cache += CheckedInt64(kind.count) * kind.walk->cache_bytes;
  }
  // Boundary storages: 0 is the model input (or the prologue's output), L the last
  // output (the epilogue's input).
  const bool prologue_keeps_output =
      segments.prologue.has_value() && segments.prologue->keeps_output;
  int64_t kept_boundaries =
      ((prologue_keeps_output || f.keeps_input) ? 1 : 0) + census.kept_boundaries;
  layer_bytes += CheckedInt64(kept_boundaries) * f.boundary_bytes;
  CheckedInt64 head_loss = epilogue.inner_bytes;
  const bool last_boundary_kept = SharedKept(*census.last, epilogue);
  if (last_boundary_kept) head_loss += f.boundary_bytes;

  // The same sum by dtype: every term above is a walk's quantity times a count.
  ByDtype by_dtype{};
  auto add_walk = [&](const BlockWalk& w, int64_t count) {
    for (int d = 0; d < kNumDTypes; ++d) {
      by_dtype[d] += CheckedInt64(count) * (CheckedInt64(w.inner_by_dtype[d]) + w.cache_by_dtype[d]);
    }
  };
  CheckedInt64 weight_copies = epilogue.weight_copy_bytes;
  for (const LayerCensus::Kind& kind : census.kinds) {
    add_walk(*kind.walk, kind.count);
    weight_copies += CheckedInt64(kind.count) * kind.walk->weight_copy_bytes;
  }
  if (stage.head) add_walk(epilogue, 1);
  if (segments.prologue.has_value()) add_walk(*segments.prologue, 1);
  by_dtype[static_cast<int>(f.boundary_dtype)] +=
      CheckedInt64(kept_boundaries + (last_boundary_kept ? 1 : 0)) * f.boundary_bytes;

  GlobalBytes globals(by_dtype);
  CheckedInt64 embedding = 0;
  if (segments.prologue.has_value()) {
    embedding = CheckedInt64(segments.prologue->inner_bytes) + globals.Add(*segments.prologue);
  }
  for (const LayerCensus::Kind& kind : census.kinds) layer_bytes += globals.Add(*kind.walk);
  if (stage.head) head_loss += globals.Add(epilogue);

  CheckedInt64 saved = embedding + layer_bytes + head_loss;
  // What the forward leaves held besides: each checkpointed call's CPU RNG state, the
  // call arguments only checkpoints hold, and the wrapped numbers backward nodes keep.
  int64_t checkpointed_calls = 0;
  CheckedInt64 held_unsaved = epilogue.held_bytes;
  // The module buffers some node saves: resident before the step, not held by it.
  CheckedInt64 saved_buffers = epilogue.buffer_bytes;
  if (segments.prologue.has_value()) {
    // A held output (the hook's leaf) that the first layer keeps counts as saved there.
    const bool output_saved = segments.prologue->holds_output && f.keeps_input;
    held_unsaved += segments.prologue->held_bytes - (output_saved ? f.boundary_bytes : 0);
    saved_buffers += segments.prologue->buffer_bytes;
  }
  for (const LayerCensus::Kind& kind : census.kinds) {
    if (kind.checkpointed) checkpointed_calls += kind.count;
    held_unsaved += CheckedInt64(kind.count) * kind.walk->held_bytes;
    saved_buffers += CheckedInt64(kind.count) * kind.walk->buffer_bytes;
  }
  // A checkpoint's RNG states are host tensors beside a CUDA model: no device bytes.
  const int64_t rng_state_bytes = config.device == Device::kCuda ? 0 : kCpuRngStateBytes;
  const CheckedInt64 held_besides = CheckedInt64(checkpointed_calls) * rng_state_bytes +
                                    globals.HeldOnlyBytes() + held_unsaved;
  CheckedInt64 dtype_total = 0;
  for (const CheckedInt64& bytes : by_dtype) dtype_total += bytes;
  if (saved.overflowed() || cache.overflowed() || dtype_total.overflowed() ||
      weight_copies.overflowed() || (saved + held_besides).overflowed() ||
      saved_buffers.overflowed()) {
    return absl::OutOfRangeError(absl::StrCat(
        "saved bytes of variant ", variant.Name(), " overflow int64 at layers=", layers));
  }
  if (dtype_total.value() != saved.value()) {
    return absl::InternalError(absl::StrCat("variant ", variant.Name(), ": saved bytes ",
                                            saved.value(), " but by dtype ",
                                            dtype_total.value()));
  }
  VariantPrediction prediction;
  prediction.variant = variant;
  prediction.saved_bytes = saved.value();
  prediction.cache_bytes = cache.value();
  prediction.embedding_bytes = embedding.value();
  prediction.layers_bytes = layer_bytes.value();
  prediction.head_loss_bytes = head_loss.value();
  // The model input: the study's hidden states (boundary 0, with no prologue) or the
  // families' token ids.
  prediction.input_bytes_kept =
      whole.prologue.has_value()
          ? globals.BytesOf(ModelTensor::kInputIds)
          : (f.keeps_input && stage.first_layer == 0 ? f.boundary_bytes : 0);
  for (int d = 0; d < kNumDTypes; ++d) prediction.saved_by_dtype[d] = by_dtype[d].value();
  prediction.held_after_forward_bytes =
      (saved + held_besides).value() - prediction.input_bytes_kept - saved_buffers.value();
  prediction.weight_copy_bytes = weight_copies.value();
  if (breakdown) {
    for (const LayerCensus::Kind& kind : census.kinds) {
      prediction.blocks.push_back(BlockKind{kind.checkpointed, kind.input_requires_grad,
                                            kind.count, *kind.walk, kind.layer_kind});
    }
    prediction.prologue = segments.prologue;
    prediction.epilogue = epilogue;
  }
  return prediction;
}

// WalkSegments walks the prologue (if the model has one) and the epilogue.
absl::StatusOr<Segments> WalkSegments(const ModelGraphs& graphs, const ValidConfig& config,
                                      const PredictOptions& options) {
  WalkOptions segment_options;
  segment_options.record_storages = options.breakdown;
  segment_options.rules = options.rules;
  Segments segments;
  // From their layouts, so that a cached graph's memo serves the walk (walk_memo.h).
  auto walk = [&](const BlockGraph& graph, std::shared_ptr<const BlockLayouts>* layouts) {
    *layouts = LayoutBlock(graph, config);
    return WalkBlock(graph, config, segment_options, layouts->get());
  };
  if (graphs.prologue.has_value()) {
    MEMLEDGER_ASSIGN_OR_RETURN(segments.prologue,
                               walk(*graphs.prologue, &segments.prologue_layouts));
    if (graphs.HookedPrologueDiffers()) {
      WalkOptions hooked = segment_options;
      hooked.input_embeddings_hooked = true;
      MEMLEDGER_ASSIGN_OR_RETURN(
          segments.hooked_prologue,
          WalkBlock(*graphs.prologue, config, hooked, segments.prologue_layouts.get()));
    }
  }
  MEMLEDGER_ASSIGN_OR_RETURN(segments.epilogue, walk(graphs.epilogue, &segments.epilogue_layouts));
  return segments;
}

}  // namespace

namespace {

absl::StatusOr<Prediction> PredictGraphs(const ValidConfig& valid,
                                         const PredictOptions& options);

}  // namespace

std::vector<ResidentTensor> ResidentTensors(const ModelGraphs& graphs, const ModelConfig& config,
                                            const OptimizerSpec& optimizer,
                                            const std::vector<StageRange>& chunks,
                                            int64_t param_bytes, int64_t state_bytes) {
  std::vector<ResidentTensor> parameters, state;
  const OptimizerBytesPerParameter per = OptimizerBytesOf(config, optimizer);
  const bool adam = optimizer.kind != OptimizerKind::kSgd;
  int64_t parameters_sum = 0, state_sum = 0;
  auto visit = [&](const BlockGraph& graph, const std::string& where) {
    for (int t : graph.Parameters()) {
      const TensorDef& def = graph.tensors[t];
      if (def.is_tied && graphs.prologue.has_value()) continue;  // the embedding's
      const CheckedInt64 numel = TensorElements(def, config);
      if (numel.overflowed()) return false;
      const std::string name = absl::StrCat(where, " ", def.name);
      const int64_t bytes = numel.value() * ElementSizeBytes(def.dtype);
      parameters.push_back({name, MemoryCategory::kParameter, bytes});
      parameters_sum += bytes;
      if (def.frozen) continue;  // no optimizer state
      auto add = [&](const char* what, int64_t b) {
        if (b <= 0) return;
        state.push_back({absl::StrCat(name, " ", what), MemoryCategory::kOptimizerState, b});
        state_sum += b;
      };
      const int64_t moments = per.moments * numel.value();
      if (adam) {
        add("exp_avg", moments / 2);
        add("exp_avg_sq", moments - moments / 2);
      } else {
        add("momentum_buffer", moments);
      }
      add("master", per.master * numel.value());
      add("step", per.per_tensor);
    }
    return true;
  };
  bool ok = true;
  for (const StageRange& chunk : chunks) {
    ok = ok && (!chunk.prologue || !graphs.prologue.has_value() ||
                visit(*graphs.prologue, "embeddings"));
    for (int64_t i = chunk.first_layer; ok && i < chunk.first_layer + chunk.layers; ++i) {
      ok = visit(graphs.Layer(i), absl::StrCat("layer ", i));
    }
    ok = ok && (!chunk.head || visit(graphs.epilogue, "head"));
  }
  if (!ok || parameters_sum != param_bytes || state_sum != state_bytes) return {};
  parameters.insert(parameters.end(), state.begin(), state.end());
  return parameters;
}

absl::StatusOr<Prediction> Predict(const ModelConfig& config,
                                   const PredictOptions& options) {
  // The one validation of the run: what is below takes the validated config.
  absl::StatusOr<ValidConfig> valid =
      ValidateRun(config, options.attention, options.variants, options.optimizer);
  if (!valid.ok()) return valid.status();
  return PredictValid(*valid, options);
}

absl::StatusOr<Prediction> PredictValid(const ValidConfig& valid, const PredictOptions& options) {
  const ModelConfig& config = *valid;
  if (options.timeline) {
    if (absl::Status s = CheckTimelineLayers(config.layers); !s.ok()) return s;
  }
  if (!config.KeepsKvCache()) return PredictGraphs(valid, options);
  // With use_cache the variants that checkpoint a layer run without the cache
  // (transformers turns it off, utils/generic.py:1041-1045): they are predicted on the
  // graphs without it, the others (and saved_bytes_none) on the graphs with it.
  PredictOptions cached = options, uncached = options;
  cached.variants.clear();
  uncached.variants.clear();
  for (const Variant& v : options.variants) {
    (v.CheckpointsAnyLayer() ? uncached : cached).variants.push_back(v);
  }
  if (uncached.variants.empty()) return PredictGraphs(valid, options);
  absl::StatusOr<Prediction> rest = PredictGraphs(valid.WithoutCache(), uncached);
  if (!rest.ok()) return rest;
  cached.peak = cached.peak && !cached.variants.empty();
  absl::StatusOr<Prediction> prediction = PredictGraphs(valid, cached);
  if (!prediction.ok()) return prediction;
  // The variants in the order asked, each against the `none` that keeps the cache.
  std::vector<VariantPrediction> with_cache = std::move(prediction->variants);
  prediction->variants.clear();
  size_t next_cached = 0, next_uncached = 0;
  for (const Variant& v : options.variants) {
    VariantPrediction p = v.CheckpointsAnyLayer()
                              ? std::move(rest->variants[next_uncached++])
                              : std::move(with_cache[next_cached++]);
    p.saved_ratio_vs_none = static_cast<double>(p.saved_bytes) /
                            static_cast<double>(prediction->saved_bytes_none);
    prediction->variants.push_back(std::move(p));
  }
  prediction->caveats = Caveats(config, options.variants);
  return prediction;
}

namespace {

absl::StatusOr<Prediction> PredictGraphs(const ValidConfig& valid,
                                         const PredictOptions& options) {
  const ModelConfig& config = *valid;
  Prediction prediction;
  prediction.config = config;
  prediction.attention = options.attention;
  std::shared_ptr<const ModelGraphs> graphs = ModelGraphsFor(config, options.attention);
  prediction.graphs = graphs;

  const int64_t d = config.width;
  const ParameterCensus census = StageParameters(*graphs, config, WholeModel(config));
  const CheckedInt64 n_params = census.elements;
  // The family's closed form (FamilyDef::expected_parameters), where it fits int64.
  if (const auto expected = FamilyOf(config.family).expected_parameters; expected != nullptr) {
    const std::optional<int64_t> count = expected(config);
    if (count.has_value() && !n_params.overflowed() && n_params.value() != *count) {
      return absl::InternalError(absl::StrCat("block graph has ", n_params.value(),
                                              " parameters, expected ", *count));
    }
  }
  // Frozen parameters are in the model's dtype; those that train, and their gradients,
  // in TrainableDtype (LoRA's fp32 adapters on a bf16 model).
  const int64_t element = ElementSizeBytes(config.TrainableDtype());
  const OptimizerSpec& optimizer = options.optimizer;
  const OptimizerBytesPerParameter per_parameter = OptimizerBytesOf(config, optimizer);
  // Only the parameters that train have gradients and optimizer state (torch.optim
  // skips a parameter whose .grad is None: adamw.py, _init_group).
  const CheckedInt64 trainable = census.trainable_elements;
  const CheckedInt64 grad_bytes = trainable * element;
  CheckedInt64 param_bytes =
      census.frozen_elements * ElementSizeBytes(config.dtype) + grad_bytes;
  CheckedInt64 moment_bytes = trainable * per_parameter.moments;
  CheckedInt64 state_bytes = moment_bytes + trainable * per_parameter.master +
                             CheckedInt64(census.trainable_tensors) * per_parameter.per_tensor;
  const CheckedInt64 buffer_bytes = BufferBytes(*graphs, config);
  if (param_bytes.overflowed() || state_bytes.overflowed() || buffer_bytes.overflowed()) {
    return absl::OutOfRangeError(absl::StrCat(
        "parameter bytes overflow int64 at layers=", config.layers, " width=", d,
        " vocab=", config.vocab, " intermediate=", config.Intermediate()));
  }
  prediction.optimizer = optimizer;
  prediction.caveats = Caveats(config, options.variants);
  prediction.n_params = n_params.value();
  prediction.param_bytes = param_bytes.value();
  prediction.n_trainable_params = trainable.value();
  prediction.frozen_param_bytes = param_bytes.value() - grad_bytes.value();
  prediction.grad_bytes = grad_bytes.value();
  prediction.buffer_bytes = buffer_bytes.value();
  prediction.optimizer_state_bytes = state_bytes.value();
  prediction.adamw_state_bytes =
      optimizer.kind == OptimizerKind::kAdamW ? moment_bytes.value() : 0;

  absl::StatusOr<Segments> walked = WalkSegments(*graphs, valid, options);
  if (!walked.ok()) return walked.status();
  const Segments& segments = *walked;

  BlockWalks walks(*graphs, valid, options.breakdown, options.rules);
  Variant none;
  absl::StatusOr<VariantPrediction> reference =
      PredictVariant(none, config, segments, /*breakdown=*/false, walks, WholeModel(config));
  if (!reference.ok()) return reference.status();
  prediction.saved_bytes_none = reference->saved_bytes;

  // What exists before the step; on CUDA tensor by tensor, each its own block of the
  // caching allocator.
  const ResidentBytes resident = ResidentOf(prediction);
  // One step simulator for every variant: it walks the model's segments once.
  std::optional<StepSimulator> simulator;
  std::string peak_unavailable;
  if (options.peak) {
    StepOptions step;
    step.cpu_threads = options.cpu_threads;
    step.cuda_blocks = options.cuda_blocks;
    step.record_events = options.timeline;
    step.rules = options.rules;
    step.python_dispatch_mode = options.python_dispatch_mode;
    // The segments' layouts, made for the buckets already.
    ModelLayouts layouts{segments.prologue_layouts, {}, segments.epilogue_layouts};
    for (int kind = 0; kind < static_cast<int>(graphs->layer_kinds.size()); ++kind) {
      layouts.layer_kinds.push_back(walks.LayoutsOf(kind));
    }
    absl::StatusOr<StepSimulator> created =
        StepSimulator::Create(valid, options.attention, step, layouts);
    if (created.ok()) {
      simulator = *std::move(created);
    } else if (absl::IsUnimplemented(created.status())) {
      peak_unavailable = std::string(created.status().message());
    } else {
      return created.status();
    }
  }
  prediction.variants.reserve(options.variants.size());
  for (const Variant& variant : options.variants) {
    // `none` is the reference itself, unless it is asked with its breakdown.
    absl::StatusOr<VariantPrediction> v =
        variant.kind == VariantKind::kNone && !options.breakdown
            ? *reference
            : PredictVariant(variant, config, segments, options.breakdown, walks,
                             WholeModel(config));
    if (!v.ok()) return v.status();
    v->variant = variant;
    v->graphs = graphs;
    v->saved_ratio_vs_none =
        static_cast<double>(v->saved_bytes) / static_cast<double>(prediction.saved_bytes_none);
    if (simulator.has_value()) {
      absl::StatusOr<StepTimeline> timeline =
          simulator->Simulate(variant, optimizer, resident);
      if (timeline.ok()) {
        v->peak = timeline->peak;
        v->peak_reserved_bytes = timeline->peak_reserved_bytes;
        v->offloaded_bytes = timeline->offloaded_bytes;
        if (options.timeline && config.device != Device::kCuda) {
          timeline->resident_tensors =
              ResidentTensors(*graphs, config, optimizer, {WholeModel(config)},
                              prediction.param_bytes, prediction.optimizer_state_bytes);
        }
        if (options.timeline) {
          v->timeline = std::make_shared<const StepTimeline>(*std::move(timeline));
        }
      } else if (absl::IsUnimplemented(timeline.status())) {
        v->peak_unavailable = std::string(timeline.status().message());
      } else {
        return timeline.status();
      }
    } else {
      v->peak_unavailable = peak_unavailable;
    }
    prediction.variants.push_back(*std::move(v));
  }

  prediction.korthikanti_saved_bytes_none = KorthikantiSavedBytes(config, options.attention);
  if (prediction.korthikanti_saved_bytes_none < 0) {
    return absl::OutOfRangeError("Korthikanti's prediction overflows int64");
  }
  prediction.saved_none_over_korthikanti =
      static_cast<double>(prediction.saved_bytes_none) /
      static_cast<double>(prediction.korthikanti_saved_bytes_none);
  return prediction;
}

}  // namespace

void AddBufferTensors(const ModelGraphs& graphs, const ModelConfig& config,
                      std::vector<ResidentTensor>* tensors) {
  std::vector<ResidentTensor> buffers;
  for (const CheckedInt64& bytes : BufferSizes(graphs, config)) {
    if (!bytes.overflowed() && bytes.value() > 0) {
      buffers.push_back(ResidentTensor{"buffer", MemoryCategory::kBuffer, bytes.value()});
    }
  }
  auto state = std::find_if(tensors->begin(), tensors->end(), [](const ResidentTensor& t) {
    return t.category == MemoryCategory::kOptimizerState;
  });
  tensors->insert(state, buffers.begin(), buffers.end());
}

ResidentBytes ResidentOf(const Prediction& prediction) {
  ResidentBytes resident{prediction.param_bytes, prediction.optimizer_state_bytes,
                         prediction.buffer_bytes, {}};
  const ModelConfig& config = prediction.config;
  if (config.device != Device::kCuda || prediction.graphs == nullptr) return resident;
  resident.tensors =
      ResidentTensors(*prediction.graphs, config, prediction.optimizer, {WholeModel(config)},
                      prediction.param_bytes, prediction.optimizer_state_bytes);
  AddBufferTensors(*prediction.graphs, config, &resident.tensors);
  return resident;
}

std::vector<std::string> Caveats(const ModelConfig& config,
                                 const std::vector<Variant>& /*variants*/) {
  std::vector<std::string> caveats;
  if (config.device == Device::kCuda) {
    // What the CUDA step's simulation leaves out (its saved bytes are checked against
    // the real stack's forward on fake CUDA, its peak against the real stack's whole step
    // on fake CUDA (tests/fake_cuda_step_test.py), its allocator against PyTorch's own;
    // its kernels' workspaces come from their sources, and no GPU has checked the peak).
    caveats.push_back(absl::StrCat(
        "cuda: the peak is checked on fake CUDA tensors, not on a GPU yet; kernel "
        "workspaces it leaves out: the "
        "memory-efficient and cuDNN attention backward's, layer norm's and reductions' "
        "partial buffers, the embedding backward's sort; cuBLASLt's 1 MiB workspace is "
        "counted as cuBLAS's ",
        config.cublas_workspace_bytes, " B (--cublas_workspace_config)"));
    caveats.push_back(
        "cuda: peak_reserved_bytes starts from a fresh allocator holding the resident "
        "tensors; a warm-up step's cached segments can make max_memory_reserved() larger");
    if (config.moe.Sparse()) {
      // Fake tensors run no kernel, and on them index_backward takes the out-of-place
      // index_put (FunctionsManual.cpp, for tensor-subclass-like inputs): the fake
      // witness cannot see what a GPU's index_put_ makes.
      caveats.push_back(
          "cuda: the experts' router sort and index backward (index_put_ with "
          "accumulate) sort on the GPU with int64 index buffers and cub's workspace, "
          "not counted; grouped_mm is transformers' path on sm80 and later");
    }
    return caveats;
  }
  if (config.dtype != DType::kFloat32 || config.amp != DType::kFloat32) {
    caveats.push_back(
        "low precision: oneDNN's bf16/fp16 matmuls (torch.backends.mkldnn, on by default) "
        "allocate CPU scratchpads not in the peak; memledger predicts ATen's own gemm");
  }
  return caveats;
}

OptimizerBytesPerParameter OptimizerBytesOf(const ModelConfig& config,
                                            const OptimizerSpec& optimizer) {
  // The state is in the dtype of what the optimizer steps: the parameters, or their
  // fp32 master copies.
  const int64_t fp32 = ElementSizeBytes(DType::kFloat32);
  const int64_t state_element =
      optimizer.master_weights ? fp32 : ElementSizeBytes(config.TrainableDtype());
  int64_t states = 0;
  int64_t per_tensor = 0;
  switch (optimizer.kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam:
      states = 2;  // exp_avg, exp_avg_sq
      per_tensor = fp32;  // step: torch.tensor(0.0, dtype=_get_scalar_dtype()), fp32
      // ... a host tensor beside CUDA parameters unless fused or capturable
      // (adam.py:166-177): no device bytes.
      if (config.device == Device::kCuda && optimizer.impl != OptimizerImpl::kFused) {
        per_tensor = 0;
      }
      break;
    case OptimizerKind::kSgd:
      states = optimizer.momentum > 0 ? 1 : 0;  // momentum_buffer
      break;
  }
  return {states * state_element, optimizer.master_weights ? fp32 : 0, per_tensor};
}

absl::StatusOr<StagePrediction> PredictStage(const ModelConfig& model,
                                             const PredictOptions& options,
                                             const StageRange& stage) {
  // A pipeline stage is a rank's (estimator/predict/ranks.h): no DynamicCache.
  ModelConfig uncached = model;
  uncached.use_cache = false;
  absl::StatusOr<ValidConfig> valid =
      ValidateRun(uncached, options.attention, options.variants, options.optimizer);
  if (!valid.ok()) return valid.status();
  return PredictValidStage(*valid, options, stage);
}

absl::StatusOr<StagePrediction> PredictValidStage(const ValidConfig& valid,
                                                  const PredictOptions& options,
                                                  const StageRange& stage) {
  const ModelConfig& config = *valid;
  if (stage.first_layer < 0 || stage.layers < 1 ||
      stage.first_layer > config.layers - stage.layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stage: layers [", stage.first_layer, ", ", stage.first_layer, " + ", stage.layers,
        ") are not within the model's ", config.layers));
  }
  std::shared_ptr<const ModelGraphs> graphs = ModelGraphsFor(config, options.attention);
  const ParameterCensus census = StageParameters(*graphs, config, stage);
  const CheckedInt64 n_params = census.elements;
  if (n_params.overflowed() || census.trainable_elements.overflowed()) {
    return absl::OutOfRangeError("stage: parameter count overflows int64");
  }
  absl::StatusOr<Segments> segments = WalkSegments(*graphs, valid, options);
  if (!segments.ok()) return segments.status();
  BlockWalks walks(*graphs, valid, options.breakdown, options.rules);
  StagePrediction prediction;
  prediction.n_params = n_params.value();
  prediction.n_trainable_params = census.trainable_elements.value();
  prediction.n_trainable_tensors = census.trainable_tensors;
  for (const Variant& variant : options.variants) {
    absl::StatusOr<VariantPrediction> v =
        PredictVariant(variant, config, *segments, options.breakdown, walks, stage);
    if (!v.ok()) return v.status();
    prediction.variants.push_back(*std::move(v));
  }
  return prediction;
}

int64_t KorthikantiSavedBytes(const ModelConfig& config, AttentionMode attention) {
  // Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  // Models", per layer without recompute: s*b*h*(34 + 5*a*s/h) bytes in fp16 with
  // dropout. Without the two 1-byte dropout masks that is 32 bytes = 16 elements per
  // token and width, 16 x the element size in the model's dtype; the attention term
  // 5*a*s^2*b (softmax 2 bytes, its dropout mask 1, its output 2) drops the mask: 2
  // elements, and exists only where the (B, H, T, T) matrix is kept (math attention).
  // Per GPU with tensor parallelism t (their Table 2): s*b*h*(10 + 24/t + 5*a*s/(h*t)),
  // the replicated 10 being the two norms' inputs and the two column-parallel linears'
  // inputs (8 bytes) and the two masks; with sequence parallelism everything over t:
  // s*b*h/t*(34 + 5*a*s/h). Without the masks, elements per token and width: 4 + 12/t,
  // or 16/t; the attention term 2/t.
  const int64_t element = ElementSizeBytes(config.dtype);
  const int64_t t = config.shard.tp;
  const int64_t per_width = config.shard.sp || t == 1 ? 16 : 4 * t + 12;  // x 1/t
  CheckedInt64 bytes = CheckedInt64(config.layers) * element * per_width * config.batch *
                       config.seq * config.width;
  if (attention == AttentionMode::kMath) {
    bytes += CheckedInt64(config.layers) * element * 2 * config.batch * config.heads *
             config.seq * config.seq;
  }
  return bytes.overflowed() ? -1 : bytes.value() / t;
}

}  // namespace memledger
