// The Llama family in LibTorch (Llama 2/3, Mistral, Qwen2, Qwen3, and the sparse
// Qwen3-MoE and Mixtral), as transformers' modules run it (models/llama/modeling_llama.py,
// models/qwen3/modeling_qwen3.py, runtime/families/llama/sparse_moe.h), and its parameters
// under Megatron's tensor-parallel layout.
#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <torch/nn/init.h>

#include <cmath>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "runtime/attention.h"
#include "runtime/dropout.h"
#include "runtime/families/rotary.h"
#include "runtime/families/llama/llama.h"
#include "runtime/families/llama/sparse_moe.h"
#include "runtime/family.h"

namespace memledger::runtime {
namespace {

// RmsNormImpl is transformers' LlamaRMSNorm: x32 = x.to(float32); weight *
// (x32 * rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).
class RmsNormImpl : public torch::nn::Module {
 public:
  RmsNormImpl(int64_t width, double eps) : eps_(eps) {
    weight = register_parameter("weight", at::ones({width}));
  }
  at::Tensor forward(const at::Tensor& x) {
    // One statement per last use (see Last in runtime/model.h); LlamaRMSNorm.forward's
    // locals `variance` and `hidden_states` (normed) live to its return.
    at::Tensor x32 = x.to(at::kFloat);  // the upcast; x itself in fp32
    const at::Tensor variance = x32.pow(2).mean(-1, /*keepdim=*/true);
    at::Tensor shifted = variance + eps_;
    at::Tensor inverse = at::rsqrt(Last(shifted));
    const at::Tensor normed = Last(x32) * Last(inverse);
    return weight * normed.to(x.scalar_type());
  }
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RmsNorm);

class LlamaLayerImpl : public DecoderLayer {
 public:
  // With c.tp > 1, one rank's shard: heads, kv heads and MLP columns / tp.
  // A sparse layer runs the model's SparseMoeBlock ("mlp") where a dense one runs
  // LlamaMLP.
  LlamaLayerImpl(const ModelConfig& c, bool sparse)
      : heads_(c.heads / c.shard.tp), kv_heads_(c.KvHeads() / c.shard.tp), head_dim_(c.HeadDim()) {
    const int64_t d = c.width, q_width = heads_ * head_dim_, kv_width = kv_heads_ * head_dim_,
                  intermediate = c.Intermediate() / c.shard.tp;
    auto linear = [](int64_t in, int64_t out, bool bias) {
      return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
    };
    // transformers' registration order (modeling_llama.py:273-282): self_attn, mlp,
    // then the norms; torch.optim steps parameters() in it.
    q_proj = register_module("q_proj", linear(d, q_width, c.qkv_bias));
    k_proj = register_module("k_proj", linear(d, kv_width, c.qkv_bias));
    v_proj = register_module("v_proj", linear(d, kv_width, c.qkv_bias));
    o_proj = register_module("o_proj", linear(q_width, d, c.o_bias));
    if (c.qk_norm) {  // Qwen3Attention registers them after o_proj (modeling_qwen3.py)
      q_norm = register_module("q_norm", RmsNorm(head_dim_, c.norm_eps));
      k_norm = register_module("k_norm", RmsNorm(head_dim_, c.norm_eps));
    }
    if (sparse) {
      mlp = register_module("mlp", SparseMoe(c.moe, d));
    } else {
      gate_proj = register_module("gate_proj", linear(d, intermediate, c.mlp_bias));
      up_proj = register_module("up_proj", linear(d, intermediate, c.mlp_bias));
      down_proj = register_module("down_proj", linear(intermediate, d, c.mlp_bias));
    }
    input_layernorm = register_module("input_layernorm", RmsNorm(d, c.norm_eps));
    post_attention_layernorm =
        register_module("post_attention_layernorm", RmsNorm(d, c.norm_eps));
  }

