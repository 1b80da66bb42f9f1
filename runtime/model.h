// The measured models in LibTorch: the study's block stack and the decoder families
// (Llama, GPT-2), written op for op as docs/DESIGN.md's "Model families" fixes them, so that
// estimator and runtime describe the same computation.
//
// A model is a prologue (model input -> first hidden states, plus the tensors every
// layer reads), `num_layers()` decoder layers, and an epilogue (last hidden states ->
// loss). Checkpointing (runtime/checkpoint.h) wraps single layers.
//
// Example:
//   ModelAndInput built = BuildModel(config, /*seed=*/0);
//   ModelStart start = built.model->Prologue(built.input);
//   at::Tensor x = built.model->layer(0)->forward(start.hidden, start.extras,
//                                                 AttentionMode::kFlash, nullptr);
#ifndef RUNTIME_MODEL_H_
#define RUNTIME_MODEL_H_

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <array>
#include <vector>

#include "estimator/graph/block_graph.h"
#include "estimator/spec/config.h"
#include "runtime/last_use.h"
#include "runtime/selective_ops.h"
#include "runtime/tensor_parallel.h"

namespace memledger::runtime {

// LayerExtras are the model-level tensors the decoder layers read besides their hidden
// states, made once per forward with no grad, by the estimator's names for them
// (ModelTensor, estimator/graph/block_graph.h): position ids, the rotary tables (1, T,
// d_head), the sliding-window layers' own tables and (1, 1, T, T) bool mask.
// ModelImpl::ExtrasOf hands each layer those it reads; undefined where a model has none.
struct LayerExtras {
  std::array<at::Tensor, kNumModelTensors> tensors;
  at::Tensor& operator[](ModelTensor id) { return tensors[static_cast<int>(id)]; }
  const at::Tensor& operator[](ModelTensor id) const { return tensors[static_cast<int>(id)]; }
  // kv_cache: transformers' DynamicCache while the forward keeps one (ModelImpl::
  // use_cache, no layer checkpointed): KvCacheUpdate appends each layer's keys and
  // values; the caller's vector holds them until the forward returns. Null otherwise.
  std::vector<at::Tensor>* kv_cache = nullptr;
  // Defined returns the defined tensors, in order: what a checkpointed layer holds
  // (transformers' keyword arguments of the layer, bound into the checkpointed call).
  std::vector<at::Tensor> Defined() const;
};

// KvCacheUpdate is DynamicLayer.update without a past (cache_utils.py):
// torch.cat([torch.tensor([], dtype=keys_dtype), x], dim=-2), a contiguous copy of x
// (promoted to the keys' dtype, as the layer's empty tensors have it) that `cache` keeps.
at::Tensor KvCacheUpdate(const at::Tensor& x, at::ScalarType keys_dtype,
                         std::vector<at::Tensor>* cache);

// PositionIds is transformers' position_ids, torch.arange(T) + past_seen_tokens (0),
// unsqueezed (modeling_llama.py:375-378, modeling_gpt2.py:571-572).
at::Tensor PositionIds(int64_t seq);

// The identity without tensor parallelism (`tp` null), else tp's. ReduceOut takes the
// row-parallel linear's output: under a replay of a `cache` that saves matmuls it is the
// cached one, which the recording forward already reduced in place.
at::Tensor CopyIn(TensorParallel* tp, const at::Tensor& x);
at::Tensor ReduceOut(TensorParallel* tp, const at::Tensor& x, const SelectiveCache* cache);
// ReduceScatter is tp.ReduceScatter of the row-parallel output x, likewise.
at::Tensor ReduceScatter(TensorParallel& tp, const at::Tensor& x, const SelectiveCache* cache);
// ToSequenceParallel: the embeddings as the first layer gets them; with sequence
// parallelism Megatron scatters them to the sequence-parallel region.
at::Tensor ToSequenceParallel(TensorParallel* tp, at::Tensor embeddings);
// LmHeadLogits: the decoder families' LM head on the final norm's output `normed`
// (weight: a vocabulary-parallel rank's rows): with sequence parallelism it gathers its
// input too (Megatron's gather-linear), else f (CopyIn) before the linear.
at::Tensor LmHeadLogits(TensorParallel* tp, const at::Tensor& normed, const at::Tensor& weight);

// DecoderLayer is one layer. With a `cache`, the ops its policy names are recorded or
// replayed (runtime/selective_ops.h); without, every op runs plainly.
class DecoderLayer : public torch::nn::Module {
 public:
  virtual at::Tensor forward(const at::Tensor& x, const LayerExtras& extras,
                             AttentionMode mode, SelectiveCache* cache) = 0;
  // tensor_parallel: null in one process; set by ModelImpl::SetTensorParallel.
  TensorParallel* tensor_parallel = nullptr;

