// The step simulation: a segment's backward nodes, as the autograd engine runs them, and
// the checkpoints' recomputes.
#include "estimator/step/simulation.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"

namespace memledger::liveness_internal {
void Simulation::Accumulate(Buffers& buffers, int tensor, const Handle& grad) {
  auto [it, inserted] = buffers.emplace(tensor, grad);
  if (inserted) return;
  Handle& old = it->second;
  // InputBuffer::accumulate: in place when the buffer holds the only reference to a
  // dense tensor (can_accumulate_inplace), else a new sum.
  if (memory_.refs(old.storage) == 1 && !old.is_view && NonOverlappingAndDense(old.layout)) {
    memory_.Unref(grad.storage);
    return;
  }
  Handle sum = NewGradLike(old, old.layout, old.dtype);
  memory_.Unref(old.storage);
  memory_.Unref(grad.storage);
  old = sum;
}

void Simulation::AccumulateGrad(const ParameterKey& parameter, const Layout& layout,
                                const Handle& grad) {
  auto it = grads_.find(parameter);
  if (it != grads_.end()) {
    memory_.Unref(grad.storage);  // .grad += new, in place
    data_parallel_->GradientAccumulated(parameter, grad.dtype);
    return;
  }
  // AccumulateGrad steals a gradient nobody else holds that has the parameter's layout;
  // otherwise it clones it. A later micro-batch's backward (the shadow pass) adds into
  // the .grad instead, unless the rank's reduction freed it with its unit's (ZeRO-3,
  // FSDP2).
  const bool once = data_parallel_->GradientsPersist();
  if (memory_.refs(grad.storage) == 1 && SameLayout(grad.layout, layout)) {
    memory_.MakeGradient(grad.storage, once);
    grads_.emplace(parameter, grad.storage);
  } else {
    const int64_t bytes = NumelOf(layout) * ElementSizeBytes(grad.dtype);
    const int clone = once ? memory_.AllocOnce(bytes, MemoryCategory::kGradient)
                           : memory_.Alloc(bytes, MemoryCategory::kGradient);
    memory_.Unref(grad.storage);
    grads_.emplace(parameter, clone);
  }
  data_parallel_->GradientAccumulated(parameter, grad.dtype);
}

void Simulation::Route(Instance& inst, int tensor, const Handle& grad, Buffers& buffers,
                       bool capture_parameters) {
  tensor = RoutedTensor(inst, tensor);
  const TensorDef& def = inst.plan->graph->tensors[tensor];
  if (def.is_parameter && !capture_parameters) {
    const ParameterKey key = KeyOf(inst, tensor);
    Handle ready = grad;  // a tied weight's: the sum of both uses'
    if (!TiedGradientReady(key, def.is_tied, &ready)) return;
    AccumulateGrad(key, TensorOf(inst, tensor).layout, ready);
    return;
  }
  Accumulate(buffers, tensor, grad);
}

// Node runs op `op_index`'s backward node (one of SegmentStructure::backward_steps,
// which Backward visits) as Engine::evaluate_function does: the formula's outputs and
// workspaces, then validate_outputs (sum_to a broadcast input's shape), then the incoming
// gradients die, then the saved tensors are released, then each output goes to its
// input's buffer (or .grad).
absl::Status Simulation::Node(Instance& inst, int op_index, const char* node,
                              Buffers::iterator found, Buffers& buffers,
                              bool capture_parameters) {
  const SegmentPlan& plan = *inst.plan;
  const SegmentStructure& structure = *plan.structure;
  const OpDef& op = plan.graph->ops[op_index];
  const Handle grad = found->second;
  buffers.erase(found);
  memory_.SetOp(At(inst, op_index, node));
  // Under a non-reentrant checkpoint the first node to unpack a saved tensor runs the
  // recompute (checkpoint.py, _checkpoint_hook's unpack_hook).
  if (inst.frame.has_value() && !inst.frame->recomputed && structure.packs[op_index]) {
    if (absl::Status s = Recompute(inst); !s.ok()) return s;
    memory_.SetOp(At(inst, op_index, node));
  }
  // Under save_on_cpu the node's apply() first unpacks each saved tensor, one copy per
  // SavedVariable.
  const bool offloaded = Offloaded(inst);
  absl::InlinedVector<int, 4> unpacked;
  if (offloaded) {
    for (int t : structure.packed_tensors[op_index]) {
      unpacked.push_back(Unpacked(TensorOf(inst, t).layout, plan.graph->tensors[t].dtype));
    }
  }

  auto layout_of = [&](int input) -> const Layout& {
    return TensorOf(inst, op.inputs[input]).layout;
  };
  auto dtype_of = [&](int input) { return plan.graph->tensors[op.inputs[input]].dtype; };
  // The formula (its row's backward): one gradient per input (an op has at most four,
  // MakePlan checks), only as many made.
  const size_t n_inputs = op.inputs.size();
  absl::InlinedVector<Handle, 4> grad_slots(n_inputs);
  Handle* const grads = grad_slots.data();
  const OpSteps& steps = StepsOf(op.type);
  if (steps.backward == nullptr) {
    return Unimplemented(absl::StrCat("the backward of ", OpTypeName(op.type)));
  }
  OpCall call = OpCallOf(inst, op);
  steps.backward(call, grad, grads);

  // An unpacked tensor is the formula's local: with the frame's holder emptied on
  // unpack (holder.handles[gid] = None), it dies as the node's apply() returns.
  if (inst.frame.has_value()) {
    for (int s : structure.packed_releases[op_index]) {
      if (inst.ids[s] >= 0) memory_.Release(inst.ids[s]);
    }
  }
  for (int copy : unpacked) memory_.Unref(copy);
  // validate_outputs: a gradient whose shape differs from its input's (a broadcast
  // bias) is reduced with sum_to; one whose dtype differs (autocast's bf16 matmul output
  // met an fp32 tensor) is cast to the input's.
  for (size_t i = 0; i < n_inputs; ++i) {
    if (!grads[i].defined() || !call.needs(static_cast<int>(i))) continue;
    if (!SameSizes(grads[i].layout, layout_of(i))) {
      Handle reduced = NewGrad(layout_of(i), grads[i].dtype);
      memory_.Unref(grads[i].storage);
      grads[i] = reduced;
    }
    if (grads[i].dtype != dtype_of(i)) {
      Handle cast = NewGradLike(grads[i], grads[i].layout, dtype_of(i));
      memory_.Unref(grads[i].storage);
      grads[i] = cast;
    }
  }
  memory_.Unref(grad.storage);  // the incoming gradient, unless someone else holds it
  // release_variables(), in Functions.h's order; under a non-reentrant checkpoint only
  // what the node held itself, since the forward (and the frame, with its last hook).
  if (inst.frame.has_value()) {
    for (int s : structure.unpacked_releases[op_index]) {
      if (inst.frame->forward_ids[s] >= 0) memory_.Release(inst.frame->forward_ids[s]);
    }
    if (op_index == structure.first_pack_op) FrameDies(inst);
  } else {
    // Offloaded, the node held on the device only what it stored without the hooks.
    const std::vector<int>& held =
        offloaded ? structure.unpacked_releases[op_index] : structure.releases[op_index];
    for (int s : held) {
      if (inst.ids[s] >= 0) memory_.Release(inst.ids[s]);
    }
  }
  for (size_t i = 0; i < n_inputs; ++i) {
    if (grads[i].defined() && call.needs(static_cast<int>(i))) {
      Route(inst, op.inputs[i], grads[i], buffers, capture_parameters);
    }
  }
  // A gradient the formula made for an input that requires none (the CPU flash
  // backward makes all three; a frozen k_proj's k takes none) has no edge:
  // validate_outputs skips it and it dies with the node's outputs, once the others are
  // in their buffers (engine.cpp, validate_outputs and evaluate_function).
  for (size_t i = 0; i < n_inputs; ++i) {
    if (grads[i].defined() && !call.needs(static_cast<int>(i))) memory_.Unref(grads[i].storage);
  }
  return absl::OkStatus();
}

// ViewNode runs a view's node as Node would, for less: no recompute, release or frame
// event can come between its steps (the view packs and releases nothing). The input's
// gradient is the incoming one viewed back (a reshape the strides refuse copies it), so
// the view takes over the incoming gradient's reference: Node's Ref of it (ViewOf) and
// its Unref once the node is done cancel. validate_outputs then reduces or casts it as
// Node does. Where the input's gradient starts a buffer entry, the output's entry is
// reused for it (Buffers keeps no order).
void Simulation::ViewNode(Instance& inst, const OpDef& op, int op_index, const char* node,
                          Buffers::iterator found, Buffers& buffers, bool capture_parameters) {
  memory_.SetOp(At(inst, op_index, node));
  // The incoming gradient's entry, viewed back in place where it can be.
  Handle& entry = found->second;
  const Layout& input = TensorOf(inst, op.inputs[0]).layout;
  const DType dtype = inst.plan->graph->tensors[op.inputs[0]].dtype;
  bool viewed = true;
  if (op.type == OpType::kT || op.type == OpType::kTranspose) {
    const int d0 = op.type == OpType::kT ? 0 : op.attributes.dim;
    const int d1 = op.type == OpType::kT ? 1 : op.attributes.dim1;
    std::swap(entry.layout.sizes[d0], entry.layout.sizes[d1]);
    std::swap(entry.layout.strides[d0], entry.layout.strides[d1]);
  } else {
    Layout back;
    viewed = StepsOf(op.type).viewed_back(op, entry.layout, input, &back);
    if (viewed) entry.layout = back;
  }
  if (viewed) entry.is_view = true;
  if (!viewed || !SameSizes(entry.layout, input) || entry.dtype != dtype) {
    // A copy, a reduction or a cast: as Node makes them, in its order.
    const Handle grad = entry;  // its storage and dtype as they came
    // borrowed: `entry` is the view, holding grad's storage without a reference of its
    // own (Node's ViewOf would have added one).
    bool borrowed = viewed;
    if (!viewed) entry = NewGrad(input, grad.dtype);
    auto replace = [&](const Handle& by) {
      if (!borrowed) memory_.Unref(entry.storage);
      borrowed = false;
      entry = by;
    };
    if (!SameSizes(entry.layout, input)) replace(NewGrad(input, entry.dtype));
    if (entry.dtype != dtype) replace(NewGradLike(entry, entry.layout, dtype));
    if (!borrowed) memory_.Unref(grad.storage);  // the incoming gradient
  }
  // As Route, but the entry reused where the input starts one.
  const int tensor = RoutedTensor(inst, op.inputs[0]);
  const bool parameter = inst.plan->graph->tensors[tensor].is_parameter && !capture_parameters;
  if (!parameter && buffers.find(tensor) == buffers.end()) {
    found->first = tensor;
    return;
  }
  const Handle out = entry;
  buffers.erase(found);
  Route(inst, tensor, out, buffers, capture_parameters);
}

// SplitBackward is split()'s one node for all its parts. It runs once every part's
// gradient has arrived: at the first part, the last one the backward reaches (the
// others' gradients wait in their buffers). split_backward concatenates them, zeros for
// a part without one, into the input's gradient; then the parts' gradients die.
absl::Status Simulation::SplitBackward(Instance& inst, int op_index, Buffers& buffers,
                                       bool capture_parameters) {
  const SegmentPlan& plan = *inst.plan;
  const SegmentStructure& structure = *plan.structure;
  const BlockGraph& graph = *plan.graph;
  const OpDef& op = graph.ops[op_index];
  // The node runs once, at the first part (the last the backward reaches).
  if (structure.split_first[op_index] != op_index) return absl::OkStatus();
  std::vector<Handle> incoming;
  std::vector<const OpDef*> missing;  // parts no gradient reached
  for (int p : structure.split_parts[op_index]) {
    const OpDef* part = &graph.ops[p];
    if (auto it = buffers.find(part->outputs[0]); it != buffers.end()) {
      incoming.push_back(it->second);
      buffers.erase(it);
    } else {
      missing.push_back(part);
    }
  }
  if (incoming.empty()) return absl::OkStatus();  // no gradient reached the split
  memory_.SetOp(At(inst, op_index, "SplitBackward0"));
  const DType dtype = incoming.front().dtype;
  std::vector<int> zeros;
  for (const OpDef* part : missing) {
    zeros.push_back(memory_.Alloc(
        NumelOf(TensorOf(inst, part->outputs[0]).layout) * ElementSizeBytes(dtype),
        MemoryCategory::kTemporary));
  }
  Handle grad = NewGrad(TensorOf(inst, op.inputs[0]).layout, dtype);
  for (int z : zeros) memory_.Unref(z);
  for (const Handle& h : incoming) memory_.Unref(h.storage);
  Route(inst, op.inputs[0], grad, buffers, capture_parameters);
  return absl::OkStatus();
}

absl::Status Simulation::Backward(Instance& inst, Buffers& buffers, bool capture_parameters) {
  using Kind = SegmentStructure::BackwardStep::Kind;
  for (const SegmentStructure::BackwardStep& step : inst.plan->structure->backward_steps) {
    if (step.kind == Kind::kSplit) {
      if (absl::Status s = SplitBackward(inst, step.op, buffers, capture_parameters);
          !s.ok()) {
        return s;
      }
      continue;
    }
    // The node runs once a gradient reached its output; a view's on its short path.
    auto found = buffers.find(step.output);
    if (found == buffers.end()) continue;
    if (step.kind == Kind::kView) {
      ViewNode(inst, inst.plan->graph->ops[step.op], step.op, step.node, found, buffers,
               capture_parameters);
    } else if (absl::Status s =
                   Node(inst, step.op, step.node, found, buffers, capture_parameters);
               !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

// CheckpointBackward is the reentrant checkpoint's node of a layer (CheckpointFunction,
// checkpoint.py:241-330; runtime/checkpoint.cc): recompute the whole layer with grad on a
// detached input, then torch.autograd.backward over it with the incoming gradient,
// capturing the input's and the parameters' gradients, which the node returns to the
// outer engine.
absl::Status Simulation::CheckpointBackward(Instance& inst, int saved_input, Handle incoming,
                                            Buffers& outer) {
  const SegmentPlan& plan = *inst.plan;
  const BlockGraph& graph = *plan.graph;
  memory_.SetOp(Special(inst.segment, Where::Activity::kCheckpointNode));
  // get_saved_variables() and x.detach(): two more references to the input; under
  // save_on_cpu the first is a device copy of its host copy (unpack_from_cpu).
  const bool offloaded = config_.offload_activations;
  Handle x;
  x.layout = TensorOf(inst, graph.input).layout;
  x.dtype = graph.tensors[graph.input].dtype;
  if (offloaded) {
    saved_input = Unpacked(x.layout, x.dtype);
  } else {
    memory_.Ref(saved_input);
  }
  x.storage = saved_input;
  memory_.Ref(saved_input);
  Handle y;
  inst.recompute = true;
  Pass pass;
  pass.replay = !variant_.PolicyAt(inst.segment).empty();
  // torch.random.fork_rng keeps the current RNG state while the recompute runs on the
  // forward's (checkpoint.py:303-308).
  const int forked = memory_.HostAlloc(kCpuRngStateBytes, MemoryCategory::kTemporary);
  if (absl::Status s = Forward(inst, &x, pass, &y); !s.ok()) return s;
  ReleaseForwardHolds(/*forward_end=*/false);  // the recompute's autocast scope ends
  memory_.SetOp(Special(inst.segment, Where::Activity::kCheckpointNode));
  memory_.Unref(forked);
  // autograd::grad: the graph root holds the incoming gradient, and so does y's buffer.
  memory_.Ref(incoming.storage);
  Buffers inner;
  inner.emplace(graph.output, Alias(incoming));
  if (absl::Status s = Backward(inst, inner, /*capture_parameters=*/true); !s.ok()) return s;
  inst.recompute = false;
  memory_.SetOp(Special(inst.segment, Where::Activity::kCheckpointNode));
  memory_.Unref(incoming.storage);  // the root
  for (const auto& [storage, id] : inst.cached) memory_.Release(id);  // cache->Clear()
  inst.cached.clear();
  // The node's locals die as its backward returns: y, the detached input, the saved list.
  memory_.Unref(y.storage);
  memory_.Unref(saved_input);
  memory_.Unref(saved_input);
  // Then the outer engine: the incoming gradient dies, the saved input is released, and
  // the captured gradients are routed (the input's, then every parameter's).
  memory_.Unref(incoming.storage);
  if (!offloaded) memory_.Release(saved_input);
  // CheckpointFunction keeps its RNG state and run_function (the call's bound
  // arguments) on its ctx, which lives as long as the graph: until the loss dies, after
  // the step (checkpoint.py:241-252).
  auto input_grad = inner.find(graph.input);
  if (input_grad != inner.end()) {
    Accumulate(outer, kLayerInputKey, input_grad->second);
    inner.erase(input_grad);
  }
  for (const auto& [tensor, grad] : inner.ByTensor()) {
    const TensorDef& def = graph.tensors[tensor];
    if (!def.is_parameter) continue;
    AccumulateGrad(KeyOf(inst, tensor), TensorOf(inst, tensor).layout, grad);
  }
  return absl::OkStatus();
}

absl::Status Simulation::Recompute(Instance& inst) {
  const SegmentPlan& plan = *inst.plan;
  const BlockGraph& graph = *plan.graph;
  Instance::Frame& frame = *inst.frame;
  frame.recomputed = true;
  memory_.SetOp(Special(inst.segment, Where::Activity::kCheckpointNode));
  // recompute_fn runs under torch.random.fork_rng, which keeps the current RNG state
  // meanwhile (checkpoint.py, _checkpoint_without_reentrant_generator).
  const int forked = memory_.HostAlloc(kCpuRngStateBytes, MemoryCategory::kTemporary);
  // The layer input, unpacked from the frame (get_inputs()): under save_on_cpu a device
  // copy of its host copy, which only what the recompute keeps holds once it is done.
  Handle x;
  x.layout = TensorOf(inst, graph.input).layout;
  x.dtype = graph.tensors[graph.input].dtype;
  x.storage = frame.input_offloaded ? Unpacked(x.layout, x.dtype) : frame.input;
  Pass pass;
  pass.replay = !variant_.PolicyAt(inst.segment).empty();
  pass.early_stop = true;
  Handle y;
  inst.recompute = true;
  absl::Status status = Forward(inst, &x, pass, &y);
  inst.recompute = false;
  if (!status.ok()) return status;
  if (y.defined()) memory_.Unref(y.storage);  // no early stop: the output is dropped
  if (frame.input_offloaded) memory_.Unref(x.storage);  // recompute_fn's args
  ReleaseForwardHolds(/*forward_end=*/false);  // the recompute's autocast scope ends
  memory_.SetOp(Special(inst.segment, Where::Activity::kCheckpointNode));
  memory_.Unref(forked);
  return absl::OkStatus();
}

void Simulation::FrameDies(Instance& inst) {
  Instance::Frame& frame = *inst.frame;
  frame.alive = false;
  if (!frame.input_offloaded) memory_.Release(frame.input);
  for (int held : frame.held) memory_.Release(held);
  memory_.Unref(frame.rng_state);
  // The selective cache's entries the recompute never reached (those after the early
  // stop) die with recompute_fn's context.
  for (const auto& [storage, id] : inst.cached) memory_.Release(id);
  inst.cached.clear();
}

}  // namespace memledger::liveness_internal
