// GraphBuilder: how a family's graphs are written. It appends tensors and ops in
// execution order; its composite helpers expand a torch::nn or transformers call
// (Linear, LayerNorm, LlamaRMSNorm, SDPA, RoPE, the loss, ...) into the ATen ops the
// pinned PyTorch runs for it. Used by estimator/families/ only.
#ifndef ESTIMATOR_GRAPH_GRAPH_BUILDER_H_
#define ESTIMATOR_GRAPH_GRAPH_BUILDER_H_

#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "estimator/graph/block_graph.h"
#include "estimator/spec/config.h"
#include "estimator/graph/rules.h"
#include "estimator/graph/sdpa_kernel.h"
#include "estimator/graph/shape.h"

namespace memledger {

class GraphBuilder {
 public:
  // The model's dtype (parameters, hidden states); autocast's (kFloat32: no autocast).
  explicit GraphBuilder(const ModelConfig& config)
      : config_(config), dtype_(config.dtype), amp_(config.amp), megatron_(config.megatron),
        dropout_(config.dropout), sp_(config.shard.sp), tp_(config.shard.tp > 1),
        cuda_(config.device == Device::kCuda) {}

  int Input(std::string name, std::vector<SymDim> shape) {
    graph_.input = AddTensor(std::move(name), dtype_, false, std::move(shape));
    return graph_.input;
  }

  int Param(std::string name, std::vector<SymDim> shape) {
    return AddTensor(std::move(name), dtype_, true, std::move(shape));
  }

  // ToDtype is .to(dtype): a copy unless the tensor has that dtype already.
  int ToDtype(const std::string& name, int x, DType dtype) {
    return Op1(OpType::kToDtype, name, {x}, {}, std::nullopt, dtype);
  }

  // Lower is autocast's cast of an fp32 argument of a lower-precision op (matmuls,
  // SDPA): a copy in the autocast dtype (of a weight, too: the copy is no parameter);
  // without autocast, or for a lower-precision tensor, the tensor itself. CPU autocast
  // in 2.15 casts nothing else our graphs run: pow, rsqrt, layer_norm, softmax and
  // log_softmax run in their input's dtype (unlike CUDA's fp32 list), and nll_loss, on
  // its fp32 list, gets fp32 log-probabilities (//tests:autocast_test checks LibTorch).
  int Lower(const std::string& name, int x) {
    if (amp_ == DType::kFloat32 || graph_.tensors[x].dtype != DType::kFloat32) return x;
    return ToDtype(name + ".autocast", x, amp_);
  }

  // Fp32 is CUDA autocast's cast of a lower-precision argument of an op on its fp32
  // list (autocast_mode.cpp, KERNEL_CUDA(..., fp32): pow, rsqrt, layer_norm, ...): an
  // fp32 copy (not cached: only casts to the lower dtype are). On the CPU, or without
  // autocast, or for an fp32 tensor, the tensor itself. Of our graphs' ops only pow
  // ever gets a lower-precision input under autocast (GPT-2's gelu_new on the MLP's
  // bf16 projection); the norms and losses already see fp32.
  int Fp32(const std::string& name, int x) {
    if (!cuda_ || amp_ == DType::kFloat32 || graph_.tensors[x].dtype == DType::kFloat32) {
      return x;
    }
    return ToDtype(name + ".autocast", x, DType::kFloat32);
  }

  // MulWrapped is `x * c` (or `c * x`) in Python with a number c: mul.Tensor of x and c
  // wrapped in a 0-dim float64 tensor, which MulBackward0 keeps.
  int MulWrapped(const std::string& name, int x) {
    std::vector<int> outputs = Op(OpType::kMulWrapped, name, {x}, {"out", "wrapped"});
    graph_.tensors[outputs[1]].dtype = DType::kFloat64;
    return outputs[0];
  }

  // NewGelu is transformers' NewGELUActivation (activations.py), GPT-2's gelu_new, as
  // Python evaluates it: 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) *
  // (input + 0.044715 * torch.pow(input, 3.0)))). Not one gelu op: pow keeps the input,
  // tanh its result, the last mul both factors, and each mul by a number its wrapped
  // number.
  int NewGelu(const std::string& name, int x) {
    int half = MulWrapped(name + ".half", x);
    int cube = Op1(OpType::kPow, name + ".cube", {Fp32(name + ".cube", x)});
    int cubic = MulWrapped(name + ".cubic", cube);
    int inner = Op1(OpType::kAdd, name + ".inner", {x, cubic});
    int scaled = MulWrapped(name + ".scaled", inner);
    int tanh = Op1(OpType::kTanh, name + ".tanh", {scaled});
    int one_plus = Op1(OpType::kAddScalar, name + ".one_plus", {tanh});
    return Op1(OpType::kMulTensor, name, {half, one_plus});
  }

  // TiedParam is a parameter owned by another segment (a tied LM head).
  // ExpertShardParam: a parameter of an expert-parallel rank's experts (TensorDef::
  // expert_shard).
  int ExpertShardParam(std::string name, std::vector<SymDim> shape) {
    int tensor = Param(std::move(name), std::move(shape));
    graph_.tensors[tensor].expert_shard = true;
    return tensor;
  }

  int TiedParam(std::string name, std::vector<SymDim> shape) {
    int tensor = Param(std::move(name), std::move(shape));
    graph_.tensors[tensor].is_tied = true;
    return tensor;
  }

  int Buffer(std::string name, DType dtype, std::vector<SymDim> shape) {
    int tensor = AddTensor(std::move(name), dtype, false, std::move(shape));
    graph_.tensors[tensor].is_buffer = true;
    return tensor;
  }

