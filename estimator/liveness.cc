#include "estimator/liveness.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/block_graph.h"
#include "estimator/checked_math.h"
#include "estimator/pipeline_steps.h"
#include "estimator/segment_plan.h"
#include "estimator/step_ledger.h"
#include "estimator/walker.h"

namespace memledger {
namespace {

using liveness_internal::ContiguousOf;
using liveness_internal::Handle;
using liveness_internal::MakePlan;
using liveness_internal::Memory;
using liveness_internal::ModelPlans;
using liveness_internal::NonOverlappingAndDense;
using liveness_internal::NumelOf;
using liveness_internal::Permuted;
using liveness_internal::SameLayout;
using liveness_internal::SameSizes;
using liveness_internal::SegmentPlan;
using liveness_internal::SegmentSummary;
using liveness_internal::Transposed;
using liveness_internal::Where;
using liveness_internal::WhereText;

// FlashSplits are the CPU flash kernel's block sizes for a sequence of length t: the q
// block by thresholds on t (256, 64 or 32, at most t), the kv block 512 (at most t).
struct FlashSplits {
  int64_t q = 0;
  int64_t kv = 0;
};
FlashSplits FlashSplitsFor(int64_t t) {
  const int64_t q = t >= 768 ? 256 : (t >= 192 ? 64 : 32);
  return FlashSplits{std::min(q, t), std::min<int64_t>(512, t)};
}


// ParameterKey names a parameter's .grad: its segment instance and tensor (a tied
// weight's is its owner's, the prologue's).
using ParameterKey = std::pair<int64_t, int>;

// Grads are the engine's input buffers of one segment's backward, by tensor.
using Buffers = std::map<int, Handle>;

class Simulation {
 public:
  // The attention mode is in the graphs Run() gets.
  Simulation(const ModelConfig& config, const Variant& variant,
             const OptimizerSpec& optimizer, const StepOptions& options, StepTimeline* out)
      : config_(config), variant_(variant), optimizer_(optimizer),
        options_(options), out_(out), memory_(out, options.record_events, optimizer) {}

  absl::Status Run(const ModelPlans& plans);
  // The step's stretches, for ComposePeak.
  struct Segments {
    SegmentSummary prologue;               // model-level tensors, embeddings
    std::vector<SegmentSummary> forward;   // per layer: its forward and x = layer(x)
    SegmentSummary head_forward;           // the head and the forward's return
    SegmentSummary head_backward;          // the seed and the head's backward
    std::vector<SegmentSummary> backward;  // per layer
    SegmentSummary tail;                   // the embeddings' backward, the graph's end
    SegmentSummary optimizer;
    // optimizer_layer_bytes: what one layer adds, by category, to the optimizer step's
    // rise, where it is all alive at once: with master weights its fp32 .grad copies,
    // with foreach its share of the exp_avg_sq.sqrt() list. The rise grows by them per
    // layer.
    std::array<int64_t, kNumMemoryCategories> optimizer_layer_bytes{};
  };
  const Segments& segments() const { return segments_; }
  std::string Text(const Where& where) const { return WhereText(where, optimizer_); }
  // NamePeak fills StepPeak::op from the label current at the peak.
  void NamePeak() { out_->peak.op = memory_.PeakText(); }

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
      int input = -1;
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
    for (const OpDef& other : inst.plan->graph->ops) {
      if (other.composite == op.composite && FromCache(inst, other)) return true;
    }
    return false;
  }
  absl::Status ForwardWorkspace(const OpDef& op, const Instance& inst);
  absl::Status Backward(Instance& inst, Buffers& buffers, bool capture_parameters);
  absl::Status Node(Instance& inst, int op_index, Buffers& buffers, bool capture_parameters);
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
  void RopeTables(std::vector<int>* extras);
  void PositionIds(std::vector<int>* extras);
  // CallArguments: the model-level tensors a checkpointed layer holds to its backward,
  // the ones its graph reads (KeepReason::kCheckpointHeld).
  std::vector<int> CallArguments(const Instance& inst) const {
    std::vector<int> held;
    const BlockGraph& graph = *inst.plan->graph;
    for (const WalkedStorage& storage : inst.plan->walk.storage_list) {
      if (storage.is_global) held.push_back(globals_.at(graph.tensors[storage.owner].name));
    }
    return held;
  }
  void Route(Instance& inst, int tensor, Handle grad, Buffers& buffers,
             bool capture_parameters);
  void Accumulate(Buffers& buffers, int tensor, Handle grad);
  void AccumulateGrad(const ParameterKey& parameter, const Layout& layout, Handle grad);
  // OptimizerStep steps tensors of these element counts, with their gradients.
  absl::Status OptimizerStep(const std::vector<int64_t>& numels);
  absl::Status ReduceAndStep();
  // ZeRO-3 (RankStep): a unit (the prologue, a layer, the head: its segment) has its
  // parameters gathered into one buffer for its forward and its backward; after its
  // backward its .grads are flattened into a bucket and freed, the bucket all-reduced
  // in place, this rank's part added into the shard's gradient (made on first use), the
  // bucket freed and the unit released (runtime/distributed.cc, GatheredUnits).
  int64_t UnitBytes(int64_t segment) const;
  void GatherUnit(int64_t segment);
  void ReleaseUnit(int64_t segment);
  void ReduceScatterUnit(int64_t segment);
  // BackwardPassed: `unit`'s backward has run (its input's gradient is complete); the
  // unit before it (or none) is gathered next.
  void BackwardPassed(int64_t unit, std::optional<int64_t> previous);
  // InFlight is one micro-batch between its forward and its backward.
  struct InFlight {
    StageRange range;   // the model chunk
    int input_id = -1;  // the model input, where the chunk reads it
    Handle received;    // a later stage's received input (a leaf that requires grad)
    Instance prologue, head;
    std::vector<Instance> layers;  // the chunk's
    std::vector<int> checkpoint_inputs;
    // rng_states: each checkpointed layer's CPU RNG state, kept by its checkpoint.
    std::vector<int> rng_states;
    std::vector<int> extras;  // the layers' model-level tensors (position ids, RoPE tables)
    std::map<std::string, int> globals;  // as the forward left them
    Handle loss;        // the head's, kept until the step ends
    Handle output;      // a stage without the head: its output, until sent
    Handle input_grad;  // the received input's .grad, until sent
  };
  absl::Status PipelineSchedule(const ModelPlans& plans, const std::vector<PipelineStep>& steps,
                                const std::vector<int>& inputs);
  void ParameterOrder(const ModelPlans& plans);
  // IsLayerZeroParameter: stepped tensor p is a parameter of layer 0 of a single rank's model
  // (what one more layer of a composed model adds to the optimizer's step).
  bool IsLayerZeroParameter(size_t p) const {
    return p < parameter_order_.size() && parameter_order_[p].first == 0 &&
           options_.rank.parallel.dp <= 1;
  }
  absl::Status ForwardPass(const ModelPlans& plans, InFlight& f);
  absl::Status BackwardPass(const ModelPlans& plans, InFlight& f,
                            std::optional<Handle> output_grad);

  // kLayerInputKey is where a checkpoint node puts its layer input's gradient.
  static constexpr int kLayerInputKey = -1;

  ParameterKey KeyOf(const Instance& inst, int tensor) const {
    const TensorDef& def = inst.plan->graph->tensors[tensor];
    if (def.is_tied && prologue_graph_ != nullptr) {
      // The LM head's tied weight is the embedding's: one .grad.
      for (size_t t = 0; t < prologue_graph_->tensors.size(); ++t) {
        if (prologue_graph_->tensors[t].name == def.name) {
          return {Where::kPrologue, static_cast<int>(t)};
        }
      }
    }
    return {inst.segment, tensor};
  }

  Handle NewGrad(const Layout& layout, DType dtype) {
    Handle h;
    h.layout = ContiguousOf(layout);
    h.dtype = dtype;
    h.storage = memory_.Alloc(NumelOf(layout) * ElementSizeBytes(dtype),
                              MemoryCategory::kTemporary);
    return h;
  }
  // ScaledPowerGrad is grad * (c * x.pow(e)) as pow's and rsqrt's backward formulas run:
  // the power (a copy even for e = 1), the wrapped scalar c, their product, then the
  // gradient; the two temporaries die after it.
  Handle ScaledPowerGrad(const Layout& layout, DType dtype) {
    const int64_t bytes = NumelOf(layout) * ElementSizeBytes(dtype);
    const int power = memory_.Alloc(bytes, MemoryCategory::kTemporary);
    const Memory::Wrapped scalar = memory_.WrapScalar(dtype);
    const int scaled = memory_.Alloc(bytes, MemoryCategory::kTemporary);
    memory_.Drop(scalar);
    Handle grad = NewGrad(layout, dtype);
    memory_.Unref(power);
    memory_.Unref(scaled);
    return grad;
  }

  // NewGradLike is an elementwise backward's result: TensorIterator lays it out like its
  // gradient input when that is dense and of the same sizes (a transposed gradient gives
  // a transposed result), else contiguous.
  Handle NewGradLike(const Handle& like, const Layout& layout, DType dtype) {
    Handle h = NewGrad(layout, dtype);
    if (SameSizes(like.layout, layout) && NonOverlappingAndDense(like.layout)) {
      h.layout = like.layout;
    }
    return h;
  }
  Handle Alias(const Handle& h) {
    memory_.Ref(h.storage);
    return h;
  }
  Handle ViewOf(const Handle& h, const Layout& layout) {
    Handle view = Alias(h);
    view.layout = layout;
    view.is_view = true;
    return view;
  }
  // Reshape is ATen's reshape of a gradient: a view when the strides allow, else a copy.
  Handle Reshape(const Handle& h, const Layout& target) {
    Layout view;
    bool overflow = false;
    if (ViewStrides(h.layout, target.sizes.data(), target.ndim, &view, &overflow)) {
      return ViewOf(h, view);
    }
    return NewGrad(target, h.dtype);
  }

  const WalkedTensor& TensorOf(const Instance& inst, int tensor) const {
    return inst.plan->walk.tensor_layouts[tensor];
  }
  bool IsParameter(const Instance& inst, int tensor) const {
    return inst.plan->graph->tensors[tensor].is_parameter;
  }

