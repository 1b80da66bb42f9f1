// Predict: every memory bucket of training a model (the study's block stack, or a Llama
// or GPT-2 family decoder from embedding to loss), per checkpointing variant, without
// running anything. The numbers are what memledger's runtime measures in the pinned
// LibTorch (kTorchRelease, estimator/graph/rules.h), byte for byte (see docs/DESIGN.md, "What is
// measured").
//
// Example:
//   memledger::ModelConfig config;  // the study's: 6 x 128, 4 heads, batch 16, seq 64
//   absl::StatusOr<memledger::Prediction> p = memledger::Predict(config, {});
//   if (p.ok()) std::cout << p->variants[0].saved_bytes;  // "none": 51052544
//
// Predict is thread-safe; the only state it keeps between calls is the graphs it built,
// one per model shape (ModelGraphsFor). Its cost does not depend on batch, seq or width,
// and not on layers either (identical layers are counted, not walked one by one; the
// step's peak is replayed on a few layers and composed). The buckets take microseconds,
// the peak (PredictOptions::peak) about 0.1-0.2 ms per variant.
#ifndef ESTIMATOR_PREDICT_PREDICT_H_
#define ESTIMATOR_PREDICT_PREDICT_H_

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "estimator/graph/block_graph.h"
#include "estimator/spec/config.h"
#include "estimator/step/liveness.h"
#include "estimator/graph/rules.h"
#include "estimator/saved/walker.h"

namespace memledger {

struct PredictOptions {
  AttentionMode attention = AttentionMode::kFlash;
  std::vector<Variant> variants = DefaultVariants();
  // breakdown fills VariantPrediction::blocks with every kept storage, op by op.
  bool breakdown = false;
  // rules: what each op keeps; null means the pinned release's
  // (RuleTable::Pinned()). Tests of the verifier pass a deliberately wrong table.
  const RuleTable* rules = nullptr;
  // optimizer: whose state optimizer_state_bytes counts.
  OptimizerSpec optimizer;
  // peak: predict each variant's whole-step peak (estimator/step/liveness.h), for configs
  // the step simulation models; timeline also keeps every allocation event.
  bool peak = true;
  bool timeline = false;
  // cpu_threads: LibTorch's intra-op threads, which size CPU kernels' workspaces (a few
  // KiB); the runtime uses min(4, cores).
  int cpu_threads = 1;
  // cuda_blocks: how a --device=cuda peak counts its storages (StepOptions::cuda_blocks):
  // the caching allocator's blocks, with the reserved peak (the default), or requests
  // rounded to 512 B, max_memory_allocated() with expandable segments and a lower bound
  // without, several times cheaper (the layout search's first pass).
  CudaBlocks cuda_blocks = CudaBlocks::kAllocator;
  // python_dispatch_mode: StepOptions::python_dispatch_mode (false: memledger's runtime).
  bool python_dispatch_mode = true;
};

// BlockKind is one kind of block in the stack, and how many blocks are of it.
struct BlockKind {
  bool checkpointed = false;
  bool input_requires_grad = true;  // false only for the first block
  int64_t count = 0;
  BlockWalk walk;  // with storages when PredictOptions::breakdown
  int layer_kind = 0;  // its graph: ModelGraphs::layer_kinds[layer_kind]
};

struct VariantPrediction {
  Variant variant;
  // The graphs this variant ran (names for its breakdown's indices): Prediction::graphs,
  // or for a checkpointing variant of a model with use_cache those without the cache.
  std::shared_ptr<const ModelGraphs> graphs;
  // saved_bytes: unique storages autograd keeps (parameters excluded) plus the selective
  // cache, for the whole model and the loss.
  int64_t saved_bytes = 0;
  int64_t cache_bytes = 0;  // the selective cache's share of saved_bytes
  double saved_ratio_vs_none = 0;
  // saved_bytes by segment: embedding (the prologue's storages), decoder layers (theirs,
  // the hidden states between them and the cache) and head + loss (the epilogue's and
  // the last hidden states). A model-level storage counts where it is first kept.
  int64_t embedding_bytes = 0;
  int64_t layers_bytes = 0;
  int64_t head_loss_bytes = 0;
  // input_bytes_kept: the part of saved_bytes that is the model input itself (the
  // study's hidden states, or token ids), which the caller allocated before the forward.
  int64_t input_bytes_kept = 0;
  // held_after_forward_bytes: what the forward allocated and still holds when it
  // returns, less the loss: saved_bytes less the model input, plus what checkpoints
  // hold without saving it (each checkpointed call's kCpuRngStateBytes RNG state, and
  // the model-level tensors only their call arguments hold). The witness measures it
  // with torch.profiler's memory events.
  int64_t held_after_forward_bytes = 0;
  // saved_bytes by the storages' dtype (indexed by DType), and the part that is
  // autocast's copies of weights, kept by the matmuls that use them.
  std::array<int64_t, kNumDTypes> saved_by_dtype{};
  int64_t weight_copy_bytes = 0;
  // peak: the whole training step's peak and where it happens, when the step
  // simulation models this config; otherwise peak_unavailable says why.
  std::optional<StepPeak> peak;
  // On --device=cuda: max_memory_reserved() for the step, the caching allocator's
  // segments at most (peak->bytes counts its blocks, as max_memory_allocated() does).
  int64_t peak_reserved_bytes = 0;
  // offloaded_bytes: with --offload_activations=cpu, the host memory save_on_cpu holds
  // when the forward returns (StepTimeline::offloaded_bytes).
  int64_t offloaded_bytes = 0;
  std::string peak_unavailable;
  // timeline: every allocation of the step, if PredictOptions::timeline.
  std::shared_ptr<const StepTimeline> timeline;
  std::vector<BlockKind> blocks;       // if PredictOptions::breakdown
  std::optional<BlockWalk> prologue;   // if PredictOptions::breakdown and there is one
  BlockWalk epilogue;                  // if PredictOptions::breakdown
};

struct Prediction {
  ModelConfig config;
  AttentionMode attention = AttentionMode::kFlash;
  // The graphs walked: names for the breakdown's indices. Owned, shared by copies.
  std::shared_ptr<const ModelGraphs> graphs;

