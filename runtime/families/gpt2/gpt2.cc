// The GPT-2 family in LibTorch: transformers' GPT2LMHeadModel (models/gpt2/
// modeling_gpt2.py) and, with ModelConfig::megatron, Megatron-LM's GPT block; and its
// parameters under Megatron's tensor-parallel layout.
#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <torch/nn/init.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "runtime/attention.h"
#include "runtime/dropout.h"
#include "runtime/family.h"

namespace memledger::runtime {
namespace {

// Times is Python's `x * c` with a number c: mul.Tensor with c wrapped in a 0-dim
// float64 tensor, which MulBackward0 keeps (at::mul(x, double) would be mul.Scalar,
// which keeps nothing).
at::Tensor Times(const at::Tensor& x, double c) {
  return at::mul(x, at::native::wrapped_scalar_tensor(c));
}

// NewGelu is transformers' NewGELUActivation (activations.py), GPT-2's gelu_new, op by op
// as Python evaluates 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) *
// (input + 0.044715 * torch.pow(input, 3.0)))); `1.0 + t` is add.Tensor with the number
// wrapped, as the estimator's add-of-a-number.
at::Tensor NewGelu(at::Tensor x) {
  at::Tensor half = Times(x, 0.5);
  at::Tensor cube = at::pow(x, 3.0);
  at::Tensor cubic = Times(Last(cube), 0.044715);
  at::Tensor inner = at::add(Last(x), Last(cubic));
  at::Tensor scaled = Times(Last(inner), std::sqrt(2.0 / M_PI));
  at::Tensor tanh = at::tanh(Last(scaled));
  at::Tensor one_plus = at::add(Last(tanh), at::native::wrapped_scalar_tensor(1.0));
  return Last(half) * Last(one_plus);
}

// Conv1DParams is GPT-2's Conv1D: weight (in, out) drawn from N(0, 0.02), bias zeros.
struct Conv1DParams {
  at::Tensor weight, bias;
};

class Gpt2LayerImpl : public DecoderLayer {
 public:
  // With c.shard.tp > 1, one rank's shard: heads and MLP columns / tp. With c.megatron,
  // Megatron's dropouts (sites named by `index`) and fused causal softmax.
  Gpt2LayerImpl(const ModelConfig& c, int64_t index)
      : heads_(c.heads / c.shard.tp), head_dim_(c.HeadDim()), attention_width_(heads_ * head_dim_),
        index_(c.megatron ? index : -1), dropout_(c.dropout) {
    const int64_t d = c.width, f = c.Intermediate() / c.shard.tp, a = attention_width_;
    auto norm = [&](const char* name) {
      return register_module(
          name, torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(c.norm_eps)));
    };
    auto conv = [&](const std::string& name, int64_t in, int64_t out) {
      Conv1DParams p;
      p.weight = register_parameter(name + "_weight", at::randn({in, out}) * 0.02);
      p.bias = register_parameter(name + "_bias", at::zeros({out}));
      return p;
    };
    ln_1 = norm("ln_1");
    c_attn = conv("c_attn", d, 3 * a);
    attn_c_proj = conv("attn_c_proj", a, d);
    ln_2 = norm("ln_2");
    c_fc = conv("c_fc", d, f);
    mlp_c_proj = conv("mlp_c_proj", f, d);
  }

