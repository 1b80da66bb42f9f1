// The step simulation: one rank's schedule (its micro-batches; a pipeline rank's steps
// are simulation_pipeline.cc's), the model-level tensors and the order the optimizer
// visits the parameters in.
#include "estimator/step/simulation.h"

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "estimator/graph/family.h"

namespace memledger::liveness_internal {

absl::Status Simulation::Run(const ModelPlans& plans) {
  const ModelGraphs& graphs = *plans.graphs;
  const bool families = graphs.prologue.has_value();
  if (families) prologue_graph_ = &*graphs.prologue;
  graphs_ = &graphs;
  segments_.optimizer_layer_bytes.assign(graphs.layer_kinds.size(), {});
  const RankStep& rank = options_.rank;
  const ParallelSpec& parallel = rank.parallel;
  chunks_ = parallel.pp > 1 ? rank.chunks : std::vector<StageRange>{WholeModel(config_)};
  data_parallel_ = MakeDataParallelProgram(*this, DataParallelOf(parallel));
  data_parallel_->SetUp(graphs);

  // The model input (the study's hidden states, the families' token ids): resident, held
  // by the caller for the whole step; one per micro-batch, on a stage that reads it (the
  // embedding's, and the families' head, whose labels are the ids shifted).
  const bool checkpointing = variant_.CheckpointsAnyLayer();
  const SegmentPlan& input_plan =
      families ? *plans.Prologue(checkpointing) : *plans.First(checkpointing);
  int input_storage = input_plan.structure->input_storage;
  for (size_t s = 0; families && s < input_plan.walk.storage_list.size(); ++s) {
    const WalkedStorage& storage = input_plan.walk.storage_list[s];
    if (graphs.prologue->tensors[storage.owner].global == ModelTensor::kInputIds) {
      input_storage = static_cast<int>(s);
    }
  }
  const int64_t micro_batches = std::max<int64_t>(1, parallel.micro_batches);
  bool reads_input = false;
  for (const StageRange& chunk : chunks_) {
    reads_input = reads_input || chunk.prologue || (chunk.head && families);
  }
  const int64_t input_bytes =
      reads_input ? input_plan.walk.storage_list[input_storage].bytes : 0;
  if (memory_.cuda()) {
    // Each micro-batch's input its own block.
    for (int64_t j = 0; reads_input && j < micro_batches; ++j) {
      out_->resident_tensors.push_back(
          ResidentTensor{absl::StrCat("input ", j), MemoryCategory::kInput, input_bytes});
    }
  } else {
    out_->resident[static_cast<int>(MemoryCategory::kInput)] = input_bytes * micro_batches;
  }
  memory_.Begin();
  if (tape_ != nullptr) memory_.SetTape(tape_);
  // Under 1F1B only the first `simulated` micro-batches are replayed: the warm-up
  // forwards, the first steady iteration (whose backward makes the .grads) and a second
  // one, which every later iteration repeats byte for byte (a forward and a backward;
  // the .grads added to in place; each loss added into the first and freed), so that
  // the step's peak is theirs, the cool-down's or the reduction's, none of which depends
  // on how many iterations came between (the inputs are resident from the start).
  // Where the peak is composed from the tape, only the first micro-batch's passes run:
  // the others are copies (PipelineSchedule).
  // The interleaved schedule's steady state cycles through the chunks, one group of
  // pp x v steps (each chunk pp forwards and pp backwards, no net change); its warm-up
  // and cool-down do not depend on the micro-batches (a multiple of pp) unless they are
  // exactly pp (all forwards first). So without events it is replayed for the least
  // multiple of pp micro-batches whose steady state has two groups: the first makes
  // every chunk's .grads, the second is what every later group repeats byte for byte
  // (its chunks' order is the same: the micro-batches differ by whole groups).
  const bool interleaved = parallel.pp > 1 && parallel.schedule == PipelineSchedule::kInterleaved;
  const int64_t warmup =
      parallel.pp > 1 ? std::min(parallel.pp - rank.stage - 1, micro_batches) : 0;
  // With the CUDA allocator every micro-batch is replayed: its blocks need not repeat.
  // Where the last backward syncs (DDP) and the ones before it do not, one more is
  // replayed, so that a backward without the hooks follows the first.
  const bool syncs = data_parallel_->SyncsInLastBackward();
  int64_t simulated = memory_.allocator()
                          ? micro_batches
                          : std::min(micro_batches, warmup + (syncs ? 3 : 2));
  if (interleaved) {
    simulated = micro_batches;
    const int64_t v = parallel.virtual_stages, pp = parallel.pp;
    const int64_t forwards = (pp - rank.stage - 1) * 2 + (v - 1) * pp + 2 * pp * v;
    const int64_t enough = ((forwards + v - 1) / v + pp - 1) / pp * pp;
    if (!options_.record_events && !memory_.allocator() && micro_batches != pp && !syncs &&
        enough < micro_batches) {
      simulated = enough;
    }
  }
  std::vector<int> inputs;
  for (int64_t j = 0; j < micro_batches; ++j) {
    const int id = reads_input ? memory_.Adopt(input_bytes, MemoryCategory::kInput) : -1;
    if (j < simulated) inputs.push_back(id);
  }
  // The hidden states a stage receives or sends: the layers' input.
  const BlockGraph& layer = graphs.Layer(0);
  hidden_.layout = plans.First(checkpointing)->walk.tensor_layouts[layer.input].layout;
  hidden_.dtype = layer.tensors[layer.input].dtype;

  if (parallel.pp > 1) {
    ParallelSpec replayed = parallel;
    replayed.micro_batches = simulated;
    if (absl::Status s = PipelineSchedule(plans, PipelineSteps(replayed, rank.stage), inputs);
        !s.ok()) {
      return s;
    }
  } else {
    // Gradient accumulation: each micro-batch's forward and backward. Where the peak is
    // composed from the tape, the second's are the first's forward again and its
    // backward's shadow pass (as PipelineSchedule copies them).
    const bool copies = tape_ != nullptr && !memory_.allocator() && !options_.record_events;
    RepeatedPass forward;
    std::array<RepeatedPass, 2> backward;  // the first micro-batch's, a later one's
    for (size_t j = 0; j < inputs.size(); ++j) {
      if (copies && j >= 1) {
        Repeat(forward);
        Repeat(backward[1]);
        continue;
      }
      InFlight f;
      f.range = chunks_.front();
      f.input_id = inputs[j];
      if (absl::Status s = CapturedForward(plans, f, copies, &forward); !s.ok()) return s;
      data_parallel_->LastBackward(j + 1 == inputs.size());
      if (absl::Status s = CapturedBackward(plans, f, std::nullopt, copies, &backward);
          !s.ok()) {
        return s;
      }
      data_parallel_->LastBackward(false);
    }
  }
  ParameterOrder(plans);

  memory_.SetPhase(StepPhase::kOptimizer);
  memory_.BeginSegment(TapeStretch::Kind::kOptimizer);
  // With a tape the step's end is the real rank's reduction and step (RankEnd), which
  // ComposeRankPeak puts in this stretch's place whatever it holds: not replayed here
  // (a rank whose passes were copied from another stage's has no .grads to reduce).
  absl::Status status = tape_ != nullptr ? absl::OkStatus() : data_parallel_->ReduceAndStep();
  segments_.optimizer = memory_.EndSegment();
  memory_.FinishTape();
  if (status.ok() && memory_.overflowed()) {
    return absl::OutOfRangeError(absl::StrCat(
        "the step's live bytes overflow int64 for layers=", config_.layers,
        " width=", config_.width, " batch=", config_.batch, " seq=", config_.seq));
  }
  return status;
}

absl::Status Simulation::RunReduction(const ModelPlans& plans) {
  const ModelGraphs& graphs = *plans.graphs;
  if (graphs.prologue.has_value()) prologue_graph_ = &*graphs.prologue;
  graphs_ = &graphs;
  segments_.optimizer_layer_bytes.assign(graphs.layer_kinds.size(), {});
  chunks_ = options_.rank.parallel.pp > 1 ? options_.rank.chunks
                                          : std::vector<StageRange>{WholeModel(config_)};
  data_parallel_ =
      MakeDataParallelProgram(*this, DataParallelOf(options_.rank.parallel));
  data_parallel_->SetUp(graphs);
  memory_.Begin();
  ParameterOrder(plans);
  // What the backward leaves: the .grads, unless the program reduced them in it.
  const bool grads_left = data_parallel_->PrepareStepEnd();
  for (const ParameterKey& key : parameter_order_) {
    if (!grads_left) break;
    if (grads_.count(key) > 0) continue;
    const SegmentPlan* plan = key.first == Where::kPrologue ? plans.prologue.get()
                              : key.first == Where::kHead   ? plans.head.get()
                                                            : LayerPlan(plans, key.first);
    const TensorDef& def = plan->graph->tensors[key.second];
    const int64_t bytes = NumelOf(plan->walk.tensor_layouts[key.second].layout) *
                          ElementSizeBytes(def.dtype);
    grads_.emplace(key, memory_.Alloc(bytes, MemoryCategory::kGradient));
  }
  memory_.SetPhase(StepPhase::kOptimizer);
  memory_.BeginSegment();
  absl::Status status = data_parallel_->ReduceAndStep();
  segments_.optimizer = memory_.EndSegment();
  if (status.ok() && memory_.overflowed()) {
    return absl::OutOfRangeError("the step's end overflows int64");
  }
  return status;
}

// ParameterOrder: the optimizer visits model.parameters(), the rank's chunks' in the
// model's order, each segment's in its graph's order (the modules' registration order).
// A tied weight is the embedding's, visited there; a chunk without the embedding holds
// its own copy, visited in the head.
void Simulation::ParameterOrder(const ModelPlans& plans) {
  const ModelGraphs& graphs = *plans.graphs;
  const bool families = graphs.prologue.has_value();
  bool has_embedding = false;
  for (const StageRange& chunk : chunks_) has_embedding = has_embedding || chunk.prologue;
  auto visit = [&](const SegmentPlan* plan, int64_t segment) {
    const BlockGraph& graph = *plan->graph;
    graph.ForEachParameter([&](int t) {
      // A frozen parameter has no .grad, so torch.optim steps it not.
      if (graph.tensors[t].frozen) return;
      if (!graph.tensors[t].is_tied || !has_embedding) {
        parameter_order_.push_back(KeyOf(graph, segment, t));
        expert_shard_.push_back(graph.tensors[t].expert_shard);
      }
    });
  };
  // The segments in the model's order; their parameter counts first, to make room once.
  auto segments = [&](auto&& f) {
    for (const StageRange& chunk : chunks_) {
      if (chunk.prologue && families) {
        f(plans.Prologue(variant_.CheckpointsAnyLayer()), Where::kPrologue);
      }
      for (int64_t i = chunk.first_layer; i < chunk.first_layer + chunk.layers; ++i) {
        f(LayerPlan(plans, i), i);
      }
      if (chunk.head) f(plans.head.get(), Where::kHead);
    }
  };
  size_t parameters = parameter_order_.size();
  segments([&](const SegmentPlan* plan, int64_t) { parameters += plan->structure->parameters; });
  parameter_order_.reserve(parameters);
  expert_shard_.reserve(parameters);
  segments(visit);
  grads_.reserve(parameter_order_.size());
}

// ForwardPass runs the stage's forward for one micro-batch: from its input (the
// embedding's) or its received hidden states, through its layers, to the loss (the
// head's) or its output; what the backward needs stays in `f`.
absl::Status Simulation::ForwardPass(const ModelPlans& plans, InFlight& f) {
  const ModelGraphs& graphs = *plans.graphs;
  const bool families = graphs.prologue.has_value();
  const SegmentPlan* const first = plans.First(variant_.CheckpointsAnyLayer());
  const BlockGraph& layer = graphs.Layer(0);
  const int input_id = f.input_id;
  Handle x;
  if (families && input_id >= 0) globals_[ModelTensor::kInputIds] = input_id;
  if (f.received.defined()) {
    x = Alias(f.received);  // the caller keeps the leaf for its gradient
  } else if (!families) {
    x.storage = input_id;
    x.layout = first->walk.tensor_layouts[layer.input].layout;
    x.dtype = layer.tensors[layer.input].dtype;
  }

  memory_.SetPhase(StepPhase::kForward);
  memory_.BeginSegment();
  std::vector<int>& extras = f.extras;  // the layers' model-level tensors the caller holds
  extras.reserve(kNumModelTensors);
  if (f.range.prologue && families) {
    data_parallel_->ForwardBegins(Where::kPrologue);
    f.prologue.plan = plans.Prologue(variant_.CheckpointsAnyLayer());
    f.prologue.segment = Where::kPrologue;
    // What the embedding reads is made before it (learned positions' ids); what the
    // layers read after it and the DynamicCache (RoPE's position ids and tables, masks).
    if (absl::Status s = MakeModelTensors(plans.tensors_before_prologue.get(), &extras);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = Forward(f.prologue, nullptr, Saving(), &x); !s.ok()) return s;
    if (const int leaf = f.prologue.plan->structure->leaf; leaf >= 0) {
      f.leaf = f.prologue.ids[TensorOf(f.prologue, leaf).storage];
      memory_.Ref(f.leaf);  // its AccumulateGrad node's
    }
    if (config_.KeepsKvCache()) DynamicCacheLayers();
    if (absl::Status s = MakeModelTensors(plans.tensors_after_prologue.get(), &extras);
        !s.ok()) {
      return s;
    }
    data_parallel_->ForwardEnds(Where::kPrologue);
  } else if (families) {
    // A later stage makes its own (ModelImpl::Extras).
    for (const SegmentPlan* plan :
         {plans.tensors_before_prologue.get(), plans.tensors_after_prologue.get()}) {
      if (absl::Status s = MakeModelTensors(plan, &extras); !s.ok()) return s;
    }
  }
  segments_.prologue = memory_.EndSegment();

  const int64_t end = f.range.first_layer + f.range.layers;
  f.layers.assign(f.range.layers, Instance());
  f.checkpoint_inputs.assign(f.range.layers, -1);
  f.rng_states.assign(f.range.layers, -1);
  if (static_cast<int64_t>(segments_.forward.size()) < end) segments_.forward.resize(end);
  const int64_t pass = passes_++;
  forward_entries_.clear();
  for (int64_t i = f.range.first_layer; i < end; ++i) {
    memory_.BeginSegment(TapeStretch::Kind::kLayerForward, i, pass);
    Instance& inst = f.layers[i - f.range.first_layer];
    inst.plan = LayerPlan(plans, i);
    inst.segment = i;
    data_parallel_->ForwardBegins(i);
    Handle y;
    if (variant_.IsCheckpointed(i)) {
      // The checkpointed layer runs without a graph (reentrant: Function.apply's
      // forward) or with one whose saved tensors are empty holders (non-reentrant),
      // filling the selective cache; the checkpoint keeps its tensor inputs: x and the
      // model-level tensors it reads.
      const bool reentrant = config_.checkpoint_impl == CheckpointImpl::kReentrant;
      Pass pass;
      pass.keeps = reentrant ? Pass::Keeps::kNone : Pass::Keeps::kUnpacked;
      pass.record = !variant_.PolicyAt(i).empty();
      // preserve_rng_state: torch.get_rng_state() before the layer runs.
      memory_.SetOp(Special(i, Where::Activity::kCheckpointNode));
      f.rng_states[i - f.range.first_layer] =
          memory_.HostAlloc(kCpuRngStateBytes, MemoryCategory::kActivation);
      if (absl::Status s = Forward(inst, &x, pass, &y); !s.ok()) return s;
      // save_inputs (non-reentrant: checkpoint.py, _make_saved_tensor, before the
      // checkpoint's own hook is entered) or CheckpointFunction's save_for_backward
      // (reentrant) packs x: under save_on_cpu into a host copy, the device's let go.
      const bool offloaded = config_.offload_activations;
      if (!offloaded) memory_.Keep(x.storage);
      std::vector<int> held = CallArguments(inst);
      for (int h : held) memory_.Keep(h);
      f.checkpoint_inputs[i - f.range.first_layer] = x.storage;
      if (!reentrant) {
        inst.frame = Instance::Frame{offloaded ? -1 : x.storage, offloaded,
                                     f.rng_states[i - f.range.first_layer], std::move(held),
                                     inst.ids, false};
      }
    } else if (absl::Status s = Forward(inst, &x, Saving(), &y); !s.ok()) {
      return s;
    }
    if (x.storage != input_id) memory_.Unref(x.storage);  // x = layer(x)
    x = y;
    data_parallel_->ForwardEnds(i);
    segments_.forward[i] = memory_.EndSegment();
    if (tape_ != nullptr) forward_entries_[i] = memory_.tape_size() - 1;
  }
  memory_.BeginSegment();
  if (f.range.head) {
    f.head.plan = plans.head.get();
    f.head.segment = Where::kHead;
    data_parallel_->ForwardBegins(Where::kHead);
    // Where the decoder model's forward returns (after its final norm) its last hidden
    // states (rebound to the norm's output) and its other locals, the layers' extras,
    // die; without a decoder (the study) when the loss is computed.
    bool returned = false;
    auto returns = [&] {
      if (x.storage != input_id) memory_.Unref(x.storage);
      ReleaseDecoderLocals();
      for (auto it = extras.rbegin(); it != extras.rend(); ++it) memory_.Unref(*it);
      extras.clear();
      returned = true;
    };
    decoder_returns_.emplace(returns);
    absl::Status forward = Forward(f.head, &x, Saving(), &f.loss);
    if (forward.ok() && !returned) returns();
    decoder_returns_.reset();
    if (!forward.ok()) return forward;
    data_parallel_->ForwardEnds(Where::kHead);
  } else {
    f.output = x;  // returned to the caller, who sends it
  }
  // A stage without the head: the layers' extras die as it returns. Then the autocast
  // scope ends (its cast cache cleared).
  ReleaseDecoderLocals();
  for (auto it = extras.rbegin(); it != extras.rend(); ++it) memory_.Unref(*it);
  f.globals = globals_;
  ReleaseForwardHolds(/*forward_end=*/true);
  segments_.head_forward = memory_.EndSegment();
  return absl::OkStatus();
}

// BackwardPass runs `f`'s backward: from the loss (loss.backward(), whose graph root
// holds ones_like(loss)) or from `output_grad`, received for its output; through the
// layers, to the embedding's parameters or the received input's .grad (f.input_grad).
absl::Status Simulation::BackwardPass(const ModelPlans& plans, InFlight& f,
                                      std::optional<Handle> output_grad) {
  const ModelGraphs& graphs = *plans.graphs;
  const bool families = graphs.prologue.has_value();
  globals_ = f.globals;
  memory_.BeginSegment();
  memory_.SetPhase(StepPhase::kBackward);
  const int64_t end = f.range.first_layer + f.range.layers;
  // The unit before `unit` in this chunk (ZeRO-3 gathers it as its input's hook runs,
  // FSDP2 prefetches it); none before the first (the embeddings' gradient ends the graph).
  auto before = [&](int64_t unit) -> std::optional<int64_t> {
    if (unit == Where::kHead) return end - 1;
    if (unit > f.range.first_layer) return unit - 1;
    if (f.range.prologue && families) return Where::kPrologue;
    return std::nullopt;
  };
  data_parallel_->BackwardBegins(f.range.head ? Where::kHead : end - 1);
  memory_.SetOp(Special(Where::kHead, Where::Activity::kLossBackward));
  Handle seed;
  std::optional<Handle> grad;
  if (f.range.head) {
    seed.layout = f.loss.layout;
    seed.dtype = f.loss.dtype;
    seed.storage = memory_.Alloc(memory_.bytes(f.loss.storage), MemoryCategory::kTemporary);
    data_parallel_->UnitBackwardBegins(Where::kHead, before(Where::kHead));
    Buffers buffers;
    buffers.emplace(graphs.epilogue.output, Alias(seed));
    if (absl::Status s = Backward(f.head, buffers, false); !s.ok()) return s;
    if (auto it = buffers.find(graphs.epilogue.input); it != buffers.end()) grad = it->second;
    data_parallel_->UnitBackwardPassed(Where::kHead, before(Where::kHead));
  } else {
    seed = *output_grad;  // the caller's reference, dropped when the backward returns
    grad = Alias(seed);
  }
  segments_.head_backward = memory_.EndSegment();
  if (static_cast<int64_t>(segments_.backward.size()) < end) segments_.backward.resize(end);
  const int64_t pass = passes_++;
  for (int64_t i = end - 1; i >= f.range.first_layer && grad.has_value(); --i) {
    memory_.BeginSegment(TapeStretch::Kind::kLayerBackward, i, pass);
    Instance& inst = f.layers[i - f.range.first_layer];
    const BlockGraph& layer = graphs.layer_kinds[KindOf(i)];
    data_parallel_->UnitBackwardBegins(i, before(i));
    const Handle incoming = *grad;
    grad.reset();
    Buffers layer_buffers;
    const int checkpoint_input = f.checkpoint_inputs[i - f.range.first_layer];
    if (inst.frame.has_value()) {
      // A non-reentrant checkpoint: the layer's nodes run in this engine, the first to
      // unpack recomputing the layer.
      layer_buffers.emplace(layer.output, incoming);
      if (absl::Status s = Backward(inst, layer_buffers, false); !s.ok()) return s;
      if (inst.frame->alive) FrameDies(inst);  // its last hook's node never ran
      inst.frame.reset();
      if (auto it = layer_buffers.find(layer.input); it != layer_buffers.end()) {
        grad = it->second;
      }
    } else if (checkpoint_input >= 0) {
      inst.plan = LayerPlan(plans, i);
      if (absl::Status s =
              CheckpointBackward(inst, checkpoint_input, incoming, layer_buffers);
          !s.ok()) {
        return s;
      }
      if (auto it = layer_buffers.find(kLayerInputKey); it != layer_buffers.end()) {
        grad = it->second;
      }
    } else {
      layer_buffers.emplace(layer.output, incoming);
      if (absl::Status s = Backward(inst, layer_buffers, false); !s.ok()) return s;
      if (auto it = layer_buffers.find(layer.input); it != layer_buffers.end()) {
        grad = it->second;
      }
    }
    // The hook on the layer's input runs where another unit made it: not on the study's
    // model input nor on a received one (a leaf), whose unit's backward ends with the
    // graph's.
    if (i > f.range.first_layer || (f.range.prologue && families)) {
      data_parallel_->UnitBackwardPassed(i, before(i));
    }
    segments_.backward[i] = memory_.EndSegment();
  }
  memory_.BeginSegment();
  if (f.range.prologue && families && grad.has_value()) {
    Buffers prologue_buffers;
    prologue_buffers.emplace(graphs.prologue->output, *grad);
    grad.reset();
    if (absl::Status s = Backward(f.prologue, prologue_buffers, false); !s.ok()) return s;
    // The hook's leaf: its AccumulateGrad steals a gradient nobody else holds that has
    // its layout, else clones it (accumulate_grad.h); the .grad stays with the leaf.
    const int leaf = f.prologue.plan->structure->leaf;
    if (auto it = prologue_buffers.find(leaf); leaf >= 0 && it != prologue_buffers.end()) {
      const Layout& layout = TensorOf(f.prologue, leaf).layout;
      if (memory_.refs(it->second.storage) == 1 && SameLayout(it->second.layout, layout)) {
        f.leaf_grad = it->second;
      } else {
        f.leaf_grad = NewGrad(layout, it->second.dtype);
        memory_.Unref(it->second.storage);
      }
      prologue_buffers.erase(it);
    }
  }
  if (f.received.defined() && grad.has_value()) {
    // The received leaf's AccumulateGrad: its .grad is the gradient if nothing else
    // holds it and it has the leaf's layout, else a copy.
    if (memory_.refs(grad->storage) == 1 && SameLayout(grad->layout, f.received.layout)) {
      f.input_grad = *grad;
    } else {
      f.input_grad = NewGrad(f.received.layout, grad->dtype);
      memory_.Unref(grad->storage);
    }
  } else if (grad.has_value()) {
    memory_.Unref(grad->storage);  // the model input's: not kept
  }
  // The backward returns: the engine's final callbacks run, then the graph task ends
  // (loss.backward()'s seed dies with it; a received output gradient is the caller's).
  data_parallel_->GraphTaskEnding(f.range.head);
  memory_.Unref(seed.storage);
  data_parallel_->GraphTaskEnded(f.range.head);
  // The loss, as a value: the first stays until the step ends; later ones are added
  // into it in place and freed.
  if (f.range.head) {
    if (loss_total_ < 0) {
      loss_total_ = f.loss.storage;
      memory_.ShadowFrees(f.loss.storage);  // a later micro-batch's is added and freed
    } else {
      memory_.Unref(f.loss.storage);
    }
  }
  segments_.tail = memory_.EndSegment();

  return absl::OkStatus();
}

// MakeModelTensors: the graph runs as a segment of its own, without grad; the decoder
// model takes what it returns (its locals, to its return).
absl::Status Simulation::MakeModelTensors(const SegmentPlan* plan, std::vector<int>* extras) {
  if (plan == nullptr) return absl::OkStatus();
  Instance inst;
  inst.plan = plan;
  inst.segment = Where::kPrologue;
  Handle last;
  if (absl::Status s = Forward(inst, nullptr, Graph(), &last); !s.ok()) return s;
  for (const auto& [tensor, id] : plan->graph->returns) {
    const int storage = inst.ids[plan->walk.tensor_layouts[tensor].storage];
    globals_[id] = storage;
    extras->push_back(storage);
  }
  return absl::OkStatus();
}

// DynamicCacheLayers: the decoder model makes its DynamicCache after the embeddings
// (transformers' decoder models' forward, with use_cache); each sliding-window layer's
// DynamicSlidingWindowLayer holds torch.tensor(sliding_window, dtype=torch.long), 8
// bytes (cache_utils.py, DynamicSlidingWindowLayer.__init__), until the forward
// returns the cache. Their count is the whole model's, which no segment graph knows.
// Recorded, each is its own event; otherwise only their sum and their lifetime count,
// and one storage of the sum stands for them: a composed model of 10^12 layers
// (ComposePeak) made 10^12 storages, 3 GB at 10^9. The sum fits: each layer's own
// parameters are more than 8 bytes, and their total was counted before.
void Simulation::DynamicCacheLayers() {
  memory_.SetOp(Special(Where::kPrologue, Where::Activity::kDynamicCache));
  const int64_t layers = model_layers_ >= 0 ? model_layers_ : config_.layers;
  const int64_t sliding = config_.SlidingLayers(layers);
  const int64_t storages = memory_.recording() ? sliding : std::min<int64_t>(sliding, 1);
  for (int64_t i = 0; i < storages; ++i) {
    // torch.tensor(...) without a device: a host tensor beside a CUDA model, until the
    // layer's first update moves it to the device (Forward makes that copy).
    const int id = memory_.HostAlloc(ElementSizeBytes(DType::kInt64) * (sliding / storages),
                                     MemoryCategory::kTemporary);
    forward_holds_.emplace_back(id, Where::kPrologue);
  }
}

}  // namespace memledger::liveness_internal
