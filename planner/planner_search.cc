// The planner's dynamic program: labels of partial plans in Pareto sets, pruned by the
// tables' bounds (Planner::Tables::Feasible).
#include "planner/planner_tables.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "estimator/graph/family.h"
#include "estimator/predict/predict.h"
#include "estimator/report/units.h"

namespace memledger {

namespace {

// Label is a partial plan in the dynamic program: layers 0..i chosen, 0..i-1 placed.
struct Label {
  int64_t f = 0;        // forward: live bytes the placed layers' forwards added
  int64_t u = kNoRise;  // the worst backward moment so far less f (see Feasible)
  int64_t s = 0;        // bytes the placed layers leave after their backward
  int64_t cost = 0;     // recompute FLOPs of layers 0..i
  int64_t g = 0;        // the placed layers' casts, freed at the forward's end (autocast)
  int32_t parent = -1;  // into the previous layer's labels
  int16_t choice = 0;   // layer i's
};

// ParetoSet keeps the labels of one state that no other label dominates (no larger f,
// u, s and cost, no smaller g). Labels fall into groups of equal (u, s, g), which take
// few values; in a group, labels sorted by f have strictly falling cost (a staircase),
// so a dominance test is a binary search. Clear keeps the groups' storage for the next
// layer's labels: the dynamic program refills every set once per layer.
class ParetoSet {
 public:
  bool empty() const { return used_ == 0; }
  void Clear() { used_ = 0; }

  // Insert adds `label` (stored in `arena`) unless a member dominates it, and removes
  // the members it dominates. `use_s`: whether s differs between labels at all.
  void Insert(std::vector<Label>& arena, const Label& label, bool use_s) {
    if (Dominated(label, use_s)) return;
    InsertUndominated(arena, label, use_s);
  }

