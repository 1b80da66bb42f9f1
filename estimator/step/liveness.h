// Liveness: the memory timeline of one whole training step (docs/DESIGN.md, "Peak memory"),
// predicted by replaying the step allocation by allocation: zero_grad(set_to_none), the
// forward op by op (each output allocated, each storage freed at its last use unless a
// backward node keeps it), the backward node by node in the autograd engine's order (each
// backward formula's outputs and workspaces, saved tensors released after their node,
// gradients accumulated into the engine's input buffers and stolen into .grad, checkpointed
// layers recomputed inside their node) and the optimizer step with its temporaries.
// Parameters, optimizer state and the model input exist before the step ("resident").
// Without recorded events, a long model is replayed as a short one (at most 2k + 1
// layers for every_k, 3 otherwise) whose stretches (each layer's forward, each layer's
// backward, ...) compose the long one's peak: the cost does not grow with layers. A
// rank's step composes so too, pass by pass.
//
// The engine semantics and each kernel's allocations are those of the pinned release
// (kTorchRelease): the runtime's counting allocator measures the same step, and verify
// compares the two peaks byte for byte.
//
// Example:
//   absl::StatusOr<StepTimeline> t = SimulateStep(
//       ModelConfig(), AttentionMode::kFlash, Variant(), OptimizerSpec(),
//       ResidentBytes{prediction.param_bytes, prediction.optimizer_state_bytes}, {});
//   if (t.ok()) std::cout << t->peak.bytes << " at " << t->peak.op;
#ifndef ESTIMATOR_STEP_LIVENESS_H_
#define ESTIMATOR_STEP_LIVENESS_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "estimator/graph/block_graph.h"
#include "estimator/graph/family.h"
#include "estimator/spec/config.h"
#include "estimator/request/parallel_spec.h"
#include "estimator/graph/rules.h"
#include "estimator/saved/walker.h"

