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
#include "estimator/family.h"
#include "estimator/predict.h"
#include "estimator/units.h"

namespace memledger {
namespace {

// Where a layer sits: its stretches differ for the first layer (the model input, or the
// embeddings), the last (the head reads its output) and a model of one layer.
enum Position : int { kFirst = 0, kMiddle = 1, kLast = 2, kOnly = 3 };
constexpr int kPositions = 4;

Position PositionOf(int64_t i, int64_t layers) {
  if (layers == 1) return kOnly;
  if (i == 0) return kFirst;
  return i == layers - 1 ? kLast : kMiddle;
}

constexpr int64_t kNoRise = std::numeric_limits<int64_t>::min();

int64_t RiseOf(const StepStretch& s) { return s.has_rise ? s.rise : kNoRise; }

bool SameStretch(const StepStretch& a, const StepStretch& b) {
  return a.net == b.net && RiseOf(a) == RiseOf(b);
}

}  // namespace

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
  };
  // By Key(position, previous checkpointed, choice, next checkpointed, lowest).
  std::vector<LayerStretches> layer;
  // By whether the first layer is checkpointed (prologue, tail), and (head) whether the
  // last one is and whether any is: transformers calls every layer with the position
  // ids, which checkpointed layers hold until the lowest one's backward.
  struct Bracket {
    bool seen = false;
    StepStretch prologue, tail, head_forward, head_backward;
  };
  Bracket first[2];
  Bracket last[2][2];
  bool optimizer_seen = false;
  StepStretch optimizer;

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

absl::Status Planner::Tables::Record(const std::vector<int>& probe, const StepStretches& s) {
  auto differ = [&](const std::string& what) {
    std::vector<std::string> names;
    for (int c : probe) names.push_back(choices[c].Name());
    return absl::InternalError(absl::StrCat(
        "checkpoint planner: the stretches of ", what,
        " depend on more than the neighbours' checkpointing (probe ", absl::StrJoin(names, " "),
        ")"));
  };
  const int64_t layers = static_cast<int64_t>(probe.size());
  const int64_t lowest = LowestOf(probe);
  for (int64_t i = 0; i < layers; ++i) {
    const bool previous = i > 0 && Checkpointed(probe[i - 1]);
    const bool next = i + 1 < layers && Checkpointed(probe[i + 1]);
    LayerStretches& entry =
        layer[Key(PositionOf(i, layers), previous, probe[i], next, i == lowest)];
    if (entry.seen && (!SameStretch(entry.forward, s.forward[i]) ||
                       !SameStretch(entry.backward, s.backward[i]))) {
      return differ(absl::StrCat("layer ", i));
    }
    entry = {true, s.forward[i], s.backward[i]};
  }
  Bracket& f = first[Checkpointed(probe.front())];
  if (f.seen && (!SameStretch(f.prologue, s.prologue) || !SameStretch(f.tail, s.tail))) {
    return differ("the prologue or tail");
  }
  f.seen = true;
  f.prologue = s.prologue;
  f.tail = s.tail;
  Bracket& l = last[Checkpointed(probe.back())][lowest >= 0];
  if (l.seen && (!SameStretch(l.head_forward, s.head_forward) ||
                 !SameStretch(l.head_backward, s.head_backward))) {
    return differ("the head");
  }
  l.seen = true;
  l.head_forward = s.head_forward;
  l.head_backward = s.head_backward;
  if (optimizer_seen && !SameStretch(optimizer, s.optimizer)) return differ("the optimizer");
  optimizer_seen = true;
  optimizer = s.optimizer;
  return absl::OkStatus();
}