  // Global is model-level tensor `id` (named after it), which the segment reads.
  int Global(ModelTensor id, DType dtype, std::vector<SymDim> shape) {
    int tensor = AddTensor(ModelTensorName(id), dtype, false, std::move(shape));
    graph_.tensors[tensor].global = id;
    return tensor;
  }
  // The families with sliding-window and full layers (transformers' layer_types):
  //
  // RotaryBuffersPerLayerType: their rotary embedding's buffers, {type}_inv_freq and
  // {type}_original_inv_freq, fp32, d_head / 2 each, for each type the model's layers
  // have, in sorted order (Gemma3RotaryEmbedding's and Olmo3RotaryEmbedding's __init__).
  void RotaryBuffersPerLayerType() {
    bool sliding = false, full = false;
    for (int64_t i = 0; i < config_.layers && !(sliding && full); ++i) {
      (config_.AttentionOf(i) == LayerAttention::kSliding ? sliding : full) = true;
    }
    for (const auto& [present, type] : {std::pair<bool, const char*>{full, "full_attention"},
                                        {sliding, "sliding_attention"}}) {
      if (!present) continue;
      Buffer(absl::StrCat("rotary_emb.", type, "_inv_freq"), DType::kFloat32, {kDHead / 2});
      Buffer(absl::StrCat("rotary_emb.", type, "_original_inv_freq"), DType::kFloat32,
             {kDHead / 2});
    }
  }
  // SlidingWindowMask: a sliding layer's attention mask, -1 where it attends without one.
  // From seq >= sliding_window on, it attends through the model's (1, 1, T, T) bool mask,
  // expanded to (B, 1, T, T) (masking_utils.py, sdpa_mask).
  int SlidingWindowMask(bool sliding) {
    if (!sliding || !config_.SlidingWindowMasked()) return -1;
    return Op1(OpType::kExpand, "sliding_mask.expand",
               {Global(ModelTensor::kSlidingMask, DType::kBool, {Sym(1), Sym(1), kT, kT})},
               {.shape = {kB, Sym(1), kT, kT}});
  }


  // Op appends an op; its outputs have `dtype`, by default the first input's (views,
  // copies and the ops here keep their input's dtype).
  std::vector<int> Op(OpType type, std::string name, std::vector<int> inputs,
                      std::vector<std::string> output_names, OpAttributes attributes = {},
                      std::optional<OpKind> policy_kind = std::nullopt,
                      std::optional<DType> output_dtype = std::nullopt) {
    DType dtype = output_dtype.value_or(
        inputs.empty() ? DType::kFloat32 : graph_.tensors[inputs[0]].dtype);
    if (!output_dtype.has_value() &&
        (type == OpType::kAdd || type == OpType::kMulTensor || type == OpType::kCat ||
         type == OpType::kDivTensor || type == OpType::kSub)) {
      // Type promotion: a floating op of two dtypes runs in fp32 (bf16 + fp32 -> fp32).
      for (int input : inputs) dtype = PromoteTypes(dtype, graph_.tensors[input].dtype);
    }
    OpDef op;
    op.type = type;
    op.name = name;
    op.inputs = std::move(inputs);
    for (std::string& output : output_names) {
      // A single "out" is named after its op ("qkv"); several get suffixes ("ln1.mean").
      std::string tensor_name =
          output_names.size() == 1 && output == "out" ? name : absl::StrCat(name, ".", output);
      op.outputs.push_back(AddTensor(std::move(tensor_name), dtype, false, {}));
    }
    op.attributes = std::move(attributes);
    op.policy_kind = policy_kind;
    op.composite = composite_;
    op.core_attention = core_attention_;
    graph_.ops.push_back(std::move(op));
    return graph_.ops.back().outputs;
  }

  int Op1(OpType type, std::string name, std::vector<int> inputs,
          OpAttributes attributes = {}, std::optional<OpKind> policy_kind = std::nullopt,
          std::optional<DType> dtype = std::nullopt) {
    return Op(type, std::move(name), std::move(inputs), {"out"}, std::move(attributes),
              policy_kind, dtype)[0];
  }

  // LayerNorm: torch::nn::LayerNorm -> at::layer_norm -> native_layer_norm.
  int LayerNorm(const std::string& name, int x) {
    int weight = Param(name + ".weight", {kD});
    int bias = Param(name + ".bias", {kD});
    std::vector<int> outputs = Op(OpType::kNativeLayerNorm, name, {x, weight, bias},
                                  {"out", "mean", "rstd"}, {}, OpKind::kLayerNorm);
    // mean and rstd come on the CPU in the parameters' dtype (fp32 for a bf16 input
    // under autocast: ATen's mixed-dtype layer norm), on CUDA in the computation dtype,
    // fp32 for every floating input (torch/_refs/__init__.py, native_layer_norm: "if
    // input.device.type in ['cpu', 'mtia']" alone converts them back; the fake-CUDA
    // witness measures it).
    const DType stats = cuda_ ? DType::kFloat32 : graph_.tensors[weight].dtype;
    graph_.tensors[outputs[1]].dtype = stats;
    graph_.tensors[outputs[2]].dtype = stats;
    return outputs[0];
  }

  // RmsNormalize is the fp32 core every RMSNorm of transformers computes (LlamaRMSNorm's,
  // Gemma3RMSNorm's _norm(x.float()), Olmo3RMSNorm's): x32 = x.to(float32); variance =
  // x32.pow(2).mean(-1, keepdim=True); normed = x32 * rsqrt(variance + eps). Its ops are
  // `name`.upcast, .pow, .variance, .add_eps, .rsqrt and .normed; the caller scales and
  // casts the result its own way.
  struct RmsNormalized {
    int variance, normed;
  };
  RmsNormalized RmsNormalize(const std::string& name, int x) {
    int x32 = ToDtype(name + ".upcast", x, DType::kFloat32);
    int squared = Op1(OpType::kPow, name + ".pow", {x32});
    int variance = Op1(OpType::kMeanDim, name + ".variance", {squared});
    int shifted = Op1(OpType::kAddScalar, name + ".add_eps", {variance});
    int inverse = Op1(OpType::kRsqrt, name + ".rsqrt", {shifted});
    return {variance, Op1(OpType::kMulTensor, name + ".normed", {x32, inverse})};
  }

  // RmsNorm is transformers' LlamaRMSNorm: x32 = x.to(float32); weight *
  // (x32 * rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype). In fp32 both
  // casts return the tensor itself. It normalises x's last dimension, `width` (the hidden
  // size, or head_dim for Qwen3's q_norm and k_norm).
  int RmsNorm(const std::string& name, int x, SymDim width = kD) {
    int weight = Param(name + ".weight", {width});
    const auto [variance, normed] = RmsNormalize(name, x);
    int downcast = ToDtype(name + ".downcast", normed, graph_.tensors[x].dtype);
    int out = Op1(OpType::kMulTensor, name, {weight, downcast});
    // LlamaRMSNorm.forward's locals `variance` and `hidden_states` (normed), to its return;
    // and its argument x, which nn.Module.__call__'s *args tuple holds to the return
    // (torch/nn/modules/module.py, _wrapped_call_impl and _call_impl) even after forward
    // rebinds its name: a fresh input (Qwen3's projected q and k) outlives the upcast.
    HeldThroughHere({x, variance, normed});
    return out;
  }