namespace memledger {

namespace liveness_internal {
struct ModelPlans;
struct SegmentSummary;
}  // namespace liveness_internal

// MemoryCategory is what a live byte is for (as PyTorch's MemTracker names them).
enum class MemoryCategory : uint8_t {
  kParameter,
  kGradient,        // a parameter's .grad
  kOptimizerState,  // moments, master weights
  kActivation,      // kept for backward: saved tensors, checkpoint inputs, the cache
  kTemporary,       // everything else: forward intermediates, gradients in flight, workspace
  kInput,           // the model input (and the labels made from it)
  kBuffer,          // the modules' buffers (a rotary embedding's inv_freq)
  kCommunication,   // a data-parallel strategy's own buffers (DDP's Reducer buckets)
};
inline constexpr int kNumMemoryCategories =
    static_cast<int>(MemoryCategory::kCommunication) + 1;
// "parameter", "gradient", "optimizer_state", "activation", "temporary", "input",
// "buffer", "communication".
const char* MemoryCategoryName(MemoryCategory category);

// CudaStream: the streams a CUDA step allocates on; the caching allocator keeps a pool
// per stream (estimator/step/cuda_allocator.h). FSDP2 allocates its all-gather input and
// output on its all-gather copy-in stream and the sharded gradients on its reduce-scatter
// stream (FSDPCommContext, torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py:92;
// foreach_all_gather, _fsdp_collectives.py:362; foreach_reduce, :673), all else on the
// default stream.
enum CudaStream : int {
  kDefaultStream = 0,
  kFsdpAllGatherStream = 1,
  kFsdpReduceScatterStream = 2,
};

// StepPhase is where in the step an allocation happens.
enum class StepPhase : uint8_t { kForward, kBackward, kOptimizer };
inline constexpr int kNumStepPhases = 3;
const char* StepPhaseName(StepPhase phase);  // "forward", "backward", "optimizer"

// TimelineEvent is one allocation (bytes > 0) or free (bytes < 0). A storage that changes
// category (a gradient stolen into .grad) is a free and an allocation at one instant.
struct TimelineEvent {
  int64_t bytes = 0;
  MemoryCategory category = MemoryCategory::kTemporary;
  StepPhase phase = StepPhase::kForward;
  int32_t op = 0;  // into StepTimeline::op_labels
  // relabel: half of a category change (no memory comes or goes; the allocator sees
  // nothing).
  bool relabel = false;
  // storage: which allocation this is (or frees): one id per allocation of the step.
  int32_t storage = -1;
};

// StepPeak is the step's largest live total (resident included) and the moment it
// happens first.
struct StepPeak {
  int64_t bytes = 0;
  StepPhase phase = StepPhase::kForward;
  std::string op;  // "layer 5 fc2 (AddmmBackward0)"
  std::array<int64_t, kNumMemoryCategories> by_category{};
  int64_t event = -1;  // index into events; -1: the resident bytes alone
};

// ResidentTensor is one tensor that exists before the step (a parameter, one of its
// optimizer state's tensors), for a memory snapshot's opening allocations.
struct ResidentTensor {
  std::string name;  // "layer 3 self_attn.q_proj.weight", "... exp_avg"
  MemoryCategory category = MemoryCategory::kParameter;
  int64_t bytes = 0;
};

struct StepTimeline {
  // resident: live before the step (parameter, optimizer_state, input).
  std::array<int64_t, kNumMemoryCategories> resident{};
  // resident_tensors: the parameters and optimizer state tensor by tensor, summing to
  // their resident bytes (empty: only the sums are known, as for a rank's ZeRO shards).
  std::vector<ResidentTensor> resident_tensors;
  int64_t resident_bytes = 0;
  std::vector<TimelineEvent> events;  // empty unless StepOptions::record_events
  std::vector<std::string> op_labels;
  StepPeak peak;
  // On --device=cuda: what the caching allocator reserves at most (its segments,
  // max_memory_reserved()), replaying the step's allocations from a fresh allocator
  // that first holds the resident tensors; peak.bytes then counts blocks, as
  // max_memory_allocated() does. 0 on the CPU.
  int64_t peak_reserved_bytes = 0;
  // offloaded_bytes: with DeviceOptions::offload_activations, the host memory save_on_cpu
  // holds when the forward returns (the tensors' bytes; 0 otherwise).
  int64_t offloaded_bytes = 0;
  // outside_allocator_bytes: on CUDA, the device memory outside the caching allocator
  // (the CUDA context's), which neither peak counts.
  int64_t outside_allocator_bytes = 0;
  // allocator_calls: on CUDA with events recorded, the step's requests to the caching
  // allocator in order, the resident tensors' first: a malloc of `bytes` (> 0, as
  // requested, before rounding) for allocation `id` on `stream` (0: the default stream;
  // FSDP2's collectives have their own: CudaStream), or its free (bytes 0). Replayed
  // through torch's own allocator they give peak.bytes and peak_reserved_bytes
  // (//tests:cuda_allocator_test).
  struct AllocatorCall {
    int32_t id = 0;
    int64_t bytes = 0;
    int stream = 0;
  };
  std::vector<AllocatorCall> allocator_calls;
};

// RankStep is one rank's step in a distributed run, as runtime/distributed.h's ranks
// run it (RankStepModelled: ZeRO 0-2; a tensor-parallel rank's collectives are ops of
// its graphs, estimator/graph/block_graph.h):
//   - micro_batches forwards and backwards (gradient accumulation: the second adds to
//     the first's .grads), each on its own input (resident before the step, where the
//     stage reads it), unscaled; after its backward each loss is added into the first
//     (a running total, kept until the step ends) and freed;
//   - with pp > 1 only pipeline stage `stage`'s model chunks, in the order of
//     estimator/step/pipeline_steps.h (Megatron-LM's 1F1B or interleaved schedule): a chunk
//     that does not run the embedding receives its input hidden states into a new
//     buffer (a leaf whose gradient it sends back after its backward, then frees both);
//     one that does not run the head sends its output and frees it
//     (deallocate_output_tensor), and receives its output's gradient into a new buffer
//     before its backward. Sends and receives are posted and waited together as
//     Megatron pairs them: the received buffers exist before what was sent is freed;
//   - with dp > 1 and no ZeRO, torch's DDP (TorchDdp): its buckets resident, each
//     chunk's last backward copies every .grad into its bucket (data_parallel_ddp.cc;
//     the .grad replaced by the bucket's view with gradient_as_bucket_view), and every
//     parameter is stepped. With ZeRO (or expert parallelism without it) the gradients
//     are copied into one flat bucket (padded to a multiple of dp), all-reduced in place
//     and divided by dp x micro_batches; expert parallelism: the average is copied back
//     into the .grads, the bucket freed, and every parameter stepped; ZeRO 1: the .grads
//     are freed, the rank's ceil(n / dp) shard of
//     the bucket (a view) stepped, then the bucket freed; ZeRO 2: the shard is copied
//     out of the bucket and divided, the bucket and the .grads freed, the copy stepped.
//     ZeRO 1, 2 all-gather the updated shards in place into the flat parameter buffer
//     (no bytes);
//   - ZeRO 3 holds only its shard of the stage's flat parameters, as FSDP and
//     DeepSpeed's stage 3 do (a tied embedding, on one stage only, keeps its unit
//     gathered from the prologue's forward to its reduction, as FSDP's root unit): a unit (the embeddings, a layer,
//     the head) has its parameters gathered into one buffer for its forward and again
//     for its backward; after the unit's backward (when the unit before it starts, or
//     when the backward returns for a stage's first unit whose input is a leaf or needs
//     no gradient) its .grads are flattened into a bucket and freed, the bucket
//     all-reduced in place, this rank's part added into the shard's gradient (made on
//     first use), the bucket freed and the parameters released. The shard's gradient is
//     divided by dp x micro_batches and stepped; the parameters stay sharded.
struct RankStep {
  ParallelSpec parallel;  // dp, zero, micro_batches, pp and the schedule
  int64_t stage = 0;      // pipeline rank
  std::vector<StageRange> chunks;  // its model chunks, in order (used when pp > 1)
};

// CudaBlocks is how a CUDA step's storages are counted.
// - kAllocator: each is its block of the caching allocator's simulation
//   (estimator/step/cuda_allocator.h), replayed in order over the whole step: peak_bytes as
//   max_memory_allocated() reports it, and the reserved peak.
// - kRequests: each is its request rounded to 512 B, the block the allocator hands out
//   when it splits a free block to size. It always does with expandable segments, so
//   this is then max_memory_allocated() exactly; without them a large block is split
//   only when more than 1 MiB would remain, so this is a lower bound. It depends on no
//   allocator state, so a long model's peak composes from a short one's stretches (the
//   checkpoint planner's probes). No reserved peak.
enum class CudaBlocks : uint8_t { kAllocator, kRequests };

struct StepOptions {
  // cpu_threads: LibTorch's intra-op threads; CPU kernels size per-thread workspaces by
  // it (flash attention, layer norm's backward). The runtime uses min(4, cores).
  int cpu_threads = 1;
  bool record_events = true;
  // rules: what each op keeps; null means RuleTable::Pinned().
  const RuleTable* rules = nullptr;
  // rank: a distributed rank's step (with dp, micro_batches or pp above 1 its peak is
  // composed pass by pass from its chunks replayed short, liveness.cc's
  // ComposeRankPeak; replayed whole with events, the CUDA allocator or reentrant
  // checkpoints).
  RankStep rank;
  // cuda_blocks: how a --device=cuda step counts its storages (ignored on the CPU).
  CudaBlocks cuda_blocks = CudaBlocks::kAllocator;
  // python_dispatch_mode: a selective checkpoint's forward and recompute run under
  // torch.utils.checkpoint's Python dispatch modes (_CachingTorchDispatchMode,
  // _CachedTorchDispatchMode), as the real stack does. A mode receives an op's wrapped
  // Python number back as a number and calls the op with it, which wraps it again: 8 B
  // more, from before the conversion to just after the op. memledger's LibTorch runtime
  // has no dispatch mode (verify predicts it with false).
  bool python_dispatch_mode = true;
  // layer_kinds: a planner's probe, a short model whose layer i is of kind
  // layer_kinds[i] (into ModelGraphs::layer_kinds) whatever the model's pattern says
  // (StepSimulator::Probe); empty: the model's own layers.
  std::vector<int> layer_kinds;
};

// ResidentBytes are what exists before the step besides the model input (Predict's
// param_bytes and optimizer_state_bytes).
struct ResidentBytes {
  int64_t parameter_bytes = 0;
  int64_t optimizer_state_bytes = 0;
  int64_t buffer_bytes = 0;
  // tensors: on --device=cuda, every resident tensor in allocation order (parameters,
  // buffers, optimizer state), each its own caching-allocator block; summing to the
  // bytes above.
  std::vector<ResidentTensor> tensors = {};
  // communication_bytes: a data-parallel strategy's buffers held for the whole run (DDP's
  // Reducer buckets), among `tensors` on CUDA.
  int64_t communication_bytes = 0;
};

// StepStretch is one stretch of the step (a layer's forward or backward, the head's, the
// optimizer's): its net bytes and its highest total, both relative to its start.
struct StepStretch {
  int64_t net = 0;
  bool has_rise = false;  // some moment of it rose above its start
  int64_t rise = 0;
};

// StepStretches is a step cut into stretches, in step order: the prologue, each layer's
// forward, the head's forward and backward, each layer's backward (from the last), the
// tail (the embeddings' backward) and the optimizer. The step's peak is the highest
// `start + rise` as the stretches follow one another: a caller can compose the peak of a
// model whose layers differ (the checkpoint planner) from stretches of short models.
struct StepStretches {
  int64_t resident_bytes = 0;
  StepStretch prologue;
  std::vector<StepStretch> forward;  // by layer
  // forward_freed: by layer, what its forward left only in autocast's cast cache (a
  // checkpointed layer's weight casts, which no backward node keeps), freed when the
  // forward ends, inside head_forward (after its rise): a caller composing layers adds
  // its model's layers' and takes out these.
  std::vector<int64_t> forward_freed;
  StepStretch head_forward;
  StepStretch head_backward;
  std::vector<StepStretch> backward;  // by layer
  StepStretch tail;
  StepStretch optimizer;
  // optimizer_layer_bytes: by layer kind, what one more layer of it adds to the
  // optimizer's rise (with master weights its fp32 .grad copies, with foreach its share
  // of exp_avg_sq.sqrt()'s list, all alive at once): a caller composing a model of
  // other layer counts adds it per layer.
  std::vector<int64_t> optimizer_layer_bytes;
};

// LayerGlobals are the model-level tensors (position ids, RoPE tables, masks) one kind of
// layer reads: those its backward nodes keep when it runs plain, and those only a
// checkpoint's frame holds, to the layer's backward (its call arguments).
struct LayerGlobals {
  std::vector<ModelTensor> kept;
  std::vector<ModelTensor> held_when_checkpointed;
};

// ModelLayouts are a model's segment graphs laid out for one config (LayoutBlock's, in
// estimator/saved/walker.h): a caller that laid them out already (Predict, for the
// buckets) hands them to StepSimulator::Create rather than have them made again. Null:
// not given.
struct ModelLayouts {
  std::shared_ptr<const BlockLayouts> prologue;
  std::vector<std::shared_ptr<const BlockLayouts>> layer_kinds;
  std::shared_ptr<const BlockLayouts> epilogue;
};

// StepSimulator simulates the steps of one model (config and attention mode) under any
// variant and optimizer; it checks what is modelled and walks the model's segments once,
// so that many variants cost one walk. Thread-safe once created. A config with use_cache
// (transformers' DynamicCache) simulates only the variants that checkpoint no layer:
// transformers runs the others without the cache, on the config with use_cache off.
class StepSimulator {
 public:
  // Create returns InvalidArgument for a bad config or options and Unimplemented for a
  // model whose step is not simulated yet (the message names what).
  // `layouts`, where given, must be those of ModelGraphsFor(config, attention)'s graphs
  // for `config`.
  static absl::StatusOr<StepSimulator> Create(const ModelConfig& config,
                                              AttentionMode attention,
                                              const StepOptions& options,
                                              const ModelLayouts& layouts = {});
  // Create for a config its caller validated (a prediction's): not checked again.
  static absl::StatusOr<StepSimulator> Create(const ValidConfig& config,
                                              AttentionMode attention,
                                              const StepOptions& options,
                                              const ModelLayouts& layouts = {});
  // Simulate returns the variant's timeline and peak (Unimplemented for master weights).
  absl::StatusOr<StepTimeline> Simulate(const Variant& variant, const OptimizerSpec& optimizer,
                                        const ResidentBytes& resident) const;
  // ReductionStretch is the step's end alone for this model (its every parameter's
  // .grad, as the backward leaves them): the rank's data-parallel reduction (RankStep:
  // ZeRO 0-2, one pipeline stage of the whole model) and the optimizer's step. A caller
  // composing a rank's step from short models' stretches puts it after their tail.
  absl::StatusOr<StepStretch> ReductionStretch(const OptimizerSpec& optimizer,
                                               const ResidentBytes& resident) const;
  // Stretches replays every layer (no events) and returns the step's stretches.
  absl::StatusOr<StepStretches> Stretches(const Variant& variant, const OptimizerSpec& optimizer,
                                          const ResidentBytes& resident) const;
  const ModelConfig& config() const { return *config_; }
  AttentionMode attention() const { return attention_; }
  // LayerGlobalsOf: by layer kind (ModelGraphs::layer_kinds), what its layers read of
  // the model-level tensors.
  std::vector<LayerGlobals> LayerGlobalsOf() const;
  // Probe: this simulator for a short model of the model's own kinds of layer in another
  // order (StepOptions::layer_kinds), sharing the segments' plans. The checkpoint planner
  // composes a model whose layers differ from such probes' Stretches.
  StepSimulator Probe(std::vector<int> kinds) const {
    StepSimulator other = *this;
    other.options_.layer_kinds = std::move(kinds);
    return other;
  }
  // ForRank: this simulator for another rank of the same layout (its stage and chunks),
  // sharing the segments' plans, which do not depend on the rank.
  StepSimulator ForRank(const RankStep& rank) const {
    StepSimulator other = *this;
    other.options_.rank = rank;
    return other;
  }