  const ModelConfig& config_;
  const Variant& variant_;
  const OptimizerSpec& optimizer_;
  const StepOptions& options_;
  StepTimeline* out_;
  Memory memory_;
  // Parameters' .grad storages by name (a tied weight has one .grad).
  std::map<ParameterKey, int> grads_;
  // Model-level tensors (TensorDef::is_global) by name: Memory ids.
  std::map<std::string, int> globals_;
  // forward_holds_: what the forward's scope holds until it returns (its loss
  // included): autocast's casts of weights (leaves that require grad), which its cast
  // cache holds until the outermost autocast scope ends (the forward's, or a checkpointed
  // layer's recompute); and the keys and values of transformers' DynamicCache
  // (use_cache without checkpointing), which the model's output holds.
  // Each entry: the Memory id and the segment (layer index, or Where::kHead) that made it.
  std::vector<std::pair<int, int64_t>> forward_holds_;
  // ReleaseForwardHolds ends the scope; at the forward's end, what it frees is noted in
  // the layers' forward stretches (SegmentSummary::freed_at_forward_end).
  void ReleaseForwardHolds(bool forward_end) {
    for (const auto& [id, segment] : forward_holds_) {
      if (forward_end && segment >= 0 &&
          segment < static_cast<int64_t>(segments_.forward.size()) && memory_.refs(id) == 1) {
        segments_.forward[segment].freed_at_forward_end[static_cast<int>(
            memory_.category(id))] += memory_.bytes(id);
      }
      memory_.Unref(id);
    }
    forward_holds_.clear();
  }
  // decoder_returns_: run by Forward after the op where the decoder model's forward
  // returns (BlockGraph::decoder_returns_after) while the head's forward runs.
  std::function<void()> decoder_returns_;
  const BlockGraph* prologue_graph_ = nullptr;
  std::vector<StageRange> chunks_;  // the rank's model chunks (or the whole model)
  Handle hidden_;     // the layout of the hidden states between layers (and stages)
  int loss_total_ = -1;  // the first micro-batch's loss, which the others are added into
  Segments segments_;
  std::vector<ParameterKey> parameter_order_;
  // ZeRO-3's state: each unit's parameter bytes (prologue, layer, head), the gathered
  // units' buffers, the shard's gradient (-1 until made), the unit whose backward runs.
  bool zero3_ = false;
  std::array<int64_t, 3> unit_bytes_{};
  int64_t shard_elements_ = 0;
  std::map<int64_t, int> gathered_;
  int shard_grad_ = -1;
  std::optional<int64_t> pending_unit_;
};

int64_t Simulation::UnitBytes(int64_t segment) const {
  return unit_bytes_[segment == Where::kPrologue ? 0 : segment == Where::kHead ? 2 : 1];
}

void Simulation::GatherUnit(int64_t segment) {
  const int64_t bytes = UnitBytes(segment);
  if (!zero3_ || bytes == 0 || gathered_.count(segment) == 1) return;
  memory_.SetOp(Special(segment, Where::Activity::kParameterGather));
  gathered_[segment] = memory_.Alloc(bytes, MemoryCategory::kParameter);
}

void Simulation::ReleaseUnit(int64_t segment) {
  auto it = gathered_.find(segment);
  if (it == gathered_.end()) return;
  memory_.Unref(it->second);
  gathered_.erase(it);
}

void Simulation::ReduceScatterUnit(int64_t segment) {
  const int64_t bytes = UnitBytes(segment);
  if (!zero3_ || bytes == 0) return;
  memory_.SetOp(Special(segment, Where::Activity::kUnitReduction));
  const int bucket = memory_.Alloc(bytes, MemoryCategory::kTemporary);
  for (auto it = grads_.begin(); it != grads_.end();) {
    if (it->first.first != segment) {
      ++it;
      continue;
    }
    memory_.Unref(it->second);
    it = grads_.erase(it);
  }
  if (shard_grad_ < 0) {
    shard_grad_ = memory_.Alloc(shard_elements_ * ElementSizeBytes(config_.dtype),
                                MemoryCategory::kGradient);
  }
  memory_.Unref(bucket);
  ReleaseUnit(segment);
}

void Simulation::BackwardPassed(int64_t unit, std::optional<int64_t> previous) {
  if (!zero3_) return;
  ReduceScatterUnit(unit);
  pending_unit_ = previous;
  if (previous.has_value()) GatherUnit(*previous);
}

// ForwardWorkspace: what a forward kernel allocates and frees besides its outputs.
absl::Status Simulation::ForwardWorkspace(const OpDef& op, const Instance& inst) {
  const DType dtype = inst.plan->graph->tensors[op.outputs[0]].dtype;
  switch (op.type) {
    case OpType::kFlashAttention: {
      // cpu_flash_attention: per-thread fp32 blocks of q x kv scores, row max and sum,
      // and the q x d_head output accumulator; a reduced-precision copy of the scores
      // for bf16/fp16 (empty in fp32).
      const Layout& q = TensorOf(inst, op.inputs[0]).layout;  // (B, H, T, d_head)
      const int64_t t = q.sizes[2], head = q.sizes[3];
      const FlashSplits splits = FlashSplitsFor(t);
      const int64_t q_split = splits.q, kv_split = splits.kv;
      const int64_t threads = options_.cpu_threads;
      const int64_t per_thread = q_split * kv_split + 2 * q_split + q_split * head;
      const int buf = memory_.Alloc(threads * per_thread * 4, MemoryCategory::kTemporary);
      const int reduced = memory_.Alloc(
          dtype == DType::kFloat32 ? 0 : threads * q_split * kv_split * ElementSizeBytes(dtype),
          MemoryCategory::kTemporary);
      memory_.Unref(buf);
      memory_.Unref(reduced);
      return absl::OkStatus();
    }
    case OpType::kSafeSoftmax: {
      // After the softmax: which rows are all -inf (isneginf of the input, a bool per
      // element, then all over the last dim, a bool per row) and a 0-dim zero in the
      // output's dtype, freed before it returns.
      const Layout& x = TensorOf(inst, op.inputs[0]).layout;
      const int64_t numel = NumelOf(x);
      const int neg_inf = memory_.Alloc(numel, MemoryCategory::kTemporary);
      const int rows = memory_.Alloc(numel / x.sizes[x.ndim - 1], MemoryCategory::kTemporary);
      memory_.Transient(ElementSizeBytes(dtype));
      memory_.Unref(rows);
      memory_.Unref(neg_inf);
      return absl::OkStatus();
    }
    case OpType::kMeanDim: {
      // mean over a dim: sum, then div_ by the count, a wrapped scalar (8 B, then the
      // dtype's size).
      memory_.ScalarOp(dtype);
      return absl::OkStatus();
    }
    case OpType::kMean: {
      // mean of everything: sum (with more than one thread, through an 8-byte partial
      // result), then a division by the element count, a wrapped double scalar (8 B)
      // converted to the tensor's dtype.
      if (options_.cpu_threads > 1) memory_.Transient(8);
      memory_.ScalarOp(dtype);
      return absl::OkStatus();
    }
    case OpType::kGatherLinear: {
      // The input all-gathered into a (B, T, in) buffer, freed once the matmul is done.
      const WalkedTensor& x = TensorOf(inst, op.inputs[0]);
      memory_.Transient(NumelOf(x.layout) * config_.tp *
                        ElementSizeBytes(inst.plan->graph->tensors[op.inputs[0]].dtype));
      return absl::OkStatus();
    }
    case OpType::kVocabParallelCrossEntropy: {
      // In place on the logits (N, V / tp): their row max (N fp32) all-reduced and
      // subtracted, then the target logits and the rows' sums of exp (N fp32 each),
      // all-reduced, alive until the op returns (its outputs exist by then).
      const int64_t rows_bytes = TensorOf(inst, op.inputs[0]).layout.sizes[0] * 4;
      memory_.Transient(rows_bytes);
      const int target = memory_.Alloc(rows_bytes, MemoryCategory::kTemporary);
      const int sums = memory_.Alloc(rows_bytes, MemoryCategory::kTemporary);
      memory_.Unref(sums);
      memory_.Unref(target);
      return absl::OkStatus();
    }
    default:
      return absl::OkStatus();
  }
}

absl::Status Simulation::Forward(Instance& inst, const Handle* input, Pass pass,
                                 Handle* output) {
  const SegmentPlan& plan = *inst.plan;
  const BlockGraph& graph = *plan.graph;
  const std::vector<WalkedStorage>& storages = plan.walk.storage_list;
  // KeepsOf: how many of storage s's keeps this pass makes.
  auto keeps_of = [&](size_t s) {
    if (pass.keeps == Pass::Keeps::kNone) return 0;
    if (pass.keeps == Pass::Keeps::kUnpacked) return plan.unpacked_keeps[s];
    int n = 0;
    for (int keeper : storages[s].kept_by) n += keeper >= 0;
    return n;
  };
  inst.ids.assign(storages.size(), -1);
  // local: made here and still referenced by the forward's locals (the early stop's
  // unwinding frees them).
  std::vector<bool> local(storages.size(), false);
  for (size_t s = 0; s < storages.size(); ++s) {
    if (!storages[s].is_global) continue;
    // A model-level tensor (token ids, RoPE's tables): made once, held by the caller.
    const std::string& name = graph.tensors[storages[s].owner].name;
    auto global = globals_.find(name);
    if (global == globals_.end()) {
      return absl::InternalError(absl::StrCat("step simulation: no model-level ", name));
    }
    inst.ids[s] = global->second;
    for (int k = keeps_of(s); k > 0; --k) memory_.Keep(global->second);
  }
  if (input != nullptr && plan.input_storage >= 0) {
    inst.ids[plan.input_storage] = input->storage;
    for (int k = keeps_of(plan.input_storage); k > 0; --k) memory_.Keep(input->storage);
  }
  for (size_t i = 0; i < graph.ops.size(); ++i) {
    const OpDef& op = graph.ops[i];
    memory_.SetOp(At(inst, static_cast<int>(i), nullptr));
    const bool replayed = pass.replay && FromCache(inst, op);
    // The recompute stops at the pack that fills the last holder: before the kernel when
    // that is an input's, after it when an output's.
    const bool stop_here = pass.early_stop && static_cast<int>(i) == plan.last_pack_op;
    // An op with a Scalar operand wraps it first: an 8-byte double tensor, converted to
    // the op's dtype (4 B in fp32), freed after the op.
    std::vector<int> prelude;
    // mul.Tensor with a wrapped Python number: the wrapped number is its output 1, which
    // MulBackward0 keeps; its conversion dies in the op.
    int wrapped_number = -1;
    if ((op.type == OpType::kAddScalar || op.type == OpType::kMulScalar ||
         op.type == OpType::kMulWrapped) &&
        !replayed) {
      const Memory::Wrapped scalar = memory_.WrapScalar(graph.tensors[op.outputs[0]].dtype);
      if (op.type == OpType::kMulWrapped) {
        wrapped_number = scalar.wrapped;
        prelude = {scalar.converted};
      } else {
        prelude = {scalar.wrapped, scalar.converted};
      }
    }
    // An elementwise op on CPU computes in its inputs' common dtype: an input of another
    // dtype is copied to it first (TensorIterator's promote_inputs_to_common_dtype), and
    // the copy dies after the op. Autocast's bf16 matmul outputs meet fp32 tensors so.
    if ((op.type == OpType::kAdd || op.type == OpType::kMulTensor ||
         op.type == OpType::kKvCacheCat) &&
        !replayed) {
      const DType common = graph.tensors[op.outputs[0]].dtype;
      for (int in : op.inputs) {
        if (graph.tensors[in].dtype == common) continue;
        prelude.push_back(memory_.Alloc(NumelOf(TensorOf(inst, in).layout) *
                                            ElementSizeBytes(common),
                                        MemoryCategory::kTemporary));
      }
    }
    // The causal mask is ones(T, T).triu(1): the ones die after triu.
    if (op.type == OpType::kCausalMask) {
      const Layout& mask = TensorOf(inst, op.outputs[0]).layout;
      prelude.push_back(memory_.Alloc(NumelOf(mask), MemoryCategory::kTemporary));
    }
    // The math SDPA's mask: ones(L, S, bool), its tril (the ones die), then
    // where(tril, 0, -inf) with both numbers as 0-dim tensors of the mask's dtype; the
    // tril and the numbers die after the where.
    if (op.type == OpType::kSdpaCausalMask) {
      const Layout& mask = TensorOf(inst, op.outputs[0]).layout;
      const int64_t element = ElementSizeBytes(graph.tensors[op.outputs[0]].dtype);
      const int ones = memory_.Alloc(NumelOf(mask), MemoryCategory::kTemporary);
      prelude.push_back(memory_.Alloc(NumelOf(mask), MemoryCategory::kTemporary));
      memory_.Unref(ones);
      prelude.push_back(memory_.Alloc(element, MemoryCategory::kTemporary));
      prelude.push_back(memory_.Alloc(element, MemoryCategory::kTemporary));
    }
    std::vector<int> made;
    if (stop_here && !plan.last_pack_is_output) {
      for (int p : prelude) memory_.Unref(p);
      return StopRecompute(inst, local, output);
    }
    // CPU dropout makes its noise (output 1) first, scales it in place by a Python
    // number (wrapped, then gone), then the product.
    std::array<int, 3> order{};
    const int n_outputs = static_cast<int>(std::min(op.outputs.size(), order.size()));
    std::copy(op.outputs.begin(), op.outputs.begin() + n_outputs, order.begin());
    if (op.type == OpType::kDropout) std::swap(order[0], order[1]);
    for (int o = 0; o < n_outputs; ++o) {
      const int out = order[o];
      if (op.type == OpType::kDropout && o == 1 && !replayed) {
        memory_.ScalarOp(graph.tensors[out].dtype);  // noise.div_(1 - p)
      }
      const int s = TensorOf(inst, out).storage;
      if (s < 0 || storages[s].owner != out || storages[s].is_parameter) continue;
      int id;
      if (replayed) {
        // The op is skipped: its output is popped from the cache (_CachedTorchDispatchMode,
        // storage.pop(0)), the cache's reference now the output's.
        auto entry = inst.cached.find(s);
        id = entry->second;
        inst.cached.erase(entry);
        memory_.Ref(id);
        memory_.Release(id);
      } else if (wrapped_number >= 0 && out == op.outputs[1]) {
        id = wrapped_number;  // made before the op, by the Python binding
      } else {
        id = memory_.Alloc(storages[s].bytes, MemoryCategory::kTemporary);
        if (pass.record && FromCache(inst, op)) {
          memory_.Keep(id);
          inst.cached[s] = id;
        }
      }
      inst.ids[s] = id;
      made.push_back(s);
      local[s] = true;
      if (config_.amp != DType::kFloat32 && storages[s].is_weight_copy && !replayed &&
          !(pass.replay && CallIsReplayed(inst, op))) {
        memory_.Ref(id);
        forward_holds_.emplace_back(id, inst.segment);
      }
      if (op.type == OpType::kKvCacheCat && !replayed) {
        memory_.Ref(id);  // the DynamicCache's reference
        forward_holds_.emplace_back(id, inst.segment);
      }
      for (int k = keeps_of(s); k > 0; --k) memory_.Keep(id);
    }
    if (!replayed) {
      if (absl::Status s = ForwardWorkspace(op, inst); !s.ok()) return s;
    }
    for (auto it = prelude.rbegin(); it != prelude.rend(); ++it) memory_.Unref(*it);
    if (stop_here) return StopRecompute(inst, local, output);
    // Outputs nobody reads die inside the op (SDPA's logsumexp without grad, layer
    // norm's statistics); then, by Python's reference counting, every storage whose last
    // reader this op was (the caller holds the segment's input and output).
    for (int s : made) {
      if (plan.last_use[s] < 0 && s != plan.output_storage) {
        memory_.Unref(inst.ids[s]);
        local[s] = false;
      }
    }
    for (int s : plan.reads[i]) {
      if (plan.last_use[s] != static_cast<int>(i) || s == plan.input_storage ||
          s == plan.output_storage || storages[s].is_global) {
        continue;
      }
      memory_.Unref(inst.ids[s]);
      local[s] = false;
    }
    if (static_cast<int>(i) == graph.decoder_returns_after && decoder_returns_) {
      decoder_returns_();
      decoder_returns_ = nullptr;
    }
  }
  output->storage = inst.ids[plan.output_storage];
  output->layout = TensorOf(inst, graph.output).layout;
  output->dtype = graph.tensors[graph.output].dtype;
  return absl::OkStatus();
}

absl::Status Simulation::StopRecompute(Instance& inst, const std::vector<bool>& local,
                                       Handle* output) {
  const SegmentPlan& plan = *inst.plan;
  for (size_t s = 0; s < local.size(); ++s) {
    if (local[s]) memory_.Unref(inst.ids[s]);
  }
  for (size_t s = 0; s < local.size(); ++s) {
    const WalkedStorage& storage = plan.walk.storage_list[s];
    if (inst.ids[s] < 0 || storage.is_global || static_cast<int>(s) == plan.input_storage) {
      continue;
    }
    for (int k = plan.unpacked_keeps[s]; k > 0; --k) memory_.Release(inst.ids[s]);
  }
  *output = Handle();
  return absl::OkStatus();
}

void Simulation::Accumulate(Buffers& buffers, int tensor, Handle grad) {
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
                                Handle grad) {
  auto it = grads_.find(parameter);
  if (it != grads_.end()) {
    memory_.Unref(grad.storage);  // .grad += new, in place
    return;
  }
  // AccumulateGrad steals a gradient nobody else holds that has the parameter's layout;
  // otherwise it clones it.
  if (memory_.refs(grad.storage) == 1 && SameLayout(grad.layout, layout)) {
    memory_.MakeGradient(grad.storage);
    grads_.emplace(parameter, grad.storage);
    return;
  }
  const int clone =
      memory_.Alloc(NumelOf(layout) * ElementSizeBytes(grad.dtype), MemoryCategory::kGradient);
  memory_.Unref(grad.storage);
  grads_.emplace(parameter, clone);
}

void Simulation::Route(Instance& inst, int tensor, Handle grad, Buffers& buffers,
                       bool capture_parameters) {
  while (inst.plan->same_as[tensor] >= 0) tensor = inst.plan->same_as[tensor];
  const TensorDef& def = inst.plan->graph->tensors[tensor];
  if (def.is_parameter && !capture_parameters) {
    AccumulateGrad(KeyOf(inst, tensor), TensorOf(inst, tensor).layout, grad);
    return;
  }
  Accumulate(buffers, tensor, grad);
}

// Node runs op `op_index`'s backward node as Engine::evaluate_function does: the
// formula's outputs and workspaces, then validate_outputs (sum_to a broadcast input's
// shape), then the incoming gradients die, then the saved tensors are released, then
// each output goes to its input's buffer (or .grad).
absl::Status Simulation::Node(Instance& inst, int op_index, Buffers& buffers,
                              bool capture_parameters) {
  const SegmentPlan& plan = *inst.plan;
  const OpDef& op = plan.graph->ops[op_index];
  const OpSemantics& semantics =
      (options_.rules != nullptr ? *options_.rules : RuleTable::Pinned()).Of(op.type);
  if (!TensorOf(inst, op.outputs[0]).requires_grad) return absl::OkStatus();  // no node
  if (plan.same_as[op.outputs[0]] >= 0) return absl::OkStatus();  // returned its input
  if (op.type == OpType::kSlice && op.attributes.split_part) {
    return SplitBackward(inst, op_index, buffers, capture_parameters);
  }
  auto found = buffers.find(op.outputs[0]);
  if (found == buffers.end()) return absl::OkStatus();  // no gradient reached it
  const Handle grad = found->second;
  buffers.erase(found);
  const char* node = semantics.backward_nodes.empty()
                         ? "?"
                         : std::string_view(semantics.backward_nodes[0]).data();
  memory_.SetOp(At(inst, op_index, node));
  // Under a non-reentrant checkpoint the first node to unpack a saved tensor runs the
  // recompute (checkpoint.py, _checkpoint_hook's unpack_hook).
  if (inst.frame.has_value() && !inst.frame->recomputed && plan.packs[op_index]) {
    if (absl::Status s = Recompute(inst); !s.ok()) return s;
    memory_.SetOp(At(inst, op_index, node));
  }

  auto needs = [&](int input) { return TensorOf(inst, op.inputs[input]).requires_grad; };
  auto layout_of = [&](int input) -> const Layout& {
    return TensorOf(inst, op.inputs[input]).layout;
  };
  auto dtype_of = [&](int input) { return plan.graph->tensors[op.inputs[input]].dtype; };
  // One gradient per input (an op has at most three).
  std::array<Handle, 3> grad_slots;
  const size_t n_inputs = std::min(op.inputs.size(), grad_slots.size());
  Handle* const grads = grad_slots.data();

  switch (op.type) {
    case OpType::kView:
    case OpType::kUnsafeView:
    case OpType::kReshape:
      // grad.reshape(self.sizes()) (a reshape that copied in the forward has a
      // CloneBackward0 + UnsafeViewBackward0 pair that ends the same way).
      grads[0] = Reshape(grad, layout_of(0));
      break;
    case OpType::kPermute: {
      std::vector<int> inverse(op.attributes.permutation.size());
      for (size_t i = 0; i < inverse.size(); ++i) inverse[op.attributes.permutation[i]] = i;
      grads[0] = ViewOf(grad, Permuted(grad.layout, inverse));
      break;
    }
    case OpType::kTranspose:
      grads[0] = ViewOf(grad, Transposed(grad.layout, op.attributes.dim, op.attributes.dim1));
      break;
    case OpType::kT:
      grads[0] = ViewOf(grad, Transposed(grad.layout, 0, 1));
      break;
    case OpType::kSelect:
      // select_backward: zeros of the input's sizes, the gradient copied into a slice.
      grads[0] = NewGrad(layout_of(0), grad.dtype);
      break;
    case OpType::kAdd:
      // grad to both inputs (the same tensor); validate_outputs reduces a broadcast one.
      if (needs(0)) grads[0] = Alias(grad);
      if (needs(1)) grads[1] = Alias(grad);
      break;
    case OpType::kAddmm: {
      // (bias, mat1, mat2): mm_mat1_backward = grad.mm(mat2^T) (contiguous);
      // mm_mat2_backward = mat1^T.mm(grad), laid out like mat2 when mat2 is a
      // transposed contiguous weight; bias: grad itself, summed by validate_outputs.
      if (needs(1)) grads[1] = NewGrad(layout_of(1), grad.dtype);
      if (needs(2)) {
        grads[2] = NewGrad(layout_of(2), grad.dtype);
        if (!layout_of(2).IsContiguous()) grads[2].layout = layout_of(2);
      }
      if (needs(0)) grads[0] = Alias(grad);
      break;
    }
    case OpType::kMm:
      // MmBackward0 computes mat2's gradient (the weight's, laid out like it) first.
      if (needs(1)) {
        grads[1] = NewGrad(layout_of(1), grad.dtype);
        if (!layout_of(1).IsContiguous()) grads[1].layout = layout_of(1);
      }
      if (needs(0)) grads[0] = NewGrad(layout_of(0), grad.dtype);
      break;
    case OpType::kMulTensor: {
      // mul_tensor_backward: self's grad * other, then other's grad * self, each in the
      // broadcast shape; validate_outputs reduces a broadcast input's.
      // Each product is in grad's and the other factor's common dtype; a factor of
      // another dtype is copied to it first (TensorIterator's input promotion).
      auto product = [&](int factor) {
        const DType common = PromoteTypes(grad.dtype, dtype_of(factor));
        std::optional<int> promoted;
        if (dtype_of(factor) != common) {
          promoted = memory_.Alloc(NumelOf(layout_of(factor)) * ElementSizeBytes(common),
                                   MemoryCategory::kTemporary);
        }
        Handle h = NewGradLike(grad, grad.layout, common);
        if (promoted) memory_.Unref(*promoted);
        return h;
      };
      if (needs(0)) grads[0] = product(1);
      if (needs(1)) grads[1] = product(0);
      break;
    }
    case OpType::kAddScalar:
    case OpType::kContiguous:
    case OpType::kKvCacheCat:
      // grad itself (clone's backward too; cat's narrow of it all, which validate_outputs
      // casts to a promoted input's dtype)
      grads[0] = Alias(grad);
      break;
    case OpType::kToDtype:
      // .to() of the same dtype is the tensor itself; else the gradient is cast back.
      grads[0] = dtype_of(0) == grad.dtype ? Alias(grad) : NewGrad(layout_of(0), dtype_of(0));
      break;
    case OpType::kPow:    // pow_backward(grad, self, 2) = grad * (2 * self.pow(1))
    case OpType::kRsqrt:  // -0.5 * grad * result.pow(3)
      grads[0] = ScaledPowerGrad(layout_of(0), grad.dtype);
      break;
    case OpType::kMean:
    case OpType::kMeanDim: {
      // grad.expand(self's sizes) / count, the wrapped count (8 B, then the dtype's).
      const Memory::Wrapped scalar = memory_.WrapScalar(grad.dtype);
      grads[0] = NewGrad(layout_of(0), grad.dtype);
      memory_.Drop(scalar);
      break;
    }
    case OpType::kGelu:
    case OpType::kSilu:
    case OpType::kNeg:
    case OpType::kLogSoftmax:
    case OpType::kTanh:  // tanh_backward(grad, result)
      grads[0] = NewGradLike(grad, layout_of(0), grad.dtype);
      break;
    case OpType::kMulWrapped: {
      // grad * other: the kept wrapped number, converted to grad's dtype for the op.
      const int converted =
          memory_.Alloc(ElementSizeBytes(grad.dtype), MemoryCategory::kTemporary);
      grads[0] = NewGradLike(grad, layout_of(0), grad.dtype);
      memory_.Unref(converted);
      break;
    }
    case OpType::kSlice:
      // slice_backward: zeros of the input's sizes, the gradient copied into a slice.
      grads[0] = NewGrad(layout_of(0), grad.dtype);
      break;
    case OpType::kCat: {
      // cat_tensors_backward: each input's gradient is a narrow view of grad.
      const int dim = layout_of(0).ndim - 1;
      for (int i = 0; i < 2; ++i) {
        Layout part = grad.layout;
        part.sizes[dim] = layout_of(i).sizes[dim];
        if (needs(i)) grads[i] = ViewOf(grad, part);
      }
      break;
    }
    case OpType::kUnsqueeze: {
      Layout squeezed;
      squeezed.ndim = grad.layout.ndim - 1;
      for (int i = 0, j = 0; i < grad.layout.ndim; ++i) {
        if (i == op.attributes.dim) continue;
        squeezed.sizes[j] = grad.layout.sizes[i];
        squeezed.strides[j++] = grad.layout.strides[i];
      }
      grads[0] = ViewOf(grad, squeezed);
      break;
    }
    case OpType::kExpand:
      // at::sum_to(grad, self.sizes()): a reduction when a dimension was broadcast.
      grads[0] = SameSizes(grad.layout, layout_of(0)) ? Alias(grad)
                                                       : NewGrad(layout_of(0), grad.dtype);
      break;
    case OpType::kBmm:
      // BmmBackward0: mat2's gradient self^T.bmm(grad) first, then self's.
      if (needs(1)) grads[1] = NewGrad(layout_of(1), grad.dtype);
      if (needs(0)) grads[0] = NewGrad(layout_of(0), grad.dtype);
      break;
    case OpType::kMulScalar: {
      // grad * scalar: the wrapped scalar (8 B, then the dtype's) around the product.
      const Memory::Wrapped scalar = memory_.WrapScalar(grad.dtype);
      grads[0] = NewGradLike(grad, layout_of(0), grad.dtype);
      memory_.Drop(scalar);
      break;
    }
    case OpType::kMaskedFill:
    case OpType::kSoftmax:
      grads[0] = NewGradLike(grad, layout_of(0), grad.dtype);
      break;
    case OpType::kFusedCausalSoftmax:
      // In place on the incoming gradient (Megatron's fused kernel).
      grads[0] = Alias(grad);
      break;
    case OpType::kNativeDropout:
      // native_dropout_backward: grad * mask * scale, one new tensor (runtime/dropout.h).
    case OpType::kDropout:
      // MulBackward0: grad * noise, one new tensor.
    case OpType::kSafeSoftmax:
      // _softmax_backward_data(grad, result, dim), as softmax's.
      grads[0] = NewGradLike(grad, layout_of(0), grad.dtype);
      break;
    case OpType::kNllLoss:
      // nll_loss_backward: zeros of the log-probabilities' sizes, scattered.
      grads[0] = NewGrad(layout_of(0), grad.dtype);
      break;
    case OpType::kEmbedding:
      // embedding_dense_backward: the whole weight's gradient.
      grads[0] = NewGrad(layout_of(0), dtype_of(0));
      break;
    case OpType::kScatter:
    case OpType::kReduceScatter:
      // The gradient all-gathered along the sequence: a new (B, T, ...) buffer.
      grads[0] = NewGrad(layout_of(0), grad.dtype);
      break;
    case OpType::kGatherLinear: {
      // Megatron's order: the input gathered again, the incoming gradient as rows
      // (B x T, out), the input's whole gradient (B x T, in), all-reduced in place and
      // this rank's tokens copied out; the weight's gradient (its own layout) and the
      // bias's; then the gathered input, the rows and the whole gradient die.
      const int64_t in = layout_of(0).sizes[layout_of(0).ndim - 1];
      const int64_t tokens = NumelOf(grad.layout) / grad.layout.sizes[grad.layout.ndim - 1];
      const int gathered = memory_.Alloc(
          NumelOf(layout_of(0)) * config_.tp * ElementSizeBytes(dtype_of(0)),
          MemoryCategory::kTemporary);
      bool overflow = false;
      const int64_t rows_sizes[] = {tokens, grad.layout.sizes[grad.layout.ndim - 1]};
      const Handle rows = Reshape(grad, Layout::Contiguous(rows_sizes, 2, &overflow));
      const int whole = memory_.Alloc(tokens * in * ElementSizeBytes(grad.dtype),
                                      MemoryCategory::kTemporary);
      for (size_t i = 0; i < n_inputs; ++i) {
        grads[i] = NewGrad(layout_of(static_cast<int>(i)), grad.dtype);
      }
      memory_.Unref(gathered);
      memory_.Unref(rows.storage);
      memory_.Unref(whole);
      // A gradient whose input needs none is computed all the same and dropped.
      for (size_t i = 0; i < n_inputs; ++i) {
        if (!needs(static_cast<int>(i))) {
          memory_.Unref(grads[i].storage);
          grads[i] = Handle();
        }
      }
      break;
    }
    case OpType::kVocabParallelEmbedding: {
      // Other ranks' tokens' rows zeroed in a copy of the gradient, then
      // embedding_dense_backward: the weight rows' gradient; the copy dies with the node.
      const int masked =
          memory_.Alloc(NumelOf(grad.layout) * ElementSizeBytes(grad.dtype), MemoryCategory::kTemporary);
      grads[0] = NewGrad(layout_of(0), dtype_of(0));
      memory_.Unref(masked);
      break;
    }
    case OpType::kVocabParallelCrossEntropy: {
      // In place: the kept softmax becomes the logits' gradient.
      grads[0].storage = inst.ids[TensorOf(inst, op.inputs[0]).storage];
      grads[0].layout = layout_of(0);
      grads[0].dtype = dtype_of(0);
      memory_.Ref(grads[0].storage);
      break;
    }
    case OpType::kNativeLayerNorm: {
      // native_layer_norm_backward: dX, dgamma, dbeta, then the CPU kernel's
      // per-thread fp32 partial sums of dgamma and dbeta (a (threads, 2N) buffer).
      if (needs(0)) grads[0] = NewGrad(layout_of(0), grad.dtype);
      if (needs(1)) grads[1] = NewGrad(layout_of(1), dtype_of(1));
      if (needs(2)) grads[2] = NewGrad(layout_of(2), dtype_of(2));
      // Its (2, threads, N) zero-filled buffer in X's dtype, only for dgamma or dbeta.
      const int64_t n = NumelOf(layout_of(1));
      if (needs(1) || needs(2)) {
        memory_.Transient(options_.cpu_threads * 2 * n * ElementSizeBytes(dtype_of(0)));
      }
      break;
    }
    case OpType::kFlashAttention: {
      // _scaled_dot_product_flash_attention_for_cpu_backward: grad_q, grad_k, grad_v,
      // then per-thread fp32 blocks of scores and their gradients (and a
      // reduced-precision copy), and each thread's row sums in the parallel loop.
      // grad_q/k/v are zeros in (B, T, H, d_head) memory, returned as (B, H, T, d_head)
      // views; the kernel reads grad_out.transpose(1, 2).contiguous() (a copy unless
      // grad_out already has that memory order).
      const Layout& q = layout_of(0);
      for (int i = 0; i < 3; ++i) {
        grads[i] = NewGrad(Transposed(layout_of(i), 1, 2), dtype_of(i));
        grads[i].layout = Transposed(grads[i].layout, 1, 2);
      }
      std::optional<int> grad_out_copy;
      if (!Transposed(grad.layout, 1, 2).IsContiguous()) {
        grad_out_copy = memory_.Alloc(NumelOf(grad.layout) * ElementSizeBytes(grad.dtype),
                                      MemoryCategory::kTemporary);
      }
      const int64_t t = q.sizes[2];
      const FlashSplits splits = FlashSplitsFor(t);
      const int64_t q_split = splits.q, kv_split = splits.kv;
      const int64_t threads = options_.cpu_threads;
      const DType dtype = dtype_of(0);
      const int buf = memory_.Alloc(threads * 2 * q_split * kv_split * 4,
                                    MemoryCategory::kTemporary);
      const int reduced = memory_.Alloc(
          dtype == DType::kFloat32 ? 0 : threads * 2 * q_split * kv_split * ElementSizeBytes(dtype),
          MemoryCategory::kTemporary);
      // parallel_for over B * H rows in one chunk per thread; each chunk allocates its
      // fp32 row sums (q_split).
      std::vector<int> rows;
      const int64_t chunks = std::min<int64_t>(threads, q.sizes[0] * q.sizes[1]);
      for (int64_t i = 0; i < chunks; ++i) {
        rows.push_back(memory_.Alloc(q_split * 4, MemoryCategory::kTemporary));
      }
      for (int row : rows) memory_.Unref(row);
      memory_.Unref(buf);
      memory_.Unref(reduced);
      if (grad_out_copy) memory_.Unref(*grad_out_copy);
      break;
    }
    default:
      return Unimplemented(absl::StrCat("the backward of ", OpTypeName(op.type)));
  }

  // An unpacked tensor is the formula's local: with the frame's holder emptied on
  // unpack (holder.handles[gid] = None), it dies as the node's apply() returns.
  if (inst.frame.has_value()) {
    for (int s : plan.packed_releases[op_index]) {
      if (inst.ids[s] >= 0) memory_.Release(inst.ids[s]);
    }
  }
  // validate_outputs: a gradient whose shape differs from its input's (a broadcast
  // bias) is reduced with sum_to; one whose dtype differs (autocast's bf16 matmul output
  // met an fp32 tensor) is cast to the input's.
  for (size_t i = 0; i < n_inputs; ++i) {
    if (!grads[i].defined()) continue;
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
    for (int s : plan.unpacked_releases[op_index]) {
      if (inst.frame->forward_ids[s] >= 0) memory_.Release(inst.frame->forward_ids[s]);
    }
    if (op_index == plan.first_pack_op) FrameDies(inst);
  } else {
    for (int s : plan.releases[op_index]) {
      if (inst.ids[s] >= 0) memory_.Release(inst.ids[s]);
    }
  }
  for (size_t i = 0; i < n_inputs; ++i) {
    if (grads[i].defined()) Route(inst, op.inputs[i], grads[i], buffers, capture_parameters);
  }
  return absl::OkStatus();
}

// SplitBackward is split()'s one node for all its parts. It runs once every part's
// gradient has arrived: at the first part, the last one the backward reaches (the
// others' gradients wait in their buffers). split_backward concatenates them, zeros for
// a part without one, into the input's gradient; then the parts' gradients die.
absl::Status Simulation::SplitBackward(Instance& inst, int op_index, Buffers& buffers,
                                       bool capture_parameters) {
  const BlockGraph& graph = *inst.plan->graph;
  const OpDef& op = graph.ops[op_index];
  std::vector<const OpDef*> parts;  // in forward order
  for (const OpDef& other : graph.ops) {
    if (other.type == OpType::kSlice && other.attributes.split_part &&
        other.inputs[0] == op.inputs[0]) {
      parts.push_back(&other);
    }
  }
  if (parts.front() != &op) return absl::OkStatus();
  std::vector<Handle> incoming;
  std::vector<const OpDef*> missing;  // parts no gradient reached
  for (const OpDef* part : parts) {
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
  const BlockGraph& graph = *inst.plan->graph;
  for (int op = static_cast<int>(graph.ops.size()) - 1; op >= 0; --op) {
    if (absl::Status s = Node(inst, op, buffers, capture_parameters); !s.ok()) return s;
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
  // get_saved_variables() and x.detach(): two more references to the input.
  Handle x;
  x.storage = saved_input;
  x.layout = TensorOf(inst, graph.input).layout;
  x.dtype = graph.tensors[graph.input].dtype;
  memory_.Ref(saved_input);
  memory_.Ref(saved_input);
  Handle y;
  inst.recompute = true;
  Pass pass;
  pass.replay = !variant_.PolicyAt(inst.segment).empty();
  // torch.random.fork_rng keeps the current RNG state while the recompute runs on the
  // forward's (checkpoint.py:303-308).
  const int forked = memory_.Alloc(kCpuRngStateBytes, MemoryCategory::kTemporary);
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
  memory_.Release(saved_input);
  // CheckpointFunction keeps its RNG state and run_function (the call's bound
  // arguments) on its ctx, which lives as long as the graph: until the loss dies, after
  // the step (checkpoint.py:241-252).
  auto input_grad = inner.find(graph.input);
  if (input_grad != inner.end()) {
    Accumulate(outer, kLayerInputKey, input_grad->second);
    inner.erase(input_grad);
  }
  for (auto& [tensor, grad] : inner) {
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
  const int forked = memory_.Alloc(kCpuRngStateBytes, MemoryCategory::kTemporary);
  // The layer input, unpacked from _NoopSaveInputs (ctx.get_args(ctx.saved_tensors)).
  Handle x;
  x.storage = frame.input;
  x.layout = TensorOf(inst, graph.input).layout;
  x.dtype = graph.tensors[graph.input].dtype;
  Pass pass;
  pass.replay = !variant_.PolicyAt(inst.segment).empty();
  pass.early_stop = true;
  Handle y;
  inst.recompute = true;
  absl::Status status = Forward(inst, &x, pass, &y);
  inst.recompute = false;
  if (!status.ok()) return status;
  if (y.defined()) memory_.Unref(y.storage);  // no early stop: the output is dropped
  ReleaseForwardHolds(/*forward_end=*/false);  // the recompute's autocast scope ends
  memory_.SetOp(Special(inst.segment, Where::Activity::kCheckpointNode));
  memory_.Unref(forked);
  return absl::OkStatus();
}

void Simulation::FrameDies(Instance& inst) {
  Instance::Frame& frame = *inst.frame;
  frame.alive = false;
  memory_.Release(frame.input);
  for (int held : frame.held) memory_.Release(held);
  memory_.Unref(frame.rng_state);
  // The selective cache's entries the recompute never reached (those after the early
  // stop) die with recompute_fn's context.
  for (const auto& [storage, id] : inst.cached) memory_.Release(id);
  inst.cached.clear();
}

// Modelled says whether Node has the backward of `type`.
bool Modelled(OpType type) {
  switch (type) {
    case OpType::kAdd:
    case OpType::kAddmm:
    case OpType::kFlashAttention:
    case OpType::kGelu:
    case OpType::kMean:
    case OpType::kMm:
    case OpType::kMulTensor:
    case OpType::kAddScalar:
    case OpType::kContiguous:
    case OpType::kToDtype:
    case OpType::kRsqrt:
    case OpType::kMeanDim:
    case OpType::kSilu:
    case OpType::kNeg:
    case OpType::kLogSoftmax:
    case OpType::kSlice:
    case OpType::kCat:
    case OpType::kUnsqueeze:
    case OpType::kExpand:
    case OpType::kNllLoss:
    case OpType::kEmbedding:
    case OpType::kConstantPad:
    case OpType::kBmm:
    case OpType::kMulScalar:
    case OpType::kMaskedFill:
    case OpType::kSoftmax:
    case OpType::kCausalMask:
    case OpType::kNativeLayerNorm:
    case OpType::kPermute:
    case OpType::kPow:
    case OpType::kReshape:
    case OpType::kSelect:
    case OpType::kT:
    case OpType::kTranspose:
    case OpType::kUnsafeView:
    case OpType::kView:
    case OpType::kVocabParallelEmbedding:
    case OpType::kVocabParallelCrossEntropy:
    case OpType::kGatherLinear:
    case OpType::kReduceScatter:
    case OpType::kScatter:
    case OpType::kNativeDropout:
    case OpType::kFusedCausalSoftmax:
    case OpType::kTanh:
    case OpType::kMulWrapped:
    case OpType::kDropout:
    case OpType::kAddInplace:
    case OpType::kSdpaCausalMask:
    case OpType::kSafeSoftmax:
    case OpType::kKvCacheCat:
      return true;
    default:
      return false;
  }
}

absl::Status Simulation::Run(const ModelPlans& plans) {
  const ModelGraphs& graphs = *plans.graphs;
  const bool families = graphs.prologue.has_value();
  if (families) prologue_graph_ = &*graphs.prologue;
  const RankStep& rank = options_.rank;
  const ParallelSpec& parallel = rank.parallel;
  chunks_ = parallel.pp > 1 ? rank.chunks : std::vector<StageRange>{WholeModel(config_)};
  zero3_ = parallel.zero >= 3 && parallel.dp > 1;
  if (zero3_) {
    // Each unit's parameter bytes (a tied weight is its owner's), and the rank's shard
    // of its stage's parameters.
    auto parameter_bytes = [&](const BlockGraph& graph) {
      return (ParameterCount(graph, config_) * ElementSizeBytes(config_.dtype)).value();
    };
    unit_bytes_ = {families ? parameter_bytes(*graphs.prologue) : 0, parameter_bytes(graphs.layer),
                   parameter_bytes(graphs.epilogue)};
    int64_t stage_bytes = 0;
    for (const StageRange& chunk : chunks_) {
      stage_bytes += (chunk.prologue ? unit_bytes_[0] : 0) + chunk.layers * unit_bytes_[1] +
                     (chunk.head ? unit_bytes_[2] : 0);
    }
    shard_elements_ = ZeroShardElements(stage_bytes / ElementSizeBytes(config_.dtype), parallel.dp);
  }

  // The model input (the study's hidden states, the families' token ids): resident, held
  // by the caller for the whole step; one per micro-batch, on a stage that reads it (the
  // embedding's, and the families' head, whose labels are the ids shifted).
  const SegmentPlan& input_plan = families ? *plans.prologue : *plans.first;
  int input_storage = input_plan.input_storage;
  for (size_t s = 0; families && s < plans.prologue->walk.storage_list.size(); ++s) {
    const WalkedStorage& storage = plans.prologue->walk.storage_list[s];
    if (storage.is_global && graphs.prologue->tensors[storage.owner].name == "input_ids") {
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
  out_->resident[static_cast<int>(MemoryCategory::kInput)] = input_bytes * micro_batches;
  memory_.Begin();
  // Under 1F1B only the first `simulated` micro-batches are replayed: the warm-up
  // forwards, the first steady iteration (whose backward makes the .grads) and a second
  // one, which every later iteration repeats byte for byte (a forward and a backward;
  // the .grads added to in place; each loss added into the first and freed), so that
  // the step's peak is theirs, the cool-down's or the reduction's, none of which depends
  // on how many iterations came between (the inputs are resident from the start). The
  // interleaved schedule's steady state cycles through the chunks: it is replayed whole.
  const bool interleaved = parallel.pp > 1 && parallel.schedule == PipelineSchedule::kInterleaved;
  const int64_t warmup =
      parallel.pp > 1 ? std::min(parallel.pp - rank.stage - 1, micro_batches) : 0;
  const int64_t simulated = interleaved ? micro_batches : std::min(micro_batches, warmup + 2);
  std::vector<int> inputs;
  for (int64_t j = 0; j < micro_batches; ++j) {
    const int id = reads_input ? memory_.Adopt(input_bytes, MemoryCategory::kInput) : -1;
    if (j < simulated) inputs.push_back(id);
  }
  // The hidden states a stage receives or sends: the layers' input.
  const BlockGraph& layer = graphs.layer;
  hidden_.layout = plans.rest->walk.tensor_layouts[layer.input].layout;
  hidden_.dtype = layer.tensors[layer.input].dtype;

  if (parallel.pp > 1) {
    ParallelSpec replayed = parallel;
    replayed.micro_batches = simulated;
    if (absl::Status s = PipelineSchedule(plans, PipelineSteps(replayed, rank.stage), inputs);
        !s.ok()) {
      return s;
    }
  } else {
    // Gradient accumulation: each micro-batch's forward and backward.
    for (int input_id : inputs) {
      InFlight f;
      f.range = chunks_.front();
      f.input_id = input_id;
      if (absl::Status s = ForwardPass(plans, f); !s.ok()) return s;
      if (absl::Status s = BackwardPass(plans, f, std::nullopt); !s.ok()) return s;
    }
  }
  ParameterOrder(plans);

  memory_.SetPhase(StepPhase::kOptimizer);
  memory_.BeginSegment();
  absl::Status status = ReduceAndStep();
  segments_.optimizer = memory_.EndSegment();
  if (status.ok() && memory_.overflowed()) {
    return absl::OutOfRangeError(absl::StrCat(
        "the step's live bytes overflow int64 for layers=", config_.layers,
        " width=", config_.width, " batch=", config_.batch, " seq=", config_.seq));
  }
  return status;
}

// PipelineSchedule executes a pipeline rank's steps (estimator/pipeline_steps.h): each
// chunk's forwards and backwards in order, and the point-to-point operations between
// them: receives allocate their buffers (input, then output gradient); then what was
// sent is freed (the last forward's output; the last backward's input gradient and the
// received input it belongs to).
absl::Status Simulation::PipelineSchedule(const ModelPlans& plans,
                                          const std::vector<PipelineStep>& steps,
                                          const std::vector<int>& inputs) {
  const size_t chunks = chunks_.size();
  std::vector<std::deque<Handle>> received(chunks), output_grads(chunks);
  std::vector<std::deque<InFlight>> in_flight(chunks);
  std::vector<size_t> forwards(chunks, 0);
  Handle last_output, last_input_grad, last_received;
  auto receive = [&]() {
    Handle h = hidden_;
    h.storage = memory_.Alloc(NumelOf(h.layout) * ElementSizeBytes(h.dtype),
                              MemoryCategory::kTemporary);
    return h;
  };
  auto free = [&](Handle& h) {
    if (h.defined()) memory_.Unref(h.storage);
    h = Handle();
  };
  memory_.SetPhase(StepPhase::kForward);
  for (const PipelineStep& step : steps) {
    switch (step.kind) {
      case PipelineStep::Kind::kForward: {
        InFlight f;
        f.range = chunks_[step.chunk];
        const size_t j = forwards[step.chunk]++;
        if (j >= inputs.size()) return absl::InternalError("a pipeline step past the micro-batches");
        f.input_id = inputs[j];
        if (!f.range.prologue) {
          if (received[step.chunk].empty()) {
            return absl::InternalError("a pipeline forward without its received input");
          }
          f.received = received[step.chunk].front();
          received[step.chunk].pop_front();
        }
        if (absl::Status s = ForwardPass(plans, f); !s.ok()) return s;
        last_output = f.output;
        f.output = Handle();
        in_flight[step.chunk].push_back(std::move(f));
        break;
      }
      case PipelineStep::Kind::kBackward: {
        if (in_flight[step.chunk].empty()) {
          return absl::InternalError("a pipeline backward before its forward");
        }
        InFlight& f = in_flight[step.chunk].front();
        std::optional<Handle> output_grad;
        if (!f.range.head) {
          if (output_grads[step.chunk].empty()) {
            return absl::InternalError("a pipeline backward without its output's gradient");
          }
          output_grad = output_grads[step.chunk].front();
          output_grads[step.chunk].pop_front();
        }
        if (absl::Status s = BackwardPass(plans, f, output_grad); !s.ok()) return s;
        last_input_grad = f.input_grad;
        last_received = f.received;
        in_flight[step.chunk].pop_front();
        break;
      }
      case PipelineStep::Kind::kCommunicate:
        memory_.SetOp(Special(Where::kHead, Where::Activity::kPointToPoint));
        if (step.receive_input >= 0) received[step.receive_input].push_back(receive());
        if (step.receive_output_grad >= 0) {
          output_grads[step.receive_output_grad].push_back(receive());
        }
        if (step.send_output) free(last_output);
        if (step.send_input_grad) {
          free(last_input_grad);
          free(last_received);
        }
        break;
    }
  }
  return absl::OkStatus();
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
    Instance inst;
    inst.plan = plan;
    inst.segment = segment;
    const BlockGraph& graph = *plan->graph;
    for (int t : graph.Parameters()) {
      if (!graph.tensors[t].is_tied || !has_embedding) parameter_order_.push_back(KeyOf(inst, t));
    }
  };
  for (const StageRange& chunk : chunks_) {
    if (chunk.prologue && families) visit(plans.prologue.get(), Where::kPrologue);
    for (int64_t i = chunk.first_layer; i < chunk.first_layer + chunk.layers; ++i) {
      visit(i == 0 ? plans.first.get() : plans.rest.get(), i);
    }
    if (chunk.head) visit(plans.head.get(), Where::kHead);
  }
}

// ForwardPass runs the stage's forward for one micro-batch: from its input (the
// embedding's) or its received hidden states, through its layers, to the loss (the
// head's) or its output; what the backward needs stays in `f`.
absl::Status Simulation::ForwardPass(const ModelPlans& plans, InFlight& f) {
  const ModelGraphs& graphs = *plans.graphs;
  const bool families = graphs.prologue.has_value();
  const SegmentPlan* const first = plans.first.get();
  const SegmentPlan* const rest = plans.rest.get();
  const BlockGraph& layer = graphs.layer;
  const int input_id = f.input_id;
  Handle x;
  if (families && input_id >= 0) globals_["input_ids"] = input_id;
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
  if (f.range.prologue && families) {
    GatherUnit(Where::kPrologue);
    f.prologue.plan = plans.prologue.get();
    f.prologue.segment = Where::kPrologue;
    // GPT-2's position ids (which its embedding reads) are made before the prologue.
    if (config_.family == Family::kGpt2) PositionIds(&extras);
    if (absl::Status s = Forward(f.prologue, nullptr, Graph(), &x); !s.ok()) return s;
    if (config_.family == Family::kLlama) {
      PositionIds(&extras);
      RopeTables(&extras);
    }
    // A tied embedding's unit stays gathered: the head reads its weight, and its
    // gradient is complete after the prologue's backward.
    if (!config_.tie_embeddings) ReleaseUnit(Where::kPrologue);
  } else if (families) {
    // A later stage makes its own (ModelImpl::Extras).
    PositionIds(&extras);
    if (config_.family == Family::kLlama) RopeTables(&extras);
  }
  segments_.prologue = memory_.EndSegment();

  const int64_t end = f.range.first_layer + f.range.layers;
  f.layers.assign(f.range.layers, Instance());
  f.checkpoint_inputs.assign(f.range.layers, -1);
  f.rng_states.assign(f.range.layers, -1);
  if (static_cast<int64_t>(segments_.forward.size()) < end) segments_.forward.resize(end);
  for (int64_t i = f.range.first_layer; i < end; ++i) {
    memory_.BeginSegment();
    Instance& inst = f.layers[i - f.range.first_layer];
    inst.plan = i == 0 ? first : rest;
    inst.segment = i;
    GatherUnit(i);
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
          memory_.Alloc(kCpuRngStateBytes, MemoryCategory::kActivation);
      if (absl::Status s = Forward(inst, &x, pass, &y); !s.ok()) return s;
      memory_.Keep(x.storage);
      for (int held : CallArguments(inst)) memory_.Keep(held);
      f.checkpoint_inputs[i - f.range.first_layer] = x.storage;
      if (!reentrant) {
        inst.frame = Instance::Frame{x.storage, f.rng_states[i - f.range.first_layer],
                                     CallArguments(inst), inst.ids, false};
      }
    } else if (absl::Status s = Forward(inst, &x, Graph(), &y); !s.ok()) {
      return s;
    }
    if (x.storage != input_id) memory_.Unref(x.storage);  // x = layer(x)
    x = y;
    ReleaseUnit(i);
    segments_.forward[i] = memory_.EndSegment();
  }
  memory_.BeginSegment();
  if (f.range.head) {
    f.head.plan = plans.head.get();
    f.head.segment = Where::kHead;
    GatherUnit(Where::kHead);
    // Where the decoder model's forward returns (after its final norm) its last hidden
    // states (rebound to the norm's output) and its other locals, the layers' extras,
    // die; without a decoder (the study) when the loss is computed.
    bool returned = false;
    decoder_returns_ = [&] {
      if (x.storage != input_id) memory_.Unref(x.storage);
      for (auto it = extras.rbegin(); it != extras.rend(); ++it) memory_.Unref(*it);
      extras.clear();
      returned = true;
    };
    absl::Status forward = Forward(f.head, &x, Graph(), &f.loss);
    if (forward.ok() && !returned) decoder_returns_();
    decoder_returns_ = nullptr;
    if (!forward.ok()) return forward;
    ReleaseUnit(Where::kHead);
  } else {
    f.output = x;  // returned to the caller, who sends it
  }
  // A stage without the head: the layers' extras die as it returns. Then the autocast
  // scope ends (its cast cache cleared).
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
  const SegmentPlan* const first = plans.first.get();
  const SegmentPlan* const rest = plans.rest.get();
  const BlockGraph& layer = graphs.layer;
  globals_ = f.globals;
  memory_.BeginSegment();
  memory_.SetPhase(StepPhase::kBackward);
  const int64_t end = f.range.first_layer + f.range.layers;
  // ZeRO-3: the unit before `unit` in this chunk, whose gathering its input's hook
  // starts; none before the first (the embeddings' gradient ends the graph).
  auto before = [&](int64_t unit) -> std::optional<int64_t> {
    if (unit == Where::kHead) return end - 1;
    if (unit > f.range.first_layer) return unit - 1;
    if (f.range.prologue && families) return Where::kPrologue;
    return std::nullopt;
  };
  if (zero3_) {
    pending_unit_ = f.range.head ? Where::kHead : end - 1;
    GatherUnit(*pending_unit_);
  }
  memory_.SetOp(Special(Where::kHead, Where::Activity::kLossBackward));
  Handle seed;
  std::optional<Handle> grad;
  if (f.range.head) {
    seed.layout = f.loss.layout;
    seed.dtype = f.loss.dtype;
    seed.storage = memory_.Alloc(memory_.bytes(f.loss.storage), MemoryCategory::kTemporary);
    Buffers buffers;
    buffers.emplace(graphs.epilogue.output, Alias(seed));
    if (absl::Status s = Backward(f.head, buffers, false); !s.ok()) return s;
    if (auto it = buffers.find(graphs.epilogue.input); it != buffers.end()) grad = it->second;
    BackwardPassed(Where::kHead, before(Where::kHead));
  } else {
    seed = *output_grad;  // the caller's reference, dropped when the backward returns
    grad = Alias(seed);
  }
  segments_.head_backward = memory_.EndSegment();
  if (static_cast<int64_t>(segments_.backward.size()) < end) segments_.backward.resize(end);
  for (int64_t i = end - 1; i >= f.range.first_layer && grad.has_value(); --i) {
    memory_.BeginSegment();
    Instance& inst = f.layers[i - f.range.first_layer];
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
      inst.plan = i == 0 ? first : rest;
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
      BackwardPassed(i, before(i));
    }
    segments_.backward[i] = memory_.EndSegment();
  }
  memory_.BeginSegment();
  if (f.range.prologue && families && grad.has_value()) {
    Buffers prologue_buffers;
    prologue_buffers.emplace(graphs.prologue->output, *grad);
    grad.reset();
    if (absl::Status s = Backward(f.prologue, prologue_buffers, false); !s.ok()) return s;
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
  // ZeRO-3: the backward returns; the unit whose input's hook never ran (the
  // embeddings', the study's first layer's) reduces its gradients. A received output
  // gradient is the caller's until then; loss.backward()'s seed died with the graph.
  auto end_backward = [&]() {
    if (zero3_ && pending_unit_.has_value()) ReduceScatterUnit(*pending_unit_);
    pending_unit_.reset();
  };
  if (!f.range.head) end_backward();
  memory_.Unref(seed.storage);  // the graph task ends
  if (f.range.head) end_backward();
  // The loss, as a value: the first stays until the step ends; later ones are added
  // into it in place and freed.
  if (f.range.head) {
    if (loss_total_ < 0) {
      loss_total_ = f.loss.storage;
    } else {
      memory_.Unref(f.loss.storage);
    }
  }
  segments_.tail = memory_.EndSegment();

  return absl::OkStatus();
}

// RopeTables is transformers' LlamaRotaryEmbedding as the runtime computes it once per
// forward, without grad: inv_freq = 1 / 10000^(arange(0, d_head, 2) / d_head) (the
// division and pow each wrap a scalar), freqs = outer(arange(T), inv_freq), emb =
// cat(freqs, freqs), cos = emb.cos(), sin = emb.sin() (the (1, T, d_head) tables every
// layer reads); the temporaries die when the prologue returns.
void Simulation::RopeTables(std::vector<int>* extras) {  // appends cos, sin
  memory_.SetOp(Special(Where::kPrologue, Where::Activity::kTables));
  const int64_t half = config_.HeadDim() / 2 * 4, t = config_.seq;
  const int exponents = memory_.Alloc(half, MemoryCategory::kTemporary);
  const Memory::Wrapped scalar = memory_.WrapScalar(DType::kFloat32);
  const int scaled = memory_.Alloc(half, MemoryCategory::kTemporary);
  memory_.Drop(scalar);
  const int powered = memory_.Alloc(half, MemoryCategory::kTemporary);
  memory_.ScalarOp(DType::kFloat32);
  const int inv_freq = memory_.Alloc(half, MemoryCategory::kTemporary);
  memory_.Unref(exponents);
  memory_.Unref(scaled);
  memory_.Unref(powered);
  const int positions = memory_.Alloc(t * 4, MemoryCategory::kTemporary);
  const int freqs = memory_.Alloc(t * half, MemoryCategory::kTemporary);
  memory_.Unref(positions);
  const int emb = memory_.Alloc(t * half * 2, MemoryCategory::kTemporary);
  // cos and sin are computed in fp32 and returned in the hidden states' dtype (the
  // model's; autocast leaves the embedding's output alone), as transformers does.
  auto in_model_dtype = [&](int fp32_table) {
    if (config_.dtype == DType::kFloat32) return fp32_table;
    const int table = memory_.Alloc(t * half / 2 * ElementSizeBytes(config_.dtype),
                                    MemoryCategory::kTemporary);
    memory_.Unref(fp32_table);
    return table;
  };
  const int cos = in_model_dtype(memory_.Alloc(t * half * 2, MemoryCategory::kTemporary));
  const int sin = in_model_dtype(memory_.Alloc(t * half * 2, MemoryCategory::kTemporary));
  memory_.Unref(emb);
  memory_.Unref(freqs);
  memory_.Unref(inv_freq);
  globals_["rope.cos"] = cos;
  globals_["rope.sin"] = sin;
  extras->push_back(cos);
  extras->push_back(sin);
}

// PositionIds is transformers' position_ids = torch.arange(T) + past_seen_tokens (0),
// unsqueezed (modeling_llama.py:375-378, modeling_gpt2.py:571-572): a local of the
// decoder model's forward, which the layers are called with; made in the prologue, held
// to the forward's end like the RoPE tables.
void Simulation::PositionIds(std::vector<int>* extras) {
  memory_.SetOp(Special(Where::kPrologue, Where::Activity::kTables));
  const int64_t bytes = config_.seq * ElementSizeBytes(DType::kInt64);
  const int arange = memory_.Alloc(bytes, MemoryCategory::kTemporary);
  const int wrapped = memory_.Alloc(8, MemoryCategory::kTemporary);  // the int 0, wrapped
  const int positions = memory_.Alloc(bytes, MemoryCategory::kTemporary);
  memory_.Unref(wrapped);
  memory_.Unref(arange);
  globals_["position_ids"] = positions;
  extras->push_back(positions);
}

// ReduceAndStep: the optimizer's step on every parameter, or on a data-parallel rank the
// gradients' reduction and the ZeRO shard's step (RankStep).
absl::Status Simulation::ReduceAndStep() {
  const int64_t element = ElementSizeBytes(config_.dtype);
  if (zero3_) {
    // The shard's gradient, reduced unit by unit in the backward, divided by dp x
    // micro-batches, stepped and freed; the parameters stay sharded.
    memory_.SetOp(Special(Where::kHead, Where::Activity::kGradientReduction));
    memory_.ScalarOp(config_.dtype);
    absl::Status status = OptimizerStep({shard_elements_});
    if (shard_grad_ >= 0) memory_.Unref(shard_grad_);
    return status;
  }
  std::vector<int64_t> numels;
  for (const ParameterKey& parameter : parameter_order_) {
    numels.push_back(memory_.bytes(grads_.at(parameter)) / element);
  }
  const ParallelSpec& data = options_.rank.parallel;
  if (data.dp <= 1) return OptimizerStep(numels);
  int64_t n = 0;
  for (int64_t numel : numels) n += numel;
  const int64_t shard = ZeroShardElements(n, data.dp);
  memory_.SetOp(Special(Where::kHead, Where::Activity::kGradientReduction));
  // The bucket: at::cat of the .grads' flat views and, when n is not a multiple of dp,
  // a block of zeros (which dies with the list of pieces).
  const int padding = shard * data.dp > n
                          ? memory_.Alloc((shard * data.dp - n) * element,
                                          MemoryCategory::kTemporary)
                          : -1;
  const int bucket = memory_.Alloc(shard * data.dp * element, MemoryCategory::kTemporary);
  if (padding >= 0) memory_.Unref(padding);
  auto free_grads = [&]() {
    for (const ParameterKey& parameter : parameter_order_) memory_.Unref(grads_.at(parameter));
  };
  // The all-reduce works in place (Gloo's own buffers are not ATen's).
  if (data.zero == 2) {
    // The shard's copy, divided by dp; then the bucket and the .grads freed.
    const int mine = memory_.Alloc(shard * element, MemoryCategory::kGradient);
    memory_.ScalarOp(config_.dtype);
    memory_.Unref(bucket);
    free_grads();
    absl::Status status = OptimizerStep({shard});
    memory_.Unref(mine);
    return status;
  }
  memory_.ScalarOp(config_.dtype);  // bucket.div_(dp)
  if (data.zero == 0) {
    // Copied back into the .grads (in place), the bucket freed.
    memory_.Unref(bucket);
    return OptimizerStep(numels);
  }
  free_grads();
  absl::Status status = OptimizerStep({shard});  // on a view of the bucket
  memory_.Unref(bucket);
  return status;
}

// OptimizerStep is torch.optim's step() of the pinned release, in the implementation the
// spec names, on a step whose state exists (torch/optim/adam.py, sgd.py; AdamW is Adam
// with decoupled weight decay, adamw.py:36-49). A Python number passed to an in-place op
// that takes a Tensor is wrapped as an 8-byte 0-dim tensor and converted to the updated
// tensor's dtype on the CPU (Memory::ScalarOp: +8, +e, -e, -8); a number taken as a
// Scalar (lerp_'s weight, addcmul_'s value, add_'s alpha) allocates nothing, nor do
// _get_value, the Python-float bias corrections or the fused kernels.
absl::Status Simulation::OptimizerStep(const std::vector<int64_t>& numels) {
  memory_.SetOp(Special(Where::kHead, Where::Activity::kOptimizerStep));
  // With master weights (runtime/runtime.cc, OptimizerRunner::Step) every .grad is first
  // copied to fp32 as its master's .grad; the optimizer steps the fp32 masters; then
  // each parameter is copied back from its master (in place) and the master's .grad
  // dies.
  const DType dtype = optimizer_.master_weights ? DType::kFloat32 : config_.dtype;
  std::vector<int> master_grads;
  if (optimizer_.master_weights) {
    for (size_t p = 0; p < numels.size(); ++p) {
      master_grads.push_back(memory_.Alloc(numels[p] * 4, MemoryCategory::kGradient));
      if (IsLayerZeroParameter(p)) {
        segments_.optimizer_layer_bytes[static_cast<int>(MemoryCategory::kGradient)] +=
            numels[p] * 4;
      }
    }
  }
  const int64_t element = ElementSizeBytes(dtype);
  const int64_t scalar_bytes = 8 + element;  // a wrapped number and its conversion
  const DType step_dtype = DType::kFloat32;  // Adam's `step`: _get_scalar_dtype()
  const bool adam =
      optimizer_.kind == OptimizerKind::kAdamW || optimizer_.kind == OptimizerKind::kAdam;
  // Adam's default weight_decay is 0; AdamW's 1e-2 multiplies the parameter in place.
  const bool decoupled_decay = optimizer_.kind == OptimizerKind::kAdamW;
  const bool momentum = optimizer_.kind == OptimizerKind::kSgd && optimizer_.momentum > 0;
  switch (optimizer_.impl) {
    case OptimizerImpl::kForLoop:
      if (adam) {
        // _single_tensor_adam, per tensor: step_t += 1 (adam.py:415); AdamW's
        // param.mul_(1 - lr * wd) (:420); exp_avg.lerp_ (:457, nothing);
        // exp_avg_sq.mul_(b2).addcmul_ (:476); denom = (exp_avg_sq.sqrt() / bc2_sqrt)
        // .add_(eps) (:545): the root dies after the division, and the last tensor's
        // denom lives until this one's is bound; param.addcdiv_ (:547, nothing).
        // Its largest moment: the last denom, the root, the quotient and its wrapped
        // divisor.
        int64_t last_denom_bytes = 0;
        int last_denom = -1;
        for (int64_t numel : numels) {
          const int64_t bytes = numel * element;
          if (!memory_.recording()) {
            memory_.Peek(last_denom_bytes + 2 * bytes + scalar_bytes, MemoryCategory::kTemporary);
            last_denom_bytes = bytes;
            continue;
          }
          memory_.ScalarOp(step_dtype);
          if (decoupled_decay) memory_.ScalarOp(dtype);
          memory_.ScalarOp(dtype);
          const int root = memory_.Alloc(bytes, MemoryCategory::kTemporary);
          const Memory::Wrapped divisor = memory_.WrapScalar(dtype);
          const int denom = memory_.Alloc(bytes, MemoryCategory::kTemporary);
          memory_.Drop(divisor);
          memory_.Unref(root);
          memory_.ScalarOp(dtype);
          if (last_denom >= 0) memory_.Unref(last_denom);
          last_denom = denom;
        }
        if (last_denom >= 0) memory_.Unref(last_denom);
      } else if (momentum) {
        // _single_tensor_sgd: buf.mul_(momentum).add_(grad) (sgd.py:364); param.add_
        // (:379, nothing).
        for (size_t p = 0; p < numels.size(); ++p) {
          if (memory_.recording()) {
            memory_.ScalarOp(dtype);
          } else {
            memory_.Peek(scalar_bytes, MemoryCategory::kTemporary);
          }
        }
      }
      break;
    case OptimizerImpl::kForeach: {
      // The slow path on CPU tensors runs each list op tensor by tensor.
      auto scalar_per_tensor = [&]() {
        for (size_t p = 0; p < numels.size(); ++p) {
          if (memory_.recording()) {
            memory_.ScalarOp(dtype);
          } else {
            memory_.Peek(scalar_bytes, MemoryCategory::kTemporary);
          }
        }
      };
      if (adam) {
        // _multi_tensor_adam: _foreach_add_(steps, torch.tensor(1.0), alpha=1.0)
        // (adam.py:682-685); AdamW's _foreach_mul_(params, ...) (:692);
        // _foreach_mul_(exp_avg_sqs, b2) (:709); exp_avg_sq_sqrt =
        // _foreach_sqrt(exp_avg_sqs) (:791), the whole list alive until the function
        // returns, through _foreach_div_ and _foreach_add_ (:793-794).
        memory_.Transient(ElementSizeBytes(step_dtype));
        if (decoupled_decay) scalar_per_tensor();
        scalar_per_tensor();
        int64_t list_bytes = 0;
        std::vector<int> roots;
        for (size_t p = 0; p < numels.size(); ++p) {
          const int64_t numel = numels[p];
          list_bytes += numel * element;
          if (IsLayerZeroParameter(p)) {
            segments_.optimizer_layer_bytes[static_cast<int>(MemoryCategory::kTemporary)] +=
                numel * element;
          }
          if (memory_.recording()) {
            roots.push_back(memory_.Alloc(numel * element, MemoryCategory::kTemporary));
          }
        }
        if (!memory_.recording()) {
          memory_.Peek(list_bytes + scalar_bytes, MemoryCategory::kTemporary);
          break;
        }
        scalar_per_tensor();
        scalar_per_tensor();
        for (auto root = roots.rbegin(); root != roots.rend(); ++root) memory_.Unref(*root);
      } else if (momentum) {
        scalar_per_tensor();  // _foreach_mul_(bufs, momentum) (sgd.py:445)
      }
      break;
    }
    case OptimizerImpl::kFused:
      // _fused_adam: _foreach_add_(steps, 1) (adam.py:877), then the kernel, which
      // allocates nothing; _fused_sgd_ (sgd.py:529) allocates nothing.
      if (!adam) break;
      for (size_t p = 0; p < numels.size(); ++p) {
        if (memory_.recording()) {
          memory_.ScalarOp(step_dtype);
        } else {
          memory_.Peek(8 + ElementSizeBytes(step_dtype), MemoryCategory::kTemporary);
        }
      }
      break;
  }
  for (int master_grad : master_grads) memory_.Unref(master_grad);
  return absl::OkStatus();
}

// Composing a long model's peak from a short one's stretches. A layer's forward and
// backward stretches depend on its own kind (plain or checkpointed) and its neighbours'
// (every_k repeats them with period k), and on whether it is the first or the last: a
// model of 2k + 3 layers (congruent to the real count mod k) has a stretch equal to each
// real layer's (verified against the whole simulation by liveness_test).
int64_t PeriodOf(const Variant& variant) {
  return variant.kind == VariantKind::kEveryK ? std::max<int64_t>(1, variant.every) : 1;
}

// ResidentTimeline starts a step's timeline from what is resident throughout it.
StepTimeline ResidentTimeline(const ResidentBytes& resident) {
  StepTimeline timeline;
  timeline.resident[static_cast<int>(MemoryCategory::kParameter)] = resident.parameter_bytes;
  timeline.resident[static_cast<int>(MemoryCategory::kOptimizerState)] =
      resident.optimizer_state_bytes;
  timeline.resident[static_cast<int>(MemoryCategory::kBuffer)] = resident.buffer_bytes;
  return timeline;
}

int64_t ReducedLayers(int64_t layers, const Variant& variant) {
  // A plan has no period: the whole model is replayed.
  if (variant.kind == VariantKind::kPlan) return layers;
  const int64_t k = PeriodOf(variant);
  // The least r >= 2k + 3 congruent to layers mod k, in closed form (k may be any int64:
  // a loop would run up to k times); the real model itself when r would not be shorter.
  if (k > (layers - 3) / 2) return layers;  // 2k + 3 > layers
  const int64_t base = 2 * k + 3;
  return std::min(layers, base + ((layers - base) % k + k) % k);
}

// Representative is the short model's layer whose stretches equal real layer i's.
int64_t Representative(int64_t i, int64_t layers, int64_t reduced, int64_t k) {
  if (i == 0) return 0;
  if (i == layers - 1) return reduced - 1;
  return k + 1 + ((i - k - 1) % k + k) % k;  // in [k + 1, 2k], congruent to i mod k
}

// ComposePeak walks the real model's stretches in step order, each the short model's
// representative one, and keeps the first highest moment. The middle layers (all but the
// first and the last) repeat one period of k stretches, and its cost does not grow with
// the layer count: a period's moments sit at live-at-its-start plus a fixed offset, and
// live grows by the same d from one period to the next. Over a run of periods each
// moment is highest in the last period when d > 0 and in the first when d <= 0 (first
// of equals), so the periods between the first and the last two are skipped with their
// net added at once. Every sum that could overflow is linear in the period's number,
// extreme at the ends, and the ends are walked.
absl::StatusOr<StepPeak> ComposePeak(const Simulation& simulation,
                                     const StepTimeline& short_timeline,
                                     int64_t layers, int64_t reduced, int64_t k) {
  const auto& segments = simulation.segments();
  std::array<int64_t, kNumMemoryCategories> live = short_timeline.resident;
  int64_t total = short_timeline.resident_bytes;
  StepPeak peak;
  peak.bytes = total;
  peak.by_category = live;
  std::optional<Where> where;
  bool overflow = false;
  // What the real layers' forwards leave only in autocast's cache, freed at the head's
  // forward end in place of the short model's.
  std::array<int64_t, kNumMemoryCategories> freed_at_forward_end{};
  auto visit = [&](const SegmentSummary& s, int64_t real_layer) {
    int64_t top = 0;
    overflow = overflow || __builtin_add_overflow(total, s.rise, &top);
    if (s.has_rise && !overflow && top > peak.bytes) {
      peak.bytes = top;
      peak.phase = s.phase;
      for (int c = 0; c < kNumMemoryCategories; ++c) {
        overflow = overflow ||
                   __builtin_add_overflow(live[c], s.at_rise[c], &peak.by_category[c]);
      }
      where = s.where;
      if (real_layer >= 0 && where->segment >= 0) where->segment = real_layer;
    }
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      overflow = overflow || __builtin_add_overflow(live[c], s.net[c], &live[c]) ||
                 __builtin_add_overflow(total, s.net[c], &total) ||
                 __builtin_add_overflow(freed_at_forward_end[c], s.freed_at_forward_end[c],
                                        &freed_at_forward_end[c]);
    }
  };
  // walk visits the layers' stretches from first to last (step +1 or -1), skipping
  // whole middle periods after the first.
  auto walk = [&](const std::vector<SegmentSummary>& stretches, int64_t first, int64_t step) {
    const int64_t middle = layers - 2;  // ComposePeak runs only for layers > 2k + 3
    const int64_t skipped_periods = middle / k >= 3 ? middle / k - 2 : 0;
    std::array<int64_t, kNumMemoryCategories> period_start{}, period_start_freed{};
    for (int64_t n = 0, i = first; n < layers; ++n, i += step) {
      if (n == 1) {
        period_start = live;
        period_start_freed = freed_at_forward_end;
      }
      visit(stretches[Representative(i, layers, reduced, k)], i);
      if (n == k && skipped_periods > 0) {
        // One period walked: skip the next skipped_periods with their net bytes.
        for (int c = 0; c < kNumMemoryCategories; ++c) {
          int64_t period_net = 0, net = 0, period_freed = 0, freed = 0;
          overflow = overflow ||
                     __builtin_sub_overflow(live[c], period_start[c], &period_net) ||
                     __builtin_mul_overflow(period_net, skipped_periods, &net) ||
                     __builtin_add_overflow(live[c], net, &live[c]) ||
                     __builtin_add_overflow(total, net, &total) ||
                     __builtin_sub_overflow(freed_at_forward_end[c], period_start_freed[c],
                                            &period_freed) ||
                     __builtin_mul_overflow(period_freed, skipped_periods, &freed) ||
                     __builtin_add_overflow(freed_at_forward_end[c], freed,
                                            &freed_at_forward_end[c]);
        }
        n += skipped_periods * k;
        i += skipped_periods * k * step;
      }
    }
  };
  visit(segments.prologue, -1);
  walk(segments.forward, 0, +1);
  // The head's forward ends by clearing autocast's cache: it frees the real layers'
  // cached casts, not the short model's (its moments all come before).
  SegmentSummary head_forward = segments.head_forward;
  for (const SegmentSummary& layer : segments.forward) {
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      head_forward.net[c] += layer.freed_at_forward_end[c];  // the short model's back
    }
  }
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    overflow = overflow || __builtin_sub_overflow(head_forward.net[c], freed_at_forward_end[c],
                                                  &head_forward.net[c]);
  }
  visit(head_forward, -1);
  visit(segments.head_backward, -1);
  walk(segments.backward, layers - 1, -1);
  visit(segments.tail, -1);
  // The optimizer's step holds every layer's fp32 .grad copy with master weights, and
  // every layer's share of foreach's list.
  SegmentSummary optimizer = segments.optimizer;
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    int64_t more = 0;
    overflow = overflow ||
               __builtin_mul_overflow(layers - reduced, segments.optimizer_layer_bytes[c],
                                      &more) ||
               __builtin_add_overflow(optimizer.rise, more, &optimizer.rise) ||
               __builtin_add_overflow(optimizer.at_rise[c], more, &optimizer.at_rise[c]);
  }
  visit(optimizer, -1);
  if (overflow) {
    return absl::OutOfRangeError(absl::StrCat("the step's live bytes overflow int64 for ",
                                              layers, " layers"));
  }
  peak.op = where.has_value() ? simulation.Text(*where) : "";
  return peak;
}

}  // namespace