namespace {

// Label is a partial plan in the dynamic program: layers 0..i chosen, 0..i-1 placed.
struct Label {
  int64_t f = 0;        // forward: live bytes the placed layers' forwards added
  int64_t u = kNoRise;  // the worst backward moment so far less f (see Feasible)
  int64_t s = 0;        // bytes the placed layers leave after their backward
  int64_t cost = 0;     // recompute FLOPs of layers 0..i
  int32_t parent = -1;  // into the previous layer's labels
  int16_t choice = 0;   // layer i's
};

// ParetoSet keeps the labels of one state that no other label dominates (no larger f,
// u, s and cost). Labels fall into groups of equal (u, s), which take few values; in a
// group, labels sorted by f have strictly falling cost (a staircase), so a dominance
// test is a binary search.
class ParetoSet {
 public:
  bool empty() const { return groups_.empty(); }

  // Insert adds `label` (stored in `arena`) unless a member dominates it, and removes
  // the members it dominates. `use_s`: whether s differs between labels at all.
  void Insert(std::vector<Label>& arena, const Label& label, bool use_s) {
    if (Dominated(label, use_s)) return;
    InsertUndominated(arena, label, use_s);
  }

  // Dominated: some member is no larger in f, u, s and cost.
  bool Dominated(const Label& label, bool use_s) const {
    const int64_t s = use_s ? label.s : 0;
    for (const Group& g : groups_) {
      if (g.u > label.u || g.s > s) continue;
      auto it = std::upper_bound(g.steps.begin(), g.steps.end(), label.f,
                                 [](int64_t f, const Step& step) { return f < step.f; });
      if (it != g.steps.begin() && std::prev(it)->cost <= label.cost) return true;
    }
    return false;
  }

  // InsertUndominated: Insert for a label known not to be dominated.
  void InsertUndominated(std::vector<Label>& arena, const Label& label, bool use_s) {
    const int64_t s = use_s ? label.s : 0;
    Group* own = nullptr;
    for (Group& g : groups_) {
      if (g.u < label.u || g.s < s) continue;
      auto first = std::lower_bound(g.steps.begin(), g.steps.end(), label.f,
                                    [](const Step& step, int64_t f) { return step.f < f; });
      auto last = first;
      while (last != g.steps.end() && last->cost >= label.cost) ++last;
      g.steps.erase(first, last);
      if (g.u == label.u && g.s == s) own = &g;
    }
    if (own == nullptr) {
      groups_.push_back(Group{label.u, s, {}});
      own = &groups_.back();
    }
    auto at = std::lower_bound(own->steps.begin(), own->steps.end(), label.f,
                               [](const Step& step, int64_t f) { return step.f < f; });
    own->steps.insert(at, Step{label.f, label.cost, static_cast<int32_t>(arena.size())});
    arena.push_back(label);
  }

  template <typename Visit>
  void ForEach(Visit visit) const {
    for (const Group& g : groups_) {
      for (const Step& step : g.steps) visit(step.label);
    }
  }

 private:
  struct Step {
    int64_t f;
    int64_t cost;
    int32_t label;
  };
  struct Group {
    int64_t u;
    int64_t s;
    std::vector<Step> steps;
  };
  std::vector<Group> groups_;
};

}  // namespace

