// The planner's tables (planner.h, Planner::Tables): a short model's probed stretches
// per layer context and choice, the bounds and candidates derived from them, and the
// dynamic program over them (planner_search.cc). Internal to //planner:planner_lib.
#ifndef PLANNER_PLANNER_TABLES_H_
#define PLANNER_PLANNER_TABLES_H_

#include <algorithm>
#include <array>
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
#include "estimator/report/units.h"
#include "planner/planner.h"

namespace memledger {
namespace planner_internal {


// Where a layer sits: its stretches differ for the first layer (the model input, or the
// embeddings), the last (the head reads its output) and a model of one layer.
enum Position : int { kFirst = 0, kMiddle = 1, kLast = 2, kOnly = 3 };
inline constexpr int kPositions = 4;

inline Position PositionOf(int64_t i, int64_t layers) {
  if (layers == 1) return kOnly;
  if (i == 0) return kFirst;
  return i == layers - 1 ? kLast : kMiddle;
}

// A layer's slot: its position, and whether it is the first layer of its kind, whose
// backward frees what only that kind's layers keep (Gemma 3's global layers' RoPE
// tables).
inline constexpr int kSlots = 2 * kPositions;
inline int SlotOf(Position position, bool first_of_kind) {
  return static_cast<int>(position) * 2 + first_of_kind;
}
inline Position PositionOfSlot(int slot) { return static_cast<Position>(slot / 2); }

inline constexpr int64_t kNoRise = std::numeric_limits<int64_t>::min();

inline int64_t RiseOf(const StepStretch& s) { return s.has_rise ? s.rise : kNoRise; }

inline bool SameStretch(const StepStretch& a, const StepStretch& b) {
  return a.net == b.net && RiseOf(a) == RiseOf(b);
}


}  // namespace planner_internal

using planner_internal::kFirst;
using planner_internal::kLast;
using planner_internal::kMiddle;
using planner_internal::kNoRise;
using planner_internal::kOnly;
using planner_internal::kPositions;
using planner_internal::kSlots;
using planner_internal::Position;
using planner_internal::PositionOf;
using planner_internal::PositionOfSlot;
using planner_internal::SlotOf;
using planner_internal::RiseOf;
using planner_internal::SameStretch;

// Tables: everything Solve needs, made once by Create.
struct Planner::Tables {
  ModelConfig config;
  PlannerOptions options;
  std::vector<LayerChoice> choices;
  // The planned model's layers: layer i is of kind kind_of[i] (into its graphs'
  // layer_kinds, `kinds` of them) in slot slot_of[i].
  int kinds = 1;
  std::vector<int> kind_of;
  std::vector<int> slot_of;
  int64_t Layers() const { return static_cast<int64_t>(kind_of.size()); }
  std::vector<std::vector<int64_t>> recompute;  // by kind, then choice: one layer's
  std::vector<int> candidates;
  StepFlops flops;
  int64_t resident = 0;

  struct LayerStretches {
    bool seen = false;
    StepStretch forward;
    StepStretch backward;
    // freed: what its forward leaves only in autocast's cast cache, freed when the
    // forward ends (StepStretches::forward_freed); the heads' forward nets are kept
    // without their probes' (a plan's are taken out as it is composed).
    int64_t freed = 0;
  };
  // groups: the model-level tensors that only checkpointed layers hold (LayerGlobals),
  // grouped by the kinds of layer that read them. A group's tensors live to the backward
  // of the lowest checkpointed layer of its kinds: transformers' position ids, which
  // every layer is called with; Gemma 3's sliding-window mask, which its sliding layers'
  // attention does not keep when plain. kind_groups: by kind, its groups (bit g).
  int groups = 0;
  std::vector<uint32_t> kind_groups;
  // By Key(kind, slot, previous checkpointed, choice, next checkpointed, lowest: the
  // groups it is the lowest checkpointed layer of).
  std::vector<LayerStretches> layer;
  // By whether the first layer is checkpointed (prologue, tail), and (head) whether the
  // first one is, the last one is, any is and of which groups: the groups' tensors die
  // where the decoder returns unless a checkpoint holds them, and so does the decoder's
  // inputs_embeds unless the first layer's checkpoint holds it.
  struct Bracket {
    bool seen = false;
    StepStretch prologue, tail, head_forward, head_backward;
  };
  Bracket first[2];
  std::vector<Bracket> last;  // by HeadIndex
  size_t HeadIndex(int first_ckpt, int last_ckpt, int any, uint32_t held) const {
    return (((static_cast<size_t>(first_ckpt) * 2 + last_ckpt) * 2 + any) << groups) + held;
  }
  // Head: the head's stretches, or, where that context was not probed and the first
  // layer does not matter, the other first's.
  const Bracket& Head(int first_ckpt, int last_ckpt, int any, uint32_t held) const {
    const Bracket& b = last[HeadIndex(first_ckpt, last_ckpt, any, held)];
    return b.seen ? b : last[HeadIndex(1 - first_ckpt, last_ckpt, any, held)];
  }
  // cached_none_peak: with transformers' use_cache, the plan that checkpoints no layer
  // runs with the DynamicCache (the others without): its peak, replayed; -1 without.
  int64_t cached_none_peak = -1;
  bool optimizer_seen = false;
  // optimizer: its rise for the model's layers (each probe's share taken out, the
  // model's added by Create); optimizer_layer_bytes: one layer's share, by kind (-1: no
  // probe had the kind).
  StepStretch optimizer;
  std::vector<int64_t> optimizer_layer_bytes;