  OptimizerSpec optimizer;
  int64_t n_params = 0;  // study: layers * (12 d^2 + 13 d); tied weights count once
  int64_t param_bytes = 0;  // in the model's dtype
  int64_t grad_bytes = 0;   // .grad, in the parameters' dtype: the trainable ones'
  // The parameters that train, and the bytes of those that do not (--freeze): part of
  // param_bytes, with no gradient and no optimizer state.
  int64_t n_trainable_params = 0;
  int64_t frozen_param_bytes = 0;
  // buffer_bytes: the modules' buffers (RoPE's inverse frequencies), resident all step.
  int64_t buffer_bytes = 0;
  // communication_bytes: a data-parallel rank's strategy's buffers held for the whole
  // run (DDP's Reducer buckets: RankKind::communication_bytes); 0 on one process.
  int64_t communication_bytes = 0;
  // optimizer_state_bytes: every tensor of torch.optim's opt.state: Adam(W)'s step,
  // exp_avg and
  // exp_avg_sq, SGD's momentum_buffer (when momentum > 0), and with master weights the
  // fp32 parameter copies (the state then is fp32 too).
  int64_t optimizer_state_bytes = 0;
  int64_t adamw_state_bytes = 0;  // AdamW's exp_avg + exp_avg_sq; 0 for other optimizers
  int64_t saved_bytes_none = 0;   // the reference for saved_ratio_vs_none
  std::vector<VariantPrediction> variants;

  // Korthikanti et al. 2022 for `none`: layers * 4 * 16 * B * T * d bytes (their 34sbh
  // without the two 1-byte dropout masks, in fp32); for math attention plus
  // layers * 8 * B * H * T^2 (their 5as^2b without the dropout mask, in fp32).
  int64_t korthikanti_saved_bytes_none = 0;
  double saved_none_over_korthikanti = 0;