// The peak of a plan, stretch by stretch in step order, with R the resident bytes,
// P the prologue's net, F_i the forward nets of layers 0..i, D_j = forward + backward
// net of layer j, H the head's two nets:
//   forward of layer i:  R + P + F_{i-1} + rise_i
//   backward of layer i: R + P + H + F_i + sum_{j > i} D_j + rise_i
//   the tail:            R + P + H + sum_j D_j + rise
// With V_i = max(V_{i-1} + D_i, F_i + rise_i) the backward's worst moment is
// R + P + H + V_{L-1}. A label keeps U = V - F: U_i = max(U_{i-1} + b_i, rise_i) with b_i
// layer i's backward net, so U takes few values (the backward frees what the layer
// kept). What a later layer adds to F, V and S = sum D does not depend on the label, so
// a partial plan no smaller in F, U, S and cost than another can be dropped.
bool Planner::Tables::Feasible(int64_t budget, const Search& search,
                               std::vector<int>* plan) const {
  const int64_t layers = config.layers;
  if (resident > budget) return false;
  // A label at step i has placed layers 0..i-1 and committed to whether layer i is
  // checkpointed; its state is (layer i-1 checkpointed, layer i checkpointed, layer 0
  // checkpointed, any of layers 0..i-1 checkpointed), which is all the stretches still
  // to come depend on. Choosing layer i's choice (of the committed kind) and layer
  // i+1's kind places layer i. Labels that reached the same state by different choices
  // compete in one Pareto set.
  auto state = [](bool previous, bool current, bool first_ckpt, bool below) {
    return ((static_cast<size_t>(previous) * 2 + current) * 2 + first_ckpt) * 2 + below;
  };
  constexpr size_t kStates = 16;
  std::vector<std::vector<Label>> arenas(layers + 1);
  std::vector<ParetoSet> sets(kStates);
  for (int current = 0; current < 2; ++current) {
    if (candidates_by_checkpoint[current].empty()) continue;
    const Bracket& b = first[current];
    if (b.prologue.has_rise && resident + b.prologue.rise > budget) continue;
    sets[state(false, current, first_matters && current, false)].Insert(arenas[0], Label(),
                                                                        !local);
  }
  // Place layer i into a label; false if a forward moment, a backward one known now
  // (`local`), or a lower bound of the moments still to come exceeds the budget.
  // Under `local`, the later layers' D: the last one's, and the middle ones'.
  const int64_t head_net = head_net_none;
  auto later_d = [&](int64_t remaining) {
    return remaining == 0 ? 0 : d_of[kLast] + (remaining - 1) * d_of[kMiddle];
  };
  // held: some layer <= i is checkpointed (layer i being placed).
  auto place = [&](const Label& from, const LayerStretches& st, int64_t base,
                   int64_t remaining, bool held, Label* to) -> bool {
    if (st.forward.has_rise && base + from.f + st.forward.rise > budget) return false;
    to->f = from.f + st.forward.net;
    to->s = from.s + st.forward.net + st.backward.net;
    if (local) {
      if (st.backward.has_rise &&
          base + head_net + (held ? held_bytes : 0) + to->f + later_d(remaining) +
                  st.backward.rise >
              budget) {
        return false;
      }
    } else {
      const int64_t shifted = from.u == kNoRise ? kNoRise : from.u + st.backward.net;
      to->u = std::max(shifted, RiseOf(st.backward));
    }
    return base + to->f + remaining * min_forward_net + min_end_rise <= budget;
  };
  const bool bounded = !search.any && search.incumbent != std::numeric_limits<int64_t>::max();
  for (int64_t i = 0; i < layers; ++i) {
    std::vector<ParetoSet> next_sets(kStates);
    const int position = PositionOf(i, layers);
    const int64_t remaining = layers - 1 - i;
    for (int previous = 0; previous < 2; ++previous) {
      for (int current = 0; current < 2; ++current) {
        for (int first_ckpt = 0; first_ckpt < (first_matters ? 2 : 1); ++first_ckpt) {
          for (int below = 0; below < 2; ++below) {
            const ParetoSet& set = sets[state(previous, current, first_ckpt, below)];
            if (set.empty()) continue;
            const int64_t base = resident + first[first_ckpt].prologue.net;
            const bool lowest = current && !below;
            set.ForEach([&](int32_t index) {
              const Label& from = arenas[i][index];
              for (int c : candidates_by_checkpoint[current]) {
                const int64_t cost = search.any ? 0 : from.cost + recompute[c];
                for (int next = 0; next < (remaining > 0 ? 2 : 1); ++next) {
                  if (remaining > 0 && candidates_by_checkpoint[next].empty()) continue;
                  Label to;
                  if (!place(from, layer[Key(position, previous, c, next, lowest)], base,
                             remaining, below || current, &to)) {
                    continue;
                  }
                  to.cost = cost;
                  ParetoSet& into = next_sets[state(current, next, first_ckpt, below || current)];
                  if (into.Dominated(to, !local)) continue;
                  // The LP bound of layers i + 1.. in what the forward has left.
                  if (bounded &&
                      static_cast<double>(cost) +
                              CostBound(remaining, budget - base - min_end_rise - to.f) >
                          static_cast<double>(search.incumbent)) {
                    continue;
                  }
                  to.parent = index;
                  to.choice = static_cast<int16_t>(c);
                  into.InsertUndominated(arenas[i + 1], to, !local);
                }
              }
            });
          }
        }
      }
    }
    sets = std::move(next_sets);
  }
  // The head, the backward, the tail and the optimizer.
  int32_t best = -1;
  int64_t best_cost = 0;
  for (int previous = 0; previous < 2; ++previous) {
    for (int first_ckpt = 0; first_ckpt < (first_matters ? 2 : 1); ++first_ckpt) {
      for (int below = 0; below < 2; ++below) {
        // `previous` is now the last layer's kind, `below` whether any layer is checkpointed.
        const Bracket& head = last[previous][below];
        const Bracket& ends = first[first_ckpt];
        const int64_t base = resident + ends.prologue.net;
        sets[state(previous, false, first_ckpt, below)].ForEach([&](int32_t index) {
          const Label& to = arenas[layers][index];
          const int64_t forward_end = base + to.f;
          if (head.head_forward.has_rise && forward_end + head.head_forward.rise > budget) {
            return;
          }
          const int64_t after_head = forward_end + head.head_forward.net;
          if (head.head_backward.has_rise && after_head + head.head_backward.rise > budget) {
            return;
          }
          const int64_t h = base + head.head_forward.net + head.head_backward.net;
          if (to.u != kNoRise && h + to.f + to.u > budget) return;
          const int64_t tail_start = h + to.s;
          if (ends.tail.has_rise && tail_start + ends.tail.rise > budget) return;
          if (optimizer.has_rise && tail_start + ends.tail.net + optimizer.rise > budget) return;
          if ((best < 0 || to.cost < best_cost) && to.cost <= search.incumbent) {
            best = index;
            best_cost = to.cost;
          }
        });
      }
    }
  }
  if (best < 0) return false;
  if (plan != nullptr) {
    plan->assign(layers, 0);
    int32_t index = best;
    for (int64_t i = layers; i >= 1; --i) {
      (*plan)[i - 1] = arenas[i][index].choice;
      index = arenas[i][index].parent;
    }
  }
  return true;
}

