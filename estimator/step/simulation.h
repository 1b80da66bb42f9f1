// The step simulation's machinery, shared by its parts (estimator/step/liveness.h is the API):
// Simulation replays one rank's training step, op by op, on a Memory ledger. Its
// methods live by concern:
//   simulation_forward.cc   a segment's forward (and a recompute's replay);
//   simulation_backward.cc  a segment's backward nodes, checkpoints' recomputes;
//   simulation_schedule.cc  the rank's schedule: micro-batches, the model-level
//                           tensors, the parameters' order;
//   simulation_pipeline.cc  a pipeline rank's steps, and the passes it copies (from its
//                           first micro-batch, or a stage whose chunk has its shape);
//   simulation_step.cc      the optimizer's step;
// and what a data-parallel rank does at its units' boundaries is its program's
// (estimator/step/data_parallel_program.h);
// and liveness.cc composes long models' peaks from a short model's stretches.
#ifndef ESTIMATOR_STEP_SIMULATION_H_
#define ESTIMATOR_STEP_SIMULATION_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/graph/block_graph.h"
#include "estimator/spec/checked_math.h"
#include "estimator/step/data_parallel_program.h"
#include "estimator/step/op_steps.h"
#include "estimator/step/pipeline_steps.h"
#include "estimator/step/segment_plan.h"
#include "estimator/step/step_ledger.h"
#include "estimator/saved/walker.h"

namespace memledger::liveness_internal {

// Buffers are the engine's input buffers of one segment's backward, by tensor: a few at
// a time, so a flat list searched in order rather than a tree of heap nodes (the step
// simulation's cost is mostly such bookkeeping).
class Buffers {
 public:
  using Entry = std::pair<int, Handle>;
  using iterator = std::vector<Entry>::iterator;
  // A layer's backward holds a few gradients at a time: room for them at once, not
  // grown one entry at a time.
  Buffers() { entries_.reserve(8); }
  iterator end() { return entries_.end(); }
  iterator find(int tensor) {
    return std::find_if(entries_.begin(), entries_.end(),
                        [tensor](const Entry& e) { return e.first == tensor; });
  }
  // emplace adds `grad` for `tensor` unless it has one: {where it is, whether added}.
  std::pair<iterator, bool> emplace(int tensor, const Handle& grad) {
    if (iterator it = find(tensor); it != end()) return {it, false};
    entries_.emplace_back(tensor, grad);
    return {entries_.end() - 1, true};
  }
  void erase(iterator it) { entries_.erase(it); }
  // ByTensor: the entries in tensor order.
  std::vector<Entry> ByTensor() const {
    std::vector<Entry> sorted = entries_;
    std::sort(sorted.begin(), sorted.end(),
              [](const Entry& a, const Entry& b) { return a.first < b.first; });
    return sorted;
  }

 private:
  std::vector<Entry> entries_;
};

// GlobalIds: the Memory id of each model-level tensor made so far (-1: not made), a
// fixed table that a pass copies to its backward without a heap allocation.
class GlobalIds {
 public:
  GlobalIds() { ids_.fill(-1); }
  int& operator[](ModelTensor id) { return ids_[static_cast<int>(id)]; }
  // Find: the tensor's id, -1 if it was not made.
  int Find(ModelTensor id) const { return ids_[static_cast<int>(id)]; }

 private:
  std::array<int, kNumModelTensors> ids_;
};

class Simulation {
 public:
  // The attention mode is in the graphs Run() gets.
  Simulation(const ModelConfig& config, const Variant& variant,
             const OptimizerSpec& optimizer, const StepOptions& options, StepTimeline* out)
      : config_(config), variant_(variant), optimizer_(optimizer),
        options_(options),
        rules_(options.rules != nullptr ? *options.rules : RuleTable::Pinned()), out_(out),
        memory_(out, options.record_events, optimizer, config.device == Device::kCuda,
                config.expandable_segments, options.cuda_blocks,
                config.cublas_workspace_bytes) {}