  // caveats: what the real stack (transformers 5.23.0, torch 2.15.0) does for this run
  // that the prediction does not model yet, one line each (Caveats()).
  std::vector<std::string> caveats;
};

// ResidentTensors lists what exists before one process's step tensor by tensor, for
// the chunks it runs: each parameter (a tied weight once, the embedding's), then each
// one's optimizer state (Adam's exp_avg and exp_avg_sq, SGD's momentum buffer, the fp32
// master copy, the step), named by segment. Empty unless they sum to `param_bytes` and
// `state_bytes` (the prediction's, or a rank's).
std::vector<ResidentTensor> ResidentTensors(const ModelGraphs& graphs, const ModelConfig& config,
                                            const OptimizerSpec& optimizer,
                                            const std::vector<StageRange>& chunks,
                                            int64_t param_bytes, int64_t state_bytes);

// AddBufferTensors puts the model's buffers (BufferSizes: each its own storage, so its
// own CUDA block, as RoPE's inv_freq and its clone original_inv_freq are) among resident
// tensors, before the optimizer's state: where the step finds them allocated.
void AddBufferTensors(const ModelGraphs& graphs, const ModelConfig& config,
                      std::vector<ResidentTensor>* tensors);

// ResidentOf is what exists before the predicted process's step, as `prediction` counts
// it (param_bytes, optimizer_state_bytes, buffer_bytes) and, on --device=cuda, tensor by
// tensor (ResidentTensors, then AddBufferTensors), as a CUDA step's simulation needs it.
ResidentBytes ResidentOf(const Prediction& prediction);

// Caveats lists, for a run of `config` under `variants`, what the real stack does that
// memledger does not model yet (see docs/real_stack.md): oneDNN's
// low-precision matmul scratchpads.
std::vector<std::string> Caveats(const ModelConfig& config, const std::vector<Variant>& variants);

// OptimizerBytesPerParameter is what the optimizer holds per parameter: its moments
// (AdamW's exp_avg and exp_avg_sq, SGD's momentum buffer), in the dtype of what it
// steps, and with master weights the fp32 copy.
// per_tensor is what it holds per stepped tensor besides: torch.optim's Adam and AdamW
// keep a 0-dim fp32 `step` tensor in each parameter's state (adam.py:170-176).
struct OptimizerBytesPerParameter {
  int64_t moments = 0;
  int64_t master = 0;
  int64_t per_tensor = 0;
};
OptimizerBytesPerParameter OptimizerBytesOf(const ModelConfig& config,
                                            const OptimizerSpec& optimizer);

// StagePrediction is a stage's parameters and, per variant, what it keeps for one
// micro-batch (VariantPrediction's saved bytes and splits; no peak).
struct StagePrediction {
  // n_params: a stage with the head but not the embedding holds its own copy of a tied
  // embedding weight (Megatron keeps one on the last stage and all-reduces its grads).
  int64_t n_params = 0;
  // Of them those that train (ParameterCensus), and the tensors they are in: with
  // --freeze or LoRA the rest keep no gradient and no optimizer state, and stay in the
  // model's dtype.
  int64_t n_trainable_params = 0;
  int64_t n_trainable_tensors = 0;
  std::vector<VariantPrediction> variants;
};

// PredictStage: InvalidArgument for a bad config or a range outside the model's layers,
// OutOfRange on int64 overflow.
absl::StatusOr<StagePrediction> PredictStage(const ModelConfig& config,
                                             const PredictOptions& options,
                                             const StageRange& stage);
// PredictValidStage: PredictStage of a config the caller validated (a rank's layout
// validates once; estimator/predict/ranks.cc). REQUIRES: ValidateRunOf(config,
// options.attention, options.variants, options.optimizer).ok() and no DynamicCache.
absl::StatusOr<StagePrediction> PredictValidStage(const ValidConfig& config,
                                                  const PredictOptions& options,
                                                  const StageRange& stage);

// KorthikantiSavedBytes is Korthikanti et al.'s activation memory for `none` in the
// model's dtype, without dropout masks, per GPU of config.shard.tp (and config.shard.sp) tensor
// parallelism (see the definition for the derivation); -1 on overflow.
int64_t KorthikantiSavedBytes(const ModelConfig& config, AttentionMode attention);

// Predict returns InvalidArgument for a bad config, variant or policy (the message
// names the flag) and OutOfRange when a byte count would overflow int64.
absl::StatusOr<Prediction> Predict(const ModelConfig& config, const PredictOptions& options);
// PredictValid: Predict of a config the caller validated, for an entry point that has
// (PredictDistributed). REQUIRES: ValidateRunOf(config, options.attention,
// options.variants, options.optimizer).ok().
absl::StatusOr<Prediction> PredictValid(const ValidConfig& config, const PredictOptions& options);

}  // namespace memledger

#endif  // ESTIMATOR_PREDICT_PREDICT_H_