  // Linear with bias on a (B, T, in) input: at::linear's fused path for a contiguous
  // input, addmm(bias, x.reshape(B*T, in), weight.t()).view(B, T, out). A non-contiguous
  // input (math attention's merged heads when d_head is 1) takes matmul(x, weight.t())
  // .add_(bias) instead, whose fold reshapes (copies) x the same way and whose mm keeps
  // the same two tensors, so one description serves both.
  // Under autocast the arguments are cast in the order the pinned build's autocast
  // wrapper evaluates them (GCC: last to first): bias, weight, input. Their ToCopy nodes
  // run in the reverse order in the backward.
  int Linear(const std::string& name, int x, SymDim in, SymDim out) {
    Composite call(this);
    int weight = Param(name + ".weight", {out, in});  // the module's order: weight, bias
    int bias = Param(name + ".bias", {out});
    bias = Lower(name + ".bias", bias);
    weight = Lower(name + ".weight", weight);
    x = Lower(name + ".input", x);
    int flat = Op1(OpType::kReshape, name + ".flatten", {x}, {.shape = {kB * kT, in}});
    int weight_t = Op1(OpType::kT, name + ".weight_t", {weight});
    int mm = Op1(OpType::kAddmm, name, {bias, flat, weight_t}, {}, OpKind::kMatmul);
    return Op1(OpType::kView, name + ".unflatten", {mm}, {.shape = {kB, kT, out}});
  }

  // NnLinear is a model's nn.Linear module `name`, or where config.lora targets it peft's
  // lora.Linear around it (Adapted).
  int NnLinear(const std::string& name, int x, SymDim in, SymDim out, bool bias) {
    const int result = bias ? Linear(name, x, in, out) : LinearNoBias(name, x, in, out);
    return config_.lora.Targets(name) ? Adapted(name, x, result, in, out) : result;
  }

  // Adapted is peft's lora.Linear around a base layer's `result` of `x`, an nn.Linear or
  // GPT-2's Conv1D (graph_builder.cc).
  // fan_in_fan_out: the base weight is (in, out), GPT-2's Conv1D's.
  int Adapted(const std::string& name, int x, int result, SymDim in, SymDim out,
              bool fan_in_fan_out = false);
  // Dora is DoraLinearVariant.forward's part of an Adapted layer (use_dora), from the
  // adapter's input `x` (cast to fp32) to result + result_dora (graph_builder.cc).
  int Dora(const std::string& name, int x, int result, int a_weight, int b_weight, SymDim in,
           SymDim out, bool fan_in_fan_out);

  // LinearNoBias: at::linear without bias is at::matmul(x, weight.t()), which folds the
  // (B, T, in) input: _unsafe_view(mm(x.reshape(B*T, in), weight.t()), (B, T, out)).
  int LinearNoBias(const std::string& name, int x, SymDim in, SymDim out) {
    return MatmulFolded(name, x, Param(name + ".weight", {out, in}), in, out);
  }

  int MatmulFolded(const std::string& name, int x, int weight, SymDim in, SymDim out) {
    Composite call(this);
    weight = Lower(name + ".weight", weight);
    x = Lower(name + ".input", x);
    int flat = Op1(OpType::kReshape, name + ".flatten", {x}, {.shape = {kB * kT, in}});
    int weight_t = Op1(OpType::kT, name + ".weight_t", {weight});
    int mm = Op1(OpType::kMm, name, {flat, weight_t}, {}, OpKind::kMatmul);
    return Op1(OpType::kUnsafeView, name + ".unflatten", {mm}, {.shape = {kB, kT, out}});
  }

  // Conv1D is GPT-2's linear, or where config.lora targets it peft's lora.Linear around
  // it (graph_builder.cc).
  int Conv1D(const std::string& name, int x, SymDim in, SymDim out);

  // ColumnParallel is a linear whose output columns are split over tensor-parallel
  // ranks (out is one rank's); with sequence parallelism Megatron's gather-linear,
  // which all-gathers the (B, T / tp, in) input and keeps the shard for backward.
  int ColumnParallel(const std::string& name, int x, SymDim in, SymDim out) {
    if (!sp_) return Conv1D(name, x, in, out);
    int weight = Param(name + ".weight", {in, out});
    int bias = Param(name + ".bias", {out});
    return Op1(OpType::kGatherLinear, name, {x, weight, bias}, {.shape = {kB, kT, out}},
               OpKind::kMatmul);
  }

  // ColumnParallelLinear is the Llama family's nn.Linear (weight (out, in)) with its
  // output columns split over tensor-parallel ranks; with sequence parallelism the
  // gather-linear of ColumnParallel.
  int ColumnParallelLinear(const std::string& name, int x, SymDim in, SymDim out, bool bias) {
    if (!sp_) return NnLinear(name, x, in, out, bias);
    std::vector<int> inputs = {x, Param(name + ".weight", {out, in})};
    if (bias) inputs.push_back(Param(name + ".bias", {out}));
    return Op1(OpType::kGatherLinear, name, inputs, {.shape = {kB, kT, out}}, OpKind::kMatmul);
  }

  // RowParallelLinear: the Llama family's row-parallel nn.Linear (weight (out, in)).
  // Without tensor parallelism, the module's own at::linear (Linear or LinearNoBias).
  // With it, as Megatron's RowParallelLinear (and RowParallel below): each rank's partial
  // sum without the bias, at::linear(x, weight), all-reduced in place or, with sequence
  // parallelism, reduce-scattered; then the replicated bias added once (an add that,
  // under autocast, promotes to the bias's fp32 as the runtime's `+ bias` does).
  int RowParallelLinear(const std::string& name, int x, SymDim in, SymDim out, bool bias) {
    if (!tp_) return NnLinear(name, x, in, out, bias);
    int weight = Param(name + ".weight", {out, in});  // the module's order: weight, bias
    int bias_param = bias ? Param(name + ".bias", {out}) : -1;
    int partial = MatmulFolded(name, x, weight, in, out);
    if (sp_) {
      partial = Op1(OpType::kReduceScatter, name + ".reduce_scatter", {partial},
                    {.shape = {kB, kTs, out}});
    }
    if (!bias) return partial;
    return Op1(OpType::kAdd, name + ".bias", {partial, bias_param});
  }

