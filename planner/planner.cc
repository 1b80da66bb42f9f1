#include "planner/planner.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "estimator/graph/family.h"
#include "estimator/predict/predict.h"
#include "estimator/predict/ranks.h"
#include "estimator/report/units.h"
#include "planner/planner_tables.h"

namespace memledger {

std::vector<LayerChoice> AllChoices(const ModelConfig& config, AttentionMode attention) {
  std::vector<LayerChoice> choices = {LayerChoice{false, {}}, LayerChoice{true, {}}};
  std::vector<OpKind> kinds;
  for (int k = 0; k < kNumOpKinds; ++k) {
    if (ValidatePolicy(SavePolicy{static_cast<OpKind>(k)}, attention, config).ok()) {
      kinds.push_back(static_cast<OpKind>(k));
    }
  }
  for (uint32_t mask = 1; mask < (1u << kinds.size()); ++mask) {
    LayerChoice choice{true, {}};
    for (size_t k = 0; k < kinds.size(); ++k) {
      if (mask & (1u << k)) choice.policy.Add(kinds[k]);
    }
    choices.push_back(choice);
  }
  return choices;
}

absl::StatusOr<Planner> Planner::Create(const ModelConfig& model,
                                        const PlannerOptions& options) {
  absl::StatusOr<ValidConfig> valid = ValidConfig::Of(model);
  if (!valid.ok()) return valid.status();
  if (absl::Status s = ValidateParallel(model, options.parallel); !s.ok()) return s;
  return Create(*valid, options);
}

absl::StatusOr<Planner> Planner::Create(const ValidConfig& valid_model,
                                        const PlannerOptions& options) {
  const ModelConfig& model = *valid_model;
  // The plans are composed without transformers' use_cache, which only the plan that
  // checkpoints nothing keeps (see ModelConfig::use_cache; its peak is replayed below).
  const ValidConfig valid = valid_model.WithoutCache();
  const ModelConfig& config = *valid;
  auto tables = std::make_shared<Tables>();
  tables->config = config;
  tables->options = options;
  // none and full are always known: the probes use them as neighbours.
  std::vector<LayerChoice> wanted =
      options.choices.empty() ? AllChoices(config, options.attention) : options.choices;
  tables->choices = {LayerChoice{false, {}}, LayerChoice{true, {}}};
  std::vector<int> allowed;
  for (const LayerChoice& choice : wanted) {
    auto it = std::find(tables->choices.begin(), tables->choices.end(), choice);
    const int index = static_cast<int>(it - tables->choices.begin());
    if (it == tables->choices.end()) tables->choices.push_back(choice);
    if (std::find(allowed.begin(), allowed.end(), index) == allowed.end()) {
      allowed.push_back(index);
    }
  }
  if (tables->choices.size() > 64) {
    return absl::InvalidArgumentError("checkpoint planner: at most 64 layer choices");
  }
  // The optimizer (the config is valid), then every choice's policy.
  if (absl::Status s = ValidateRunOf(valid, options.attention, {Variant()}, options.optimizer);
      !s.ok()) {
    return s;
  }
  // The dynamic program keeps every layer's partial plans to trace the answer back.
  if (config.layers > kMaxPlannerLayers) {
    return absl::InvalidArgumentError(absl::StrCat("the checkpoint planner handles at most ",
                                                   kMaxPlannerLayers, " layers, got --layers ",
                                                   config.layers));
  }
  // The model's layers' kinds and slots (the first layer of each kind is its own slot).
  const std::shared_ptr<const ModelGraphs> graphs = ModelGraphsFor(config, options.attention);
  tables->kinds = static_cast<int>(graphs->layer_kinds.size());
  std::vector<bool> kind_seen(tables->kinds, false);
  for (int64_t i = 0; i < config.layers; ++i) {
    const int kind = graphs->KindOf(i);
    tables->kind_of.push_back(kind);
    tables->slot_of.push_back(SlotOf(PositionOf(i, config.layers), !kind_seen[kind]));
    kind_seen[kind] = true;
  }
  for (const LayerChoice& choice : tables->choices) {
    if (!choice.checkpointed) continue;
    if (absl::Status s = ValidatePolicy(choice.policy, options.attention, config); !s.ok()) {
      return s;
    }
  }

  absl::StatusOr<StepFlops> flops = CountStepFlops(valid, options.attention);
  if (!flops.ok()) return flops.status();
  tables->flops = *flops;
  tables->recompute.assign(tables->kinds, {});
  for (int kind = 0; kind < tables->kinds; ++kind) {
    const int64_t first = graphs->FirstOfKind(kind);
    for (const LayerChoice& choice : tables->choices) {
      absl::StatusOr<int64_t> recompute =
          first < 0 ? absl::StatusOr<int64_t>(0)
                    : RecomputeFlops(valid, options.attention, choice, first);
      if (!recompute.ok()) return recompute.status();
      tables->recompute[kind].push_back(*recompute);
    }
  }

  // Resident bytes: parameters, optimizer state and buffers, as Predict counts them (a
  // data-parallel rank's as PredictRanks does).
  const ParallelSpec& parallel = options.parallel;
  const DataParallel data_parallel = DataParallelOf(parallel);
  if (parallel.pp > 1 || parallel.micro_batches > 1 || data_parallel == DataParallel::kZero3 ||
      data_parallel == DataParallel::kFsdp2) {
    return absl::UnimplementedError(
        "the checkpoint planner plans one data-parallel rank with ZeRO 0-2 and one "
        "micro-batch, not --pp, --micro_batches, --zero=3 or --fsdp yet");
  }
  PredictOptions predict;
  predict.attention = options.attention;
  predict.optimizer = options.optimizer;
  predict.variants = {Variant()};
  predict.peak = false;
  absl::StatusOr<Prediction> buckets = PredictValid(valid, predict);
  if (!buckets.ok()) return buckets.status();
  // On CUDA tensor by tensor, each a request the probes count rounded (their stretches
  // are of CudaBlocks::kRequests: the allocator's blocks would not compose).
  ResidentBytes resident = ResidentOf(*buckets);
  if (parallel.dp > 1) {
    absl::StatusOr<RanksPrediction> ranks = PredictValidRanks(valid, parallel, predict);
    if (!ranks.ok()) return ranks.status();
    absl::StatusOr<ResidentBytes> rank =
        RankResident(config, parallel, ranks->kinds[0], options.attention, options.optimizer);
    if (!rank.ok()) return rank.status();
    resident = *rank;
  }
  // The plan without checkpoints keeps transformers' DynamicCache: its own peak.
  if (model.KeepsKvCache() && parallel.dp <= 1) {  // ranks keep no DynamicCache
    StepOptions cached;
    cached.cpu_threads = options.cpu_threads;
    cached.record_events = false;
    cached.cuda_blocks = CudaBlocks::kRequests;  // as the probes count
    absl::StatusOr<StepSimulator> with_cache =
        StepSimulator::Create(valid_model, options.attention, cached);
    if (!with_cache.ok()) return with_cache.status();
    absl::StatusOr<StepTimeline> none = with_cache->Simulate(Variant(), options.optimizer, resident);
    if (!none.ok()) return none.status();
    tables->cached_none_peak = none->peak.bytes;
  }

  // The probes: short models of the model's kinds of layer (planner_probes.cc).
  StepOptions step;
  step.cpu_threads = options.cpu_threads;
  step.record_events = false;
  // Under DDP the Reducer's hooks run in each layer's backward
  // (estimator/step/data_parallel_ddp.cc): the probes run as the rank; its step ends as
  // one process's (nothing after the backward).
  const bool ddp = TorchDdp(parallel);
  if (ddp) step.rank.parallel = parallel;
  absl::StatusOr<StepSimulator> simulator = StepSimulator::Create(valid, options.attention, step);
  if (!simulator.ok()) return simulator.status();
  if (absl::Status s = tables->RecordProbes(*simulator, options.optimizer, resident); !s.ok()) {
    return s;
  }

  if (parallel.dp > 1 && !ddp) {
    // The rank's step ends with the gradients' reduction and its shard's step, over the
    // whole model's parameters, whatever the plan.
    StepOptions rank = step;
    rank.rank.parallel = parallel;
    absl::StatusOr<StepSimulator> whole = StepSimulator::Create(valid, options.attention, rank);
    if (!whole.ok()) return whole.status();
    absl::StatusOr<StepStretch> end = whole->ReductionStretch(options.optimizer, resident);
    if (!end.ok()) return end.status();
    tables->optimizer = *end;
  } else {
    // The optimizer's rise over the model's layers, kind by kind.
    for (int kind = 0; kind < tables->kinds; ++kind) {
      tables->optimizer.rise += graphs->LayersOfKind(kind, 0, config.layers) *
                                std::max<int64_t>(tables->optimizer_layer_bytes[kind], 0);
    }
  }

  // The layer count times the largest stretch must fit int64 with room to add.
  __int128 largest = 0;
  for (const Tables::LayerStretches& st : tables->layer) {
    for (const StepStretch* s : {&st.forward, &st.backward}) {
      largest = std::max<__int128>(largest, s->net < 0 ? -static_cast<__int128>(s->net) : s->net);
      largest = std::max<__int128>(largest, s->rise < 0 ? -static_cast<__int128>(s->rise) : s->rise);
    }
  }
  if (largest * (4 * static_cast<__int128>(config.layers) + 16) + tables->resident >
      std::numeric_limits<int64_t>::max() / 2) {
    return absl::OutOfRangeError(absl::StrCat(
        "checkpoint planner: the step's live bytes overflow int64 at layers=", config.layers));
  }

  tables->DeriveBounds();
  tables->ChooseCandidates(allowed);
  tables->BuildHull();
  return Planner(std::move(tables));
}

PlanResult Planner::Evaluate(const std::vector<int>& plan) const {
  const Tables& t = *tables_;
  PlanResult result;
  for (int c : plan) result.layers.push_back(t.choices[c]);
  result.recompute_flops = t.RecomputeOf(plan);
  result.peak_bytes = PeakOf(plan);
  result.step_flops = t.flops.total;
  result.overhead =
      t.flops.total > 0
          ? (static_cast<double>(t.flops.total) + static_cast<double>(result.recompute_flops)) /
                static_cast<double>(t.flops.total)
          : 1;
  return result;
}

absl::StatusOr<PlanResult> Planner::Solve(int64_t budget_bytes) const {
  // A cheap plan of a simple form caps the recompute first: the dynamic program then
  // drops every partial plan that cannot beat it (by the LP bound of its rest).
  const Tables& t = *tables_;
  std::vector<int> plan;
  Tables::Search search;
  std::vector<int> incumbent;
  int64_t incumbent_cost = 0;
  if (t.Incumbent(budget_bytes, &incumbent, &incumbent_cost)) {
    search.incumbent = incumbent_cost;
  }
  if (!t.Feasible(budget_bytes, search, &plan)) plan = std::move(incumbent);
  if (plan.empty()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "no checkpoint plan fits ", HumanBytes(budget_bytes), " (", budget_bytes,
        " bytes); the smallest peak any plan reaches is ", HumanBytes(SmallestBudget()),
        " (", SmallestBudget(), " bytes)"));
  }
  if (!t.Probed(plan)) {
    return absl::InternalError(
        "checkpoint planner: the plan puts a layer (or the head) in a context no probe had");
  }
  PlanResult result = Evaluate(plan);
  if (result.peak_bytes > budget_bytes) {
    return absl::InternalError(absl::StrCat("checkpoint planner: the plan peaks at ",
                                            result.peak_bytes, " over the budget ",
                                            budget_bytes));
  }
  return result;
}