absl::StatusOr<StepSimulator> StepSimulator::Create(const ModelConfig& config,
                                                    AttentionMode attention,
                                                    const StepOptions& options) {
  if (absl::Status s = ValidateConfig(config); !s.ok()) return s;
  if (options.cpu_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("cpu_threads must be >= 1, got ", options.cpu_threads));
  }
  auto plans = std::make_shared<ModelPlans>();
  plans->graphs = ModelGraphsFor(config, attention);
  const ModelGraphs& graphs = *plans->graphs;
  // What the simulation does not model yet, found before any work.
  for (const BlockGraph* graph : {graphs.prologue ? &*graphs.prologue : nullptr,
                                  &graphs.layer, &graphs.epilogue}) {
    if (graph == nullptr) continue;
    for (const OpDef& op : graph->ops) {
      if (!Modelled(op.type)) {
        return absl::UnimplementedError(absl::StrCat(
            "peak memory: the step simulation does not model the backward of ",
            OpTypeName(op.type), " yet"));
      }
    }
  }
  const bool families = graphs.prologue.has_value();
  const RuleTable* rules = options.rules;
  auto make = [&](const BlockGraph& graph, bool input_requires_grad,
                  std::unique_ptr<SegmentPlan>* plan) {
    absl::StatusOr<std::unique_ptr<SegmentPlan>> made =
        MakePlan(graph, config, input_requires_grad, rules);
    if (made.ok()) *plan = *std::move(made);
    return made.status();
  };
  if (families) {
    if (absl::Status s = make(*graphs.prologue, false, &plans->prologue); !s.ok()) return s;
  }
  // The study's first layer reads the model input, which needs no gradient; the
  // families' first layer reads the embeddings.
  if (absl::Status s = make(graphs.layer, families, &plans->first); !s.ok()) return s;
  if (absl::Status s = make(graphs.layer, true, &plans->rest); !s.ok()) return s;
  if (absl::Status s = make(graphs.epilogue, true, &plans->head); !s.ok()) return s;
  return StepSimulator(config, attention, options, std::move(plans));
}