  at::Tensor forward(const at::Tensor& x, const LayerExtras& extras, AttentionMode mode,
                     SelectiveCache* cache) override {
    // One statement per last use (see Last in runtime/model.h), in the graph's order.
    // With tensor parallelism, Megatron's f (CopyIn) before the column-parallel
    // projections and g (ReduceOut) after the row-parallel ones; with sequence
    // parallelism x holds this rank's T / tp tokens, the column-parallel projections
    // all-gather them and the row-parallel ones reduce-scatter.
    const int64_t b = x.size(0), t = extras[ModelTensor::kRopeCos].size(1);  // all T tokens
    // Qwen3: q_norm(q_proj(h).view(B, T, -1, d_head)).transpose(1, 2), and k_norm on k.
    auto heads = [&](const at::Tensor& projected, int64_t n, RmsNorm* norm = nullptr) {
      at::Tensor split = projected.view({b, t, n, head_dim_});
      if (norm != nullptr && !norm->is_empty()) split = (*norm)->forward(Last(split));
      return Last(split).transpose(1, 2);
    };
    // LlamaAttention.forward's argument and locals (hidden_states, query_states,
    // key_states, value_states) live to its return, after o_proj; LlamaMLP.forward's x
    // to its return, after down_proj (modeling_llama.py:164, 206-250).
    at::Tensor h = ColumnInput(input_layernorm->forward(x));
    at::Tensor q = heads(ColumnParallel(*q_proj, h, cache), heads_, &q_norm);
    at::Tensor k = heads(ColumnParallel(*k_proj, h, cache), kv_heads_, &k_norm);
    at::Tensor v = heads(ColumnParallel(*v_proj, h, cache), kv_heads_);
    at::Tensor a = RopeAttention(q, k, v, extras, RotaryTables(), heads_, kv_heads_, mode, cache);
    at::Tensor merged = Last(a).transpose(1, 2).contiguous().reshape({b, t, -1});
    at::Tensor projected = RowParallel(*o_proj, Last(merged), cache);
    h = q = k = v = at::Tensor();  // self_attn returns
    at::Tensor x1 = x + Last(projected);
    at::Tensor h2 = ColumnInput(post_attention_layernorm->forward(x1));
    at::Tensor down;
    if (mlp) {
      down = mlp->forward(h2, cache);
    } else {
      at::Tensor gate = ColumnParallel(*gate_proj, h2, cache);
      at::Tensor act = SiluOp(Last(gate), cache);
      at::Tensor up = ColumnParallel(*up_proj, h2, cache);
      at::Tensor product = Last(act) * Last(up);
      down = RowParallel(*down_proj, Last(product), cache);
    }
    h2 = at::Tensor();  // mlp returns
    return Last(x1) + Last(down);
  }

  RmsNorm input_layernorm{nullptr};
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  RmsNorm q_norm{nullptr}, k_norm{nullptr};  // Qwen3 only
  RmsNorm post_attention_layernorm{nullptr};
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};  // dense
  SparseMoe mlp{nullptr};  // sparse

 private:
  int64_t heads_, kv_heads_, head_dim_;
};

class LlamaModel : public ModelImpl {
 public:
  explicit LlamaModel(const ModelConfig& c) : head_dim_(c.HeadDim()) {
    const int64_t vocab = c.vocab / c.shard.tp;  // a tensor-parallel rank's rows
    embed_tokens = register_module("embed_tokens", torch::nn::Embedding(vocab, c.width));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.layers; ++i) {
      layers->push_back(std::make_shared<LlamaLayerImpl>(c, c.moe.IsSparse(i)));
    }
    norm = register_module("norm", RmsNorm(c.width, c.norm_eps));
    // LlamaRotaryEmbedding's buffers (modeling_llama.py:86-87): fp32, d_head / 2 each.
    at::Tensor inv_freq =
        1.0 / at::pow(10000.0, at::arange(0, head_dim_, 2, at::kFloat) / head_dim_);
    register_buffer("rotary_emb_inv_freq", inv_freq);
    register_buffer("rotary_emb_original_inv_freq", inv_freq.clone());
    if (!c.tie_embeddings) {
      lm_head = register_module(
          "lm_head", torch::nn::Linear(torch::nn::LinearOptions(c.width, vocab).bias(false)));
    }
  }

  ModelStart Prologue(const at::Tensor& input_ids) const override {
    ModelStart start;
    start.hidden = InputEmbeddings(
        tensor_parallel != nullptr
            ? tensor_parallel->VocabEmbedding(input_ids, embed_tokens->weight)
            : embed_tokens.ptr()->forward(input_ids));
    start.extras = Extras(input_ids.size(1), start.hidden.scalar_type());
    start.hidden = ToSequenceParallel(tensor_parallel, std::move(start.hidden));
    start.decoder_locals = {start.hidden};  // inputs_embeds
    return start;
  }