  at::Tensor forward(const at::Tensor& x, const LayerExtras& extras, AttentionMode mode,
                     SelectiveCache* cache) override {
    // One statement per last use (see Last in runtime/model.h), in the graph's order.
    // With tensor parallelism, ColumnParallel and RowParallel convolutions; with sequence
    // parallelism x holds this rank's T / tp tokens and attention all of them.
    const int64_t b = x.size(0);
    // GPT2Block.forward's locals (modeling_gpt2.py): `hidden_states`, ln_1's output, until
    // `hidden_states = attn_output + residual` rebinds it, ln_2's to the return, and
    // `attn_output` to the return too. Megatron's block holds none of them.
    const bool python_locals = index_ < 0;
    at::Tensor normed1 = LayerNormOp(*ln_1, x, cache);
    at::Tensor qkv = ColumnParallel(c_attn, python_locals ? normed1 : Last(normed1), cache);
    const int64_t t = qkv.size(1);
    std::vector<at::Tensor> parts = Last(qkv).split(attention_width_, 2);
    for (at::Tensor& part : parts) part = part.view({b, t, heads_, head_dim_}).transpose(1, 2);
    if (extras.kv_cache != nullptr) {
      // key_states, value_states = curr_past_key_values.update(...) (modeling_gpt2.py).
      const at::ScalarType keys = parts[1].scalar_type();
      parts[1] = KvCacheUpdate(parts[1], keys, extras.kv_cache);
      parts[2] = KvCacheUpdate(parts[2], keys, extras.kv_cache);
    }
    at::Tensor a;
    if (index_ >= 0) {
      a = MegatronCoreAttention(parts[0], parts[1], parts[2], index_);
      parts.clear();
    } else if (dropout_.attn > 0 && mode == AttentionMode::kFlash) {
      // With dropout the CPU's SDPA runs ATen's math kernel (nothing for a selective
      // policy to save: it names the flash op).
      a = at::scaled_dot_product_attention(parts[0], parts[1], parts[2], /*attn_mask=*/{},
                                           dropout_.attn, /*is_causal=*/true);
    } else {
      a = AttentionOp(mode, parts[0], parts[1], parts[2], cache);
    }
    at::Tensor merged = Last(a).transpose(1, 2).contiguous().reshape({b, t, attention_width_});
    at::Tensor projected = Dropout(RowParallel(attn_c_proj, Last(merged), cache),
                                   DropoutKind::kAttentionOut, dropout_.resid);
    // GPT2Attention.forward's query_states, key_states, value_states live to its return,
    // after resid_dropout (modeling_gpt2.py).
    parts.clear();
    at::Tensor x1 = x + (python_locals ? projected : Last(projected));
    normed1.reset();
    at::Tensor normed2 = LayerNormOp(*ln_2, x1, cache);
    at::Tensor fc = ColumnParallel(c_fc, python_locals ? normed2 : Last(normed2), cache);
    // transformers' GPT-2 runs gelu_new (NewGELU); Megatron's GPT gelu(tanh).
    at::Tensor m = index_ >= 0 ? GeluOp(Last(fc), "tanh", cache) : NewGelu(Last(fc));
    at::Tensor out = Dropout(RowParallel(mlp_c_proj, Last(m), cache), DropoutKind::kMlpOut,
                             dropout_.resid);
    return Last(x1) + Last(out);
  }

  // Dropout is Megatron's (megatron-gpt); else transformers' nn.Dropout(p) in training,
  // F.dropout, which on the CPU is at::dropout (its noise kept for backward).
  at::Tensor Dropout(at::Tensor x, DropoutKind kind, double p) const {
    if (index_ >= 0) return MegatronDropout(Last(x), {index_, kind});
    return p > 0 ? at::dropout(Last(x), p, /*train=*/true) : x;
  }

  // ColumnParallel is a Conv1D whose output columns are split over tensor-parallel
  // ranks: Megatron's f before it, or with sequence parallelism its all-gather of the
  // input (GatherLinear).
  at::Tensor ColumnParallel(const Conv1DParams& p, const at::Tensor& x, SelectiveCache* cache) {
    if (tensor_parallel != nullptr && tensor_parallel->SequenceParallel()) {
      return GatherLinearOp(*tensor_parallel, p.weight, p.bias, /*conv1d=*/true, x, cache);
    }
    return Conv1DOp(p.weight, p.bias, CopyIn(tensor_parallel, x), cache);
  }

  // RowParallel is a Conv1D whose input rows are split over tensor-parallel ranks: each
  // rank's partial sum (an mm, without the bias) is all-reduced in place (with sequence
  // parallelism reduce-scattered) and the replicated bias added once after, as
  // Megatron's RowParallelLinear does.
  at::Tensor RowParallel(const Conv1DParams& p, const at::Tensor& x, SelectiveCache* cache) {
    if (tensor_parallel == nullptr) return Conv1DOp(p.weight, p.bias, x, cache);
    at::Tensor partial = Conv1DOp(p.weight, at::Tensor(), x, cache);
    if (tensor_parallel->SequenceParallel()) {
      return ReduceScatter(*tensor_parallel, Last(partial), cache) + p.bias;
    }
    return ReduceOut(tensor_parallel, Last(partial), cache) + p.bias;
  }

  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  Conv1DParams c_attn, attn_c_proj, c_fc, mlp_c_proj;

 private:
  int64_t heads_, head_dim_, attention_width_;
  int64_t index_;  // the layer's index with Megatron's dropouts, else -1
  ModelConfig::Dropouts dropout_;  // transformers' probabilities (not megatron-gpt's)
};

class Gpt2Model : public ModelImpl {
 public:
  explicit Gpt2Model(const ModelConfig& c) {
    // A tensor-parallel rank's rows of the vocabulary.
    wte = register_module("wte", torch::nn::Embedding(c.vocab / c.shard.tp, c.width));
    wpe = register_module("wpe", torch::nn::Embedding(c.max_positions, c.width));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.layers; ++i) {
      layers->push_back(std::make_shared<Gpt2LayerImpl>(c, i));
    }
    megatron_ = c.megatron;
    embd_dropout_ = c.dropout.embd;
    ln_f = register_module(
        "ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width}).eps(c.norm_eps)));
  }

