// The planner's tables (planner.h, Planner::Tables): a short model's probed stretches
// per layer context and choice, the bounds and candidates derived from them, and the
// dynamic program over them (planner_search.cc). Internal to //planner:planner_lib.
#ifndef PLANNER_PLANNER_TABLES_H_
#define PLANNER_PLANNER_TABLES_H_

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
using planner_internal::PositionOf;
using planner_internal::RiseOf;
using planner_internal::SameStretch;

// Tables: everything Solve needs, made once by Create.
struct Planner::Tables {
  ModelConfig config;
  PlannerOptions options;
  std::vector<LayerChoice> choices;
  std::vector<int64_t> recompute;  // per choice
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
  // By Key(position, previous checkpointed, choice, next checkpointed, lowest).
  std::vector<LayerStretches> layer;
  // By whether the first layer is checkpointed (prologue, tail), and (head) whether the
  // first one is, the last one is and any is: transformers calls every layer with the
  // position ids, which checkpointed layers hold until the lowest one's backward, and the
  // decoder's inputs_embeds dies where it returns unless the first layer's checkpoint
  // holds it.
  struct Bracket {
    bool seen = false;
    StepStretch prologue, tail, head_forward, head_backward;
  };
  Bracket first[2];
  Bracket last[2][2][2];
  // Head: last[first][last_ckpt][any], or, where that context was not probed and the
  // first layer does not matter, the other first's.
  const Bracket& Head(int first_ckpt, int last_ckpt, int any) const {
    const Bracket& b = last[first_ckpt][last_ckpt][any];
    return b.seen ? b : last[1 - first_ckpt][last_ckpt][any];
  }
  // cached_none_peak: with transformers' use_cache, the plan that checkpoints no layer
  // runs with the DynamicCache (the others without): its peak, replayed; -1 without.
  int64_t cached_none_peak = -1;
  bool optimizer_seen = false;
  // optimizer: its rise for the model's layers (each probe's share taken out, the
  // model's added by Create); optimizer_layer_bytes: one layer's share, by kind.
  StepStretch optimizer;
  std::vector<int64_t> optimizer_layer_bytes;

  bool Checkpointed(int choice) const { return choices[choice].checkpointed; }
  // lowest: a checkpointed layer with no checkpointed layer before it, whose frame
  // (non-reentrant) is the last to hold the position ids; ignored for other choices.
  size_t Key(int position, bool previous, int choice, bool next, bool lowest) const {
    lowest = lowest && Checkpointed(choice);
    return (((static_cast<size_t>(position) * 2 + previous) * choices.size() + choice) * 2 +
            next) * 2 + lowest;
  }
  // Layer: layer i's stretches in `plan`, whose first checkpointed layer is `lowest`
  // (-1: none).
  const LayerStretches& Layer(int64_t i, const std::vector<int>& plan, int64_t lowest) const {
    const int64_t layers = static_cast<int64_t>(plan.size());
    const bool previous = i > 0 && Checkpointed(plan[i - 1]);
    const bool next = i + 1 < layers && Checkpointed(plan[i + 1]);
    return layer[Key(PositionOf(i, layers), previous, plan[i], next, i == lowest)];
  }
  // LowestOf: the first checkpointed layer of `plan`, -1 if none.
  int64_t LowestOf(const std::vector<int>& plan) const {
    for (size_t i = 0; i < plan.size(); ++i) {
      if (Checkpointed(plan[i])) return static_cast<int64_t>(i);
    }
    return -1;
  }

  // Record adds a probe's stretches, checking those already seen.
  absl::Status Record(const std::vector<int>& probe, const StepStretches& s);
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
  int64_t d_of[4] = {};  // D by position, when local
  // held_bytes: what checkpointed layers hold until the lowest one's backward (the
  // position ids), so that the lowest one's D is d_of - held_bytes; and head_net_none:
  // the head's two nets when no layer is checkpointed (held_bytes more when one is).
  // A backward moment of layer i is held_bytes higher once a layer <= i is checkpointed.
  int64_t held_bytes = 0;
  int64_t head_net_none = 0;
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
  std::vector<int64_t> least_forward_net;  // per choice, over its contexts
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
};

}  // namespace memledger

#endif  // PLANNER_PLANNER_TABLES_H_