  absl::Status Run(const ModelPlans& plans);
  // RunReduction is the step's end alone, from the .grads the backward leaves (one per
  // parameter, each its own storage): the data-parallel reduction and the optimizer's
  // step, as segments().optimizer (the rank's, without ZeRO-3; one pipeline stage).
  absl::Status RunReduction(const ModelPlans& plans);
  // set_model_layers: the real model's layer count when this simulation replays a short
  // model for ComposePeak (what is made once for the whole model is the real one's).
  void set_model_layers(int64_t layers) { model_layers_ = layers; }
  // set_model_chunks: the rank's real chunks when this simulation replays them short
  // (ZeRO-3's shard is the real stage's).
  void set_model_chunks(std::vector<StageRange> chunks) { model_chunks_ = std::move(chunks); }
  // RecordTape: Run cuts the whole step into `tape`'s consecutive stretches (each layer's
  // forward and backward per pass, the optimizer's step, the rest between), for a rank's
  // composed peak (liveness.cc).
  void RecordTape(std::vector<TapeStretch>* tape) { tape_ = tape; }
  // The step's stretches, for ComposePeak.
  struct Segments {
    SegmentSummary prologue;               // model-level tensors, embeddings
    std::vector<SegmentSummary> forward;   // per layer: its forward and x = layer(x)
    SegmentSummary head_forward;           // the head and the forward's return
    SegmentSummary head_backward;          // the seed and the head's backward
    std::vector<SegmentSummary> backward;  // per layer
    SegmentSummary tail;                   // the embeddings' backward, the graph's end
    SegmentSummary optimizer;
    // optimizer_layer_bytes: what one layer of each kind adds, by category, to the
    // optimizer step's rise, where it is all alive at once: with master weights its fp32
    // .grad copies, with foreach its share of the exp_avg_sq.sqrt() list. The rise grows
    // by them per layer.
    std::vector<std::array<int64_t, kNumMemoryCategories>> optimizer_layer_bytes;
  };
  const Segments& segments() const { return segments_; }
  std::string Text(const Where& where) const { return WhereText(where, optimizer_); }
  // NamePeak fills StepPeak::op from the label current at the peak.
  void NamePeak() { out_->peak.op = memory_.PeakText(); }
  // reserved_peak: on CUDA, the caching allocator's segments at most.
  int64_t reserved_peak() const { return memory_.reserved_peak(); }

 private:
  // One segment instance in the model: its plan and its storages' ids in Memory.
  struct Instance {
    const SegmentPlan* plan = nullptr;
    int64_t segment = Where::kHead;  // layer index, or Where::kHead
    bool recompute = false;          // a checkpointed layer's forward again, with grad
    std::vector<int> ids;  // walked storage -> Memory id; -1: parameter or not made
    // cached: the selective cache, walked storage -> Memory id, filled by a recording
    // forward and read (each entry popped) by the replaying one.
    std::map<int, int> cached;
    // Frame is a non-reentrant checkpoint's _CheckpointFrame in the backward
    // (torch/utils/checkpoint.py): the layer's nodes are the outer graph's, each saved
    // tensor a holder filled by the recompute. It holds the layer input (_NoopSaveInputs),
    // the call's other tensors (the partial's keyword arguments), the forward's RNG
    // state and the selective cache until the node that releases the last hook.
    struct Frame {
      int input = -1;  // -1: offloaded (input_offloaded)
      // input_offloaded: save_inputs packed the layer input into save_on_cpu's hook
      // (DeviceOptions::offload_activations): the frame holds its host copy, and the
      // recompute unpacks a device copy of it.
      bool input_offloaded = false;
      int rng_state = -1;
      std::vector<int> held;
      // forward_ids: the forward's ids, for what its nodes hold without the hooks.
      std::vector<int> forward_ids;
      bool recomputed = false;
      bool alive = true;
    };
    std::optional<Frame> frame;
  };

  // How a segment's forward runs.
  struct Pass {
    enum class Keeps : uint8_t {
      kAll,       // with grad: backward nodes keep what the rules say
      kNone,      // without grad (a reentrant checkpoint's forward): nothing kept
      // with grad under a non-reentrant checkpoint's pack hook: only what the nodes
      // hold without the hooks (SegmentPlan::unpacked_keeps)
      kUnpacked,
    };
    Keeps keeps = Keeps::kAll;
    bool record = false;      // the policy's ops' outputs go into the selective cache
    bool replay = false;      // a recompute under a policy: those ops pop their outputs
    // early_stop: a non-reentrant recompute, which stops once the last holder is filled
    // (SegmentPlan::last_pack_op); what it made that no holder keeps dies then.
    bool early_stop = false;
  };
  static Pass Graph() { return Pass(); }
  // Saving: a forward with grad outside the checkpoints. Under save_on_cpu
  // (DeviceOptions::offload_activations) every pack goes to the host, and the nodes hold
  // on the device only what SavedVariable stores without the hooks (wrapped numbers).
  Pass Saving() const {
    Pass pass;
    if (config_.offload_activations) pass.keeps = Pass::Keeps::kUnpacked;
    return pass;
  }
  // Offloaded: `inst`'s nodes hold host copies of what they saved (a Saving() forward
  // under save_on_cpu; not a checkpoint's recompute or frame, whose hooks are the
  // checkpoint's).
  bool Offloaded(const Instance& inst) const {
    return config_.offload_activations && !inst.frame.has_value() && !inst.recompute;
  }
  // Unpacked is save_on_cpu's unpack of a saved tensor of `layout`: a device copy of its
  // host copy (unpack_from_cpu's tensor.to(device)), contiguous (pack_to_cpu's
  // torch.empty(tensor.size())).
  int Unpacked(const Layout& layout, DType dtype) {
    return memory_.Alloc(NumelOf(layout) * ElementSizeBytes(dtype), MemoryCategory::kActivation);
  }

