// The planner's tables: recording the probes' stretches, the bounds, candidates and hull
// derived from them, a plan's peak, and the incumbent plans.
#include "planner/planner_tables.h"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
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

absl::Status Planner::Tables::Record(const std::vector<int>& probe,
                                     const std::vector<int>& probe_kinds,
                                     const StepStretches& s) {
  auto differ = [&](const std::string& what) {
    std::vector<std::string> names;
    for (size_t i = 0; i < probe.size(); ++i) {
      names.push_back(absl::StrCat(choices[probe[i]].Name(), kinds > 1 ? "@" : "",
                                   kinds > 1 ? absl::StrCat(probe_kinds[i]) : ""));
    }
    return absl::InternalError(absl::StrCat(
        "checkpoint planner: the stretches of ", what,
        " depend on more than the neighbours' checkpointing (probe ", absl::StrJoin(names, " "),
        ")"));
  };
  const int64_t layers = static_cast<int64_t>(probe.size());
  const Placement placement = PlacementOf(probe, probe_kinds);
  int64_t probe_freed = 0;
  std::vector<int64_t> of_kind(kinds, 0);  // the probe's layers by kind
  for (int64_t i = 0; i < layers; ++i) {
    const int kind = probe_kinds[i];
    const bool previous = i > 0 && Checkpointed(probe[i - 1]);
    const bool next = i + 1 < layers && Checkpointed(probe[i + 1]);
    LayerStretches& entry = layer[Key(kind, SlotOf(PositionOf(i, layers), of_kind[kind] == 0),
                                      previous, probe[i], next, LowestMask(placement, i))];
    ++of_kind[kind];
    const int64_t freed = i < static_cast<int64_t>(s.forward_freed.size()) ? s.forward_freed[i] : 0;
    if (entry.seen && (!SameStretch(entry.forward, s.forward[i]) ||
                       !SameStretch(entry.backward, s.backward[i]) || entry.freed != freed)) {
      return differ(absl::StrCat("layer ", i));
    }
    entry = {true, s.forward[i], s.backward[i], freed};
    probe_freed += freed;
  }
  Bracket& f = first[Checkpointed(probe.front())];
  if (f.seen && (!SameStretch(f.prologue, s.prologue) || !SameStretch(f.tail, s.tail))) {
    return differ("the prologue or tail");
  }
  f.seen = true;
  f.prologue = s.prologue;
  f.tail = s.tail;
  // One layer's share of the optimizer's step, by kind (master weights' fp32 copies,
  // foreach's list).
  if (optimizer_layer_bytes.empty()) optimizer_layer_bytes.assign(kinds, -1);
  for (int kind = 0; kind < kinds; ++kind) {
    if (of_kind[kind] == 0) continue;
    const int64_t bytes =
        kind < static_cast<int>(s.optimizer_layer_bytes.size()) ? s.optimizer_layer_bytes[kind] : 0;
    if (optimizer_layer_bytes[kind] >= 0 && optimizer_layer_bytes[kind] != bytes) {
      return differ("the optimizer");
    }
    optimizer_layer_bytes[kind] = bytes;
  }
  // A probe without some kind of layer frees that kind's model-level tensors (Gemma 3's
  // RoPE tables per span) as the decoder returns, in the head, and its optimizer steps
  // without that kind's parameters: only probes with every kind tell the head and the
  // optimizer.
  bool every_kind = true;
  for (int kind : kind_of) every_kind = every_kind && of_kind[kind] > 0;
  if (!every_kind) return absl::OkStatus();
  Bracket& l = last[HeadIndex(Checkpointed(probe.front()), Checkpointed(probe.back()),
                              placement.any, placement.held)];
  // The head's forward without the probe's casts freed at its end.
  StepStretch head_forward = s.head_forward;
  head_forward.net += probe_freed;
  if (l.seen && (!SameStretch(l.head_forward, head_forward) ||
                 !SameStretch(l.head_backward, s.head_backward))) {
    return differ("the head");
  }
  l.seen = true;
  l.head_forward = head_forward;
  l.head_backward = s.head_backward;
  // The optimizer's rise without the probe's layers' share; Create adds the model's.
  StepStretch step = s.optimizer;
  for (int kind = 0; kind < kinds; ++kind) step.rise -= of_kind[kind] * optimizer_layer_bytes[kind];
  if (optimizer_seen && !SameStretch(optimizer, step)) return differ("the optimizer");
  optimizer_seen = true;
  optimizer = step;
  return absl::OkStatus();
}

