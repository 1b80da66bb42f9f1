#include "runtime/model.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "runtime/attention.h"
#include "estimator/graph/block_graph.h"
#include "estimator/graph/family.h"
#include "runtime/family.h"
#include "runtime/last_use.h"
#include "runtime/selective_ops.h"
#include "runtime/tensor_parallel.h"

namespace memledger::runtime {
at::Tensor KvCacheUpdate(const at::Tensor& x, at::ScalarType keys_dtype,
                         std::vector<at::Tensor>* cache) {
  at::Tensor copy = at::cat({at::empty({0}, x.options().dtype(keys_dtype)), x}, -2);
  cache->push_back(copy);
  return copy;
}

std::vector<at::Tensor> LayerExtras::Defined() const {
  std::vector<at::Tensor> defined;
  for (const at::Tensor& t : tensors) {
    if (t.defined()) defined.push_back(t);
  }
  return defined;
}

at::Tensor PositionIds(int64_t seq) {
  return (at::arange(seq, at::kLong) + 0).unsqueeze(0);
}

BlockImpl::BlockImpl(int64_t width, int64_t heads) : width_(width), heads_(heads) {
  TORCH_CHECK(width % heads == 0, "width ", width, " is not divisible by heads ", heads);
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
  qkv = register_module("qkv", torch::nn::Linear(width, 3 * width));
  proj = register_module("proj", torch::nn::Linear(width, width));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
  fc1 = register_module("fc1", torch::nn::Linear(width, 4 * width));
  fc2 = register_module("fc2", torch::nn::Linear(4 * width, width));
}

at::Tensor BlockImpl::forward(const at::Tensor& x, const LayerExtras& /*extras*/,
                              AttentionMode mode, SelectiveCache* cache) {
  // One statement per last use (see Last): each intermediate dies right after the op
  // that reads it last, so a graph-free (checkpointed) forward peaks as Python's would.
  const int64_t batch = x.size(0), seq = x.size(1), d = width_;
  at::Tensor qkv_out = LinearOp(*qkv, LayerNormOp(*ln1, x, cache), cache);
  at::Tensor heads =
      Last(qkv_out).view({batch, seq, 3, heads_, d / heads_}).permute({2, 0, 3, 1, 4});
  at::Tensor a = AttentionOp(mode, heads.select(0, 0), heads.select(0, 1),
                             heads.select(0, 2), cache);
  heads.reset();
  at::Tensor projected =
      LinearOp(*proj, Last(a).transpose(1, 2).reshape({batch, seq, d}), cache);
  at::Tensor y = x + Last(projected);
  at::Tensor hidden = LinearOp(*fc1, LayerNormOp(*ln2, y, cache), cache);
  at::Tensor m = GeluOp(Last(hidden), "none", cache);
  at::Tensor out = LinearOp(*fc2, Last(m), cache);
  return Last(y) + Last(out);
}

ModelAndInput BuildModel(const ModelConfig& config, int64_t seed) {
  at::manual_seed(static_cast<uint64_t>(seed));
  ModelAndInput built;
  built.model = RuntimeFamilyOf(config.family).make_model(config);
  // The study's input is its first block's hidden states; a decoder's, token ids.
  built.input = FamilyOf(config.family).decoder
                    ? at::randint(config.vocab, {config.batch, config.seq}, at::kLong)
                    : at::randn({config.batch, config.seq, config.width});
  // --freeze: requires_grad_(False) on the parameters the estimator's graphs freeze, as
  // named_parameters() names them.
  if (config.freeze.any()) {
    const auto named = built.model->named_parameters();
    for (const std::string& name :
         FrozenParameterNames(*ModelGraphsFor(config, AttentionMode::kMath))) {
      const at::Tensor* parameter = named.find(name);
      TORCH_CHECK(parameter != nullptr, "--freeze: the runtime's model has no parameter ",
                  name);
      parameter->requires_grad_(false);
    }
  }
  built.model->amp = config.amp;
  built.model->checkpoint_impl = config.checkpoint_impl;
  built.model->use_cache = config.KeepsKvCache();
  if (config.dtype != DType::kFloat32) {
    // Drawn in fp32 with the same seed, then converted: the whole model in that dtype.
    const at::ScalarType dtype =
        config.dtype == DType::kBFloat16 ? at::kBFloat16 : at::kHalf;
    built.model->to(dtype);
    // Buffers stay fp32, as from_config(dtype=...) leaves LlamaRotaryEmbedding's
    // (modeling_llama.py:105: computed as float; measured fp32 by the witness), but for
    // those made in the default dtype, the model's (ModelImpl::BufferInModelDtype).
    for (auto& buffer : built.model->named_buffers()) {
      if (built.model->BufferInModelDtype(buffer.key())) continue;
      buffer.value().set_data(buffer.value().to(at::kFloat));
    }
    if (!FamilyOf(config.family).decoder) built.input = built.input.to(dtype);
  }
  return built;
}

at::Tensor StudyLoss(const at::Tensor& output) { return output.pow(2).mean(); }

at::Tensor CausalLmLoss(at::Tensor logits, const at::Tensor& input_ids, TensorParallel* tp) {
  const int64_t vocab = logits.size(-1);
  // transformers' ForCausalLMLoss upcasts before the loss: logits.float() (a no-op in
  // fp32); its fp32 `logits` and its padded `labels` are locals to its return, as the
  // caller's logits are.
  const at::Tensor logits32 = logits.to(at::kFloat);
  const at::Tensor padded = at::constant_pad_nd(input_ids, {0, 1}, -100);
  at::Tensor labels = padded.slice(1, 1).contiguous();
  if (tp != nullptr) {
    return tp->VocabCrossEntropy(logits32.view({-1, vocab}), Last(labels).view(-1));
  }
  // cross_entropy's two ops.
  at::Tensor log_probs = at::log_softmax(logits32.view({-1, vocab}), 1);
  return at::nll_loss_nd(Last(log_probs), Last(labels).view(-1), {}, at::Reduction::Mean,
                         -100);
}

at::Tensor CopyIn(TensorParallel* tp, const at::Tensor& x) {
  return tp == nullptr ? x : tp->CopyIn(x);
}

at::Tensor ToSequenceParallel(TensorParallel* tp, at::Tensor embeddings) {
  if (tp == nullptr || !tp->SequenceParallel()) return embeddings;
  return tp->Scatter(embeddings);
}

at::Tensor LmHeadLogits(TensorParallel* tp, const at::Tensor& normed, const at::Tensor& weight) {
  if (tp != nullptr && tp->SequenceParallel()) {
    return tp->GatherLinear(normed, weight, at::Tensor(), /*conv1d=*/false, nullptr);
  }
  return at::linear(CopyIn(tp, normed), weight);
}

namespace {
// ReplaysMatmul: the row-parallel output comes from the cache, already reduced.
bool ReplaysMatmul(const SelectiveCache* cache) {
  return cache != nullptr && cache->replaying() && cache->Saves(OpKind::kMatmul);
}
}  // namespace

at::Tensor ReduceScatter(TensorParallel& tp, const at::Tensor& x, const SelectiveCache* cache) {
  return tp.ReduceScatter(x, ReplaysMatmul(cache));
}

at::Tensor ReduceOut(TensorParallel* tp, const at::Tensor& x, const SelectiveCache* cache) {
  if (tp == nullptr) return x;
  return tp->ReduceOut(x, ReplaysMatmul(cache));
}

bool DecoderLayer::SequenceParallel() const {
  return tensor_parallel != nullptr && tensor_parallel->SequenceParallel();
}

at::Tensor DecoderLayer::ColumnInput(const at::Tensor& h) const {
  return SequenceParallel() ? h : CopyIn(tensor_parallel, h);
}

at::Tensor DecoderLayer::ColumnParallel(torch::nn::LinearImpl& linear, const at::Tensor& h,
                                        SelectiveCache* cache) const {
  if (!SequenceParallel()) return LinearOp(linear, h, cache);
  return GatherLinearOp(*tensor_parallel, linear.weight, linear.bias, /*conv1d=*/false, h,
                        cache);
}

at::Tensor DecoderLayer::RowParallel(torch::nn::LinearImpl& linear, const at::Tensor& x,
                                     SelectiveCache* cache) const {
  if (tensor_parallel == nullptr) return LinearOp(linear, x, cache);
  // Megatron's RowParallelLinear: each rank's partial sum without the bias, reduced,
  // then the replicated bias added once (GraphBuilder::RowParallelLinear).
  at::Tensor partial = FunctionalLinearOp(linear.weight, at::Tensor(), x, cache);
  at::Tensor reduced = SequenceParallel()
                           ? ReduceScatter(*tensor_parallel, Last(partial), cache)
                           : ReduceOut(tensor_parallel, Last(partial), cache);
  if (!linear.bias.defined()) return reduced;
  return Last(reduced) + linear.bias;
}

void ModelImpl::SetTensorParallel(TensorParallel* tp) {
  tensor_parallel = tp;
  for (int64_t i = 0; i < num_layers(); ++i) layer(i)->tensor_parallel = tp;
}

at::Tensor TakeShard(const at::Tensor& whole, const ParameterShard& shard) {
  if (shard.pieces.empty()) return whole;
  std::vector<at::Tensor> pieces;
  for (const auto& [start, length] : shard.pieces) {
    pieces.push_back(whole.narrow(shard.dim, start, length));
  }
  return at::cat(pieces, shard.dim);
}


}  // namespace memledger::runtime