// DeriveBounds sets `local`, `first_matters`, D by position and the pruning bounds from
// the recorded stretches.
void Planner::Tables::DeriveBounds() {
  Tables& t = *this;
  const int n = static_cast<int>(choices.size());
  bool any = false;
  int64_t d[kPositions] = {};
  bool d_seen[kPositions] = {};
  bool d_varies = false;
  // D by position over the stretches of layers that are not the lowest checkpointed
  // one; the lowest one's D must then be held_bytes less, one constant.
  for (int lowest = 0; lowest < 2; ++lowest) {
    bool held_known = false;
    for (int position = 0; position < kPositions; ++position) {
      for (int previous = 0; previous < 2; ++previous) {
        for (int c = 0; c < n; ++c) {
          if (lowest && !t.Checkpointed(c)) continue;
          for (int next = 0; next < 2; ++next) {
            const Tables::LayerStretches& st = t.layer[t.Key(position, previous, c, next, lowest)];
            if (!st.seen) continue;
            t.min_forward_net =
                any ? std::min(t.min_forward_net, st.forward.net) : st.forward.net;
            any = true;
            const int64_t dd = st.forward.net + st.backward.net;
            if (lowest) {
              if (!d_seen[position]) {
                d_varies = true;
              } else if (!held_known) {
                t.held_bytes = d[position] - dd;
                held_known = true;
              } else if (d[position] - dd != t.held_bytes) {
                d_varies = true;
              }
              continue;
            }
            if (d_seen[position] && d[position] != dd) d_varies = true;
            d[position] = dd;
            d_seen[position] = true;
          }
        }
      }
    }
  }
  bool head_varies = !t.last[0][0].seen;
  t.head_net_none = t.last[0][0].head_forward.net + t.last[0][0].head_backward.net;
  for (int last_ckpt = 0; last_ckpt < 2; ++last_ckpt) {
    for (int any_ckpt = 0; any_ckpt < 2; ++any_ckpt) {
      const Tables::Bracket& b = t.last[last_ckpt][any_ckpt];
      if (b.seen && b.head_forward.net + b.head_backward.net !=
                        t.head_net_none + (any_ckpt ? t.held_bytes : 0)) {
        head_varies = true;
      }
    }
  }
  t.local = !d_varies && !head_varies && !t.options.general;
  t.first_matters = !(t.first[0].seen && t.first[1].seen &&
                      SameStretch(t.first[0].prologue, t.first[1].prologue) &&
                      SameStretch(t.first[0].tail, t.first[1].tail));
  for (int position = 0; position < kPositions; ++position) t.d_of[position] = d[position];
  // Every plan's forward ends, then its head's forward runs: the smaller of the two
  // heads' rises (or 0 when a head has none) is a moment still to come.
  // So is the head's backward (its loss gradient, often the peak), at the head's
  // forward net above the forward's end.
  int64_t end = std::numeric_limits<int64_t>::max();
  for (const auto& by_any : t.last) {
    for (const Tables::Bracket& b : by_any) {
      if (!b.seen) continue;
      const int64_t forward_moment = std::max<int64_t>(RiseOf(b.head_forward), 0);
      const int64_t backward_moment =
          b.head_forward.net + std::max<int64_t>(RiseOf(b.head_backward), 0);
      end = std::min(end, std::max(forward_moment, backward_moment));
    }
  }
  t.min_end_rise = end == std::numeric_limits<int64_t>::max() ? 0 : end;
  // Under `local`, the last layer's backward comes after the head's nets: a second
  // moment every plan reaches, R + P + H + F_all + its rise.
  if (t.local) {
    int64_t least_rise = std::numeric_limits<int64_t>::max();
    for (int position : {kLast, kOnly}) {
      for (int previous = 0; previous < 2; ++previous) {
        for (int c = 0; c < n; ++c) {
          for (int lowest = 0; lowest < 2; ++lowest) {
            const Tables::LayerStretches& st =
                t.layer[t.Key(position, previous, c, false, lowest)];
            if (st.seen) {
              least_rise = std::min(least_rise, st.backward.has_rise ? st.backward.rise : 0);
            }
          }
        }
      }
    }
    if (least_rise != std::numeric_limits<int64_t>::max()) {
      t.min_end_rise = std::max(
          t.min_end_rise, t.head_net_none + std::min<int64_t>(t.held_bytes, 0) + least_rise);
    }
  }
}

