// The symbolic graphs of a model's segments (prologue, decoder layer, epilogue) as the
// pinned PyTorch (estimator/graph/rules.h) executes them for each family: every ATen op the
// forward runs, with symbolic shapes over the config's sizes (B, T, d, H, kv heads,
// d_head, F, V) and each tensor's dtype. What each op keeps is in estimator/rules.h.
//
// Example:
//   std::shared_ptr<const ModelGraphs> graphs = ModelGraphsFor(config, AttentionMode::kFlash);
//   for (const OpDef& op : graphs->Layer(0).ops) ...  // in execution order
#ifndef ESTIMATOR_GRAPH_BLOCK_GRAPH_H_
#define ESTIMATOR_GRAPH_BLOCK_GRAPH_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "estimator/spec/checked_math.h"
#include "estimator/spec/config.h"
#include "estimator/graph/rules.h"
#include "estimator/graph/shape.h"
#include "estimator/graph/walk_memo.h"

namespace memledger {

// ModelTensor names a model-level tensor: made once per forward (or per step) outside
// the segments and read by them, matched across graphs by this id.
enum class ModelTensor : uint8_t {
  kNone,        // not a model-level tensor
  kInputIds,    // the token ids (B, T), the model input
  kPositionIds, // position_ids (1, T)
  kRopeCos,     // the rotary tables (1, T, d_head) in the hidden states' dtype
  kRopeSin,
  // Gemma 3's sliding-window layers' own rotary tables (rope_local_base_freq): one pair
  // per layer type (modeling_gemma3.py, Gemma3TextModel.forward).
  kRopeLocalCos,
  kRopeLocalSin,
  // The sliding-window layers' (1, 1, T, T) bool mask, which transformers' sdpa_mask
  // materializes once seq >= sliding_window (masking_utils.py, _ignore_causal_mask_sdpa)
  // and the decoder model holds in causal_mask_mapping to its return.
  kSlidingMask,
};
inline constexpr int kNumModelTensors = static_cast<int>(ModelTensor::kSlidingMask) + 1;
// ModelTensorName: "input_ids", "position_ids", "rope.cos", "rope.sin", "rope_local.cos",
// "rope_local.sin", "sliding_mask" ("" for kNone).
const char* ModelTensorName(ModelTensor id);

// TensorDef is one tensor of the graph; its layout is derived during a walk.
struct TensorDef {
  std::string name;  // "ln1.out", "qkv.weight"
  DType dtype = DType::kFloat32;
  bool is_parameter = false;
  // frozen: a parameter that does not train (ModelConfig::freeze): it requires no grad,
  // so it gets no gradient and no optimizer state.
  bool frozen = false;
  // global: which model-level storage it is (kNone: none), made before the segments run
  // and shared by them; never requires grad, and counts once for the whole model however
  // many segments keep it.
  ModelTensor global = ModelTensor::kNone;
  bool is_global() const { return global != ModelTensor::kNone; }
  // is_tied: a parameter another segment owns (a tied LM head): not counted again.
  bool is_tied = false;
  // is_buffer: a module buffer (register_buffer): exists before the step, read by no op
  // the graph models, holds no gradient and is not stepped.
  bool is_buffer = false;
  // expert_shard: an expert-parallel rank's experts (--ep): its gradient is reduced over
  // the data-parallel ranks that hold the same experts (dp / ep of them), not over all.
  bool expert_shard = false;
  // host: on a CUDA step the tensor lives in host memory and holds no device bytes (the
  // memory-efficient kernel's philox seed and offset: attention.cu,
  // _efficient_attention_forward, at::kCPU unless a CUDA graph is being captured).
  bool host = false;
  std::vector<SymDim> shape;  // parameters, globals and the graph input only
};

// OpAttributes are an op's non-tensor arguments; each op reads only its own.
struct OpAttributes {
  std::vector<SymDim> shape = {};  // view, reshape, _unsafe_view, expand: target sizes;
                                   // triu's causal mask: (T, T)
  std::vector<int> permutation = {};  // permute
  int dim = 0;                   // transpose, select, slice, unsqueeze
  int dim1 = 0;                  // transpose: the other dimension
  int64_t index = 0;             // select
  SymDim start = Sym(0);  // slice: narrow(dim, start, length)
  SymDim length = Sym(0);
  // split_part: the slice is one part of a split() of its input; the parts share one
  // backward node (SplitBackward0: the parts' gradients concatenated) instead of one
  // SliceBackward0 each.
  bool split_part = false;
  bool keepdim = false;  // sum.dim_IntList
};

// OpDef is one op in execution order.
struct OpDef {
  OpType type;
  std::string name;  // where it sits in the block: "qkv", "attention.scores"
  std::vector<int> inputs;
  std::vector<int> outputs;
  OpAttributes attributes;
  // policy_kind says which selective-checkpointing op kind this op belongs to.
  std::optional<OpKind> policy_kind;
  // composite: the ops of one composite ATen call (matmul, linear) share an id, -1 for
  // none. The call's arguments are held until it returns, so a storage it reads lives
  // at least until the last of its ops.
  int composite = -1;
  // core_attention: one of math attention's core ops (scores to values), which
  // Megatron's selective recompute runs again in the backward instead of keeping.
  bool core_attention = false;
  // no_grad: the op makes no backward node and keeps nothing, as under torch.no_grad().
  // DoRA's lora_weight branch is written so: autograd records it, but the loss never
  // reaches its node (it is read only detached), so what it saves lives only as long as
  // the branch's Python locals; BlockGraph::node_held_until holds that much.
  bool no_grad = false;
};

// BlockGraph is one segment of the model: a decoder layer (hidden states (B, T, d) in,
// out), the prologue (no hidden input; token ids to the first hidden states) or the
// epilogue (the last hidden states to the loss).
struct BlockGraph {
  std::vector<TensorDef> tensors;
  std::vector<OpDef> ops;
  int input = -1;   // the hidden states coming in; -1 for the prologue
  int output = 0;   // the hidden states going out (the prologue's, a layer's) or the loss
  // parameter_order: the parameters in the modules' registration order, which
  // model.parameters() and so torch.optim visit; empty when that is the graph's order.
  std::vector<int> parameter_order;
  // held_until: (tensor, op) for a tensor a Python local (a module's argument, a
  // variable not yet rebound) holds until op has run, after its last reader; op -1:
  // until the segment's forward returns (the logits, which ForCausalLM returns).
  std::vector<std::pair<int, int>> held_until;
  // node_held_until: (tensor, op) for a tensor that a no_grad op's unreachable node
  // (OpDef::no_grad) saves, held until op has run where the forward saves with grad:
  // not in a checkpointed forward, whose pack hook stores a holder, nor in its
  // non-reentrant recompute, which fills no dead holder.
  std::vector<std::pair<int, int>> node_held_until;
  // decoder_returns_after: in an epilogue, the op after which the decoder model's forward
  // (LlamaModel, GPT2Model) returns, its final norm's last: its locals die there (the
  // last layer's output, rebound to the norm's; position ids; RoPE tables). -1: none
  // (the study's loss reads its input to the end).
  int decoder_returns_after = -1;
  // decoder_locals: in a prologue, what the decoder model's forward holds in its locals
  // until it returns, after its final norm: LlamaModel's and Gemma3TextModel's
  // inputs_embeds (the first layer's input, modeling_llama.py:370-388), GPT2Model's
  // inputs_embeds and position_embeds.
  std::vector<int> decoder_locals;
  // input_embeddings: in a prologue, the tensor the model's input embeddings module
  // (get_input_embeddings()) returns, which enable_input_require_grads' hook marks as
  // requiring grad (WalkOptions::input_embeddings_hooked); -1: none.
  int input_embeddings = -1;
  // returns: in a graph of the model's own tensors (ModelGraphs::tensors_before_prologue,
  // tensors_after_prologue), the tensors it hands the decoder model, by model-level id:
  // they outlive the graph (the decoder holds them to its return), and the segments read
  // them as globals (TensorDef::global). `output` is the last of them.
  std::vector<std::pair<int, ModelTensor>> returns;
  // walk_memo: what walks of this graph kept (estimator/graph/walk_memo.h); ModelGraphsFor
  // sets it on the graphs it caches, which never change after. Null: no memo.
  std::shared_ptr<WalkMemo> walk_memo;
  // RequiresGrad: which tensors require grad in a forward with grad, the graph's input
  // not (a prologue's case): a parameter that trains, and what an op makes from a
  // differentiable input that requires grad (RuleTable::Pinned()), integers and bools
  // never.
  std::vector<bool> RequiresGrad() const;
  // Parameters returns the parameter tensors in that order.
  std::vector<int> Parameters() const;
  // ForEachParameter calls f(tensor) for each parameter, in that order, copying nothing
  // (the step simulation lists them at every step).
  template <typename F>
  void ForEachParameter(F f) const {
    if (!parameter_order.empty()) {
      for (int t : parameter_order) f(t);
      return;
    }
    for (size_t t = 0; t < tensors.size(); ++t) {
      if (tensors[t].is_parameter) f(static_cast<int>(t));
    }
  }
};

// ModelGraphs is a model as segments: prologue (embedding; none for the study, whose
// input is the hidden state itself), the decoder layers, epilogue (final norm, LM head
// and loss; the study's x.pow(2).mean()). The layers are of a few kinds (Gemma 3's
// sliding-window and global layers) in a repeating pattern: layer i is
// layer_kinds[pattern[i % pattern.size()]]. Every consumer works per kind, so its cost
// grows with the kinds and the pattern's period, not with the layer count.
struct ModelGraphs {
  std::optional<BlockGraph> prologue;
  std::vector<BlockGraph> layer_kinds;  // at least one; all take and give (B, T, d)
  std::vector<int> pattern = {0};       // one period of kinds, into layer_kinds
  BlockGraph epilogue;
  // The decoder model's own tensors, made without grad once per forward (a pipeline's
  // later stage makes its own, as runtime/model.h's ModelImpl::Extras): graphs of no
  // input that return model-level tensors (BlockGraph::returns). Before the prologue
  // those its embedding reads (GPT-2's position ids); after it the layers' (position
  // ids, the sliding-window mask, the rotary tables). No ops: none.
  BlockGraph tensors_before_prologue;
  BlockGraph tensors_after_prologue;