  LayerExtras Extras(int64_t seq, at::ScalarType dtype) const override {
    // position_ids, then LlamaRotaryEmbedding (theta 10000, scaling 1): cos, sin of
    // (1, T, d_head).
    at::NoGradGuard no_grad;
    LayerExtras extras;
    extras[ModelTensor::kPositionIds] = PositionIds(seq);
    std::tie(extras[ModelTensor::kRopeCos], extras[ModelTensor::kRopeSin]) =
        RopeTables(seq, head_dim_, 10000.0, dtype);
    return extras;
  }

  at::Tensor Epilogue(at::Tensor hidden, const at::Tensor& input_ids,
                      const std::function<void()>& decoder_returns) const override {
    const at::Tensor& weight = lm_head ? lm_head->weight : embed_tokens->weight;
    // The decoder's output lives to the return (LlamaForCausalLM's `hidden_states`).
    const at::Tensor normed = norm.ptr()->forward(hidden);
    hidden = at::Tensor();  // LlamaModel.forward returns its norm's output
    decoder_returns();
    at::Tensor logits = LmHeadLogits(tensor_parallel, normed, weight);
    // `logits` lives to the return, as transformers' ForCausalLM keeps it beside the
    // loss computed on logits.float().
    return CausalLmLoss(logits, input_ids, tensor_parallel);
  }

  torch::nn::Embedding embed_tokens{nullptr};
  RmsNorm norm{nullptr};
  torch::nn::Linear lm_head{nullptr};

 private:
  int64_t head_dim_;
};

}  // namespace

// Megatron's layout of nn.Linear weights (out, in): q/k/v, gate/up (and their biases)
// and the vocabulary rows split by output, o_proj and down_proj by input; their biases
// and the norms replicated.
ParameterShard LlamaShardOf(const ModelConfig& c, const std::string& name, int64_t r) {
  const int64_t hd = c.HeadDim(), q = c.heads / c.shard.tp * hd, kv = c.KvHeads() / c.shard.tp * hd,
                f = c.Intermediate() / c.shard.tp, v = c.vocab / c.shard.tp;
  if (absl::EndsWith(name, "q_proj.weight") || absl::EndsWith(name, "q_proj.bias")) {
    return Split(0, q, r);
  }
  for (const char* kv_name : {"k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"}) {
    if (absl::EndsWith(name, kv_name)) return Split(0, kv, r);
  }
  if (absl::EndsWith(name, "o_proj.weight")) return Split(1, q, r);
  for (const char* mlp_name : {"gate_proj.weight", "gate_proj.bias", "up_proj.weight",
                               "up_proj.bias"}) {
    if (absl::EndsWith(name, mlp_name)) return Split(0, f, r);
  }
  if (absl::EndsWith(name, "down_proj.weight")) return Split(1, f, r);
  if (name == "embed_tokens.weight" || name == "lm_head.weight") return Split(0, v, r);
  return {};
}

bool LlamaGradientIsPartial(const ModelConfig& c, const std::string& name) {
  // Qwen3's q_norm and k_norm weights are replicated, but each rank normalises its own
  // heads only: transformers' tensor-parallel plan marks them
  // "replicated_with_grad_allreduce" (configuration_qwen3.py, base_model_tp_plan).
  if (c.shard.tp > 1 &&
      (absl::EndsWith(name, "q_norm.weight") || absl::EndsWith(name, "k_norm.weight"))) {
    return true;
  }
  return ReplicatedUnderSequenceParallelism(c, name);
}

const RuntimeFamily& LlamaRuntimeFamily() {
  static const RuntimeFamily kDef = {
      .id = Family::kLlama,
      .make_model = [](const ModelConfig& c) -> std::shared_ptr<ModelImpl> {
        return std::make_shared<LlamaModel>(c);
      },
      .shard_of = LlamaShardOf,
      .gradient_is_partial = LlamaGradientIsPartial,
      .prologue_prefixes = {"embed_tokens."},
  };
  return kDef;
}

}  // namespace memledger::runtime
