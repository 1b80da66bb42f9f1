#include "estimator/step/segment_plan.h"

#include <algorithm>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace memledger::liveness_internal {

absl::StatusOr<std::unique_ptr<SegmentPlan>> MakePlan(const BlockGraph& graph,
                                                      const ModelConfig& config,
                                                      bool input_requires_grad,
                                                      const RuleTable* rules) {
  WalkOptions options;
  options.input_requires_grad = input_requires_grad;
  options.record_layouts = true;
  options.rules = rules;
  absl::StatusOr<BlockWalk> walk = WalkBlock(graph, config, options);
  if (!walk.ok()) return walk.status();
  auto plan = std::make_unique<SegmentPlan>();
  plan->graph = &graph;
  plan->walk = *std::move(walk);
  const std::vector<WalkedTensor>& tensors = plan->walk.tensor_layouts;
  for (const OpDef& op : graph.ops) {
    if (op.inputs.size() > 4) {  // Node keeps at most four gradients
      return absl::InternalError(absl::StrCat("step simulation: op '", op.name, "' has ",
                                              op.inputs.size(), " inputs"));
    }
  }
  plan->last_use.assign(plan->walk.storage_list.size(), -1);
  plan->reads.resize(graph.ops.size());
  for (size_t op = 0; op < graph.ops.size(); ++op) {
    for (int input : graph.ops[op].inputs) {
      const int s = tensors[input].storage;
      // Parameters and buffers are resident: never freed by the step.
      if (s < 0 || plan->walk.storage_list[s].is_parameter ||
          plan->walk.storage_list[s].is_buffer) {
        continue;
      }
      std::vector<int>& reads = plan->reads[op];
      if (std::find(reads.begin(), reads.end(), s) == reads.end()) reads.push_back(s);
      plan->last_use[s] = static_cast<int>(op);
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
  for (size_t s = 0; s < plan->last_use.size(); ++s) {
    const int last = plan->last_use[s];
    if (last < 0 || graph.ops[last].composite < 0) continue;
    const int end = composite_end[graph.ops[last].composite];
    // Only an argument of the call: a storage made inside it dies at its last reader.
    const int owner_op = [&] {
      for (size_t op = 0; op < graph.ops.size(); ++op) {
        for (int out : graph.ops[op].outputs) {
          if (out == plan->walk.storage_list[s].owner) return static_cast<int>(op);
        }
      }
      return -1;
    }();
    if (owner_op >= 0 && graph.ops[owner_op].composite == graph.ops[last].composite) continue;
    if (end > last) {
      plan->last_use[s] = end;
      plan->reads[end].push_back(static_cast<int>(s));
    }
  }
  // What a Python local holds lives to the last op (nothing is allocated after it).
  const int last_op = static_cast<int>(graph.ops.size()) - 1;
  for (const auto& [tensor, until] : graph.held_until) {
    const int s = tensors[tensor].storage;
    const int op = until < 0 ? last_op : until;
    if (s < 0 || op < 0 || plan->last_use[s] >= op) continue;
    plan->last_use[s] = op;
    plan->reads[op].push_back(s);
  }
  const RuleTable& table = rules != nullptr ? *rules : RuleTable::Pinned();
  plan->releases.resize(graph.ops.size());
  plan->packed_releases.resize(graph.ops.size());
  plan->unpacked_releases.resize(graph.ops.size());
  plan->unpacked_keeps.assign(plan->walk.storage_list.size(), 0);
  plan->packs.assign(graph.ops.size(), false);
  for (size_t i = 0; i < graph.ops.size(); ++i) {
    const OpDef& op = graph.ops[i];
    std::vector<const KeepRule*> keeps;
    for (const KeepRule& rule : table.Of(op.type).keeps) keeps.push_back(&rule);
    std::sort(keeps.begin(), keeps.end(), [](const KeepRule* a, const KeepRule* b) {
      return std::make_pair(a->is_output, a->saved_name) <
             std::make_pair(b->is_output, b->saved_name);
    });
    const bool has_node = tensors[op.outputs[0]].requires_grad;
    for (const KeepRule* rule : keeps) {
      if (rule->needs_grad_of_input >= 0 &&
          !tensors[op.inputs[rule->needs_grad_of_input]].requires_grad) {
        continue;
      }
      const int tensor = rule->is_output ? op.outputs[rule->index] : op.inputs[rule->index];
      const int s = tensors[tensor].storage;
      if (s < 0) continue;
      plan->releases[i].push_back(s);
      if (rule->wrapped_number) {
        plan->unpacked_releases[i].push_back(s);
        if (has_node) ++plan->unpacked_keeps[s];
        continue;
      }
      plan->packed_releases[i].push_back(s);
      if (!has_node) continue;
      plan->packs[i] = true;
      if (plan->first_pack_op < 0) plan->first_pack_op = static_cast<int>(i);
      if (plan->last_pack_op != static_cast<int>(i)) plan->last_pack_is_output = false;
      plan->last_pack_op = static_cast<int>(i);
      plan->last_pack_is_output = plan->last_pack_is_output || rule->is_output;
    }
  }
  plan->same_as.assign(graph.tensors.size(), -1);
  for (const OpDef& op : graph.ops) {
    const bool identity =
        (op.type == OpType::kToDtype &&
         graph.tensors[op.inputs[0]].dtype == graph.tensors[op.outputs[0]].dtype) ||
        (op.type == OpType::kContiguous && tensors[op.inputs[0]].layout.IsContiguous()) ||
        // add_ returns self; its AddBackward0 hands the gradient through.
        op.type == OpType::kAddInplace;
    if (identity) plan->same_as[op.outputs[0]] = op.inputs[0];
  }
  // Each split's parts (slices of one input marked split_part), in forward order, under
  // its first part: the backward's SplitBackward0 waits for them all.
  plan->split_parts.assign(graph.ops.size(), {});
  plan->split_first.assign(graph.ops.size(), -1);
  std::map<int, int> first_of_input;  // a split's input -> its first part
  for (size_t i = 0; i < graph.ops.size(); ++i) {
    const OpDef& op = graph.ops[i];
    if (op.type != OpType::kSlice || !op.attributes.split_part) continue;
    const int first = first_of_input.emplace(op.inputs[0], static_cast<int>(i)).first->second;
    plan->split_first[i] = first;
    plan->split_parts[first].push_back(static_cast<int>(i));
  }
  for (size_t i = 0; i < graph.ops.size(); ++i) {
    const int call = graph.ops[i].composite;
    if (call < 0) continue;
    if (static_cast<size_t>(call) >= plan->composite_ops.size()) {
      plan->composite_ops.resize(static_cast<size_t>(call) + 1);
    }
    plan->composite_ops[static_cast<size_t>(call)].push_back(static_cast<int>(i));
  }
  if (graph.input >= 0) plan->input_storage = tensors[graph.input].storage;
  plan->output_storage = tensors[graph.output].storage;
  plan->decoder_local.assign(plan->walk.storage_list.size(), false);
  for (int t : graph.decoder_locals) {
    if (tensors[t].storage >= 0) plan->decoder_local[tensors[t].storage] = true;
  }
  return plan;
}

}  // namespace memledger::liveness_internal