// DeriveBounds sets `local`, `first_matters`, D by layer and the pruning bounds from
// the recorded stretches.
void Planner::Tables::DeriveBounds() {
  Tables& t = *this;
  const int n = static_cast<int>(choices.size());
  const uint32_t masks = 1u << groups;
  bool any = false;
  // D by kind and slot over the stretches of layers that are not the lowest checkpointed
  // one of any group; the lowest one's D must then be its groups' held bytes less, and at
  // the first position (where the lowest is the first layer) first_held_bytes less again.
  const size_t places = static_cast<size_t>(kinds) * kSlots;
  std::vector<int64_t> d(places, 0);
  std::vector<bool> d_seen(places, false);
  bool d_varies = false;
  struct Gap {
    size_t place;
    uint32_t lowest;
    int64_t bytes;
  };
  std::vector<Gap> gaps;
  for (uint32_t lowest = 0; lowest < masks; ++lowest) {
    for (size_t place = 0; place < places; ++place) {
      const int kind = static_cast<int>(place / kSlots), slot = static_cast<int>(place % kSlots);
      if ((lowest & ~kind_groups[kind]) != 0) continue;
      for (int previous = 0; previous < 2; ++previous) {
        for (int c = 0; c < n; ++c) {
          if (lowest && !t.Checkpointed(c)) continue;
          for (int next = 0; next < 2; ++next) {
            const Tables::LayerStretches& st = t.At(kind, slot, previous, c, next, lowest);
            if (!st.seen) continue;
            t.min_forward_net =
                any ? std::min(t.min_forward_net, st.forward.net) : st.forward.net;
            any = true;
            // What the layer leaves after its backward: its casts were freed at the
            // forward's end.
            const int64_t dd = st.forward.net + st.backward.net - st.freed;
            if (lowest) {
              if (!d_seen[place]) d_varies = true;
              gaps.push_back({place, lowest, d[place] - dd});
              continue;
            }
            if (d_seen[place] && d[place] != dd) d_varies = true;
            d[place] = dd;
            d_seen[place] = true;
          }
        }
      }
    }
  }
  // A group's bytes from a layer after the first that is the lowest of it alone; the
  // first's gap is first_held_bytes more (all of it the group's when the model has one
  // group and only a first layer was probed checkpointed).
  auto first_position = [](size_t place) {
    const Position position = PositionOfSlot(static_cast<int>(place % kSlots));
    return position == kFirst || position == kOnly;
  };
  t.held_bytes.assign(groups, 0);
  std::vector<bool> held_known(groups, false);
  for (const Gap& gap : gaps) {
    if (first_position(gap.place) || std::popcount(gap.lowest) != 1) continue;
    const int g = std::countr_zero(gap.lowest);
    if (held_known[g] && t.held_bytes[g] != gap.bytes) d_varies = true;
    t.held_bytes[g] = gap.bytes;
    held_known[g] = true;
  }
  std::optional<int64_t> first_gap;
  for (const Gap& gap : gaps) {
    if (!first_position(gap.place)) continue;
    if (groups == 1 && !held_known[0]) {
      t.held_bytes[0] = gap.bytes;
      held_known[0] = true;
    }
    for (int g = 0; g < groups; ++g) {
      d_varies = d_varies || ((gap.lowest >> g & 1) && !held_known[g]);
    }
    const int64_t extra = gap.bytes - t.HeldBytes(gap.lowest);
    if (first_gap.has_value() && *first_gap != extra) d_varies = true;
    first_gap = extra;
  }
  t.first_held_bytes = first_gap.value_or(0);
  for (const Gap& gap : gaps) {
    for (int g = 0; g < groups; ++g) {
      d_varies = d_varies || ((gap.lowest >> g & 1) && !held_known[g]);
    }
    if (!d_varies && gap.bytes != t.HeldBytes(gap.lowest) +
                                      (first_position(gap.place) ? t.first_held_bytes : 0)) {
      d_varies = true;
    }
  }
  // The model's layers' D, summed from the last.
  const int64_t layers = static_cast<int64_t>(t.kind_of.size());
  t.later_d.assign(layers, 0);
  for (int64_t i = layers - 2; i >= 0; --i) {
    const size_t place = static_cast<size_t>(t.kind_of[i + 1]) * kSlots + t.slot_of[i + 1];
    if (!d_seen[place]) d_varies = true;
    t.later_d[i] = t.later_d[i + 1] + d[place];
  }
  const Bracket& plain = t.last[t.HeadIndex(0, 0, 0, 0)];
  bool head_varies = !plain.seen;
  t.head_net_none = plain.head_forward.net + plain.head_backward.net;
  bool heads_differ_by_first = false;
  for (int first_ckpt = 0; first_ckpt < 2; ++first_ckpt) {
    for (int last_ckpt = 0; last_ckpt < 2; ++last_ckpt) {
      for (int any_ckpt = 0; any_ckpt < 2; ++any_ckpt) {
        for (uint32_t held = 0; held < masks; ++held) {
          const Tables::Bracket& b = t.last[t.HeadIndex(first_ckpt, last_ckpt, any_ckpt, held)];
          if (b.seen && b.head_forward.net + b.head_backward.net !=
                            t.head_net_none + t.HeldBytes(held) +
                                (first_ckpt ? t.first_held_bytes : 0)) {
            head_varies = true;
          }
          const Tables::Bracket& other =
              t.last[t.HeadIndex(1 - first_ckpt, last_ckpt, any_ckpt, held)];
          if (b.seen && other.seen &&
              (!SameStretch(b.head_forward, other.head_forward) ||
               !SameStretch(b.head_backward, other.head_backward))) {
            heads_differ_by_first = true;
          }
        }
      }
    }
  }
  for (const Tables::LayerStretches& st : t.layer) t.casts = t.casts || st.freed != 0;
  t.local = !d_varies && !head_varies && !t.options.general;
  t.first_matters = heads_differ_by_first ||
                    !(t.first[0].seen && t.first[1].seen &&
                      SameStretch(t.first[0].prologue, t.first[1].prologue) &&
                      SameStretch(t.first[0].tail, t.first[1].tail));
  // Every plan's forward ends, then its head's forward runs: the smaller of the two
  // heads' rises (or 0 when a head has none) is a moment still to come.
  // So is the head's backward (its loss gradient, often the peak), at the head's
  // forward net above the forward's end.
  int64_t end = std::numeric_limits<int64_t>::max();
  for (const Tables::Bracket& b : t.last) {
    if (!b.seen) continue;
    const int64_t forward_moment = std::max<int64_t>(RiseOf(b.head_forward), 0);
    // After the forward's end a plan's casts are freed (G, unknown here): only the
    // head's forward rise is then a moment every plan reaches above its F.
    const int64_t backward_moment =
        t.casts ? forward_moment
                : b.head_forward.net + std::max<int64_t>(RiseOf(b.head_backward), 0);
    end = std::min(end, std::max(forward_moment, backward_moment));
  }
  t.min_end_rise = end == std::numeric_limits<int64_t>::max() ? 0 : end;
  // Under `local`, the last layer's backward comes after the head's nets: a second
  // moment every plan reaches, R + P + H + F_all + its rise (G lower with casts, which
  // the bound cannot know).
  if (t.local && !t.casts) {
    int64_t least_rise = std::numeric_limits<int64_t>::max();
    for (int kind = 0; kind < kinds; ++kind) {
      for (int slot = 0; slot < kSlots; ++slot) {
        if (PositionOfSlot(slot) != kLast && PositionOfSlot(slot) != kOnly) continue;
        for (int previous = 0; previous < 2; ++previous) {
          for (int c = 0; c < n; ++c) {
            for (uint32_t lowest = 0; lowest < masks; ++lowest) {
              const Tables::LayerStretches& st = t.At(kind, slot, previous, c, false, lowest);
              if (st.seen) {
                least_rise = std::min(least_rise, st.backward.has_rise ? st.backward.rise : 0);
              }
            }
          }
        }
      }
    }
    if (least_rise != std::numeric_limits<int64_t>::max()) {
      int64_t least_held = 0;
      for (int64_t bytes : t.held_bytes) least_held += std::min<int64_t>(bytes, 0);
      t.min_end_rise =
          std::max(t.min_end_rise, t.head_net_none + least_held +
                                       std::min<int64_t>(t.first_held_bytes, 0) + least_rise);
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
    for (int kind = 0; kind < kinds; ++kind) {
      for (int slot = 0; slot < kSlots; ++slot) {
        for (int previous = 0; previous < 2; ++previous) {
          for (uint32_t key = 0; key < 2u << groups; ++key) {
            const bool next = key >> groups;
            const uint32_t lowest = key & ((1u << groups) - 1);
            const Tables::LayerStretches& x = t.At(kind, slot, previous, a, next, lowest);
            const Tables::LayerStretches& y = t.At(kind, slot, previous, b, next, lowest);
            if (x.seen != y.seen) return false;
            if (!x.seen) continue;
            if (x.freed != y.freed) return false;  // what later moments gain differs
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
    }
    return true;
  };
  // a recomputes no more than b in every kind of layer (the same: equal in every one).
  auto cheaper = [&](int a, int b, bool same) {
    for (int kind = 0; kind < kinds; ++kind) {
      if (t.recompute[kind][a] > t.recompute[kind][b]) return false;
      if (same && t.recompute[kind][a] != t.recompute[kind][b]) return false;
    }
    return true;
  };
  for (int c : allowed) {
    bool dominated = false;
    for (int other : allowed) {
      if (other == c || t.Checkpointed(other) != t.Checkpointed(c)) continue;
      if (!cheaper(other, c, false) || !no_larger(other, c)) continue;
      const bool tie = cheaper(other, c, true) && no_larger(c, other);
      if (!tie || other < c) dominated = true;
    }
    if (!dominated) t.candidates.push_back(c);
  }
}

// BuildHull groups the candidates by kind and makes the LP bound's hull, of each
// choice's least forward net and least recompute over the kinds of layer (each layer
// lies on or above it).
void Planner::Tables::BuildHull() {
  Tables& t = *this;
  const int n = static_cast<int>(choices.size());
  t.least_forward_net.assign(n, std::numeric_limits<int64_t>::max());
  t.least_recompute.assign(n, std::numeric_limits<int64_t>::max());
  for (int c = 0; c < n; ++c) {
    for (int kind = 0; kind < kinds; ++kind) {
      t.least_recompute[c] = std::min(t.least_recompute[c], t.recompute[kind][c]);
      for (int slot = 0; slot < kSlots; ++slot) {
        for (int previous = 0; previous < 2; ++previous) {
          for (uint32_t key = 0; key < 2u << groups; ++key) {
            const Tables::LayerStretches& st =
                t.At(kind, slot, previous, c, key >> groups, key & ((1u << groups) - 1));
            if (st.seen) {
              t.least_forward_net[c] = std::min(t.least_forward_net[c], st.forward.net);
            }
          }
        }
      }
    }
  }
  std::vector<std::pair<double, double>> points;
  for (int c : t.candidates) {
    points.emplace_back(static_cast<double>(t.least_forward_net[c]),
                        static_cast<double>(t.least_recompute[c]));
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

int64_t Planner::Tables::PeakOf(const std::vector<int>& plan) const {
  const Tables& t = *this;
  const int64_t layers = static_cast<int64_t>(plan.size());
  const Placement placement = t.PlacementOf(plan, t.kind_of);
  if (t.cached_none_peak >= 0 && !placement.any) return t.cached_none_peak;
  int64_t total = t.resident;
  int64_t peak = total;
  auto visit = [&](const StepStretch& s) {
    if (s.has_rise) peak = std::max(peak, total + s.rise);
    total += s.net;
  };
  const Tables::Bracket& ends = t.first[t.Checkpointed(plan.front())];
  const Tables::Bracket& head = t.Head(t.Checkpointed(plan.front()), t.Checkpointed(plan.back()),
                                       placement.any, placement.held);
  visit(ends.prologue);
  StepStretch head_forward = head.head_forward;  // less the plan's casts, freed at its end
  for (int64_t i = 0; i < layers; ++i) {
    const LayerStretches& st = t.Layer(i, plan, placement);
    visit(st.forward);
    head_forward.net -= st.freed;
  }
  visit(head_forward);
  visit(head.head_backward);
  for (int64_t i = layers - 1; i >= 0; --i) visit(t.Layer(i, plan, placement).backward);
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
  const int64_t layers = Layers();
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
    const int64_t sum = RecomputeOf(trial);
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
      const std::vector<int64_t>& costs = recompute[kind_of[i]];
      for (int c : candidates) {
        if (costs[c] >= costs[(*plan)[i]]) continue;
        (*plan)[i] = c;
        if (PeakOf(*plan) <= budget) {
          *cost += costs[c] - costs[current];
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

}  // namespace memledger