 private:
  // ValidateProbe: ValidateRun for this model, and for a probe (StepOptions::layer_kinds)
  // its kinds and a plan of its length.
  absl::Status ValidateProbe(const Variant& variant, const OptimizerSpec& optimizer) const;
  // RankEnd is the real rank's step end (every parameter's gradient reduced and
  // stepped), made once per optimizer: a composed rank's step ends with it.
  absl::StatusOr<liveness_internal::SegmentSummary> RankEnd(
      const liveness_internal::ModelPlans& plans, const OptimizerSpec& optimizer,
      const ResidentBytes& resident) const;

  StepSimulator(const ValidConfig& config, AttentionMode attention, const StepOptions& options,
                std::shared_ptr<const liveness_internal::ModelPlans> plans)
      : config_(config), attention_(attention), options_(options), plans_(std::move(plans)) {}

  ValidConfig config_;
  AttentionMode attention_;
  StepOptions options_;
  std::shared_ptr<const liveness_internal::ModelPlans> plans_;  // the segments' plans
};

// SimulateStep predicts the step's timeline and peak. Unimplemented for a config whose
// step the simulation does not model yet (the message names the op or optimizer);
// InvalidArgument for a bad config or variant; OutOfRange on overflow.
absl::StatusOr<StepTimeline> SimulateStep(const ModelConfig& config, AttentionMode attention,
                                          const Variant& variant,
                                          const OptimizerSpec& optimizer,
                                          const ResidentBytes& resident,
                                          const StepOptions& options);

}  // namespace memledger

#endif  // ESTIMATOR_STEP_LIVENESS_H_
