// The planner's probes: short models whose layers are in every context the planned
// model's layers can be in, each kind of layer in each of its slots, simulated once and
// recorded into the tables (Planner::Tables::RecordProbes).
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "planner/planner_tables.h"

namespace memledger {
namespace {

// Probe: a short model's layers, their choices (into Tables::choices) and kinds.
struct Probe {
  std::vector<int> choices;
  std::vector<int> kinds;
};

constexpr int kNone = 0, kFull = 1;  // Create puts them first

// TemplateProbes: for each choice c of `kind`, with o the other checkpointing (none
// when c is checkpointed, full when not), [c o c o c c c o c] places c first and last
// beside an o and in the middle in all four contexts, and [c c] first and last beside
// its own; a checkpointed c also as the lowest after plain layers, in the middle beside
// either ([none c none], [none c c none]) and last ([none c]), and first with a plain
// last layer ([c none], the head's context). A one-layer model has only [c]. All of one
// kind: they cover every context of a model whose layers are alike in few probes.
std::vector<Probe> TemplateProbes(const Planner::Tables& t, int kind, int64_t layers) {
  std::vector<std::vector<int>> plans;
  const int n = static_cast<int>(t.choices.size());
  for (int c = 0; c < n; ++c) {
    if (layers == 1) {
      plans.push_back({c});
      continue;
    }
    const int o = t.Checkpointed(c) ? kNone : kFull;
    plans.push_back({c, o, c, o, c, c, c, o, c});
    plans.push_back({c, c});
    if (!t.Checkpointed(c)) continue;
    plans.push_back({kNone, c, kNone});
    plans.push_back({kNone, c, c, kNone});
    plans.push_back({kNone, c});
    plans.push_back({c, kNone});
  }
  std::vector<Probe> probes;
  for (std::vector<int>& plan : plans) {
    std::vector<int> kinds(plan.size(), kind);
    probes.push_back({std::move(plan), std::move(kinds)});
  }
  return probes;
}

// ProbeLayer: a layer of a probe before or around the one probed, plain or fully
// checkpointed.
struct ProbeLayer {
  int kind;
  bool checkpointed;
};

// Sequences calls `visit` on every sequence of `symbols` of length `from` to `to`,
// shortest first, until it returns true; whether one did.
template <typename Visit>
bool Sequences(const std::vector<ProbeLayer>& symbols, int from, int to, Visit visit) {
  std::vector<ProbeLayer> sequence;
  for (int length = from; length <= to; ++length) {
    std::vector<size_t> digit(length, 0);
    while (true) {
      sequence.clear();
      for (size_t d : digit) sequence.push_back(symbols[d]);
      if (visit(sequence)) return true;
      int k = length - 1;
      while (k >= 0 && ++digit[k] == symbols.size()) digit[k--] = 0;
      if (k < 0) break;
    }
  }
  return false;
}

}  // namespace

absl::Status Planner::Tables::RecordProbes(const StepSimulator& simulator,
                                           const OptimizerSpec& optimizer,
                                           const ResidentBytes& resident_bytes) {
  const int64_t layers = static_cast<int64_t>(kind_of.size());
  const int n = static_cast<int>(choices.size());
  if (absl::Status s = GroupGlobals(simulator); !s.ok()) return s;
  // Every key: kind, slot, previous, choice, next, then the groups' bits.
  layer.assign((static_cast<size_t>(kinds) * kSlots * 2 * n * 2) << groups, LayerStretches());
  last.assign(HeadIndex(1, 1, 1, (1u << groups) - 1) + 1, Bracket());
  auto run = [&](const Probe& probe) -> absl::Status {
    std::vector<LayerChoice> layer_choices;
    for (int c : probe.choices) layer_choices.push_back(choices[c]);
    absl::StatusOr<StepStretches> stretches = simulator.Probe(probe.kinds).Stretches(
        PlanVariant(layer_choices), optimizer, resident_bytes);
    if (!stretches.ok()) return stretches.status();
    resident = stretches->resident_bytes;
    return Record(probe.choices, probe.kinds, *stretches);
  };
  // The kinds in the order the model first has them, and the symbols probes are made of:
  // each kind of a distinct set of groups, plain and checkpointed.
  std::vector<int> every;
  for (int kind : kind_of) {
    if (std::find(every.begin(), every.end(), kind) == every.end()) every.push_back(kind);
  }
  auto layers_for = [&](int kind) {
    std::vector<int> chosen = {kind};
    for (int k : every) {
      bool known = false;
      for (int c : chosen) known = known || (c != kind && kind_groups[c] == kind_groups[k]);
      if (k != kind && !known) chosen.push_back(k);
    }
    std::vector<ProbeLayer> symbols;
    for (int k : chosen) {
      symbols.push_back({k, false});
      symbols.push_back({k, true});
    }
    return symbols;
  };
  auto add = [](Probe* probe, int kind, int choice) {
    probe->kinds.push_back(kind);
    probe->choices.push_back(choice);
  };

  // The templates first, for the first layer's kind and each kind with more than its
  // first layer.
  std::vector<bool> alike(kinds, false);  // a kind with a layer not its first
  for (int64_t i = 0; i < layers; ++i) {
    alike[kind_of[i]] = alike[kind_of[i]] || slot_of[i] % 2 == 0;
  }
  for (int kind = 0; kind < kinds; ++kind) {
    if (kind != kind_of[0] && !alike[kind]) continue;
    for (const Probe& probe : TemplateProbes(*this, kind, layers)) {
      if (absl::Status s = run(probe); !s.ok()) return s;
    }
  }

  // Then a probe for each context the model's layers can be in and no probe had: the
  // layer, one after it unless it is last, and the fewest layers before it (none when
  // it is first) that make its context: the one before checkpointed as it says, a layer
  // of its kind before it unless it is its kind's first, and for each of its groups a
  // checkpointed layer of the group before it unless it is the group's lowest.
  std::vector<bool> place_seen(static_cast<size_t>(kinds) * kSlots, false);
  for (int64_t i = 0; i < layers; ++i) {
    const int kind = kind_of[i], slot = slot_of[i];
    if (place_seen[static_cast<size_t>(kind) * kSlots + slot]) continue;
    place_seen[static_cast<size_t>(kind) * kSlots + slot] = true;
    const Position position = PositionOfSlot(slot);
    const bool first_of_kind = slot % 2 == 1;
    const bool after = position == kMiddle || position == kLast;
    const bool before = position == kFirst || position == kMiddle;
    const std::vector<ProbeLayer> symbols = layers_for(kind);
    for (int previous = 0; previous < (after ? 2 : 1); ++previous) {
      for (int c = 0; c < n; ++c) {
        for (int next = 0; next < (before ? 2 : 1); ++next) {
          for (uint32_t lowest = 0; lowest <= kind_groups[kind]; ++lowest) {
            if ((lowest & ~kind_groups[kind]) != 0 || (lowest && !Checkpointed(c))) continue;
            if (At(kind, slot, previous, c, next, lowest).seen) continue;
            Probe probe;
            if (after) {
              auto makes_context = [&](const std::vector<ProbeLayer>& seq) {
                if (seq.back().checkpointed != (previous == 1)) return false;
                bool own_kind = false;
                uint32_t held = 0;
                for (const ProbeLayer& sym : seq) {
                  own_kind = own_kind || sym.kind == kind;
                  if (sym.checkpointed) held |= kind_groups[sym.kind];
                }
                if (own_kind == first_of_kind) return false;
                if (Checkpointed(c) && (kind_groups[kind] & ~held) != lowest) return false;
                for (const ProbeLayer& sym : seq) {
                  add(&probe, sym.kind, sym.checkpointed ? kFull : kNone);
                }
                return true;
              };
              if (!Sequences(symbols, 1, groups + 2, makes_context)) {
                continue;  // no model of these kinds has the context
              }
            } else if (Checkpointed(c) && lowest != kind_groups[kind]) {
              continue;  // the first layer is the lowest of all its groups
            }
            add(&probe, kind, c);
            if (before) add(&probe, kind, next ? kFull : kNone);
            if (absl::Status s = run(probe); !s.ok()) return s;
            if (!At(kind, slot, previous, c, next, lowest).seen) {
              return absl::InternalError(absl::StrCat(
                  "checkpoint planner: a probe missed ", choices[c].Name(), " in layer kind ",
                  kind, "'s slot ", slot));
            }
          }
        }
      }
    }
  }

  // The head's contexts a plan of the model can make: its first and last layers
  // checkpointed or not, and the groups its checkpointed layers hold: theirs, and any
  // union of its middle layers' (one checkpointed layer per kind of a distinct set of
  // groups makes it). Each by a probe with every kind: the model's first layer's kind,
  // the middle layers that make the union, the other kinds plain, the last layer's kind.
  if (layers == 1) return absl::OkStatus();  // the templates had them all
  const int first_kind = kind_of.front(), last_kind = kind_of.back();
  std::vector<int> middle_kinds;  // one per distinct set of groups, among layers 1..L-2
  for (int64_t i = 1; i + 1 < layers; ++i) {
    bool known = false;
    for (int k : middle_kinds) known = known || kind_groups[k] == kind_groups[kind_of[i]];
    if (!known) middle_kinds.push_back(kind_of[i]);
  }
  std::vector<int> others;  // the kinds neither first nor last, plain
  for (int kind : every) {
    if (kind != first_kind && kind != last_kind) others.push_back(kind);
  }
  for (int first_ckpt = 0; first_ckpt < 2; ++first_ckpt) {
    for (int last_ckpt = 0; last_ckpt < 2; ++last_ckpt) {
      // Every subset of the middle kinds, checkpointed, the rest of the probe plain.
      for (uint32_t subset = 0; subset < (1u << middle_kinds.size()); ++subset) {
        Probe probe;
        add(&probe, first_kind, first_ckpt ? kFull : kNone);
        for (size_t m = 0; m < middle_kinds.size(); ++m) {
          if (subset >> m & 1) add(&probe, middle_kinds[m], kFull);
        }
        for (int kind : others) add(&probe, kind, kNone);
        add(&probe, last_kind, last_ckpt ? kFull : kNone);
        const Placement p = PlacementOf(probe.choices, probe.kinds);
        const Bracket& head = last[HeadIndex(first_ckpt, last_ckpt, p.any, p.held)];
        if (head.seen) continue;
        if (absl::Status s = run(probe); !s.ok()) return s;
        if (!head.seen) {
          return absl::InternalError(absl::StrCat(
              "checkpoint planner: a probe missed the head's context (first layer ",
              first_ckpt ? "" : "not ", "checkpointed, last ", last_ckpt ? "" : "not ",
              "checkpointed, groups held ", p.held, ")"));
        }
      }
    }
  }
  return absl::OkStatus();
}

// GroupGlobals sets the groups: the model-level tensors only checkpointed layers hold,
// by the kinds of the model's layers that read them.
absl::Status Planner::Tables::GroupGlobals(const StepSimulator& simulator) {
  const std::vector<LayerGlobals> globals = simulator.LayerGlobalsOf();
  std::vector<bool> in_model(kinds, false);
  for (int kind : kind_of) in_model[kind] = true;
  std::vector<std::pair<ModelTensor, std::vector<bool>>> held_by;
  for (int kind = 0; kind < kinds; ++kind) {
    if (!in_model[kind]) continue;
    for (ModelTensor id : globals[kind].held_when_checkpointed) {
      auto it = std::find_if(held_by.begin(), held_by.end(),
                             [&](const auto& entry) { return entry.first == id; });
      if (it == held_by.end()) {
        held_by.emplace_back(id, std::vector<bool>(kinds, false));
        it = std::prev(held_by.end());
      }
      it->second[kind] = true;
    }
  }
  std::vector<std::vector<bool>> sets;
  for (const auto& [id, kinds_of] : held_by) {
    for (int kind = 0; kind < kinds; ++kind) {
      if (in_model[kind] && std::count(globals[kind].kept.begin(), globals[kind].kept.end(), id)) {
        return absl::UnimplementedError(absl::StrCat(
            "the checkpoint planner: some layers keep ", ModelTensorName(id),
            " for their backward and others hold it only when checkpointed"));
      }
    }
    if (std::find(sets.begin(), sets.end(), kinds_of) == sets.end()) sets.push_back(kinds_of);
  }
  if (sets.size() > static_cast<size_t>(kMaxGroups)) {
    return absl::UnimplementedError(absl::StrCat(
        "the checkpoint planner: the layers hold ", sets.size(),
        " sets of model-level tensors when checkpointed (at most ", kMaxGroups, ")"));
  }
  groups = static_cast<int>(sets.size());
  kind_groups.assign(kinds, 0);
  for (int g = 0; g < groups; ++g) {
    for (int kind = 0; kind < kinds; ++kind) kind_groups[kind] |= sets[g][kind] ? 1u << g : 0;
  }
  return absl::OkStatus();
}

}  // namespace memledger