  bool Checkpointed(int choice) const { return choices[choice].checkpointed; }
  size_t Key(int kind, int slot, bool previous, int choice, bool next, uint32_t lowest) const {
    lowest &= Checkpointed(choice) ? kind_groups[kind] : 0;
    return (((((static_cast<size_t>(kind) * kSlots + slot) * 2 + previous) * choices.size() +
              choice) * 2 + next) << groups) + lowest;
  }
  const LayerStretches& At(int kind, int slot, bool previous, int choice, bool next,
                           uint32_t lowest) const {
    return layer[Key(kind, slot, previous, choice, next, lowest)];
  }
  // Placement: where a plan's checkpoints are, for the contexts of its layers.
  static constexpr int kMaxGroups = 4;
  struct Placement {
    // by group, its lowest checkpointed layer (-1: none)
    std::array<int64_t, kMaxGroups> lowest = {-1, -1, -1, -1};
    uint32_t held = 0;  // the groups some checkpointed layer holds
    bool any = false;   // some layer is checkpointed
  };
  Placement PlacementOf(const std::vector<int>& plan, const std::vector<int>& kinds) const {
    Placement p;
    const uint32_t all = (1u << groups) - 1;
    // Past the first checkpointed layer of every group there is nothing to learn.
    for (size_t i = 0; i < plan.size() && !(p.any && p.held == all); ++i) {
      if (!Checkpointed(plan[i])) continue;
      p.any = true;
      for (int g = 0; g < groups; ++g) {
        if ((kind_groups[kinds[i]] >> g & 1) && p.lowest[g] < 0) {
          p.lowest[g] = static_cast<int64_t>(i);
          p.held |= 1u << g;
        }
      }
    }
    return p;
  }
  // LowestMask: the groups layer i is the lowest checkpointed layer of.
  uint32_t LowestMask(const Placement& p, int64_t i) const {
    uint32_t mask = 0;
    for (int g = 0; g < groups; ++g) mask |= (p.lowest[g] == i ? 1u : 0u) << g;
    return mask;
  }
  // Layer: layer i's stretches in `plan` (of the model's layers), placed as `p`.
  const LayerStretches& Layer(int64_t i, const std::vector<int>& plan,
                              const Placement& p) const {
    const int64_t layers = static_cast<int64_t>(plan.size());
    const bool previous = i > 0 && Checkpointed(plan[i - 1]);
    const bool next = i + 1 < layers && Checkpointed(plan[i + 1]);
    return At(kind_of[i], slot_of[i], previous, plan[i], next, LowestMask(p, i));
  }
  // RecomputeOf: what `plan` recomputes, layer by layer.
  int64_t RecomputeOf(const std::vector<int>& plan) const {
    int64_t sum = 0;
    for (size_t i = 0; i < plan.size(); ++i) sum += recompute[kind_of[i]][plan[i]];
    return sum;
  }