  absl::Status Unimplemented(const std::string& what) {
    return absl::UnimplementedError(absl::StrCat(
        "peak memory: the step simulation does not model ", what, " yet"));
  }

  Where At(const Instance& inst, int op, const char* node) const {
    Where where;
    where.graph = inst.plan->graph;
    where.segment = inst.segment;
    where.op = op;
    where.node = node;
    where.recompute = inst.recompute;
    return where;
  }
  Where Special(int64_t segment, Where::Activity activity) const {
    Where where;
    where.segment = segment;
    where.activity = activity;
    return where;
  }

  absl::Status Forward(Instance& inst, const Handle* input, Pass pass, Handle* output);
  bool FromCache(const Instance& inst, const OpDef& op) const {
    return op.policy_kind.has_value() && variant_.PolicyAt(inst.segment).Saves(*op.policy_kind);
  }
  // CallIsReplayed: `op` belongs to a composite call (a linear) whose op the replay
  // returns from the selective cache. The replay bypasses the dispatcher and casts its
  // arguments itself (runtime/selective_ops.cc), so autocast's cache never sees them.
  bool CallIsReplayed(const Instance& inst, const OpDef& op) const {
    if (op.composite < 0) return false;
    for (int other : inst.plan->structure->composite_ops[static_cast<size_t>(op.composite)]) {
      if (FromCache(inst, inst.plan->graph->ops[other])) return true;
    }
    return false;
  }
  absl::Status Backward(Instance& inst, Buffers& buffers, bool capture_parameters);
  // Node runs the backward node of op `op_index` (named `node`), whose incoming gradient
  // is `found` (buffers' entry for the op's output); Backward finds it, and sends a
  // split's parts to SplitBackward and a view's node to ViewNode.
  absl::Status Node(Instance& inst, int op_index, const char* node, Buffers::iterator found,
                    Buffers& buffers, bool capture_parameters);
  // ViewNode is Node for a view's node (SegmentStructure::BackwardStep::Kind::kView),
  // whose incoming gradient is `found` (buffers' entry for the op's output).
  void ViewNode(Instance& inst, const OpDef& op, int op_index, const char* node,
                Buffers::iterator found, Buffers& buffers, bool capture_parameters);
  absl::Status SplitBackward(Instance& inst, int op_index, Buffers& buffers,
                             bool capture_parameters);
  absl::Status CheckpointBackward(Instance& inst, int saved_input, Handle incoming,
                                  Buffers& outer);
  // Recompute is a non-reentrant checkpoint's unpack hook at its first call: the layer
  // run again from its input, with grad, under the forward's RNG state, until the last
  // holder is filled.
  absl::Status Recompute(Instance& inst);
  // FrameDies: the node holding the frame's last hook has released its variables.
  void FrameDies(Instance& inst);
  // StopRecompute is _StopRecomputationError unwinding the recompute: the forward's
  // locals (`local`) die, and so does its graph, with what its nodes held without the
  // hooks; the holders' tensors stay (the frame's recomputed dict). `output` is left
  // undefined.
  absl::Status StopRecompute(Instance& inst, const std::vector<bool>& local, Handle* output);
  // MakeModelTensors runs a graph of the model's own tensors (ModelPlans::
  // tensors_before_prologue, tensors_after_prologue; null: none) and takes what it
  // returns as the model-level tensors, appended to `extras`.
  absl::Status MakeModelTensors(const SegmentPlan* plan, std::vector<int>* extras);
  // DynamicCacheLayers: the DynamicCache's sliding-window layers' scalars.
  void DynamicCacheLayers();
  // CallArguments: the model-level tensors a checkpointed layer holds to its backward,
  // the ones its graph reads (KeepReason::kCheckpointHeld).
  std::vector<int> CallArguments(const Instance& inst) const {
    std::vector<int> held;
    const BlockGraph& graph = *inst.plan->graph;
    for (const WalkedStorage& storage : inst.plan->walk.storage_list) {
      if (storage.is_global) held.push_back(globals_.Find(graph.tensors[storage.owner].global));
    }
    return held;
  }
  void Route(Instance& inst, int tensor, const Handle& grad, Buffers& buffers,
             bool capture_parameters);
  // TiedGradientReady: whether a parameter's AccumulateGrad runs now on *grad. A tied
  // weight whose two uses are in one backward graph (one pipeline stage holds the LM
  // head and the embedding) has one AccumulateGrad node with an edge from each; the
  // engine runs it once both have arrived, their sum made in its InputBuffer
  // (torch/csrc/autograd/input_buffer.cpp, accumulate). The head's gradient waits in
  // tied_buffer_ (by the embedding's tensor) until the embedding's adds its own; *grad
  // is then the sum.
  bool TiedGradientReady(const ParameterKey& key, bool head_use, Handle* grad) {
    if (prologue_graph_ == nullptr || options_.rank.parallel.pp != 1 ||
        key.first != Where::kPrologue) {
      return true;
    }
    if (head_use) {
      Accumulate(tied_buffer_, key.second, *grad);
      return false;
    }
    if (tied_buffer_.find(key.second) == tied_buffer_.end()) return true;
    Accumulate(tied_buffer_, key.second, *grad);
    const auto pending = tied_buffer_.find(key.second);
    *grad = pending->second;
    tied_buffer_.erase(pending);
    return true;
  }
  void Accumulate(Buffers& buffers, int tensor, const Handle& grad);
  void AccumulateGrad(const ParameterKey& parameter, const Layout& layout, const Handle& grad);
  // OptimizerStep steps tensors of these element counts, with their gradients.
  absl::Status OptimizerStep(const std::vector<int64_t>& numels);
  // InFlight is one micro-batch between its forward and its backward.
  struct InFlight {
    StageRange range;   // the model chunk
    int input_id = -1;  // the model input, where the chunk reads it
    Handle received;    // a later stage's received input (a leaf that requires grad)
    // leaf: the hooked prologue's leaf (SegmentStructure::leaf), held by its
    // AccumulateGrad node with leaf_grad, its .grad, until the graph dies with the loss
    // (after the step); -1: none.
    int leaf = -1;
    Handle leaf_grad;
    Instance prologue, head;
    std::vector<Instance> layers;  // the chunk's
    std::vector<int> checkpoint_inputs;
    // rng_states: each checkpointed layer's CPU RNG state, kept by its checkpoint.
    std::vector<int> rng_states;
    std::vector<int> extras;  // the layers' model-level tensors (position ids, RoPE tables)
    GlobalIds globals;  // as the forward left them
    Handle loss;        // the head's, kept until the step ends
    Handle output;      // a stage without the head: its output, until sent
    Handle input_grad;  // the received input's .grad, until sent
    bool repeated = false;  // its passes copied from the second micro-batch's
  };
  // BeginCapture (with `capture`) ends the open stretch and says where the pass's own
  // stretches begin on the tape; Capture, after the pass, takes them and its handle.
  size_t BeginCapture(bool capture);
  // CapturedForward and CapturedBackward run a micro-batch's pass and, with `capture`,
  // take it as stretches: the forward, and the backward with its shadow pass (a later
  // micro-batch's backward, Memory::BeginShadow).
  absl::Status CapturedForward(const ModelPlans& plans, InFlight& f, bool capture,
                               RepeatedPass* pass);
  absl::Status CapturedBackward(const ModelPlans& plans, InFlight& f,
                                std::optional<Handle> output_grad, bool capture,
                                std::array<RepeatedPass, 2>* passes);
  RepeatedPass Capture(size_t begin, const Handle& handle);
  // Repeat appends `pass`'s stretches (each pass renumbered, each layer `shift` later)
  // and returns its handle, a storage already counted in them.
  Handle Repeat(const RepeatedPass& pass, int64_t shift = 0);
  // Shifted: `pass` with its layers (and the layers its stretches' moments name) `by`
  // later.
  static RepeatedPass Shifted(RepeatedPass pass, int64_t by);
  // ShapeOf: what chunk `c`'s passes depend on, for sharing them with other stages;
  // nullopt where they are not shared.
  std::optional<ModelPlans::ChunkShape> ShapeOf(size_t c) const;
  absl::Status PipelineSchedule(const ModelPlans& plans, const std::vector<PipelineStep>& steps,
                                const std::vector<int>& inputs);
  void ParameterOrder(const ModelPlans& plans);
  // KindOf: layer i's kind, the model's pattern's or a probe's (StepOptions::layer_kinds);
  // KindsPeriod: the pattern's period (a probe's is its length); FirstOfKind: the first
  // layer of `kind` in them (-1: none); LayerPlan: layer i's segment plan.
  int KindOf(int64_t layer) const {
    return options_.layer_kinds.empty() ? graphs_->KindOf(layer)
                                        : options_.layer_kinds[static_cast<size_t>(layer)];
  }
  int64_t KindsPeriod() const {
    return options_.layer_kinds.empty() ? graphs_->Period()
                                        : static_cast<int64_t>(options_.layer_kinds.size());
  }
  int64_t FirstOfKind(int kind) const {
    for (int64_t i = 0; i < KindsPeriod(); ++i) {
      if (KindOf(i) == kind) return i;
    }
    return -1;
  }
  const SegmentPlan* LayerPlan(const ModelPlans& plans, int64_t i) const {
    // The first layer's own plan is the pattern's first kind (the study's reads an input
    // without a gradient); a probe may start with another kind.
    return i == 0 && KindOf(0) == graphs_->KindOf(0)
               ? plans.First(variant_.CheckpointsAnyLayer())
               : plans.rest[KindOf(i)].get();
  }
  // OptimizerLayerBytes is where stepped tensor p's bytes count in
  // Segments::optimizer_layer_bytes: its kind's, when p is a parameter of the first layer
  // of its kind in a single rank's model or under DDP, whose step is one process's
  // (what one more layer of that kind adds to the optimizer's step); null otherwise.
  std::array<int64_t, kNumMemoryCategories>* OptimizerLayerBytes(size_t p) {
    if (p >= parameter_order_.size() || !data_parallel_->StepIsOneProcess()) {
      return nullptr;
    }
    const int64_t layer = parameter_order_[p].first;
    if (layer < 0 || layer >= KindsPeriod()) return nullptr;
    const int kind = KindOf(layer);
    if (FirstOfKind(kind) != layer) return nullptr;
    return &segments_.optimizer_layer_bytes[kind];
  }
  absl::Status ForwardPass(const ModelPlans& plans, InFlight& f);
  absl::Status BackwardPass(const ModelPlans& plans, InFlight& f,
                            std::optional<Handle> output_grad);