// ChooseCandidates keeps the allowed choices no other allowed choice with the same
// checkpointing beats: cost no higher and every stretch of every context no larger
// (ties keep the first). Replacing a beaten choice by its better one in any plan leaves
// every later moment of the step no higher, since its neighbours see only its kind.
void Planner::Tables::ChooseCandidates(const std::vector<int>& allowed) {
  Tables& t = *this;
  auto no_larger = [&](int a, int b) {  // a's stretches <= b's in every context
    for (int position = 0; position < kPositions; ++position) {
      for (int previous = 0; previous < 2; ++previous) {
        for (int key = 0; key < 4; ++key) {
          const int next = key / 2, lowest = key % 2;
          const Tables::LayerStretches& x = t.layer[t.Key(position, previous, a, next, lowest)];
          const Tables::LayerStretches& y = t.layer[t.Key(position, previous, b, next, lowest)];
          if (x.seen != y.seen) return false;
          if (!x.seen) continue;
          if (x.forward.net > y.forward.net || RiseOf(x.forward) > RiseOf(y.forward) ||
              x.forward.net + x.backward.net > y.forward.net + y.backward.net) {
            return false;
          }
          if (x.backward.has_rise && (!y.backward.has_rise ||
                                      x.forward.net + x.backward.rise >
                                          y.forward.net + y.backward.rise)) {
            return false;
          }
        }
      }
    }
    return true;
  };
  for (int c : allowed) {
    bool dominated = false;
    for (int other : allowed) {
      if (other == c || t.Checkpointed(other) != t.Checkpointed(c)) continue;
      if (t.recompute[other] > t.recompute[c] || !no_larger(other, c)) continue;
      const bool tie = t.recompute[other] == t.recompute[c] && no_larger(c, other);
      if (!tie || other < c) dominated = true;
    }
    if (!dominated) t.candidates.push_back(c);
  }
}