  // RowParallel is GPT-2's Conv1D with its input rows split over tensor-parallel ranks:
  // as Megatron's RowParallelLinear, each computes a partial (B, T, out) sum without the
  // bias (mm(x.view(-1, in), weight)), which an all-reduce in place (no new tensor) or,
  // with sequence parallelism, a reduce-scatter to (B, T / tp, out) completes; then the
  // replicated bias is added. Without tensor parallelism, the Conv1D.
  int RowParallel(const std::string& name, int x, SymDim in, SymDim out) {
    if (!tp_) return Conv1D(name, x, in, out);
    int weight = Param(name + ".weight", {in, out});  // the module's order: weight, bias
    int bias = Param(name + ".bias", {out});
    int partial;
    {
      Composite call(this);
      weight = Lower(name + ".weight", weight);  // mm's autocast: weight, then input
      int flat = Lower(name + ".input",
                       Op1(OpType::kView, name + ".flatten", {x}, {.shape = {kB * kT, in}}));
      int mm = Op1(OpType::kMm, name, {flat, weight}, {}, OpKind::kMatmul);
      partial = Op1(OpType::kView, name + ".unflatten", {mm}, {.shape = {kB, kT, out}});
    }
    if (sp_) {
      partial = Op1(OpType::kReduceScatter, name + ".reduce_scatter", {partial},
                    {.shape = {kB, kTs, out}});
    }
    return Op1(OpType::kAdd, name + ".bias", {partial, bias});
  }

  // Matmul of (B, H, n, m) by (B, H, m, p) as at::matmul runs it (the batched case of
  // ATen's composite matmul): expand both to the broadcast batch, reshape to
  // (B*H, ., .) (a copy unless it can be a view), bmm, and _unsafe_view the result back
  // to (B, H, n, p).
  // `autocast` false: inside a kernel that autocast already cast the arguments of (the
  // ATen math SDPA's matmuls run with autocast excluded).
  int BatchedMatmul(const std::string& name, int a, std::vector<SymDim> a_shape, int b,
                    std::vector<SymDim> b_shape, bool autocast = true) {
    Composite call(this);
    if (autocast) {
      a = Lower(name + ".self", a);
      b = Lower(name + ".mat2", b);
    }
    int a3 = Op1(OpType::kReshape, name + ".reshape_self",
                 {Op1(OpType::kExpand, name + ".expand_self", {a}, {.shape = a_shape})},
                 {.shape = {kB * kH, a_shape[2], a_shape[3]}});
    int b3 = Op1(OpType::kReshape, name + ".reshape_mat2",
                 {Op1(OpType::kExpand, name + ".expand_mat2", {b}, {.shape = b_shape})},
                 {.shape = {kB * kH, b_shape[2], b_shape[3]}});
    int bmm = Op1(OpType::kBmm, name, {a3, b3});
    return Op1(OpType::kUnsafeView, name + ".unflatten", {bmm},
               {.shape = {kB, kH, a_shape[2], b_shape[3]}});
  }

  // CausalAttention of q, k, v of shape (B, H, T, d_head): scaled_dot_product_attention
  // with the kernel it runs on the model's device (estimator/graph/sdpa_kernel.h), or with
  // --attention=math plain ops (matmul, scale, masked_fill with a fresh mask, softmax,
  // matmul). `mask`: a (B, 1, T, T) bool mask SDPA is called with instead of
  // is_causal; `enable_gqa`: k and v have the kv heads (SDPA reads them in place, or
  // its math kernel repeats them).
  int CausalAttention(AttentionMode mode, int q, int k, int v, int mask = -1,
                      bool enable_gqa = false) {
    if (mode == AttentionMode::kMath) return EagerAttention(q, k, v);
    // ValidateRun refuses a call no kernel runs; math is only a placeholder here.
    const SdpaKernel kernel =
        SdpaKernelFor(config_, SdpaCall{.masked = mask >= 0,
                                        .enable_gqa = enable_gqa,
                                        .dropout = dropout_.attn > 0})
            .value_or(SdpaKernel::kMath);
    switch (kernel) {
      case SdpaKernel::kCpuFlash:
        return CpuFlashAttention(q, k, v, mask);
      case SdpaKernel::kCudaFlash:
        return CudaFusedAttention(OpType::kCudaFlashAttention, q, k, v, DType::kUInt64);
      case SdpaKernel::kCudaEfficient:
        // Its philox seed and offset stay on the host (TensorDef::host).
        return CudaFusedAttention(
            mask >= 0 ? OpType::kEfficientAttentionMasked : OpType::kEfficientAttention, q, k,
            v, DType::kInt64, mask, /*rng_on_host=*/true);
      case SdpaKernel::kCudnn:
        return CudaFusedAttention(OpType::kCudnnAttention, q, k, v, DType::kInt64);
      case SdpaKernel::kMath:
        return SdpaMathAttention(q, k, v, enable_gqa);
    }
    return -1;
  }

  // CpuFlashAttention: the CPU flash kernel, with the additive mask ATen makes from a
  // bool one.
  int CpuFlashAttention(int q, int k, int v, int mask) {
    if (mask >= 0) {
      Composite call(this);
      q = Lower("attention.q", q);
      k = Lower("attention.k", k);
      v = Lower("attention.v", v);
      const int additive = Op1(OpType::kSdpaBoolMask, "attention.attn_mask", {mask}, {},
                               std::nullopt, DTypeOf(q));
      std::vector<int> outputs = Op(OpType::kFlashAttentionMasked, "attention",
                                    {q, k, v, additive}, {"out", "logsumexp"}, {},
                                    OpKind::kAttention);
      graph_.tensors[outputs[1]].dtype = DType::kFloat32;
      return outputs[0];
    }
    // One call: autocast casts its arguments inside it, so the caller's q, k, v live
    // to its end.
    Composite call(this);
    q = Lower("attention.q", q);
    k = Lower("attention.k", k);
    v = Lower("attention.v", v);
    std::vector<int> outputs = Op(OpType::kFlashAttention, "attention", {q, k, v},
                                  {"out", "logsumexp"}, {}, OpKind::kAttention);
    graph_.tensors[outputs[1]].dtype = DType::kFloat32;  // logsumexp accumulates in fp32
    return outputs[0];
  }

  // CudaFusedAttention: a CUDA kernel of one op, (out, logsumexp in fp32, and the
  // philox seed and offset in `rng` dtype: the flash kernel's uint64, the efficient and
  // cuDNN kernels' int64), SDPA's arguments cast by autocast first.
  // `mask`: a bool mask made additive in q's dtype first (convert_boolean_attn_mask;
  // preprocess_mask's expand is a view), the kernel's attn_bias. `rng_on_host`: the
  // seed and offset are host tensors.
  int CudaFusedAttention(OpType type, int q, int k, int v, DType rng, int mask = -1,
                         bool rng_on_host = false) {
    Composite call(this);
    q = Lower("attention.q", q);
    k = Lower("attention.k", k);
    v = Lower("attention.v", v);
    std::vector<int> inputs = {q, k, v};
    if (mask >= 0) {
      inputs.push_back(Op1(OpType::kSdpaBoolMask, "attention.attn_mask", {mask}, {},
                           std::nullopt, DTypeOf(q)));
    }
    std::vector<int> outputs = Op(type, "attention", inputs,
                                  {"out", "logsumexp", "philox_seed", "philox_offset"}, {},
                                  OpKind::kAttention);
    graph_.tensors[outputs[1]].dtype = DType::kFloat32;
    for (int i : {2, 3}) {
      graph_.tensors[outputs[i]].dtype = rng;
      graph_.tensors[outputs[i]].host = rng_on_host;
    }
    return outputs[0];
  }