 protected:
  // Megatron's linears for nn.Linear layers (Llama's, Gemma 3's). With sequence
  // parallelism the layer's input holds this rank's T / tp tokens: each column-parallel
  // projection all-gathers it, each row-parallel one reduce-scatters; without, f
  // (CopyIn) before the column-parallel ones and g (ReduceOut) after the row-parallel.
  bool SequenceParallel() const;
  // ColumnInput: the input of column-parallel projections, through f unless sequence
  // parallel (where each projection gathers it).
  at::Tensor ColumnInput(const at::Tensor& h) const;
  at::Tensor ColumnParallel(torch::nn::LinearImpl& linear, const at::Tensor& h,
                            SelectiveCache* cache) const;
  at::Tensor RowParallel(torch::nn::LinearImpl& linear, const at::Tensor& x,
                         SelectiveCache* cache) const;
};

// ModelStart is what the prologue hands the first layer.
struct ModelStart {
  at::Tensor hidden;
  LayerExtras extras;
  // decoder_locals: what the decoder model's forward holds in its locals until it
  // returns, after its final norm (LlamaModel's inputs_embeds, modeling_llama.py:370-388).
  std::vector<at::Tensor> decoder_locals;
};

// ModelImpl is a whole trainable model; its layers are registered in order as "layers".
class ModelImpl : public torch::nn::Module {
 public:
  int64_t num_layers() const { return static_cast<int64_t>(layers->size()); }
  std::shared_ptr<DecoderLayer> layer(int64_t index) const {
    return layers->ptr<DecoderLayer>(static_cast<size_t>(index));
  }
  // Prologue maps the model input to the first hidden states and the layers' extras.
  virtual ModelStart Prologue(const at::Tensor& input) const = 0;
  // InputEmbeddings is what a prologue calls on its input embeddings' output
  // (get_input_embeddings()'s): enable_input_require_grads' forward hook, which
  // transformers' activation_checkpointing_enable registers (modeling_utils.py:3180-3189,
  // 2143-2144), while hook_input_embeddings is set (ForwardStage, for a variant that
  // checkpoints): output.requires_grad_(True), which makes the output of frozen
  // embeddings a leaf that requires grad (the estimator's Freeze).
  at::Tensor InputEmbeddings(at::Tensor output) const {
    if (hook_input_embeddings && !output.requires_grad()) output.requires_grad_(true);
    return output;
  }
  mutable bool hook_input_embeddings = false;
  // TrainableParameters: parameters() less the frozen ones (requires_grad false), which
  // get no .grad and which torch.optim does not step.
  std::vector<at::Tensor> TrainableParameters() const {
    std::vector<at::Tensor> trainable;
    for (const at::Tensor& p : parameters()) {
      if (p.requires_grad()) trainable.push_back(p);
    }
    return trainable;
  }
  // Epilogue maps the last hidden states (and the model input, for labels) to the loss.
  // Where the decoder model's forward (LlamaModel, GPT2Model) returns, after its final
  // norm, it drops `hidden` (rebound to the norm's output there) and calls
  // `decoder_returns`, where the caller drops that forward's other locals (position
  // ids, RoPE tables).
  virtual at::Tensor Epilogue(at::Tensor hidden, const at::Tensor& input,
                              const std::function<void()>& decoder_returns) const = 0;
  // Extras makes the layers' extras for `seq` tokens whose hidden states have `dtype`,
  // without grad: what Prologue adds, for a pipeline stage that receives its hidden
  // states (each stage computes its own RoPE tables, as Megatron does).
  virtual LayerExtras Extras(int64_t /*seq*/, at::ScalarType /*dtype*/) const { return {}; }
  // ExtrasOf is what layer `index` is called with of the model's extras (Gemma 3: its
  // layer type's tables and mask); all of them by default.
  virtual LayerExtras ExtrasOf(int64_t /*index*/, const LayerExtras& extras) const {
    return extras;
  }
  // CacheLayers: what transformers' DynamicCache makes for the layers besides their keys
  // and values, held with them to the forward's return (Gemma 3's sliding-window layers'
  // 8-byte tensors); made after the prologue of a forward that keeps the cache.
  virtual std::vector<at::Tensor> CacheLayers() const { return {}; }
  // BufferInModelDtype: a buffer transformers makes in the default dtype, so in the
  // model's dtype (Gemma 3's embed_scale); the others stay fp32.
  virtual bool BufferInModelDtype(const std::string& /*name*/) const { return false; }
  // CallsLayersWithPositionIds: transformers' decoder models pass position_ids to every
  // layer (which a checkpointed one holds); Megatron's GPT does not.
  virtual bool CallsLayersWithPositionIds() const { return true; }

  // SetTensorParallel makes a model built with config.shard.tp > 1 (one rank's shard) call
  // `tp` at Megatron's communication points; it must outlive the model's use.
  void SetTensorParallel(TensorParallel* tp);