  // kLayerInputKey is where a checkpoint node puts its layer input's gradient.
  static constexpr int kLayerInputKey = -1;

  ParameterKey KeyOf(const Instance& inst, int tensor) const {
    return KeyOf(*inst.plan->graph, inst.segment, tensor);
  }
  ParameterKey KeyOf(const BlockGraph& graph, int64_t segment, int tensor) const {
    const TensorDef& def = graph.tensors[tensor];
    if (def.is_tied && prologue_graph_ != nullptr) {
      // The LM head's tied weight is the embedding's: one .grad.
      for (size_t t = 0; t < prologue_graph_->tensors.size(); ++t) {
        if (prologue_graph_->tensors[t].name == def.name) {
          return {Where::kPrologue, static_cast<int>(t)};
        }
      }
    }
    return {segment, tensor};
  }

  // OpCallOf: op `op` of `inst` as its rows see it (op_steps.h).
  OpCall OpCallOf(const Instance& inst, const OpDef& op) {
    return OpCall(memory_, *inst.plan, inst.ids, op, options_, config_.shard.tp);
  }
  Handle NewGrad(const Layout& layout, DType dtype) {
    return liveness_internal::NewGrad(memory_, layout, dtype);
  }
  Handle NewGradLike(const Handle& like, const Layout& layout, DType dtype) {
    return liveness_internal::NewGradLike(memory_, like, layout, dtype);
  }
  Handle Alias(const Handle& h) { return liveness_internal::Alias(memory_, h); }