  // EagerAttention: --attention=math's plain ops.
  int EagerAttention(int q, int k, int v) {
    const std::vector<SymDim> bhtd = {kB, kH, kT, kDHead};
    core_attention_ = true;  // from q, k, v to the values: the core
    int k_t = Op1(OpType::kTranspose, "attention.k_t", {k}, {.dim = 2, .dim1 = 3});
    int scores = BatchedMatmul("attention.scores", q, bhtd, k_t, {kB, kH, kDHead, kT});
    int scaled = Op1(OpType::kMulScalar, "attention.scale", {scores});
    // Megatron's scaled_upper_triang_masked_softmax masks inside the kernel: no mask
    // tensor; it keeps its output, as softmax does.
    int masked = scaled;
    if (!megatron_) {
      int mask = Op(OpType::kCausalMask, "attention.causal_mask", {}, {"out"},
                    {.shape = {kT, kT}}, std::nullopt, DType::kBool)[0];
      masked = Op1(OpType::kMaskedFill, "attention.mask_fill", {scaled, mask});
    }
    int probs = Dropout("attention.dropout",
                        Op1(megatron_ ? OpType::kFusedCausalSoftmax : OpType::kSoftmax,
                            "attention.softmax", {masked}),
                        dropout_.attn);
    const int values = BatchedMatmul("attention.values", probs, {kB, kH, kT, kT}, v, bhtd);
    core_attention_ = false;
    return values;
  }

  // Dropout is a training dropout: Megatron's (p = 0.1, native_dropout, whose backward
  // keeps the bool mask) in megatron-gpt; else F.dropout with transformers' probability
  // `p` for the site (the CPU's dropout, which keeps its noise), the tensor itself when
  // p is 0.
  int Dropout(const std::string& name, int x, double p) {
    // On CUDA F.dropout is native_dropout too (Dropout.cpp, is_fused_kernel_acceptable:
    // a CUDA input with 0 < p < 1), which keeps a bool mask instead of the noise.
    if (megatron_ || (cuda_ && p > 0)) {
      std::vector<int> outputs = Op(OpType::kNativeDropout, name, {x}, {"out", "mask"});
      graph_.tensors[outputs[1]].dtype = DType::kBool;
      return outputs[0];
    }
    if (p <= 0) return x;
    return Op(OpType::kDropout, name, {x}, {"out", "noise"})[0];
  }

  // SdpaMathAttention is scaled_dot_product_attention(q, k, v, dropout_p=p > 0,
  // is_causal=True) on the CPU: the flash kernel refuses dropout (sdp_utils_cpp.cpp,
  // check_for_dropout), so SDPA runs ATen's _scaled_dot_product_attention_math
  // (attention.cpp), op by op:
  //   query_acc, key_acc, value_acc = fp32 copies of bf16/fp16 q, k, v (the tensors
  //     themselves in fp32), alive to its return, as are query, attn_mask and attn;
  //   query = query_acc * sqrt(scale);
  //   attn_mask = where(ones(L, S, bool).tril(), 0, -inf) in query's dtype;
  //   attn = matmul(query, key_acc.transpose(-2, -1) * sqrt(scale)); attn.add_(mask);
  //   attn = _safe_softmax(attn, -1); attn = dropout(attn, p, true);
  //   return (matmul(attn, value_acc).to(origin), attn.to(origin)), the second made
  //     first (GCC evaluates make_tuple's arguments right to left) and dropped by SDPA.
  // With enable_gqa, pre_process_group_query_attention_input repeat_interleaves
  // key_acc and value_acc to the query's heads (copies, alive to its return) after the
  // mask and before the first matmul. Autocast casts q, k, v (SDPA is on the lower-
  // precision list, CPU's and CUDA's), which its wrapper holds until the kernel returns;
  // the kernel's own ops run without autocast.
  int SdpaMathAttention(int q, int k, int v, bool enable_gqa) {
    Composite call(this);
    const int q_in = q, k_in = k, v_in = v;
    q = Lower("attention.q", q), k = Lower("attention.k", k), v = Lower("attention.v", v);
    const DType origin = graph_.tensors[q].dtype;
    const std::vector<SymDim> bhtd = {kB, kH, kT, kDHead};
    const int q_acc = ToDtype("attention.query_acc", q, DType::kFloat32);
    const int k_acc = ToDtype("attention.key_acc", k, DType::kFloat32);
    const int v_acc = ToDtype("attention.value_acc", v, DType::kFloat32);
    const int query = Op1(OpType::kMulScalar, "attention.query_scaled", {q_acc});
    const int mask = Op(OpType::kSdpaCausalMask, "attention.causal_mask", {}, {"out"},
                        {.shape = {kT, kT}}, std::nullopt, DType::kFloat32)[0];
    const int k_all = enable_gqa ? RepeatKv("attention.key_repeated", k_acc, true) : k_acc;
    const int v_all = enable_gqa ? RepeatKv("attention.value_repeated", v_acc, true) : v_acc;
    const int k_t = Op1(OpType::kTranspose, "attention.key_t", {k_all}, {.dim = 2, .dim1 = 3});
    const int key = Op1(OpType::kMulScalar, "attention.key_scaled", {k_t});
    int attn = BatchedMatmul("attention.scores", query, bhtd, key, {kB, kH, kDHead, kT},
                             /*autocast=*/false);
    attn = Op1(OpType::kAddInplace, "attention.add_mask", {attn, mask});
    attn = Op1(OpType::kSafeSoftmax, "attention.softmax", {attn});
    attn = Dropout("attention.dropout", attn, dropout_.attn);
    const int weights = ToDtype("attention.weights", attn, origin);
    const int values = BatchedMatmul("attention.values", attn, {kB, kH, kT, kT}, v_all, bhtd,
                                     /*autocast=*/false);
    const int out = ToDtype("attention.out", values, origin);
    HeldThroughHere({q_acc, k_acc, v_acc, query, mask, attn, weights});
    if (enable_gqa) HeldThroughHere({k_all, v_all});
    if (q != q_in || k != k_in || v != v_in) HeldThroughHere({q, k, v});
    return out;
  }