  // Dominated: some member is no larger in f, u, s and cost.
  bool Dominated(const Label& label, bool use_s) const {
    const int64_t s = use_s ? label.s : 0;
    for (const Group& g : Groups()) {
      if (g.u > label.u || g.s > s || g.g < label.g) continue;
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
    for (Group& g : Groups()) {
      if (g.u < label.u || g.s < s || g.g > label.g) continue;
      auto first = std::lower_bound(g.steps.begin(), g.steps.end(), label.f,
                                    [](const Step& step, int64_t f) { return step.f < f; });
      auto last = first;
      while (last != g.steps.end() && last->cost >= label.cost) ++last;
      g.steps.erase(first, last);
      if (g.u == label.u && g.s == s && g.g == label.g) own = &g;
    }
    if (own == nullptr) {
      if (used_ == groups_.size()) groups_.emplace_back();
      own = &groups_[used_++];
      own->u = label.u;
      own->s = s;
      own->g = label.g;
      own->steps.clear();
    }
    auto at = std::lower_bound(own->steps.begin(), own->steps.end(), label.f,
                               [](const Step& step, int64_t f) { return step.f < f; });
    own->steps.insert(at, Step{label.f, label.cost, static_cast<int32_t>(arena.size())});
    arena.push_back(label);
  }

  template <typename Visit>
  void ForEach(Visit visit) const {
    for (const Group& g : Groups()) {
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
    int64_t g;
    std::vector<Step> steps;
  };
  std::span<Group> Groups() { return {groups_.data(), used_}; }
  std::span<const Group> Groups() const { return {groups_.data(), used_}; }
  std::vector<Group> groups_;  // the first used_ are this layer's
  size_t used_ = 0;
};

}  // namespace

// The peak of a plan, stretch by stretch in step order, with R the resident bytes,
// P the prologue's net, F_i the forward nets of layers 0..i, D_j = forward + backward
// net of layer j, H the head's two nets (under autocast less G, the casts the forward's
// end frees, summed over the layers like F; first_held_bytes more when layer 0 is
// checkpointed, as its frame keeps the decoder's inputs_embeds):
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
  const int64_t layers = Layers();
  if (resident > budget) return false;
  // A label at step i has placed layers 0..i-1 and committed to whether layer i is
  // checkpointed; its state is (layer i-1 checkpointed, layer i checkpointed, layer 0
  // checkpointed, any of layers 0..i-1 checkpointed, and the groups they hold), which is
  // all the stretches still to come depend on. Choosing layer i's choice (of the
  // committed kind) and layer i+1's kind places layer i. Labels that reached the same
  // state by different choices compete in one Pareto set.
  auto state = [&](bool previous, bool current, bool first_ckpt, bool below, uint32_t held) {
    return ((((static_cast<size_t>(previous) * 2 + current) * 2 + first_ckpt) * 2 + below)
            << groups) + held;
  };
  const uint32_t masks = 1u << groups;
  const size_t kStates = size_t{16} << groups;
  std::vector<std::vector<Label>> arenas(layers + 1);
  std::vector<ParetoSet> sets(kStates);
  std::vector<ParetoSet> next_sets(kStates);
  for (int current = 0; current < 2; ++current) {
    if (candidates_by_checkpoint[current].empty()) continue;
    const Bracket& b = first[current];
    if (b.prologue.has_rise && resident + b.prologue.rise > budget) continue;
    sets[state(false, current, first_matters && current, false, 0)].Insert(arenas[0], Label(),
                                                                           !local);
  }
  // Place layer i into a label; false if a forward moment, a backward one known now
  // (`local`), or a lower bound of the moments still to come exceeds the budget.
  // Under `local`, the later layers' D: later_d.
  // H, under `local`: the head's nets when no layer is checkpointed, and more where the
  // first layer's checkpoint holds what the decoder's return would free.
  auto head_net = [&](bool first_ckpt) {
    return head_net_none + (first_ckpt ? first_held_bytes : 0);
  };
  // held: what the groups a checkpointed layer <= i holds are (layer i being placed).
  auto place = [&](const Label& from, const LayerStretches& st, int64_t base, int64_t i,
                   int64_t held, bool first_ckpt, Label* to) -> bool {
    const int64_t remaining = layers - 1 - i;
    if (st.forward.has_rise && base + from.f + st.forward.rise > budget) return false;
    to->f = from.f + st.forward.net;
    to->s = from.s + st.forward.net + st.backward.net;
    to->g = from.g + st.freed;
    if (local) {
      // F less the casts freed at the forward's end; the later layers' D likewise.
      if (st.backward.has_rise &&
          base + head_net(first_ckpt) + held + to->f - to->g +
                  later_d[i] +
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
    for (ParetoSet& set : next_sets) set.Clear();
    const int kind = kind_of[i], slot = slot_of[i];
    const int64_t remaining = layers - 1 - i;
    for (int previous = 0; previous < 2; ++previous) {
      for (int current = 0; current < 2; ++current) {
        for (int first_ckpt = 0; first_ckpt < (first_matters ? 2 : 1); ++first_ckpt) {
          for (size_t below_held = 0; below_held < 2 * size_t{masks}; ++below_held) {
            const bool below = below_held / masks;
            const uint32_t held = below_held % masks;
            const ParetoSet& set = sets[state(previous, current, first_ckpt, below, held)];
            if (set.empty()) continue;
            const int64_t base = resident + first[first_ckpt].prologue.net;
            // Layer i is the lowest checkpointed layer of its groups no layer below holds.
            const uint32_t own = current ? kind_groups[kind] : 0;
            const uint32_t lowest = own & ~held;
            const int64_t held_now = HeldBytes(held | own);
            const size_t row =
                ((static_cast<size_t>(kind) * kSlots + slot) * 2 + previous) * choices.size();
            set.ForEach([&](int32_t index) {
              const Label& from = arenas[i][index];
              for (int c : candidates_by_checkpoint[current]) {
                const int64_t cost = search.any ? 0 : from.cost + recompute[kind][c];
                for (int next = 0; next < (remaining > 0 ? 2 : 1); ++next) {
                  if (remaining > 0 && candidates_by_checkpoint[next].empty()) continue;
                  Label to;
                  // At(kind, slot, previous, c, next, lowest): c is of the committed
                  // checkpointing, so `lowest` needs no normalizing.
                  const LayerStretches& st =
                      layer[(((row + c) * 2 + next) << groups) + lowest];
                  if (!place(from, st, base, i, held_now, first_ckpt, &to)) {
                    continue;
                  }
                  to.cost = cost;
                  // The LP bound of layers i + 1.. in what the forward has left: cheaper
                  // than the dominance test, and it drops more.
                  if (bounded &&
                      static_cast<double>(cost) +
                              CostBound(remaining, budget - base - min_end_rise - to.f) >
                          static_cast<double>(search.incumbent)) {
                    continue;
                  }
                  ParetoSet& into =
                      next_sets[state(current, next, first_ckpt, below || current, held | own)];
                  if (into.Dominated(to, !local)) continue;
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
    std::swap(sets, next_sets);
  }
  // The head, the backward, the tail and the optimizer.
  int32_t best = -1;
  int64_t best_cost = 0;
  for (int previous = 0; previous < 2; ++previous) {
    for (int first_ckpt = 0; first_ckpt < (first_matters ? 2 : 1); ++first_ckpt) {
      for (size_t below_held = 0; below_held < 2 * size_t{masks}; ++below_held) {
        // `previous` is now the last layer's kind, `below` whether any layer is
        // checkpointed, `held` the groups they hold.
        const bool below = below_held / masks;
        const uint32_t held = below_held % masks;
        const Bracket& head = Head(first_ckpt, previous, below, held);
        const Bracket& ends = first[first_ckpt];
        const int64_t base = resident + ends.prologue.net;
        // No layer checkpointed: the one plan that keeps the DynamicCache, replayed.
        if (!below && cached_none_peak > budget) continue;
        sets[state(previous, false, first_ckpt, below, held)].ForEach([&](int32_t index) {
          const Label& to = arenas[layers][index];
          const int64_t forward_end = base + to.f;
          if (head.head_forward.has_rise && forward_end + head.head_forward.rise > budget) {
            return;
          }
          // The forward's end frees the plan's casts (G), after the head's forward rise.
          const int64_t after_head = forward_end + head.head_forward.net - to.g;
          if (head.head_backward.has_rise && after_head + head.head_backward.rise > budget) {
            return;
          }
          const int64_t h = base + head.head_forward.net + head.head_backward.net - to.g;
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

}  // namespace memledger