absl::StatusOr<StepTimeline> StepSimulator::Simulate(const Variant& variant,
                                                     const OptimizerSpec& optimizer,
                                                     const ResidentBytes& resident) const {
  if (absl::Status s = ValidateRun(config_, attention_, {variant}, optimizer); !s.ok()) {
    return s;
  }
  if (variant.kind == VariantKind::kCoreAttention) {
    return absl::UnimplementedError(
        "peak memory: the step simulation does not model core_attention's recompute yet");
  }
  if (config_.KeepsKvCache() && variant.CheckpointsAnyLayer()) {
    return absl::InvalidArgumentError(
        "step simulation: a model with use_cache runs a checkpointing variant without the "
        "cache; simulate it on the config with use_cache off (Predict does)");
  }
  const ModelPlans& plans = *static_cast<const ModelPlans*>(plans_.get());
  StepTimeline timeline = ResidentTimeline(resident);
  // Without events, a long model's peak is composed from a short one's stretches: the
  // cost stops growing with layers.
  const int64_t reduced = ReducedLayers(config_.layers, variant);
  // A data-parallel rank's reduction holds all of its layers' gradients at once (its
  // stretch grows with the layers), a second micro-batch's backward adds to .grads, and
  // a pipeline stage interleaves micro-batches: such a step is replayed whole.
  if (!options_.record_events && reduced < config_.layers &&
      options_.rank.parallel.dp <= 1 && options_.rank.parallel.micro_batches <= 1 &&
      options_.rank.parallel.pp <= 1) {
    ModelConfig short_config = config_;
    short_config.layers = reduced;
    Simulation simulation(short_config, variant, optimizer, options_, &timeline);
    if (absl::Status s = simulation.Run(plans); !s.ok()) return s;
    absl::StatusOr<StepPeak> peak =
        ComposePeak(simulation, timeline, config_.layers, reduced, PeriodOf(variant));
    if (!peak.ok()) return peak.status();
    timeline.peak = *std::move(peak);
    return timeline;
  }
  Simulation simulation(config_, variant, optimizer, options_, &timeline);
  if (absl::Status s = simulation.Run(plans); !s.ok()) return s;
  simulation.NamePeak();
  return timeline;
}