// BuildHull groups the candidates by kind and makes the LP bound's hull.
void Planner::Tables::BuildHull() {
  Tables& t = *this;
  const int n = static_cast<int>(choices.size());
  t.least_forward_net.assign(n, std::numeric_limits<int64_t>::max());
  for (int position = 0; position < kPositions; ++position) {
    for (int previous = 0; previous < 2; ++previous) {
      for (int c = 0; c < n; ++c) {
        for (int key = 0; key < 4; ++key) {
          const Tables::LayerStretches& st =
              t.layer[t.Key(position, previous, c, key / 2, key % 2)];
          if (st.seen) t.least_forward_net[c] = std::min(t.least_forward_net[c], st.forward.net);
        }
      }
    }
  }
  std::vector<std::pair<double, double>> points;
  for (int c : t.candidates) {
    points.emplace_back(static_cast<double>(t.least_forward_net[c]),
                        static_cast<double>(t.recompute[c]));
    t.candidates_by_checkpoint[t.Checkpointed(c)].push_back(c);
  }
  std::sort(points.begin(), points.end());
  // The lower-left convex hull: cost falls as the forward net rises.
  for (const auto& p : points) {
    if (!t.hull.empty() && p.second >= t.hull.back().second) continue;
    while (t.hull.size() >= 2) {
      const auto& a = t.hull[t.hull.size() - 2];
      const auto& b = t.hull.back();
      // b is above the segment a-p: drop it.
      if ((b.second - a.second) * (p.first - a.first) >=
          (p.second - a.second) * (b.first - a.first)) {
        t.hull.pop_back();
      } else {
        break;
      }
    }
    t.hull.push_back(p);
  }
  for (size_t k = 0; k + 1 < t.hull.size(); ++k) {
    t.hull_slope.push_back((t.hull[k + 1].second - t.hull[k].second) /
                           (t.hull[k + 1].first - t.hull[k].first));
  }
}

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
  // The plans are predicted without transformers' use_cache, which only a plan that
  // checkpoints nothing would keep (see ModelConfig::use_cache).
  ModelConfig config = model;
  config.use_cache = false;
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
  // The config and the optimizer, then every choice's policy.
  if (absl::Status s = ValidateRun(config, options.attention, {Variant()}, options.optimizer);
      !s.ok()) {
    return s;
  }
  // The dynamic program keeps every layer's partial plans to trace the answer back.
  if (config.layers > kMaxPlannerLayers) {
    return absl::InvalidArgumentError(absl::StrCat("the checkpoint planner handles at most ",
                                                   kMaxPlannerLayers, " layers, got --layers ",
                                                   config.layers));
  }
  for (const LayerChoice& choice : tables->choices) {
    if (!choice.checkpointed) continue;
    if (absl::Status s = ValidatePolicy(choice.policy, options.attention, config); !s.ok()) {
      return s;
    }
  }

  absl::StatusOr<StepFlops> flops = CountStepFlops(config, options.attention);
  if (!flops.ok()) return flops.status();
  tables->flops = *flops;
  for (const LayerChoice& choice : tables->choices) {
    absl::StatusOr<int64_t> recompute = RecomputeFlops(config, options.attention, choice);
    if (!recompute.ok()) return recompute.status();
    tables->recompute.push_back(*recompute);
  }

  // Resident bytes: parameters, optimizer state and buffers, as Predict counts them.
  PredictOptions predict;
  predict.attention = options.attention;
  predict.optimizer = options.optimizer;
  predict.variants = {Variant()};
  predict.peak = false;
  absl::StatusOr<Prediction> buckets = Predict(config, predict);
  if (!buckets.ok()) return buckets.status();
  const ResidentBytes resident{buckets->param_bytes, buckets->optimizer_state_bytes,
                               buckets->buffer_bytes};

  // Probes: for each choice c, with o the other kind of layer (none when c is
  // checkpointed, full when not), [c o c o c c c o c] places c first and last beside
  // an o and in the middle in all four contexts, and [c c] first and last beside its
  // own kind; a one-layer model has only [c].
  const int none = 0, full = 1;
  StepOptions step;
  step.cpu_threads = options.cpu_threads;
  step.record_events = false;
  auto simulator_for = [&](int64_t layers) {
    ModelConfig probe_config = config;
    probe_config.layers = layers;
    return StepSimulator::Create(probe_config, options.attention, step);
  };
  tables->layer.assign(
      tables->Key(kPositions - 1, true, tables->choices.size() - 1, true, true) + 1,
      Tables::LayerStretches());
  const int n = static_cast<int>(tables->choices.size());
  std::vector<std::pair<int64_t, std::vector<std::vector<int>>>> probes;
  if (config.layers == 1) {
    std::vector<std::vector<int>> ones;
    for (int c = 0; c < n; ++c) ones.push_back({c});
    probes.emplace_back(1, std::move(ones));
  } else {
    std::vector<std::vector<int>> longs, shorts, threes, fours;
    for (int c = 0; c < n; ++c) {
      const int o = tables->Checkpointed(c) ? none : full;
      longs.push_back({c, o, c, o, c, c, c, o, c});
      shorts.push_back({c, c});
      // A checkpointed c as the lowest one after plain layers: in the middle beside
      // either kind, and last ([c o ...] and [c c] have it first).
      if (!tables->Checkpointed(c)) continue;
      threes.push_back({none, c, none});
      fours.push_back({none, c, c, none});
      shorts.push_back({none, c});
    }
    probes.emplace_back(9, std::move(longs));
    probes.emplace_back(2, std::move(shorts));
    probes.emplace_back(3, std::move(threes));
    probes.emplace_back(4, std::move(fours));
  }
  for (const auto& [layers, plans] : probes) {
    absl::StatusOr<StepSimulator> simulator = simulator_for(layers);
    if (!simulator.ok()) return simulator.status();
    for (const std::vector<int>& probe : plans) {
      std::vector<LayerChoice> layer_choices;
      for (int c : probe) layer_choices.push_back(tables->choices[c]);
      absl::StatusOr<StepStretches> stretches =
          simulator->Stretches(PlanVariant(layer_choices), options.optimizer, resident);
      if (!stretches.ok()) return stretches.status();
      tables->resident = stretches->resident_bytes;
      if (absl::Status s = tables->Record(probe, *stretches); !s.ok()) return s;
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

int64_t Planner::Tables::PeakOf(const std::vector<int>& plan) const {
  const Tables& t = *this;
  const int64_t layers = static_cast<int64_t>(plan.size());
  int64_t total = t.resident;
  int64_t peak = total;
  auto visit = [&](const StepStretch& s) {
    if (s.has_rise) peak = std::max(peak, total + s.rise);
    total += s.net;
  };
  const int64_t lowest = t.LowestOf(plan);
  const Tables::Bracket& ends = t.first[t.Checkpointed(plan.front())];
  const Tables::Bracket& head = t.last[t.Checkpointed(plan.back())][lowest >= 0];
  visit(ends.prologue);
  for (int64_t i = 0; i < layers; ++i) visit(t.Layer(i, plan, lowest).forward);
  visit(head.head_forward);
  visit(head.head_backward);
  for (int64_t i = layers - 1; i >= 0; --i) visit(t.Layer(i, plan, lowest).backward);
  visit(ends.tail);
  visit(t.optimizer);
  return peak;
}

int64_t Planner::PeakOf(const std::vector<int>& plan) const { return tables_->PeakOf(plan); }

double Planner::Tables::CostBound(int64_t r, int64_t memory) const {
  constexpr double kInfinity = std::numeric_limits<double>::infinity();
  if (r <= 0) return memory >= 0 ? 0 : kInfinity;
  const double x = static_cast<double>(memory) / static_cast<double>(r);  // per layer
  if (hull.empty() || x < hull.front().first) return kInfinity;
  double per_layer = hull.back().second;
  for (size_t k = 0; k + 1 < hull.size(); ++k) {
    if (x < hull[k + 1].first) {
      per_layer = hull[k].second + hull_slope[k] * (x - hull[k].first);
      break;
    }
  }
  return static_cast<double>(r) * per_layer * (1 - 1e-9) - 1;
}

bool Planner::Tables::Incumbent(int64_t budget, std::vector<int>* plan, int64_t* cost) const {
  const int64_t layers = config.layers;
  const int none = 0;
  const bool none_allowed =
      std::find(candidates.begin(), candidates.end(), none) != candidates.end();
  bool found = false;
  std::vector<int> trial(layers);
  auto consider = [&](int b, int a, int64_t k, bool none_last) {
    if (none_last && (!none_allowed || k >= layers)) return false;
    for (int64_t i = 0; i < layers; ++i) trial[i] = i < k ? b : a;
    if (none_last) trial[layers - 1] = none;
    if (PeakOf(trial) > budget) return false;
    int64_t sum = 0;
    for (int c : trial) sum += recompute[c];
    if (!found || sum < *cost) {
      found = true;
      *cost = sum;
      *plan = trial;
    }
    return true;
  };
  for (int a : candidates) {
    for (int b : candidates) {
      for (bool none_last : {false, true}) {
        // The fewest leading b layers that fit, assuming more of them never hurt.
        int64_t lo = -1, hi = layers;
        if (!consider(b, a, hi, none_last)) continue;
        while (hi - lo > 1) {
          const int64_t mid = lo + (hi - lo) / 2;
          (consider(b, a, mid, none_last) ? hi : lo) = mid;
        }
      }
    }
  }
  // Then one layer at a time, the cheapest choice that still fits, while one does.
  for (int sweep = 0; found && sweep < 3; ++sweep) {
    bool improved = false;
    for (int64_t i = 0; i < layers; ++i) {
      const int current = (*plan)[i];
      for (int c : candidates) {
        if (recompute[c] >= recompute[(*plan)[i]]) continue;
        (*plan)[i] = c;
        if (PeakOf(*plan) <= budget) {
          *cost += recompute[c] - recompute[current];
          improved = true;
          break;
        }
        (*plan)[i] = current;
      }
    }
    if (!improved) break;
  }
  return found;
}

PlanResult Planner::Evaluate(const std::vector<int>& plan) const {
  const Tables& t = *tables_;
  PlanResult result;
  for (int c : plan) {
    result.layers.push_back(t.choices[c]);
    result.recompute_flops += t.recompute[c];
  }
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
  int64_t hi = PeakOf(std::vector<int>(t.config.layers, 1));
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
  const int64_t hi = std::max(lo, PeakOf(std::vector<int>(tables_->config.layers, 0)));
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
const std::vector<int64_t>& Planner::recompute_flops() const { return tables_->recompute; }
const StepFlops& Planner::step_flops() const { return tables_->flops; }
const std::vector<int>& Planner::candidates() const { return tables_->candidates; }

}  // namespace memledger