  torch::nn::ModuleList layers{nullptr};
  // amp: autocast's dtype for the forward (config.amp); kFloat32 runs without autocast.
  DType amp = DType::kFloat32;
  // checkpoint_impl: how its checkpointed layers run (config.checkpoint_impl).
  CheckpointImpl checkpoint_impl = CheckpointImpl::kNonReentrant;
  // use_cache: transformers' use_cache (config.use_cache), kept by a forward that
  // checkpoints no layer.
  bool use_cache = false;
  TensorParallel* tensor_parallel = nullptr;
};

// ParameterShard is the part of the whole model's parameter that a tensor-parallel rank
// holds: along `dim`, the concatenation of `pieces` (start, length); the whole tensor
// when `pieces` is empty (replicated).
struct ParameterShard {
  int64_t dim = 0;
  std::vector<std::pair<int64_t, int64_t>> pieces;
};
// ShardOf and GradientIsPartial ask the family's RuntimeFamily (runtime/family.h),
// which knows its parameter names.
// ShardOf: rank `tp_rank`'s part of parameter `name` (as named_parameters() names it)
// under Megatron's layout for config.shard.tp ranks: q/k/v, gate/up, c_attn (per q, k, v),
// c_fc and the LM head and token embedding (vocabulary rows) split by output; o_proj,
// down_proj and both c_proj split by input; norms, biases of row-parallel linears and
// GPT-2's position embedding replicated.
ParameterShard ShardOf(const ModelConfig& config, const std::string& name, int64_t tp_rank);
// GradientIsPartial: with sequence parallelism (config.shard.sp), a replicated parameter used
// on a rank's T / tp tokens only (norms, row-parallel biases; not GPT-2's position
// embedding, added before the scatter) gets a partial gradient on each rank, to be
// all-reduced over the tensor-parallel group.
bool GradientIsPartial(const ModelConfig& config, const std::string& name);
// TakeShard is `whole`'s part under `shard` (a new tensor; `whole` itself if replicated).
at::Tensor TakeShard(const at::Tensor& whole, const ParameterShard& shard);

// BlockImpl is the study's pre-LN block with 12 d^2 + 13 d parameters:
//   h = ln1(x); qkv = qkv_lin(h)                      // Linear(d, 3d)
//   q, k, v = qkv.view(B, T, 3, H, dh).permute(2, 0, 3, 1, 4)   // views of qkv
//   x = x + proj(attention(q, k, v).transpose(1, 2).reshape(B, T, d))
//   x = x + fc2(gelu(fc1(ln2(x))))                   // Linear(d, 4d), exact GELU
// REQUIRES: width % heads == 0.
class BlockImpl : public DecoderLayer {
 public:
  BlockImpl(int64_t width, int64_t heads);
  at::Tensor forward(const at::Tensor& x, const LayerExtras& extras, AttentionMode mode,
                     SelectiveCache* cache) override;

  torch::nn::LayerNorm ln1{nullptr};
  torch::nn::Linear qkv{nullptr};
  torch::nn::Linear proj{nullptr};
  torch::nn::LayerNorm ln2{nullptr};
  torch::nn::Linear fc1{nullptr};
  torch::nn::Linear fc2{nullptr};

 private:
  int64_t width_;
  int64_t heads_;
};

// ModelAndInput is a freshly built model and its input batch: for the study fp32
// hidden states (B, T, d) that do not require grad; for the decoder families int64
// token ids (B, T) drawn uniformly from the vocabulary.
struct ModelAndInput {
  std::shared_ptr<ModelImpl> model;
  at::Tensor input;
};

// BuildModel seeds LibTorch's generator with `seed`, builds the model of
// `config.family`, then draws the input, so the same (config, seed) always gives the
// same model and input; a low-precision model (and the study's input) is then
// converted to config.dtype. With config.shard.tp > 1 the model is one rank's shard (heads, kv
// heads, MLP columns and vocabulary rows / tp), drawn in those shapes: a rank copies its
// parameters from the whole model's (ShardOf).
// REQUIRES: ValidateConfig(config).ok().
ModelAndInput BuildModel(const ModelConfig& config, int64_t seed);

// StudyLoss is the study's loss, x.pow(2).mean() (pow with a Scalar exponent).
at::Tensor StudyLoss(const at::Tensor& output);

// CausalLmLoss is the decoder families' loss: labels = pad(input_ids, (0, 1),
// value=-100)[..., 1:].contiguous(); cross_entropy(logits.float().view(-1, V),
// labels.view(-1)); over vocabulary-parallel logits with `tp`.
at::Tensor CausalLmLoss(at::Tensor logits, const at::Tensor& input_ids,
                        TensorParallel* tp = nullptr);


}  // namespace memledger::runtime

#endif  // RUNTIME_MODEL_H_
