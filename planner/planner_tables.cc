// The planner's tables: recording the probes' stretches, the bounds, candidates and hull
// derived from them, a plan's peak, and the incumbent plans.
#include "planner/planner_tables.h"

#include <algorithm>
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
  int64_t probe_freed = 0;
  for (int64_t i = 0; i < layers; ++i) {
    const bool previous = i > 0 && Checkpointed(probe[i - 1]);
    const bool next = i + 1 < layers && Checkpointed(probe[i + 1]);
    LayerStretches& entry =
        layer[Key(PositionOf(i, layers), previous, probe[i], next, i == lowest)];
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
  Bracket& l = last[Checkpointed(probe.front())][Checkpointed(probe.back())][lowest >= 0];
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
  // The optimizer's rise without the probe's layers' share (master weights' fp32
  // copies, foreach's list: optimizer_layer_bytes each); Create adds the model's.
  StepStretch step = s.optimizer;
  for (int64_t bytes : s.optimizer_layer_bytes) step.rise -= layers * bytes;
  if (optimizer_seen && (!SameStretch(optimizer, step) ||
                         optimizer_layer_bytes != s.optimizer_layer_bytes)) {
    return differ("the optimizer");
  }
  optimizer_seen = true;
  optimizer = step;
  optimizer_layer_bytes = s.optimizer_layer_bytes;
  return absl::OkStatus();
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
  // one; the lowest one's D must then be held_bytes less, one constant, and at the first
  // position (where the lowest is the first layer) first_held_bytes less again.
  int64_t gap[kPositions] = {};
  bool gap_seen[kPositions] = {};
  for (int lowest = 0; lowest < 2; ++lowest) {
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
            // What the layer leaves after its backward: its casts were freed at the
            // forward's end.
            const int64_t dd = st.forward.net + st.backward.net - st.freed;
            if (lowest) {
              if (!d_seen[position] || (gap_seen[position] && gap[position] != d[position] - dd)) {
                d_varies = true;
              }
              gap[position] = d[position] - dd;
              gap_seen[position] = true;
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
  // held_bytes from the layers after the first; the first's gap is first_held_bytes more
  // (all of it held_bytes when only a first layer was probed checkpointed).
  std::optional<int64_t> held, first_gap;
  for (int position = 0; position < kPositions; ++position) {
    if (!gap_seen[position]) continue;
    std::optional<int64_t>& known =
        position == kFirst || position == kOnly ? first_gap : held;
    if (known.has_value() && *known != gap[position]) d_varies = true;
    known = gap[position];
  }
  t.held_bytes = held.value_or(first_gap.value_or(0));
  t.first_held_bytes = first_gap.has_value() ? *first_gap - t.held_bytes : 0;
  bool head_varies = !t.last[0][0][0].seen;
  t.head_net_none = t.last[0][0][0].head_forward.net + t.last[0][0][0].head_backward.net;
  bool heads_differ_by_first = false;
  for (int first_ckpt = 0; first_ckpt < 2; ++first_ckpt) {
    for (int last_ckpt = 0; last_ckpt < 2; ++last_ckpt) {
      for (int any_ckpt = 0; any_ckpt < 2; ++any_ckpt) {
        const Tables::Bracket& b = t.last[first_ckpt][last_ckpt][any_ckpt];
        if (b.seen && b.head_forward.net + b.head_backward.net !=
                          t.head_net_none + (any_ckpt ? t.held_bytes : 0) +
                              (first_ckpt ? t.first_held_bytes : 0)) {
          head_varies = true;
        }
        const Tables::Bracket& other = t.last[1 - first_ckpt][last_ckpt][any_ckpt];
        if (b.seen && other.seen &&
            (!SameStretch(b.head_forward, other.head_forward) ||
             !SameStretch(b.head_backward, other.head_backward))) {
          heads_differ_by_first = true;
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
  for (int position = 0; position < kPositions; ++position) t.d_of[position] = d[position];
  // Every plan's forward ends, then its head's forward runs: the smaller of the two
  // heads' rises (or 0 when a head has none) is a moment still to come.
  // So is the head's backward (its loss gradient, often the peak), at the head's
  // forward net above the forward's end.
  int64_t end = std::numeric_limits<int64_t>::max();
  for (const auto& by_last : t.last) {
    for (const auto& by_any : by_last) {
      for (const Tables::Bracket& b : by_any) {
        if (!b.seen) continue;
        const int64_t forward_moment = std::max<int64_t>(RiseOf(b.head_forward), 0);
        // After the forward's end a plan's casts are freed (G, unknown here): only the
        // head's forward rise is then a moment every plan reaches above its F.
        const int64_t backward_moment =
            t.casts ? forward_moment
                    : b.head_forward.net + std::max<int64_t>(RiseOf(b.head_backward), 0);
        end = std::min(end, std::max(forward_moment, backward_moment));
      }
    }
  }
  t.min_end_rise = end == std::numeric_limits<int64_t>::max() ? 0 : end;
  // Under `local`, the last layer's backward comes after the head's nets: a second
  // moment every plan reaches, R + P + H + F_all + its rise (G lower with casts, which
  // the bound cannot know).
  if (t.local && !t.casts) {
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
          t.min_end_rise, t.head_net_none + std::min<int64_t>(t.held_bytes, 0) +
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
    for (int position = 0; position < kPositions; ++position) {
      for (int previous = 0; previous < 2; ++previous) {
        for (int key = 0; key < 4; ++key) {
          const int next = key / 2, lowest = key % 2;
          const Tables::LayerStretches& x = t.layer[t.Key(position, previous, a, next, lowest)];
          const Tables::LayerStretches& y = t.layer[t.Key(position, previous, b, next, lowest)];
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

int64_t Planner::Tables::PeakOf(const std::vector<int>& plan) const {
  const Tables& t = *this;
  const int64_t layers = static_cast<int64_t>(plan.size());
  if (t.cached_none_peak >= 0 && t.LowestOf(plan) < 0) return t.cached_none_peak;
  int64_t total = t.resident;
  int64_t peak = total;
  auto visit = [&](const StepStretch& s) {
    if (s.has_rise) peak = std::max(peak, total + s.rise);
    total += s.net;
  };
  const int64_t lowest = t.LowestOf(plan);
  const Tables::Bracket& ends = t.first[t.Checkpointed(plan.front())];
  const Tables::Bracket& head =
      t.Head(t.Checkpointed(plan.front()), t.Checkpointed(plan.back()), lowest >= 0);
  visit(ends.prologue);
  StepStretch head_forward = head.head_forward;  // less the plan's casts, freed at its end
  for (int64_t i = 0; i < layers; ++i) {
    visit(t.Layer(i, plan, lowest).forward);
    head_forward.net -= t.Layer(i, plan, lowest).freed;
  }
  visit(head_forward);
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

}  // namespace memledger