int64_t Planner::SmallestBudget() const {
  const Tables& t = *tables_;
  // All-full is one plan, so its peak is an upper bound; bisect down to the least
  // feasible budget, which is some plan's peak.
  int64_t hi = PeakOf(std::vector<int>(t.Layers(), 1));
  int64_t lo = t.resident - 1;  // infeasible: the resident bytes alone exceed it
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    Tables::Search search;
    search.any = true;
    if (t.Feasible(mid, search, nullptr)) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
  return hi;
}

absl::StatusOr<std::vector<FrontierPoint>> Planner::Frontier(int points) const {
  if (points < 2) return absl::InvalidArgumentError("the frontier needs at least 2 points");
  const int64_t lo = SmallestBudget();
  const int64_t hi = std::max(lo, PeakOf(std::vector<int>(tables_->Layers(), 0)));
  std::vector<FrontierPoint> frontier;
  for (int k = 0; k < points; ++k) {
    const int64_t budget =
        k == points - 1 ? hi
                        : lo + static_cast<int64_t>((static_cast<__int128>(hi - lo) * k) /
                                                    (points - 1));
    absl::StatusOr<PlanResult> plan = Solve(budget);
    if (!plan.ok()) return plan.status();
    frontier.push_back(FrontierPoint{budget, *std::move(plan)});
  }
  return frontier;
}

const std::vector<LayerChoice>& Planner::choices() const { return tables_->choices; }
int64_t Planner::recompute_flops(int64_t layer, int choice) const {
  return tables_->recompute[tables_->kind_of[layer]][choice];
}
const StepFlops& Planner::step_flops() const { return tables_->flops; }
const std::vector<int>& Planner::candidates() const { return tables_->candidates; }

}  // namespace memledger