  // Slice is x.narrow(dim, start, length): a view.
  int Slice(const std::string& name, int x, int dim, SymDim start, SymDim length) {
    return Op1(OpType::kSlice, name, {x}, {.dim = dim, .start = start, .length = length});
  }

  // Rope is transformers' q * cos + rotate_half(q) * sin, rotate_half(x) =
  // cat(-x[..., d_head/2:], x[..., :d_head/2]); cos and sin are (1, 1, T, d_head) views.
  int Rope(const std::string& name, int x, int cos, int sin) {
    // (x * cos) + (rotate_half(x) * sin), in Python's order of evaluation
    // (modeling_llama.py:147-148).
    int x_cos = Op1(OpType::kMulTensor, name + ".mul_cos", {x, cos});
    int x1 = Slice(name + ".x1", x, 3, Sym(0), kDHead / 2);
    int x2 = Slice(name + ".x2", x, 3, kDHead / 2, kDHead / 2);
    int negated = Op1(OpType::kNeg, name + ".neg", {x2});
    int rotated = Op1(OpType::kCat, name + ".rotate_half", {negated, x1});
    int rotated_sin = Op1(OpType::kMulTensor, name + ".mul_sin", {rotated, sin});
    return Op1(OpType::kAdd, name, {x_cos, rotated_sin});
  }

  // RopeAttention is the attention of LlamaAttention.forward and its look-alikes
  // (Qwen3's, Gemma3Attention) between the q/k/v projections and o_proj, on (B, heads,
  // T, d_head) q, k, v: apply_rotary_pos_emb with the (1, T, d_head) tables (its
  // arguments held to its return); with use_cache past_key_values.update's copies (a
  // DynamicSlidingWindowLayer keeps a slice of the same torch.cat copies a DynamicLayer
  // keeps, cache_utils.py); repeat_kv where SDPA does not read the shared heads itself;
  // attention; and the heads merged to (B, T, H x d_head). The forward's locals q, k, v
  // (after RoPE and the cache) are returned for the caller to hold to its return.
  struct RopeAttentionOut {
    int merged, q, k, v;
  };
  // `mask`: a (B, 1, T, T) bool mask (a sliding window's), which turns SDPA's
  // enable_gqa off (integrations/sdpa_attention.py, use_gqa_in_sdpa), so grouped-query
  // layers repeat_kv; -1 for none. `cast_back`: apply_rotary_pos_emb returns
  // q_embed.to(q.dtype), k_embed.to(k.dtype) (a family whose tables stay fp32).
  RopeAttentionOut RopeAttention(const ModelConfig& config, AttentionMode mode, int q, int k,
                                 int v, int cos, int sin, int mask = -1, bool cast_back = false) {
    int cos4 = Op1(OpType::kUnsqueeze, "rope.cos_heads", {cos}, {.dim = 1});
    int sin4 = Op1(OpType::kUnsqueeze, "rope.sin_heads", {sin}, {.dim = 1});
    const int q_pre = q, k_pre = k;
    q = Rope("q_rope", q, cos4, sin4);
    k = Rope("k_rope", k, cos4, sin4);
    if (cast_back) {
      // The casts in its return statement, its locals q_embed and k_embed alive to it.
      const int q_embed = q, k_embed = k;
      q = ToDtype("q_rope.cast", q_embed, DTypeOf(q_pre));
      k = ToDtype("k_rope.cast", k_embed, DTypeOf(k_pre));
      HeldThroughHere({q_pre, k_pre, q_embed, k_embed});
    } else {
      HeldThroughHere({q_pre, k_pre});  // apply_rotary_pos_emb's arguments, to its return
    }
    if (config.KeepsKvCache()) {
      // key_states, value_states = past_key_values.update(...): the cache's copies, the
      // old locals rebound after both are made. Under autocast the keys are fp32 (RoPE's
      // product with fp32 cos), the values bf16.
      const DType keys = DTypeOf(k);
      const int k_cached = KvCache("k_cache", k, keys);
      const int v_cached = KvCache("v_cache", v, keys);
      HeldThroughHere({k, v});
      k = k_cached;
      v = v_cached;
    }
    const RopeAttentionOut locals = {-1, q, k, v};
    if (config.KvHeads() < config.heads && (mask >= 0 || RepeatsKv(mode, config.HeadDim()))) {
      k = RepeatKv("k_repeat", k);
      v = RepeatKv("v_repeat", v);
    }
    int attention =
        CausalAttention(mode, q, k, v, mask, ModelSdpaCall(config, mode, mask >= 0).enable_gqa);
    int transposed =
        Op1(OpType::kTranspose, "attention.transpose", {attention}, {.dim = 1, .dim1 = 2});
    int merged = Op1(OpType::kReshape, "attention.merge_heads",
                     {Op1(OpType::kContiguous, "attention.contiguous", {transposed})},
                     {.shape = {kB, kT, kH * kDHead}});
    return {merged, locals.q, locals.k, locals.v};
  }

  // RepeatKv is transformers' repeat_kv, x[:, :, None].expand(B, kv, H / kv, T, d_head)
  // .reshape(B, H, T, d_head): a copy (a view of one kv head). `interleave`: ATen's
  // repeat_interleave, whose clone copies one kv head too, then flattens it.
  int RepeatKv(const std::string& name, int x, bool interleave = false) {
    int unsqueezed = Op1(OpType::kUnsqueeze, name + ".unsqueeze", {x}, {.dim = 2});
    int expanded = Op1(OpType::kExpand, name + ".expand", {unsqueezed},
                       {.shape = {kB, kKv, kH / kKv, kT, kDHead}});
    if (interleave) expanded = Op1(OpType::kContiguous, name + ".clone", {expanded});
    return Op1(OpType::kReshape, name, {expanded}, {.shape = {kB, kH, kT, kDHead}});
  }

  // VocabEmbedding is the token embedding: an embedding, or with tensor parallelism
  // Megatron's vocabulary-parallel one over this rank's V / tp rows.
  // InputEmbeddings marks what the input embeddings return (BlockGraph::input_embeddings).
  void InputEmbeddings(int tensor) { graph_.input_embeddings = tensor; }