absl::StatusOr<StepStretches> StepSimulator::Stretches(const Variant& variant,
                                                       const OptimizerSpec& optimizer,
                                                       const ResidentBytes& resident) const {
  if (absl::Status s = ValidateRun(config_, attention_, {variant}, optimizer); !s.ok()) {
    return s;
  }
  if (config_.amp != DType::kFloat32) {
    // A layer's forward leaves casts in autocast's cache that the head's forward frees:
    // a stretch's net then depends on every earlier layer's choice.
    return absl::UnimplementedError(
        "peak memory: the stretches of a step under autocast do not compose yet (its cast "
        "cache, filled by checkpointed layers, is freed at the forward's end)");
  }
  if (optimizer.master_weights) {
    // The optimizer's stretch holds every layer's fp32 .grad copy: it depends on the
    // layer count, which a caller composing stretches changes.
    return absl::UnimplementedError(
        "peak memory: the stretches of a step with master weights do not compose yet (the "
        "optimizer's step holds every layer's fp32 gradient copy)");
  }
  if (config_.checkpoint_impl == CheckpointImpl::kReentrant && variant.kind != VariantKind::kNone) {
    // Its checkpoints hold their call arguments (shared by every layer) to the step's
    // end: when those die depends on whether any layer is checkpointed.
    return absl::UnimplementedError(
        "peak memory: the stretches of a step with --checkpoint_impl=reentrant do not "
        "compose yet (its checkpoints hold the layers' shared arguments to the step's end)");
  }
  if (optimizer.impl == OptimizerImpl::kForeach &&
      optimizer.kind != OptimizerKind::kSgd) {
    // Likewise foreach's exp_avg_sq.sqrt() list, one tensor per parameter.
    return absl::UnimplementedError(
        "peak memory: the stretches of a step with --optimizer_impl=foreach do not compose "
        "yet (its step holds a square root of every parameter's exp_avg_sq at once)");
  }
  const ModelPlans& plans = *static_cast<const ModelPlans*>(plans_.get());
  StepTimeline timeline = ResidentTimeline(resident);
  StepOptions options = options_;
  options.record_events = false;
  Simulation simulation(config_, variant, optimizer, options, &timeline);
  if (absl::Status s = simulation.Run(plans); !s.ok()) return s;
  auto stretch = [](const SegmentSummary& summary) {
    StepStretch out;
    for (int64_t bytes : summary.net) out.net += bytes;
    out.has_rise = summary.has_rise;
    out.rise = summary.rise;
    return out;
  };
  const Simulation::Segments& segments = simulation.segments();
  StepStretches out;
  out.resident_bytes = timeline.resident_bytes;
  out.prologue = stretch(segments.prologue);
  for (const SegmentSummary& s : segments.forward) out.forward.push_back(stretch(s));
  out.head_forward = stretch(segments.head_forward);
  out.head_backward = stretch(segments.head_backward);
  for (const SegmentSummary& s : segments.backward) out.backward.push_back(stretch(s));
  out.tail = stretch(segments.tail);
  out.optimizer = stretch(segments.optimizer);
  return out;
}

absl::StatusOr<StepTimeline> SimulateStep(const ModelConfig& config, AttentionMode attention,
                                          const Variant& variant,
                                          const OptimizerSpec& optimizer,
                                          const ResidentBytes& resident,
                                          const StepOptions& options) {
  absl::StatusOr<StepSimulator> simulator = StepSimulator::Create(config, attention, options);
  if (!simulator.ok()) return simulator.status();
  return simulator->Simulate(variant, optimizer, resident);
}

const char* MemoryCategoryName(MemoryCategory category) {
  switch (category) {
    case MemoryCategory::kParameter: return "parameter";
    case MemoryCategory::kGradient: return "gradient";
    case MemoryCategory::kOptimizerState: return "optimizer_state";
    case MemoryCategory::kActivation: return "activation";
    case MemoryCategory::kTemporary: return "temporary";
    case MemoryCategory::kInput: return "input";
    case MemoryCategory::kBuffer: return "buffer";
  }
  return "?";
}

const char* StepPhaseName(StepPhase phase) {
  switch (phase) {
    case StepPhase::kForward: return "forward";
    case StepPhase::kBackward: return "backward";
    case StepPhase::kOptimizer: return "optimizer";
  }
  return "?";
}

}  // namespace memledger
