#include "estimator/step/segment_plan.h"

#include <algorithm>
#include <map>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace memledger::liveness_internal {

namespace {

// Derive fills `structure` from `graph` and its walk.
absl::Status Derive(const BlockGraph& graph, const BlockWalk& walk, const RuleTable* rules,
                    int leaf, SegmentStructure& structure) {
  structure.leaf = leaf;
  const std::vector<WalkedTensor>& tensors = walk.tensor_layouts;
  for (const OpDef& op : graph.ops) {
    if (op.inputs.size() > 4) {  // Node keeps at most four gradients
      return absl::InternalError(absl::StrCat("step simulation: op '", op.name, "' has ",
                                              op.inputs.size(), " inputs"));
    }
  }
  structure.last_use.assign(walk.storage_list.size(), -1);
  structure.node_keeps.assign(walk.storage_list.size(), 0);
  for (size_t s = 0; s < walk.storage_list.size(); ++s) {
    structure.node_keeps[s] = walk.storage_list[s].node_keepers;
  }
  structure.reads.resize(graph.ops.size());
  for (size_t op = 0; op < graph.ops.size(); ++op) {
    for (int input : graph.ops[op].inputs) {
      const int s = tensors[input].storage;
      // Parameters and buffers are resident: never freed by the step.
      if (s < 0 || walk.storage_list[s].is_parameter ||
          walk.storage_list[s].is_buffer) {
        continue;
      }
      std::vector<int>& reads = structure.reads[op];
      if (std::find(reads.begin(), reads.end(), s) == reads.end()) reads.push_back(s);
      structure.last_use[s] = static_cast<int>(op);
    }
  }
  // A composite call (matmul, linear) holds its arguments until its last op: a storage
  // read inside one lives to the call's end.
  std::vector<int> composite_end;
  for (size_t op = 0; op < graph.ops.size(); ++op) {
    const int c = graph.ops[op].composite;
    if (c < 0) continue;
    if (composite_end.size() <= static_cast<size_t>(c)) composite_end.resize(c + 1, -1);
    composite_end[c] = static_cast<int>(op);
  }
  for (size_t s = 0; s < structure.last_use.size(); ++s) {
    const int last = structure.last_use[s];
    if (last < 0 || graph.ops[last].composite < 0) continue;
    const int end = composite_end[graph.ops[last].composite];
    // Only an argument of the call: a storage made inside it dies at its last reader.
    const int owner_op = [&] {
      for (size_t op = 0; op < graph.ops.size(); ++op) {
        for (int out : graph.ops[op].outputs) {
          if (out == walk.storage_list[s].owner) return static_cast<int>(op);
        }
      }
      return -1;
    }();
    if (owner_op >= 0 && graph.ops[owner_op].composite == graph.ops[last].composite) continue;
    if (end > last) {
      structure.last_use[s] = end;
      structure.reads[end].push_back(static_cast<int>(s));
    }
  }
  // What a Python local holds lives to the last op (nothing is allocated after it).
  const int last_op = static_cast<int>(graph.ops.size()) - 1;
  for (const auto& [tensor, until] : graph.held_until) {
    const int s = tensors[tensor].storage;
    const int op = until < 0 ? last_op : until;
    // A local that is a parameter, or views one (DoRA's weight.to() of its own dtype),
    // frees nothing: parameters are resident.
    if (s < 0 || op < 0 || walk.storage_list[s].is_parameter || walk.storage_list[s].is_buffer ||
        structure.last_use[s] >= op) {
      continue;
    }
    structure.last_use[s] = op;
    structure.reads[op].push_back(s);
  }
  structure.node_hold_until.assign(walk.storage_list.size(), -1);
  structure.node_releases.resize(graph.ops.size());
  for (const auto& [tensor, until] : graph.node_held_until) {
    const int s = tensors[tensor].storage;
    if (s < 0 || walk.storage_list[s].is_parameter || structure.node_hold_until[s] >= 0) {
      continue;
    }
    structure.node_hold_until[s] = until;
    structure.node_releases[until].push_back(s);
  }
  const RuleTable& table = rules != nullptr ? *rules : RuleTable::Pinned();
  structure.releases.resize(graph.ops.size());
  structure.packed_releases.resize(graph.ops.size());
  structure.unpacked_releases.resize(graph.ops.size());
  structure.unpacked_keeps.assign(walk.storage_list.size(), 0);
  structure.packs.assign(graph.ops.size(), false);
  structure.packed_tensors.resize(graph.ops.size());
  for (size_t i = 0; i < graph.ops.size(); ++i) {
    const OpDef& op = graph.ops[i];
    std::vector<const KeepRule*> keeps;
    for (const KeepRule& rule : table.Of(op.type).keeps) keeps.push_back(&rule);
    std::sort(keeps.begin(), keeps.end(), [](const KeepRule* a, const KeepRule* b) {
      return std::make_pair(a->is_output, a->saved_name) <
             std::make_pair(b->is_output, b->saved_name);
    });
    const bool has_node = tensors[op.outputs[0]].requires_grad && op.outputs[0] != leaf;
    for (const KeepRule* rule : keeps) {
      if (rule->needs_grad_of_input >= 0 &&
          !tensors[op.inputs[rule->needs_grad_of_input]].requires_grad) {
        continue;
      }
      const int tensor = rule->is_output ? op.outputs[rule->index] : op.inputs[rule->index];
      if (has_node && !rule->wrapped_number) structure.packed_tensors[i].push_back(tensor);
      const int s = tensors[tensor].storage;
      if (s < 0) continue;
      structure.releases[i].push_back(s);
      if (rule->wrapped_number) {
        structure.unpacked_releases[i].push_back(s);
        if (has_node) ++structure.unpacked_keeps[s];
        continue;
      }
      structure.packed_releases[i].push_back(s);
      if (!has_node) continue;
      structure.packs[i] = true;
      if (structure.first_pack_op < 0) structure.first_pack_op = static_cast<int>(i);
      if (structure.last_pack_op != static_cast<int>(i)) structure.last_pack_is_output = false;
      structure.last_pack_op = static_cast<int>(i);
      structure.last_pack_is_output = structure.last_pack_is_output || rule->is_output;
    }
  }
  structure.same_as.assign(graph.tensors.size(), -1);
  for (const OpDef& op : graph.ops) {
    const bool identity =
        (op.type == OpType::kToDtype &&
         graph.tensors[op.inputs[0]].dtype == graph.tensors[op.outputs[0]].dtype) ||
        (op.type == OpType::kContiguous && tensors[op.inputs[0]].layout.IsContiguous()) ||
        // add_ returns self; its AddBackward0 hands the gradient through.
        op.type == OpType::kAddInplace;
    if (identity) structure.same_as[op.outputs[0]] = op.inputs[0];
  }
  // Each split's parts (slices of one input marked split_part), in forward order, under
  // its first part: the backward's SplitBackward0 waits for them all.
  structure.split_parts.assign(graph.ops.size(), {});
  structure.split_first.assign(graph.ops.size(), -1);
  std::map<int, int> first_of_input;  // a split's input -> its first part
  for (size_t i = 0; i < graph.ops.size(); ++i) {
    const OpDef& op = graph.ops[i];
    if (op.type != OpType::kSlice || !op.attributes.split_part) continue;
    const int first = first_of_input.emplace(op.inputs[0], static_cast<int>(i)).first->second;
    structure.split_first[i] = first;
    structure.split_parts[first].push_back(static_cast<int>(i));
  }
  for (size_t i = 0; i < graph.ops.size(); ++i) {
    const int call = graph.ops[i].composite;
    if (call < 0) continue;
    if (static_cast<size_t>(call) >= structure.composite_ops.size()) {
      structure.composite_ops.resize(static_cast<size_t>(call) + 1);
    }
    structure.composite_ops[static_cast<size_t>(call)].push_back(static_cast<int>(i));
  }
  for (int i = static_cast<int>(graph.ops.size()) - 1; i >= 0; --i) {
    const OpDef& op = graph.ops[i];
    const int out = op.outputs[0];
    if (!tensors[out].requires_grad || structure.same_as[out] >= 0 || out == leaf) continue;
    using Kind = SegmentStructure::BackwardStep::Kind;
    SegmentStructure::BackwardStep step;
    step.op = i;
    step.output = out;
    if (op.type == OpType::kSlice && op.attributes.split_part) {
      step.kind = Kind::kSplit;
    } else if (ViewsBack(op.type) && op.inputs.size() == 1 && !structure.packs[i] &&
               structure.releases[i].empty()) {
      step.kind = Kind::kView;
    }
    const std::vector<std::string_view>& names = table.Of(op.type).backward_nodes;
    if (!names.empty()) step.node = names[0].data();
    structure.backward_steps.push_back(step);
  }
  if (graph.input >= 0) structure.input_storage = tensors[graph.input].storage;
  structure.output_storage = tensors[graph.output].storage;
  structure.decoder_local.assign(walk.storage_list.size(), false);
  for (int t : graph.decoder_locals) {
    if (tensors[t].storage >= 0) structure.decoder_local[tensors[t].storage] = true;
  }
  // What the segment hands its caller: its output, and a model-tensor graph's returns.
  std::vector<bool> returned(walk.storage_list.size(), false);
  if (structure.output_storage >= 0) returned[structure.output_storage] = true;
  for (const auto& [tensor, id] : graph.returns) {
    if (tensors[tensor].storage >= 0) returned[tensors[tensor].storage] = true;
  }
  structure.frees.resize(graph.ops.size());
  for (size_t i = 0; i < graph.ops.size(); ++i) {
    for (int s : structure.reads[i]) {
      if (structure.last_use[s] == static_cast<int>(i) && s != structure.input_storage &&
          !returned[s] && !walk.storage_list[s].is_global) {
        structure.frees[i].push_back(s);
      }
    }
  }
  structure.inert.assign(graph.ops.size(), false);
  for (size_t i = 0; i < graph.ops.size(); ++i) {
    const OpDef& op = graph.ops[i];
    // Only an op type Forward gives nothing of its own (OpSteps::forward_inert).
    if (!StepsOf(op.type).forward_inert) continue;
    bool inert = static_cast<int>(i) != structure.last_pack_op &&
                 static_cast<int>(i) != graph.decoder_returns_after;
    for (int out : op.outputs) {
      const int s = tensors[out].storage;
      inert = inert && (s < 0 || walk.storage_list[s].owner != out ||
                        walk.storage_list[s].is_parameter);
    }
    inert = inert && structure.frees[i].empty() && structure.node_releases[i].empty();
    structure.inert[i] = inert;
  }
  for (size_t i = 0; i < graph.ops.size(); ++i) {
    if (structure.inert[i]) continue;
    const OpDef& op = graph.ops[i];
    SegmentStructure::ForwardStep step;
    step.op = static_cast<int>(i);
    if (op.outputs.size() > step.outputs.size()) {
      return absl::InternalError(absl::StrCat("estimator graph op '", op.name, "' has ",
                                              op.outputs.size(), " outputs; a step makes ",
                                              step.outputs.size(), " at most"));
    }
    step.n_outputs = static_cast<int>(op.outputs.size());
    for (int o = 0; o < step.n_outputs; ++o) {
      SegmentStructure::ForwardStep::Output& output = step.outputs[o];
      output.tensor = op.outputs[o];
      output.storage = tensors[output.tensor].storage;
      const int s = output.storage;
      output.makes = s >= 0 && walk.storage_list[s].owner == output.tensor &&
                     !walk.storage_list[s].is_parameter;
      output.unread = output.makes && structure.last_use[s] < 0 && !returned[s];
    }
    if (op.type == OpType::kDropout) std::swap(step.outputs[0], step.outputs[1]);
    structure.forward_steps.push_back(step);
  }
  graph.ForEachParameter([&](int) { ++structure.parameters; });
  return absl::OkStatus();
}

// StructureMemo: the structures of cached graphs' plans (those with a walk memo, which
// live as long as the process), by what they follow from: the graph, whether its input
// requires grad, which storage each tensor lives in, and which contiguous() inputs are
// contiguous already (same_as). Entries are only added, at most kMaxEntries.
class StructureMemo {
 public:
  struct Key {
    const WalkMemo* graph = nullptr;
    bool input_requires_grad = false;
    bool input_embeddings_hooked = false;
    std::vector<int> storage_of;
    std::vector<bool> contiguous;
    friend bool operator==(const Key&, const Key&) = default;
  };
  std::shared_ptr<const SegmentStructure> Find(const Key& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [k, structure] : entries_) {
      if (k == key) return structure;
    }
    return nullptr;
  }
  void Remember(Key key, std::shared_ptr<const SegmentStructure> structure) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (entries_.size() < kMaxEntries) entries_.emplace_back(std::move(key), std::move(structure));
  }
  static StructureMemo& Get() {
    static auto* const memo = new StructureMemo();
    return *memo;
  }

 private:
  static constexpr size_t kMaxEntries = 1024;
  std::mutex mutex_;
  std::vector<std::pair<Key, std::shared_ptr<const SegmentStructure>>> entries_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<SegmentPlan>> MakePlan(const BlockGraph& graph,
                                                      const ValidConfig& config,
                                                      bool input_requires_grad,
                                                      const RuleTable* rules,
                                                      const BlockLayouts* layouts,
                                                      bool input_embeddings_hooked) {
  WalkOptions options;
  options.input_requires_grad = input_requires_grad;
  options.input_embeddings_hooked = input_embeddings_hooked;
  options.record_layouts = true;
  options.rules = rules;
  // From the graph's layouts, so that a cached graph's memo serves the walk (walk_memo.h);
  // without them (a layout that fails) the walk says why.
  std::shared_ptr<const BlockLayouts> made;
  if (layouts == nullptr) {
    made = LayoutBlock(graph, config);
    layouts = made.get();
  }
  absl::StatusOr<BlockWalk> walk = WalkBlock(graph, config, options, layouts);
  if (!walk.ok()) return walk.status();
  auto plan = std::make_unique<SegmentPlan>();
  plan->graph = &graph;
  plan->walk = *std::move(walk);
  const bool memoizable =
      graph.walk_memo != nullptr && (rules == nullptr || rules == &RuleTable::Pinned());
  StructureMemo::Key key;
  if (memoizable) {
    key.graph = graph.walk_memo.get();
    key.input_requires_grad = input_requires_grad;
    key.input_embeddings_hooked = input_embeddings_hooked;
    key.storage_of.reserve(graph.tensors.size());
    for (const WalkedTensor& t : plan->walk.tensor_layouts) key.storage_of.push_back(t.storage);
    for (const OpDef& op : graph.ops) {
      if (op.type != OpType::kContiguous) continue;
      key.contiguous.push_back(plan->walk.tensor_layouts[op.inputs[0]].layout.IsContiguous());
    }
    plan->structure = StructureMemo::Get().Find(key);
    if (plan->structure != nullptr) return plan;
  }
  auto structure = std::make_shared<SegmentStructure>();
  const int leaf = input_embeddings_hooked ? graph.input_embeddings : -1;
  if (absl::Status s = Derive(graph, plan->walk, rules, leaf, *structure); !s.ok()) return s;
  plan->structure = structure;
  if (memoizable) StructureMemo::Get().Remember(std::move(key), std::move(structure));
  return plan;
}

}  // namespace memledger::liveness_internal