  // RoutedTensor: where a gradient for `tensor` goes, past ops that return their input
  // itself (SegmentStructure::same_as).
  int RoutedTensor(const Instance& inst, int tensor) const {
    const std::vector<int>& same_as = inst.plan->structure->same_as;
    while (same_as[tensor] >= 0) tensor = same_as[tensor];
    return tensor;
  }
  const WalkedTensor& TensorOf(const Instance& inst, int tensor) const {
    return inst.plan->walk.tensor_layouts[tensor];
  }
  bool IsParameter(const Instance& inst, int tensor) const {
    return inst.plan->graph->tensors[tensor].is_parameter;
  }

  const ModelConfig& config_;
  int64_t model_layers_ = -1;  // -1: config_.layers
  std::vector<StageRange> model_chunks_;  // empty: chunks_
  const Variant& variant_;
  const OptimizerSpec& optimizer_;
  const StepOptions& options_;
  const RuleTable& rules_;  // options_.rules, or the pinned release's
  StepTimeline* out_;
  Memory memory_;
  // Parameters' .grad storages by name (a tied weight has one .grad). Looked up for
  // every parameter's gradient: hashed, not a tree of heap nodes.
  absl::flat_hash_map<ParameterKey, int> grads_;
  // Model-level tensors (TensorDef::global): Memory ids.
  GlobalIds globals_;
  // forward_holds_: what the forward's scope holds until it returns (its loss
  // included): autocast's casts of weights (leaves that require grad), which its cast
  // cache holds until the outermost autocast scope ends (the forward's, or a checkpointed
  // layer's recompute); and the keys and values of transformers' DynamicCache
  // (use_cache without checkpointing), with its sliding-window layers' own tensors,
  // which the model's output holds.
  // Each entry: the Memory id and the segment (layer index, or Where::kHead) that made it.
  std::vector<std::pair<int, int64_t>> forward_holds_;
  // ReleaseForwardHolds ends the scope; at the forward's end, what it frees is noted in
  // the layers' forward stretches (SegmentSummary::freed_at_forward_end).
  void ReleaseForwardHolds(bool forward_end) {
    for (const auto& [id, segment] : forward_holds_) {
      if (forward_end && segment >= 0 &&
          segment < static_cast<int64_t>(segments_.forward.size()) && memory_.refs(id) == 1) {
        const int c = static_cast<int>(memory_.category(id));
        segments_.forward[segment].freed_at_forward_end[c] += memory_.bytes(id);
        // On the tape, this pass's stretch of the layer.
        if (auto entry = forward_entries_.find(segment); entry != forward_entries_.end()) {
          (*tape_)[entry->second].summary.freed_at_forward_end[c] += memory_.bytes(id);
        }
      }
      memory_.Unref(id);
    }
    forward_holds_.clear();
  }
  // The tape the step is cut into (RecordTape), and where on it each layer's stretch of
  // the current forward pass is.
  std::vector<TapeStretch>* tape_ = nullptr;
  std::map<int64_t, size_t> forward_entries_;
  int64_t passes_ = 0;  // forward and backward passes begun
  // early_stop_locals_: Forward's `local` flags for a recompute's early stop, kept
  // between recomputes so that each does not allocate them again.
  std::vector<bool> early_stop_locals_;
  // decoder_returns_: run by Forward after the op where the decoder model's forward
  // returns (BlockGraph::decoder_returns_after) while the head's forward runs; a
  // reference to ForwardPass's own lambda, which outlives that forward.
  std::optional<absl::FunctionRef<void()>> decoder_returns_;
  // decoder_locals_: the Memory ids the decoder model's locals hold (the prologue's
  // BlockGraph::decoder_locals), let go where it returns, or where a stage's forward
  // without the head returns.
  std::vector<int> decoder_locals_;
  void ReleaseDecoderLocals() {
    for (int id : decoder_locals_) memory_.Unref(id);
    decoder_locals_.clear();
  }
  const BlockGraph* prologue_graph_ = nullptr;
  Buffers tied_buffer_;  // the tied weight's AccumulateGrad input buffer (TiedGradientReady)
  const ModelGraphs* graphs_ = nullptr;  // Run's
  std::vector<StageRange> chunks_;  // the rank's model chunks (or the whole model)
  Handle hidden_;     // the layout of the hidden states between layers (and stages)
  int loss_total_ = -1;  // the first micro-batch's loss, which the others are added into
  Segments segments_;
  std::vector<ParameterKey> parameter_order_;
  // expert_shard_[p]: parameter_order_[p] is an expert-parallel rank's experts
  // (TensorDef::expert_shard).
  std::vector<bool> expert_shard_;
  // data_parallel_: what the rank does at its units' boundaries (Run's, RunReduction's).
  friend class DataParallelProgram;
  std::unique_ptr<DataParallelProgram> data_parallel_;
};

}  // namespace memledger::liveness_internal

#endif  // ESTIMATOR_STEP_SIMULATION_H_