  int VocabEmbedding(const std::string& name, int weight, int input_ids) {
    if (!tp_) return Op1(OpType::kEmbedding, name, {weight, input_ids});
    std::vector<int> outputs = Op(OpType::kVocabParallelEmbedding, name, {weight, input_ids},
                                  {"out", "masked_input", "input_mask"});
    graph_.tensors[outputs[1]].dtype = DType::kInt64;
    graph_.tensors[outputs[2]].dtype = DType::kBool;
    return outputs[0];
  }

  // CrossEntropy is the families' loss: labels = pad(input_ids, (0, 1), value=-100)
  // [..., 1:].contiguous(); cross_entropy(logits.view(-1, V), labels.view(-1)), i.e.
  // nll_loss(log_softmax(logits.float())); with tensor parallelism Megatron's
  // vocabulary-parallel cross-entropy.
  int CrossEntropy(int logits, int input_ids) {
    // LlamaForCausalLM / GPT2LMHeadModel keep `logits` (and return it) while the loss
    // function computes on logits.float() (modeling_llama.py, LlamaForCausalLM.forward):
    // in low precision both copies live. ForCausalLMLoss (loss_utils.py) keeps its
    // `logits` (the fp32 ones) and the padded `labels` as locals until it returns.
    HeldToEnd(logits);
    int logits32 = ToDtype("loss.logits_float", logits, DType::kFloat32);
    HeldToEnd(logits32);
    int flat = Op1(OpType::kView, "loss.logits_flat", {logits32}, {.shape = {kB * kT, kV}});
    int padded = Op1(OpType::kConstantPad, "labels.pad", {input_ids});
    HeldToEnd(padded);
    int shifted = Slice("labels.shift", padded, 1, Sym(1), kT);
    int labels = Op1(OpType::kContiguous, "labels", {shifted});
    int labels_flat = Op1(OpType::kView, "labels.flat", {labels}, {.shape = {kB * kT}});
    if (tp_) {
      // The vocabulary-parallel cross-entropy over this rank's V / tp columns.
      std::vector<int> outputs =
          Op(OpType::kVocabParallelCrossEntropy, "loss.vocab_parallel", {flat, labels_flat},
             {"out", "masked_target", "target_mask"});
      graph_.tensors[outputs[1]].dtype = DType::kInt64;
      graph_.tensors[outputs[2]].dtype = DType::kBool;
      return outputs[0];
    }
    int log_probs = Op1(OpType::kLogSoftmax, "loss.log_softmax", {flat});
    return Op(OpType::kNllLoss, "loss.nll", {log_probs, labels_flat}, {"out", "total_weight"})[0];
  }

  // KvCache is DynamicLayer.update's copy of `x` (keys or values), which the model's
  // DynamicCache holds until its forward returns. The layer's empty tensors have the
  // keys' dtype (lazy_initialization), so cat promotes values of another dtype to it.
  int KvCache(const std::string& name, int x, DType keys_dtype) {
    return Op1(OpType::kKvCacheCat, name, {x}, {}, std::nullopt,
               PromoteTypes(keys_dtype, graph_.tensors[x].dtype));
  }

  DType DTypeOf(int tensor) const { return graph_.tensors[tensor].dtype; }
  bool Cuda() const { return cuda_; }  // a CUDA step's graphs
  // SetDType: an output whose dtype is not its first input's (topk's int64 indices).
  void SetDType(int tensor, DType dtype) { graph_.tensors[tensor].dtype = dtype; }

  // The decoder model's own tensors (ModelGraphs::tensors_after_prologue), made without
  // grad; Returns hands each to the decoder model.
  //
  // PositionIds is transformers' position_ids = torch.arange(T) + past_seen_tokens (0),
  // unsqueezed (modeling_llama.py:375-378, modeling_gpt2.py:571-572): (1, T) int64, the
  // arange dying after the sum.
  int PositionIds() {
    int arange = Op1(OpType::kArange, "position_ids.arange", {}, {.shape = {kT}},
                     std::nullopt, DType::kInt64);
    int positions = Op1(OpType::kAddWrappedInt, "position_ids", {arange});
    return Op1(OpType::kUnsqueeze, "position_ids.unsqueeze", {positions}, {.dim = 0});
  }
  // RopeTables is a rotary embedding's forward without grad, as runtime/families/
  // rotary.h's RopeTables computes it: inv_freq = 1 / base^(arange(0, d_head, 2) /
  // d_head) (one statement: its temporaries die with it), freqs = outer(arange(T),
  // inv_freq), emb = cat(freqs, freqs), then cos and sin (1, T, d_head) in `dtype` (the
  // layers' global's: cos.to(x.dtype)), each fp32 table dying after its cast; freqs, emb
  // and inv_freq die as the tables are returned. Returns {cos, sin}.
  std::pair<int, int> RopeTables(const std::string& name, DType dtype) {
    int exponents = Op1(OpType::kArange, name + ".exponents", {}, {.shape = {kDHead / 2}},
                        std::nullopt, DType::kFloat32);
    int scaled = Op1(OpType::kDivScalar, name + ".scaled", {exponents});
    int powered = Op1(OpType::kPowScalarBase, name + ".powered", {scaled});
    int inv_freq = Op1(OpType::kScalarDivide, name + ".inv_freq", {powered});
    HeldThroughHere({exponents, scaled, powered});
    int positions = Op1(OpType::kArange, name + ".positions", {}, {.shape = {kT}},
                        std::nullopt, DType::kFloat32);
    int freqs = Op1(OpType::kOuter, name + ".freqs", {positions, inv_freq});
    int emb = Op1(OpType::kCat, name + ".emb", {freqs, freqs});
    auto table = [&](OpType op, const char* part) {
      int fp32 = Op1(op, absl::StrCat(name, ".", part, ".fp32"), {emb});
      int unsqueezed = Op1(OpType::kUnsqueeze, absl::StrCat(name, ".", part, ".unsqueeze"),
                           {fp32}, {.dim = 0});
      return ToDtype(absl::StrCat(name, ".", part), unsqueezed, dtype);
    };
    int cos = table(OpType::kCos, "cos");
    int sin = table(OpType::kSin, "sin");
    HeldThroughHere({emb, freqs, inv_freq});
    return {cos, sin};
  }
  // SlidingWindowMaskTensor is create_sliding_window_causal_mask's sdpa_mask without
  // vmap (masking_utils.py): arange(B) and arange(1), the q and kv positions arange(T) +
  // 0, then and_masks(sliding_window_overlay, causal) from new_ones((), bool): kv > q -
  // window, &, then kv <= q, &, each result rebinding the last and each comparison
  // dying after its &. The (1, 1, T, T) mask stays; the aranges die as sdpa_mask returns
  // (profiled).
  int SlidingWindowMaskTensor() {
    const std::string name = "sliding_mask";
    int batch = Op1(OpType::kArange, name + ".batch_arange", {}, {.shape = {kB}},
                    std::nullopt, DType::kInt64);
    int head = Op1(OpType::kArange, name + ".head_arange", {}, {.shape = {Sym(1)}},
                   std::nullopt, DType::kInt64);
    auto positions = [&](const char* which) {
      int arange = Op1(OpType::kArange, absl::StrCat(name, ".", which, "_arange"), {},
                       {.shape = {kT}}, std::nullopt, DType::kInt64);
      return Op1(OpType::kAddWrappedInt, absl::StrCat(name, ".", which), {arange});
    };
    int q = positions("q");
    int kv = positions("kv");
    int q4 = Op1(OpType::kView, name + ".q_column", {q}, {.shape = {Sym(1), Sym(1), kT, Sym(1)}});
    int kv4 = Op1(OpType::kView, name + ".kv_row", {kv}, {.shape = {Sym(1), Sym(1), Sym(1), kT}});
    int result = Op1(OpType::kOnes, name + ".ones", {}, {.shape = {}}, std::nullopt,
                     DType::kBool);
    int shifted = Op1(OpType::kAddWrappedInt, name + ".shifted", {q4});
    int in_window = Op1(OpType::kGt, name + ".in_window", {kv4, shifted}, {}, std::nullopt,
                        DType::kBool);
    result = Op1(OpType::kBitwiseAnd, name + ".windowed", {result, in_window});
    int causal = Op1(OpType::kLe, name + ".causal", {kv4, q4}, {}, std::nullopt, DType::kBool);
    result = Op1(OpType::kBitwiseAnd, name, {result, causal});
    HeldThroughHere({batch, head, q, kv});
    return result;
  }
  // Returns: the graph hands `tensor` to the decoder model as model-level tensor `id`
  // (BlockGraph::returns).
  void Returns(int tensor, ModelTensor id) { graph_.returns.emplace_back(tensor, id); }