  // Record adds a probe's stretches, checking those already seen.
  // RecordProbes simulates and records probes (planner_probes.cc) until every context
  // the model's layers can be in is seen; Internal where two probes disagree.
  absl::Status RecordProbes(const StepSimulator& simulator, const OptimizerSpec& optimizer,
                            const ResidentBytes& resident);
  // GroupGlobals sets groups and kind_groups from the layers' LayerGlobals.
  absl::Status GroupGlobals(const StepSimulator& simulator);
  // `kinds`: the probe's layers' kinds.
  absl::Status Record(const std::vector<int>& probe, const std::vector<int>& kinds,
                      const StepStretches& s);
  // After the probes: the bounds, the candidates and the hull (see below).
  void DeriveBounds();
  void ChooseCandidates(const std::vector<int>& allowed);
  void BuildHull();
  // local: D = forward + backward net is one number per position and the head's nets
  // do not depend on the last layer's choice. Then S is the same for every label at a
  // layer, the backward moment of layer i is known once it is placed
  // (R + P + H + F_i + rise_i + the later layers' D), and a label is (F, cost) only.
  bool local = false;
  // casts: some layer leaves casts that the forward's end frees (autocast): a label
  // then carries what its layers free (G), every moment after the forward G lower (and
  // D, under `local`, is what a layer leaves after its backward, its casts gone).
  bool casts = false;
  // first_matters: the prologue's and tail's stretches depend on whether the first
  // layer is checkpointed (else the states need not tell).
  bool first_matters = true;
  // later_d: when local, by layer i, the D of the layers after it (their kinds' and
  // slots').
  std::vector<int64_t> later_d;
  // held_bytes: by group, what its tensors are, which checkpointed layers hold until
  // the lowest one's backward, so that the lowest one's D is that much less; and
  // head_net_none: the head's two nets when no layer is checkpointed (each held group's
  // bytes more). A backward moment of layer i is a group's bytes higher once a layer
  // <= i of its kinds is checkpointed.
  std::vector<int64_t> held_bytes;
  int64_t head_net_none = 0;
  int64_t HeldBytes(uint32_t held) const {
    int64_t sum = 0;
    for (int g = 0; g < groups; ++g) sum += (held >> g & 1) ? held_bytes[g] : 0;
    return sum;
  }
  // first_held_bytes: what a checkpointed first layer holds past the decoder's return,
  // where the decoder's locals let go of its input (transformers' inputs_embeds): its D is
  // that much less again, and the head's nets that much more. 0 when a plain first layer
  // keeps its input anyway.
  int64_t first_held_bytes = 0;
  // Lower bounds for pruning: the smallest forward net of any layer, and the smallest
  // moment above the forward's end that must still come (the head's forward rise, or
  // the last layer's backward rise above F).
  int64_t min_forward_net = 0;
  int64_t min_end_rise = 0;
  // hull: the lower convex hull of (the least forward net of a choice, its recompute)
  // over the candidates, by rising forward net: the LP relaxation of "the cheapest way
  // to place r more layers in M bytes" is r * hull(M / r).
  std::vector<std::pair<double, double>> hull;
  std::vector<double> hull_slope;  // between hull[k] and hull[k + 1]
  std::vector<int> candidates_by_checkpoint[2];
  std::vector<int64_t> least_forward_net;  // per choice, over its contexts and kinds
  std::vector<int64_t> least_recompute;    // per choice, over the kinds
  // CostBound is a lower bound on the recompute of `r` more layers whose forward nets
  // sum to at most `memory`; infinity when even the leanest cannot fit. It errs low
  // (by a relative 1e-9 and one FLOP) so that double rounding never prunes the optimum.
  double CostBound(int64_t r, int64_t memory) const;

  // Search says what Feasible looks for.
  struct Search {
    bool any = false;  // any plan that fits (recompute ignored): SmallestBudget's test
    // incumbent: a cap on recompute (e.g. that of a plan known to fit): partial plans
    // whose lower bound exceeds it are dropped, and only plans within it are returned.
    int64_t incumbent = std::numeric_limits<int64_t>::max();
  };
  // Feasible runs the dynamic program for `budget`; on success fills `plan` with the
  // least recompute (false when no plan fits, or none within the cap).
  bool Feasible(int64_t budget, const Search& search, std::vector<int>* plan) const;
  // Incumbent: the cheapest fitting plan of the simple form [b x k, a x (L - k)] or
  // [b x k, a x (L - k - 1), none], over candidate pairs, k by bisection; false if none.
  bool Incumbent(int64_t budget, std::vector<int>* plan, int64_t* cost) const;
  int64_t PeakOf(const std::vector<int>& plan) const;
  // Probed: every stretch PeakOf composes for `plan` was recorded from a probe (the
  // probes are made to cover every context a plan can make; Solve checks its answer).
  bool Probed(const std::vector<int>& plan) const {
    const Placement placement = PlacementOf(plan, kind_of);
    if (cached_none_peak >= 0 && !placement.any) return true;
    for (int64_t i = 0; i < static_cast<int64_t>(plan.size()); ++i) {
      if (!Layer(i, plan, placement).seen) return false;
    }
    return first[Checkpointed(plan.front())].seen &&
           Head(Checkpointed(plan.front()), Checkpointed(plan.back()), placement.any,
                placement.held)
               .seen;
  }
};

}  // namespace memledger

#endif  // PLANNER_PLANNER_TABLES_H_