  ModelStart Prologue(const at::Tensor& input_ids) const override {
    // position_ids, as GPT2Model makes them; it calls each block with them.
    LayerExtras extras = Extras(input_ids.size(1), at::kFloat);
    const at::Tensor& position_ids = extras[ModelTensor::kPositionIds];
    // GPT2Model.forward: inputs_embeds = wte(input_ids), position_embeds = wpe(...), in
    // that order (their backward nodes' order, which the estimator's step simulation
    // follows); both are its locals until it returns (modeling_gpt2.py:567-575).
    at::Tensor tokens = InputEmbeddings(
        tensor_parallel != nullptr ? tensor_parallel->VocabEmbedding(input_ids, wte->weight)
                                   : wte.ptr()->forward(input_ids));
    at::Tensor positions = wpe.ptr()->forward(position_ids);
    at::Tensor embeddings = ToSequenceParallel(tensor_parallel, tokens + positions);
    ModelStart start{EmbeddingDropout(std::move(embeddings)), std::move(extras), {}};
    // Megatron's GPT embedding adds them inside its module, where they die.
    if (!megatron_) start.decoder_locals = {std::move(tokens), std::move(positions)};
    return start;
  }

  LayerExtras Extras(int64_t seq, at::ScalarType /*dtype*/) const override {
    LayerExtras extras;
    extras[ModelTensor::kPositionIds] = PositionIds(seq);
    return extras;
  }
  bool CallsLayersWithPositionIds() const override { return !megatron_; }

  at::Tensor Epilogue(at::Tensor hidden, const at::Tensor& input_ids,
                      const std::function<void()>& decoder_returns) const override {
    // The transformer's output lives to the return (GPT2LMHeadModel's `hidden_states`).
    const at::Tensor normed = ln_f.ptr()->forward(hidden);
    hidden = at::Tensor();  // GPT2Model.forward returns ln_f's output
    decoder_returns();
    at::Tensor logits = LmHeadLogits(tensor_parallel, normed, wte->weight);
    // `logits` lives to the return, as transformers' ForCausalLM keeps it beside the
    // loss computed on logits.float().
    return CausalLmLoss(logits, input_ids, tensor_parallel);
  }

  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};

 private:
  at::Tensor EmbeddingDropout(at::Tensor x) const {
    if (megatron_) return MegatronDropout(Last(x), {-1, DropoutKind::kEmbeddings});
    return embd_dropout_ > 0 ? at::dropout(Last(x), embd_dropout_, /*train=*/true) : x;
  }
  bool megatron_ = false;
  double embd_dropout_ = 0;  // transformers' embd_pdrop
};

// Megatron's layout of Conv1D weights (in, out): c_attn's q | k | v columns and c_fc's
// split by output, both c_proj by input, the vocabulary rows of wte; the norms, the
// row-parallel biases and the position embedding replicated.
ParameterShard Gpt2ShardOf(const ModelConfig& c, const std::string& name, int64_t r) {
  const int64_t hd = c.HeadDim(), q = c.heads / c.shard.tp * hd, f = c.Intermediate() / c.shard.tp,
                v = c.vocab / c.shard.tp, width = c.heads * hd;
  if (absl::EndsWith(name, "c_attn_weight") || absl::EndsWith(name, "c_attn_bias")) {
    const int64_t dim = absl::EndsWith(name, "weight") ? 1 : 0;
    return ParameterShard{dim, {{r * q, q}, {width + r * q, q}, {2 * width + r * q, q}}};
  }
  if (absl::EndsWith(name, "attn_c_proj_weight")) return Split(0, q, r);
  if (absl::EndsWith(name, "c_fc_weight")) return Split(1, f, r);
  if (absl::EndsWith(name, "c_fc_bias")) return Split(0, f, r);
  if (absl::EndsWith(name, "mlp_c_proj_weight")) return Split(0, f, r);
  if (name == "wte.weight") return Split(0, v, r);
  return {};
}

// The position embedding is added before the sequence-parallel scatter: every rank's
// gradient of it is whole.
bool Gpt2GradientIsPartial(const ModelConfig& c, const std::string& name) {
  return name != "wpe.weight" && ReplicatedUnderSequenceParallelism(c, name);
}

}  // namespace

const RuntimeFamily& Gpt2RuntimeFamily() {
  static const RuntimeFamily kDef = {
      .id = Family::kGpt2,
      .make_model = [](const ModelConfig& c) -> std::shared_ptr<ModelImpl> {
        return std::make_shared<Gpt2Model>(c);
      },
      .shard_of = Gpt2ShardOf,
      .gradient_is_partial = Gpt2GradientIsPartial,
      .prologue_prefixes = {"wte.", "wpe."},
  };
  return kDef;
}

}  // namespace memledger::runtime