  // DecoderReturnsHere: the decoder model's forward returns after the last op so far.
  void DecoderReturnsHere() {
    graph_.decoder_returns_after = static_cast<int>(graph_.ops.size()) - 1;
  }

  // HeldToEnd: a Python local holds `tensor` until the segment's forward returns.
  void HeldToEnd(int tensor) { graph_.held_until.emplace_back(tensor, -1); }

  // CausalLmHead is a decoder's end after its final norm `h`: the decoder model returns
  // it (...ForCausalLM's `hidden_states` local, to its return), then the LM head (tied to
  // embed_tokens or not; with sequence parallelism vocabulary-parallel, gathering its
  // input too) and the loss over `input_ids`.
  int CausalLmHead(int h, int input_ids) {
    DecoderReturnsHere();
    HeldToEnd(h);
    int weight = config_.tie_embeddings ? TiedParam("embed_tokens.weight", {kV, kD})
                                        : Param("lm_head.weight", {kV, kD});
    int logits = config_.shard.sp ? Op1(OpType::kGatherLinear, "lm_head", {h, weight},
                                  {.shape = {kB, kT, kV}}, OpKind::kMatmul)
                            : MatmulFolded("lm_head", h, weight, kD, kV);
    return CrossEntropy(logits, input_ids);
  }
  // HeldThroughHere: Python locals hold `tensors` until the last op made so far has run
  // (a module's arguments and locals, to its return).
  // HeldByDecoder: in a prologue, tensors the decoder model's locals hold until it
  // returns (BlockGraph::decoder_locals).
  void HeldByDecoder(std::initializer_list<int> tensors) {
    for (int t : tensors) {
      graph_.decoder_locals.push_back(t);
      graph_.held_until.emplace_back(t, -1);  // to the prologue's end, then the caller's
    }
  }

  void HeldThroughHere(std::initializer_list<int> tensors) {
    for (int t : tensors) {
      graph_.held_until.emplace_back(t, static_cast<int>(graph_.ops.size()) - 1);
    }
  }

  // RegistrationOrder: the parameters' order in model.parameters(), by module name
  // ("q_proj" names q_proj.weight, then q_proj.bias) or by a parameter's own name
  // ("experts.gate_up_proj"), when it is not the graph's.
  void RegistrationOrder(const std::vector<std::string>& modules) {
    for (const std::string& module : modules) {
      for (const std::string suffix :
           {"", ".weight", ".bias", ".lora_A.weight", ".lora_B.weight",
            ".lora_magnitude_vector.weight"}) {
        for (size_t t = 0; t < graph_.tensors.size(); ++t) {
          if (graph_.tensors[t].is_parameter && graph_.tensors[t].name == module + suffix) {
            graph_.parameter_order.push_back(static_cast<int>(t));
          }
        }
      }
    }
  }

  BlockGraph Finish(int output) {
    graph_.output = output;
    return std::move(graph_);
  }

 private:
  int AddTensor(std::string name, DType dtype, bool is_parameter,
                std::vector<SymDim> shape) {
    TensorDef tensor;
    tensor.name = std::move(name);
    tensor.dtype = dtype;
    tensor.is_parameter = is_parameter;
    tensor.shape = std::move(shape);
    graph_.tensors.push_back(std::move(tensor));
    return static_cast<int>(graph_.tensors.size()) - 1;
  }

  // Composite marks the ops appended while it lives as one composite call.
  class Composite {
   public:
    explicit Composite(GraphBuilder* g) : g_(g) { g_->composite_ = g_->next_composite_++; }
    ~Composite() { g_->composite_ = -1; }
    Composite(const Composite&) = delete;
    Composite& operator=(const Composite&) = delete;

   private:
    GraphBuilder* g_;
  };

  const ModelConfig& config_;  // outlives the builder (BuildModelGraphs' argument)
  DType dtype_;
  DType amp_;
  bool megatron_;  // Megatron-LM's dropouts and fused causal softmax
  ModelConfig::Dropouts dropout_;  // transformers' GPT-2's dropout probabilities
  bool sp_;        // Megatron's sequence parallelism
  bool tp_;        // Megatron's tensor parallelism (tp > 1)
  bool cuda_;      // a CUDA step: its autocast lists and dropout kernel
  BlockGraph graph_;
  int composite_ = -1;
  int next_composite_ = 0;
  bool core_attention_ = false;  // appending math attention's core ops
};

}  // namespace memledger

#endif  // ESTIMATOR_GRAPH_GRAPH_BUILDER_H_