  // prologue_output_requires_grad: the prologue's output requires grad (an embedding
  // trains); input_embeddings_leaf: what the input embeddings return does not (their
  // weights are frozen), so enable_input_require_grads' hook makes it a leaf that does.
  // Set by BuildModelGraphs.
  bool prologue_output_requires_grad = false;
  bool input_embeddings_leaf = false;
  // FirstInputRequiresGrad: whether the first layer's input requires grad. The study's
  // is the model input: no. The families' is the embeddings' output: yes while an
  // embedding trains; with the embeddings frozen only under checkpointing
  // (`checkpointing`), whose hook makes it a leaf that does (Freeze,
  // WalkOptions::input_embeddings_hooked).
  bool FirstInputRequiresGrad(bool checkpointing) const {
    return prologue_output_requires_grad || (checkpointing && input_embeddings_leaf);
  }
  // HookedPrologueDiffers: the hook changes the prologue's walk.
  bool HookedPrologueDiffers() const { return input_embeddings_leaf; }
  int KindOf(int64_t layer) const {
    return pattern[static_cast<size_t>(layer % static_cast<int64_t>(pattern.size()))];
  }
  const BlockGraph& Layer(int64_t layer) const { return layer_kinds[KindOf(layer)]; }
  int64_t Period() const { return static_cast<int64_t>(pattern.size()); }
  // LayersOfKind counts the layers of `kind` among [first, first + count), in closed
  // form.
  int64_t LayersOfKind(int kind, int64_t first, int64_t count) const;
  // FirstOfKind is the first layer of `kind`.
  int64_t FirstOfKind(int kind) const;
};

// FrozenParameterNames: the names of the frozen parameters (TensorDef::frozen), each once,
// as the runtime's named_parameters() names them.
std::vector<std::string> FrozenParameterNames(const ModelGraphs& graphs);

// BuildModelGraphs returns the graphs of `config.family` with `mode` attention, as the
// family's PyTorch code runs them (docs/DESIGN.md, "Model families").
// REQUIRES: ValidateConfig(config).ok().
ModelGraphs BuildModelGraphs(const ModelConfig& config, AttentionMode mode);

// TensorElements is one tensor's element count for `config`.
CheckedInt64 TensorElements(const TensorDef& tensor, const ModelConfig& config);

// ParameterCount sums a graph's parameters' elements for `config`; `tied`: those owned
// by another segment (a tied LM head's weight) instead of the others.
CheckedInt64 ParameterCount(const BlockGraph& graph, const ModelConfig& config,
                            bool tied = false);

// ParameterCensus is a stage's parameters: their elements, and how many tensors they are
// (torch.optim keeps per-tensor state: Adam's `step`); of them, those that train (not
// TensorDef::frozen), which alone have gradients and optimizer state.
struct ParameterCensus {
  CheckedInt64 elements = 0;
  int64_t tensors = 0;
  CheckedInt64 trainable_elements = 0;
  int64_t trainable_tensors = 0;
  CheckedInt64 frozen_elements = 0;  // elements less trainable_elements
};

// BufferBytes sums the model's buffers (TensorDef::is_buffer), which every rank's model
// holds whatever layers it runs.
CheckedInt64 BufferBytes(const ModelGraphs& graphs, const ModelConfig& config);
// BufferSizes is each of those buffers' bytes, one storage each, in the graphs' order.
std::vector<CheckedInt64> BufferSizes(const ModelGraphs& graphs, const ModelConfig& config);

// StageParameters counts the parameters a stage holds: its layers', the embedding's with
// the prologue, the head's with the head, and a tied head weight's own copy on a stage
// with the head but not the embedding (Megatron keeps one on the last stage).
ParameterCensus StageParameters(const ModelGraphs& graphs, const ModelConfig& config,
                                const StageRange& stage);

// ModelGraphsFor is BuildModelGraphs memoized: graphs depend on the sizes only through
// symbols, so one built graph serves every config of the same shape (family, attention
// mode, dtype, autocast, q/k/v bias, grouped-query attention or not, tied head). Thread-safe.
std::shared_ptr<const ModelGraphs> ModelGraphsFor(const ModelConfig& config,
                                                  AttentionMode mode);

}  // namespace memledger

#endif  // ESTIMATOR_GRAPH_BLOCK_GRAPH_H_
