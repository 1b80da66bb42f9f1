// Model configuration and checkpointing variants, shared by the estimator, the runtime
// and the verifier so that one name means one thing everywhere.
//
// Example:
//   memledger::ModelConfig config;  // the study's defaults: 6 x 128, 4 heads, 16 x 64
//   absl::StatusOr<std::vector<memledger::Variant>> variants =
//       memledger::ParseVariants("none,full,every_k,selective", /*every=*/2,
//                                /*policy=*/"matmul");
#ifndef ESTIMATOR_SPEC_CONFIG_H_
#define ESTIMATOR_SPEC_CONFIG_H_

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace memledger {

// DType is an element type of a tensor.
// kFloat64 only for the 0-dim tensors a Python number is wrapped in (mul.Tensor(x, 0.5));
// kUInt64 only for the CUDA flash kernel's philox seed and offset.
enum class DType : uint8_t {
  kFloat32, kBool, kInt64, kBFloat16, kFloat16, kFloat64, kInt32, kUInt64
};
inline constexpr int kNumDTypes = static_cast<int>(DType::kUInt64) + 1;

// ElementSizeBytes: inline, as the step simulation asks it at most of its allocations.
constexpr int64_t ElementSizeBytes(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kBool:
      return 1;
    case DType::kInt64:
    case DType::kFloat64:
    case DType::kUInt64:
      return 8;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
  }
  return 0;
}

// PromoteTypes is ATen's result type of an op on two floating tensors of these dtypes:
// the dtype itself when they agree, else fp32 (bf16 with fp32 or fp16 -> fp32).
constexpr DType PromoteTypes(DType a, DType b) { return a == b ? a : DType::kFloat32; }
// "float32", "bool", "int64", "bfloat16", "float16", "float64", "int32", "uint64"
const char* DTypeName(DType dtype);

// ParseModelDType parses --dtype: fp32, bf16 or fp16.
absl::StatusOr<DType> ParseModelDType(absl::string_view name);
// ParseAmp parses --amp: none (kFloat32), bf16 or fp16.
absl::StatusOr<DType> ParseAmp(absl::string_view name);
absl::string_view AmpName(DType amp);  // "none", "bf16", "fp16"
absl::string_view ModelDTypeName(DType dtype);  // "fp32", "bf16", "fp16"

// Device is where the step runs. kCpu is the step memledger's runtime measures here;
// kCuda is a CUDA GPU's step: CUDA autocast's lists, the CUDA SDPA kernels and dropout,
// and only device memory counted (a Python number wrapped for an op stays on the host).
enum class Device : uint8_t { kCpu, kCuda };
absl::string_view DeviceName(Device device);  // "cpu", "cuda"
absl::StatusOr<Device> ParseDevice(absl::string_view name);  // --device
// ParseCublasWorkspaceConfig is --cublas_workspace_config: CUBLAS_WORKSPACE_CONFIG's
// ":SIZE:COUNT" pairs, in bytes.
absl::StatusOr<int64_t> ParseCublasWorkspaceConfig(absl::string_view config);

// kCudaContextBytes: the CUDA context's device memory with lazy module loading (torch
// sets CUDA_MODULE_LOADING=LAZY since 1.13, the default from CUDA 12.2), as PyTorch's PR
// #86509 measured it: 287,047,680 B (666,632,192 B eager). --cuda_context_mib changes it.
inline constexpr int64_t kCudaContextBytes = 287047680;
// kCublasWorkspaceBytes: the cuBLAS workspace each GEMM allocates from the caching
// allocator when CUBLAS_WORKSPACE_CONFIG is unset: 32 MiB (:4096:8) for compute capability
// 9 to 12 (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize).
inline constexpr int64_t kCublasWorkspaceBytes = int64_t{32} << 20;

// SdpaBackend is --sdpa_backend: the kernel F.scaled_dot_product_attention runs.
// kAuto is what the pinned torch selects for the call (estimator/graph/sdpa_kernel.h).
enum class SdpaBackend : uint8_t { kAuto, kFlash, kEfficient, kCudnn, kMath };
absl::string_view SdpaBackendName(SdpaBackend backend);  // "auto", "flash", ...
absl::StatusOr<SdpaBackend> ParseSdpaBackend(absl::string_view name);

// Family is the kind of model: which graph the estimator builds and the runtime runs.
// Each is a line of estimator/spec/families.inc, defined in one folder per side:
// estimator/families/<name>/ (its FamilyDef, estimator/graph/family.h, whose comment says
// what the family is) and runtime/families/<name>/.
enum class Family : uint8_t {
#define MEMLEDGER_FAMILY(name) k##name,
#include "estimator/spec/families.inc"
#undef MEMLEDGER_FAMILY
};
inline constexpr int kNumFamilies = 0
#define MEMLEDGER_FAMILY(name) +1
#include "estimator/spec/families.inc"
#undef MEMLEDGER_FAMILY
    ;

// LayerAttention is a decoder layer's attention span (transformers' layer_types).
enum class LayerAttention : uint8_t {
  kFull,     // "full_attention": every earlier token
  kSliding,  // "sliding_attention": the last sliding_window tokens
};

// CheckpointImpl is torch.utils.checkpoint's implementation (use_reentrant). Both keep
// each call's RNG state and hold the call's bound arguments; they differ in when they
// let go: the reentrant CheckpointFunction keeps them on its ctx, which lives as long as
// the graph (until the loss dies, after the optimizer's step in a training loop); the
// non-reentrant frame dies with the last of its saved tensors, in the layer's backward.
// They recompute differently: the reentrant one replays the whole layer in its node and
// backpropagates through it there; the non-reentrant one runs the layer's nodes in the
// outer graph, recomputes at the first unpack and stops once the last saved tensor is
// remade (estimator/step/simulation_backward.cc, Recompute).
enum class CheckpointImpl : uint8_t { kNonReentrant, kReentrant };
absl::string_view CheckpointImplName(CheckpointImpl impl);  // "non_reentrant", "reentrant"
// ParseCheckpointImpl parses --checkpoint_impl.
absl::StatusOr<CheckpointImpl> ParseCheckpointImpl(absl::string_view name);

// Freeze is which parameters do not train (requires_grad_(False), as a fine-tuning
// script sets it): no gradient, no optimizer state, and their matmuls compute only the
// input's gradient, so what those saved for the weight's is not saved (derivatives.yaml).
// A tied LM head is the embedding's own Parameter: freezing either freezes both.
struct Freeze {
  // embeddings: every input embedding table (the prologue's parameters: embed_tokens,
  // GPT-2's wte and wpe). The first layer's input then requires no gradient, unless
  // checkpointing is on: transformers' activation_checkpointing_enable registers
  // enable_input_require_grads' hook, which makes the embedding's output a leaf that
  // requires grad (modeling_utils.py:3180-3189, 2143-2144).
  bool embeddings = false;
  bool lm_head = false;  // the LM head's weight
  bool any() const { return embeddings || lm_head; }
  friend bool operator==(const Freeze&, const Freeze&) = default;
  friend auto operator<=>(const Freeze&, const Freeze&) = default;
};
// FreezeName: "embeddings,lm_head", "embeddings", "lm_head" or "" (nothing frozen).
std::string FreezeName(const Freeze& freeze);
// ParseFreeze parses --freeze: a comma-separated list of embeddings and lm_head; empty
// or "none" freezes nothing.
absl::StatusOr<Freeze> ParseFreeze(absl::string_view list);

// Lora is peft's LoraConfig for get_peft_model (peft 0.21.2, tuners/lora): every base
// parameter frozen (_mark_only_adapters_as_trainable), and each nn.Linear the targets name
// wrapped in lora.Linear, whose forward adds lora_B(lora_A(dropout(x))) * scaling to the
// base layer's output (tuners/lora/layer.py, Linear.forward).
struct Lora {
  int64_t rank = 0;      // r; 0: no adapters
  double alpha = 8;      // lora_alpha: the scaling alpha / r, which changes no memory
  double dropout = 0;    // lora_dropout: nn.Dropout(p) on the adapter's input; 0: Identity
  // target_modules: module names (a module matches its own name or a name ending in
  // ".name"), or {"all-linear"}: every nn.Linear but the output layer.
  std::vector<std::string> targets = {"q_proj", "v_proj"};
  // dora: use_dora, weight-decomposed LoRA (tuners/lora/dora.py, DoraLinearLayer): each
  // target also trains a magnitude vector (out) and its forward rebuilds the adapters'
  // (out, in) product every step (GraphBuilder::Adapted).
  bool dora = false;
  bool enabled() const { return rank > 0; }
  bool Targets(absl::string_view module) const {
    if (!enabled()) return false;
    for (const std::string& target : targets) {
      if (target == "all-linear" || module == target ||
          (module.size() > target.size() && module[module.size() - target.size() - 1] == '.' &&
           module.substr(module.size() - target.size()) == target)) {
        return true;
      }
    }
    return false;
  }
  friend bool operator==(const Lora&, const Lora&) = default;
};
// kLoraAdapterDtype: the adapters' dtype on any model. get_peft_model's
// autocast_adapter_dtype (default True) upcasts bf16 and fp16 adapters to fp32
// (peft 0.21.2, tuners/tuners_utils.py, cast_adapter_dtype).
inline constexpr DType kLoraAdapterDtype = DType::kFloat32;
// kMaxLoraRank bounds --lora_rank (peft takes any r; the published recipes use 8 to 256).
inline constexpr int64_t kMaxLoraRank = 65536;
// LoraTargetsName: "q_proj,v_proj", "all-linear".
std::string LoraTargetsName(const Lora& lora);
// ParseLoraTargets parses --lora_targets: comma-separated module names, or all-linear.
absl::StatusOr<std::vector<std::string>> ParseLoraTargets(absl::string_view list);

// SmallestPeriod is the shortest prefix p of `per_layer` with per_layer[i] ==
// p[i % |p|]: a per-layer list as the repeating period ModelConfig keeps.
template <typename T>
std::vector<T> SmallestPeriod(const std::vector<T>& per_layer) {
  for (size_t n = 1; n < per_layer.size(); ++n) {
    bool periodic = true;
    for (size_t i = n; i < per_layer.size() && periodic; ++i) {
      periodic = per_layer[i] == per_layer[i % n];
    }
    if (periodic) return std::vector<T>(per_layer.begin(), per_layer.begin() + n);
  }
  return per_layer;
}

// MoeBlock is whose SparseMoeBlock a sparse layer runs (transformers 5.23): the router
// and the experts' registration order differ.
enum class MoeBlock : uint8_t {
  // Qwen3MoeSparseMoeBlock (models/qwen3_moe/modeling_qwen3_moe.py): experts before the
  // gate; softmax(logits, dtype=float), top-k, renormalised if norm_topk_prob, then cast
  // back to the logits' dtype.
  kQwen3Moe,
  // MixtralSparseMoeBlock (models/mixtral/modeling_mixtral.py): the gate before the
  // experts; softmax(logits.float()), top-k, always renormalised, kept in fp32.
  kMixtral,
};

// ExpertsImpl is config._experts_implementation: transformers 5.23 defaults to
// grouped_mm where it can dispatch (modeling_utils.py, get_correct_experts_implementation;
// on the CPU with torch >= 2.10 always), else eager.
enum class ExpertsImpl : uint8_t {
  // integrations/moe.py, grouped_mm_experts_forward: the (token, expert) pairs sorted by
  // expert, gathered, two torch._grouped_mm calls over the 3-D expert weights, weighted,
  // unsorted and summed. Every tensor's size is independent of the routing.
  kGroupedMm,
  // The experts class's own forward (Qwen3MoeExperts.forward, MixtralExperts.forward): a
  // Python loop over the experts hit, each gathering its tokens and running its own
  // linears; the sizes are each expert's share of the routing.
  kEager,
};

// RoutingSource is where the tokens-per-expert counts of the eager experts come from.
enum class RoutingSource : uint8_t {
  // An even split of the B x T x k (token, expert) pairs, the remainder to the lowest
  // expert ids (the default).
  kBalanced,
  // Every token routed to the same k experts: each of experts 0..k-1 receives all B x T
  // tokens, the most one expert can receive.
  kWorst,
  // The counts of a measured step, one row per sparse layer (--routing=PATH).
  kGiven,
};

// kMaxLayerPeriod bounds the period of a model's layer pattern (layer_types, Gemma 3's
// sliding_window_pattern, the MoE's decoder_sparse_step and mlp_only_layers): a model's
// layers are held as one period, and one process's step is replayed over two periods
// and composed (ComposePeak), so 10^12 layers cost what a period does; a pattern that
// does not repeat is as long as the model. The deepest published models have a few
// hundred layers.
inline constexpr int64_t kMaxLayerPeriod = 65536;
// CheckLayerPeriod: "<what> makes a layer pattern of <period> layers (...), more than
// the 65536 a step's replay holds" where `period` is past kMaxLayerPeriod.
absl::Status CheckLayerPeriod(absl::string_view what, int64_t period);
// kMaxCudaLayers bounds the layers of a CUDA step, which is simulated tensor by tensor
// through the caching allocator's blocks rather than composed: 4,096 of tiny-llama's
// layers took 1.3 s and 271 MB here, 16,384 5.6 s and 928 MB; 10^12 ran out of memory.
inline constexpr int64_t kMaxCudaLayers = 4096;

// MoeSpec is a sparse model's mixture of experts.
struct MoeSpec {
  int64_t experts = 0;       // num_experts (Mixtral: num_local_experts); 0: dense
  int64_t top_k = 0;         // num_experts_per_tok
  int64_t intermediate = 0;  // an expert's MLP width (moe_intermediate_size; Mixtral's
                             // intermediate_size)
  bool norm_topk_prob = true;  // the top-k weights renormalised to sum to 1
  MoeBlock block = MoeBlock::kQwen3Moe;
  ExpertsImpl impl = ExpertsImpl::kGroupedMm;
  // sparse_layers: which layers are sparse as one repeating period (layer i's is
  // sparse_layers[i % size]); empty: every layer. Qwen3-MoE's mlp_only_layers and
  // decoder_sparse_step make some dense (modeling_qwen3_moe.py, Qwen3MoeDecoderLayer).
  std::vector<bool> sparse_layers = {};
  // sparse_step, dense_layers: what sparse_layers was derived from, where a config.json
  // gave decoder_sparse_step and mlp_only_layers (layer indices), so that another layer
  // count (--layers) derives it again (DeriveSparseLayers); sparse_step 0: not derived.
  int64_t sparse_step = 0;
  std::vector<int64_t> dense_layers = {};
  RoutingSource routing = RoutingSource::kBalanced;
  // routing_rows: with kGiven, the tokens each expert receives, one row of `experts`
  // counts per sparse layer in layer order, each row summing to B x T x k. With expert
  // parallelism (RankShard::ep > 1) it may hold every expert-parallel rank's rows, rank
  // by rank (ep x sparse layers), or every data-parallel rank's (dp x sparse layers:
  // dp / ep groups of ep ranks).
  std::vector<std::vector<int64_t>> routing_rows = {};

  bool Sparse() const { return experts > 0; }
  // DeriveSparseLayers sets sparse_layers for `layers` layers from sparse_step and
  // dense_layers as Qwen3MoeDecoderLayer decides: layer i is sparse iff (i + 1) %
  // decoder_sparse_step == 0 and i is not in mlp_only_layers (indices past the last
  // layer name none). Without such an index the pattern repeats every
  // decoder_sparse_step layers (one dense layer where the model is shorter); with one
  // it is as long as the model. InvalidArgument where that period is past
  // kMaxLayerPeriod (CheckLayerPeriod), before it is sized.
  absl::Status DeriveSparseLayers(int64_t layers) {
    if (sparse_step < 1) return absl::OkStatus();
    const bool dense_named = std::any_of(dense_layers.begin(), dense_layers.end(),
                                         [&](int64_t i) { return i >= 0 && i < layers; });
    const int64_t length = dense_named ? layers : (layers < sparse_step ? 1 : sparse_step);
    if (absl::Status s =
            CheckLayerPeriod(dense_named ? "mlp_only_layers" : "decoder_sparse_step", length);
        !s.ok()) {
      return s;
    }
    std::vector<bool> sparse(static_cast<size_t>(length));
    for (int64_t i = 0; i < length; ++i) sparse[static_cast<size_t>(i)] = (i + 1) % sparse_step == 0;
    for (int64_t i : dense_layers) {
      if (i >= 0 && i < length) sparse[static_cast<size_t>(i)] = false;
    }
    sparse_layers = SmallestPeriod(sparse);
    if (sparse_layers == std::vector<bool>{true}) sparse_layers.clear();
    return absl::OkStatus();
  }
  bool IsSparse(int64_t layer) const {
    return Sparse() && (sparse_layers.empty() ||
                        sparse_layers[static_cast<size_t>(
                            layer % static_cast<int64_t>(sparse_layers.size()))]);
  }
  friend bool operator==(const MoeSpec&, const MoeSpec&) = default;
};

// RankShard is the part of the model one rank's graphs hold, where the layout splits
// the model itself (tensor, sequence and expert parallelism; the layout's other
// dimensions, estimator/request/parallel_spec.h, split the batch, the layers and the
// parameters' storage, not a rank's graphs). Left at its defaults: the whole model.
struct RankShard {
  // tp: tensor parallelism, Megatron-style. The model is one rank's shard: q/k/v, the
  // MLP's first projection and the vocabulary split column-wise (heads, kv heads,
  // intermediate and vocab / tp per rank), the attention output and the MLP's second
  // projection row-wise; norms, residuals and dropouts replicated.
  int64_t tp = 1;
  // sp: Megatron's sequence parallelism with tp > 1: the norms, dropouts and residuals
  // hold T / tp tokens; a column-parallel linear all-gathers its input (keeping the
  // shard for backward) and a row-parallel one reduce-scatters its output (megatron-gpt).
  bool sp = false;
  // ep: expert parallelism (--ep), as transformers 5.23 trains it
  // (distributed/expert_parallel.py): each of ep ranks holds experts / ep whole experts
  // (MoEParamShard, Shard(0)) and AllToAllEP sends every (token, expert) pair to its
  // expert's rank and the results back. ep_rank: the rank whose graphs these are;
  // ep_group: its group of ep data-parallel ranks (data-parallel rank / ep), whose
  // batches its experts receive where routing_rows gives every data-parallel rank's.
  int64_t ep = 1;
  int64_t ep_rank = 0;
  int64_t ep_group = 0;
  friend bool operator==(const RankShard&, const RankShard&) = default;
};

// ModelArchitecture is the model itself: what its config.json says (a preset, a
// family's reader, HfConfigJson). The first three sizes are the study's; the others
// describe the decoder families and, left at 0, take the study's values (kv_heads =
// heads, head_dim = width / heads, intermediate = 4 width).
// REQUIRES (checked by ValidateConfig): sizes >= 1; family-specific consistency.
struct ModelArchitecture {
  int64_t layers = 6;
  int64_t width = 128;  // hidden size d
  int64_t heads = 4;
  Family family = Family{};  // the registry's first line: the study, whose sizes these are
  int64_t kv_heads = 0;       // key/value heads (grouped-query attention when < heads)
  int64_t head_dim = 0;       // per-head width
  int64_t intermediate = 0;   // MLP width F
  int64_t vocab = 0;          // vocabulary V (decoder families)
  int64_t max_positions = 0;  // GPT-2's learned positions; 0: unlimited (RoPE)
  double norm_eps = 1e-5;
  bool tie_embeddings = false;  // lm_head shares embed_tokens' weight
  bool qkv_bias = false;        // q/k/v projections have biases (Qwen2, Llama's attention_bias)
  bool o_bias = false;          // o_proj has a bias (Llama's attention_bias)
  bool mlp_bias = false;        // gate/up/down projections have biases (Llama's mlp_bias)
  // qk_norm: an RMSNorm over each head's head_dim on q and on k, between the projection
  // and RoPE, each with its own (head_dim) weight (Qwen3's q_norm and k_norm,
  // models/qwen3/modeling_qwen3.py, Qwen3Attention).
  bool qk_norm = false;
  // layer_attention: the layers' attention spans as one repeating period (layer i's is
  // layer_attention[i % size]); empty: every layer full. Gemma 3's layer_types, by
  // default 5 sliding : 1 full (configuration_gemma3.py, sliding_window_pattern 6).
  std::vector<LayerAttention> layer_attention = {};
  // layer_types_layers: the layer count of a config.json's layer_types list that does not
  // repeat (it is its own period), which another layer count (--layers) cannot extend;
  // 0: none (a pattern, or a list that repeats). Not part of the model (operator==).
  int64_t layer_types_layers = 0;
  int64_t sliding_window = 0;  // the sliding layers' window in tokens (0: none)
  // moe: transformers' sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral) on some or
  // all layers; experts 0: a dense model.
  MoeSpec moe = {};
  // megatron: Megatron-LM's ops in the gpt2 family (--model=megatron-gpt): dropouts
  // (p = 0.1) after the embeddings, the attention probabilities and both residual
  // branches, each keeping a bool mask for backward, and the fused causal softmax (no
  // mask tensor). Needs math attention.
  bool megatron = false;
  // dropout: transformers' GPT-2's training-mode dropout probabilities (config.json's
  // resid_pdrop, embd_pdrop, attn_pdrop; GPT2Config's default is 0.1 each). Only
  // whether each is above 0 moves memory: each dropout keeps its noise, and attention
  // dropout sends SDPA to ATen's math kernel, which keeps the T x T probabilities.
  struct Dropouts {
    double resid = 0;  // after the attention's and the MLP's output projections
    double embd = 0;   // after the embeddings
    double attn = 0;   // on the attention probabilities, inside SDPA
    bool Any() const { return resid > 0 || embd > 0 || attn > 0; }
    friend bool operator==(const Dropouts&, const Dropouts&) = default;
  };
  Dropouts dropout = {};
  // use_cache: transformers' use_cache (config.json's; true by default in its configs,
  // false for the study and megatron-gpt). A forward with it fills a DynamicCache with
  // torch.cat copies of every layer's keys and values (cache_utils.py,
  // DynamicLayer.update), which attention reads and the model's output holds until the
  // forward returns. transformers turns it off while gradient checkpointing trains
  // (utils/generic.py:1041-1045), so Predict applies it to the variants that checkpoint
  // no layer; the graphs have the cache exactly when it is true.
  bool use_cache = false;
  // KeepsKvCache: use_cache for a family transformers builds (not the study or
  // megatron-gpt, which have no DynamicCache).
  bool KeepsKvCache() const { return use_cache && !megatron; }
  int64_t KvHeads() const { return kv_heads > 0 ? kv_heads : heads; }
  int64_t HeadDim() const { return head_dim > 0 ? head_dim : width / heads; }
  int64_t Intermediate() const { return intermediate > 0 ? intermediate : 4 * width; }
  // SlidingLayers counts the sliding-window layers among the first `n`.
  int64_t SlidingLayers(int64_t n) const {
    const int64_t period = static_cast<int64_t>(layer_attention.size());
    int64_t count = 0;
    for (int64_t i = 0; i < period; ++i) {
      if (layer_attention[i] == LayerAttention::kSliding) count += i < n ? (n - 1 - i) / period + 1 : 0;
    }
    return count;
  }
  // SparseLayers counts the layers with a mixture of experts.
  int64_t SparseLayers() const {
    int64_t n = 0;
    for (int64_t i = 0; i < layers; ++i) n += moe.IsSparse(i);
    return n;
  }
  // LayerAttentionPeriod is layer_attention over the layers the model has: a model
  // shorter than the period has only its first `layers` types (transformers'
  // layer_types are per layer), so a type no layer has is not in it.
  std::vector<LayerAttention> LayerAttentionPeriod() const {
    if (static_cast<int64_t>(layer_attention.size()) <= layers) return layer_attention;
    return SmallestPeriod(std::vector<LayerAttention>(
        layer_attention.begin(), layer_attention.begin() + static_cast<size_t>(layers)));
  }
  LayerAttention AttentionOf(int64_t layer) const {
    return layer_attention.empty()
               ? LayerAttention::kFull
               : layer_attention[static_cast<size_t>(
                     layer % static_cast<int64_t>(layer_attention.size()))];
  }


  friend bool operator==(const ModelArchitecture& a, const ModelArchitecture& b) {
    return a.layers == b.layers && a.width == b.width && a.heads == b.heads &&
           a.family == b.family && a.KvHeads() == b.KvHeads() && a.HeadDim() == b.HeadDim() &&
           a.Intermediate() == b.Intermediate() && a.vocab == b.vocab &&
           a.max_positions == b.max_positions && a.norm_eps == b.norm_eps &&
           a.tie_embeddings == b.tie_embeddings && a.qkv_bias == b.qkv_bias &&
           a.o_bias == b.o_bias && a.mlp_bias == b.mlp_bias && a.qk_norm == b.qk_norm &&
           a.layer_attention == b.layer_attention && a.sliding_window == b.sliding_window &&
           a.moe == b.moe && a.megatron == b.megatron && a.dropout == b.dropout &&
           a.use_cache == b.use_cache;
  }
};

// RunShape is what one step trains on and in: a micro-batch of `batch` sequences of
// `seq` tokens, the dtypes, and how checkpointed layers run.
struct RunShape {
  int64_t batch = 16;
  int64_t seq = 64;
  // dtype: parameters, gradients and activations ("pure" low precision when not fp32);
  // PyTorch still keeps some tensors in fp32 (SDPA's logsumexp, transformers' RMSNorm
  // upcast, the logits' .float() before the loss).
  DType dtype = DType::kFloat32;
  // amp: autocast's lower-precision dtype (bf16 or fp16) over an fp32 model; kFloat32
  // means no autocast. Matmuls and SDPA run in it (on cast copies of their fp32 inputs
  // and weights), norms, pow, rsqrt and losses in fp32, the rest in their inputs' dtype.
  DType amp = DType::kFloat32;
  // checkpoint_impl: how checkpointed layers run (transformers 5.23 and torch default to
  // non-reentrant).
  CheckpointImpl checkpoint_impl = CheckpointImpl::kNonReentrant;
  // freeze: the parameters that do not train (--freeze).
  Freeze freeze;
  // lora: peft's LoRA adapters (--lora_rank and the others); with them only the
  // adapters train.
  Lora lora;
  friend bool operator==(const RunShape&, const RunShape&) = default;
};

// DeviceOptions is where the step runs and what the device's allocator and kernels are
// asked for.
struct DeviceOptions {
  // device: where the step runs; sdpa_backend: the SDPA kernel asked for;
  // expandable_segments: on CUDA, the caching allocator's expandable segments
  // (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True).
  Device device = Device::kCpu;
  SdpaBackend sdpa_backend = SdpaBackend::kAuto;
  bool expandable_segments = false;
  // cuda_context_bytes: on CUDA, what the CUDA context holds on the device, outside the
  // caching allocator (no max_memory_* counts it; nvidia-smi does).
  int64_t cuda_context_bytes = kCudaContextBytes;
  // cublas_workspace_bytes: on CUDA, each GEMM's cuBLAS workspace
  // (CUBLAS_WORKSPACE_CONFIG: the sum of its :SIZE:COUNT KiB).
  int64_t cublas_workspace_bytes = kCublasWorkspaceBytes;
  // offload_activations: on CUDA, the forward runs under
  // torch.autograd.graph.save_on_cpu(pin_memory=True) (--offload_activations=cpu):
  // every tensor autograd saves is copied to pinned host memory, each SavedVariable its
  // own copy (a weight's too), and back to the device, a copy per node, when its node
  // runs.
  bool offload_activations = false;
  friend bool operator==(const DeviceOptions&, const DeviceOptions&) = default;
};

// ModelConfig is what one rank's step is predicted for: the architecture, the run's
// shape, the device's options, and `shard`, the rank's part of the model under the
// layout (ShardOf(ParallelSpec), estimator/request/parallel_spec.h). A function that
// needs only one of these concerns takes it alone.
struct ModelConfig : ModelArchitecture, RunShape, DeviceOptions {
  // shard: the part of the model this rank's graphs hold.
  RankShard shard = {};

  // TrainableDtype: the dtype of the parameters that train, and so of their gradients
  // and (without master weights) their optimizer state: with LoRA only the adapters
  // train, in kLoraAdapterDtype whatever the model's dtype.
  DType TrainableDtype() const { return lora.enabled() ? kLoraAdapterDtype : dtype; }

  // SlidingWindowMasked: the sliding-window layers attend through a materialized mask
  // (transformers skips it while seq < sliding_window).
  bool SlidingWindowMasked() const {
    bool sliding = false;
    for (LayerAttention type : LayerAttentionPeriod()) sliding = sliding || type == LayerAttention::kSliding;
    return sliding && seq >= sliding_window;
  }
  // ExpertLoad is the tokens each expert receives in sparse layer `sparse_index` (the
  // index among the sparse layers), as moe.routing says: from this rank's batch
  // (shard.ep_rank's rows where the routing gives every rank's).
  std::vector<int64_t> ExpertLoad(int64_t sparse_index) const {
    return ExpertLoadFrom(shard.ep_rank, sparse_index);
  }
  // ExpertLoadFrom: ExpertLoad of expert-parallel rank `source`'s batch (in
  // shard.ep_group).
  // Balanced and worst routings route every rank's batch alike.
  std::vector<int64_t> ExpertLoadFrom(int64_t source, int64_t sparse_index) const {
    const int64_t tokens = batch * seq, pairs = tokens * moe.top_k;
    std::vector<int64_t> load(static_cast<size_t>(moe.experts), 0);
    switch (moe.routing) {
      case RoutingSource::kBalanced:
        for (int64_t e = 0; e < moe.experts; ++e) {
          load[e] = pairs / moe.experts + (e < pairs % moe.experts ? 1 : 0);
        }
        break;
      case RoutingSource::kWorst:
        for (int64_t e = 0; e < moe.top_k; ++e) load[e] = tokens;
        break;
      case RoutingSource::kGiven: {
        const int64_t per_rank = SparseLayers();
        // Rank by rank where the rows are every rank's (ep_group is 0 unless they are
        // every group's too).
        const bool by_rank = static_cast<int64_t>(moe.routing_rows.size()) > per_rank;
        const int64_t rank = by_rank ? shard.ep_group * shard.ep + source : 0;
        load = moe.routing_rows[static_cast<size_t>(rank * per_rank + sparse_index)];
        break;
      }
    }
    return load;
  }
  // ReceivedLoad: with expert parallelism, the tokens each of shard.ep_rank's experts
  // (experts / ep of them, from expert ep_rank x experts / ep on) receives in sparse
  // layer `sparse_index`, from every rank's batch (AllToAllEP's recv_counts, summed
  // over the sources).
  std::vector<int64_t> ReceivedLoad(int64_t sparse_index) const {
    const int64_t local = moe.experts / shard.ep;
    std::vector<int64_t> received(static_cast<size_t>(local), 0);
    for (int64_t source = 0; source < shard.ep; ++source) {
      const std::vector<int64_t> sent = ExpertLoadFrom(source, sparse_index);
      for (int64_t j = 0; j < local; ++j) {
        received[static_cast<size_t>(j)] += sent[static_cast<size_t>(shard.ep_rank * local + j)];
      }
    }
    return received;
  }
  // RoutedGroups: the expert-parallel groups whose batches routing_rows gives (1 unless
  // it gives every data-parallel rank's, dp / ep groups then).
  int64_t RoutedGroups() const {
    const int64_t per_group = shard.ep * SparseLayers();
    const int64_t rows = static_cast<int64_t>(moe.routing_rows.size());
    return moe.routing == RoutingSource::kGiven && shard.ep > 1 && per_group > 0 &&
                   rows > per_group
               ? rows / per_group
               : 1;
  }
  // RoutingSizesGraphs: the graphs' sizes depend on the routing: the eager experts'
  // per-expert rows, or with expert parallelism the rows a rank receives.
  bool RoutingSizesGraphs() const {
    return moe.Sparse() && (moe.impl == ExpertsImpl::kEager || shard.ep > 1);
  }
  // RunLoad: the tokens each expert this rank runs receives in sparse layer
  // `sparse_index`: ExpertLoad, or with expert parallelism ReceivedLoad.
  std::vector<int64_t> RunLoad(int64_t sparse_index) const {
    return shard.ep > 1 ? ReceivedLoad(sparse_index) : ExpertLoad(sparse_index);
  }
  // LayersAlone is this model with only `kept` of its layers (model indices, in order),
  // each keeping its attention span, sparseness and routing row, and its batch `scale`
  // times larger (a given routing's rows likewise): the model a pipeline stage's
  // checkpoint plan is guided by (planner/stage_planner.h). REQUIRES: routing_rows one
  // per sparse layer (not every expert-parallel rank's).
  ModelConfig LayersAlone(const std::vector<int64_t>& kept, int64_t scale = 1) const {
    ModelConfig out = *this;
    out.layers = static_cast<int64_t>(kept.size());
    out.batch = batch * scale;
    if (!layer_attention.empty()) {
      out.layer_attention.clear();
      for (int64_t l : kept) out.layer_attention.push_back(AttentionOf(l));
    }
    if (moe.Sparse() && !moe.sparse_layers.empty()) {
      out.moe.sparse_layers.clear();
      for (int64_t l : kept) out.moe.sparse_layers.push_back(moe.IsSparse(l));
    }
    if (moe.Sparse() && moe.routing == RoutingSource::kGiven) {
      out.moe.routing_rows.clear();
      // The rows follow the sparse layers in order; `kept` is in order too.
      int64_t layer = 0, sparse_index = 0;
      for (int64_t l : kept) {
        for (; layer < l; ++layer) sparse_index += moe.IsSparse(layer);
        if (!moe.IsSparse(l)) continue;
        std::vector<int64_t> row = moe.routing_rows[static_cast<size_t>(sparse_index)];
        for (int64_t& tokens : row) tokens *= scale;
        out.moe.routing_rows.push_back(std::move(row));
      }
    }
    return out;
  }

  friend bool operator==(const ModelConfig& a, const ModelConfig& b) {
    return static_cast<const ModelArchitecture&>(a) == static_cast<const ModelArchitecture&>(b) &&
           static_cast<const RunShape&>(a) == static_cast<const RunShape&>(b) &&
           static_cast<const DeviceOptions&>(a) == static_cast<const DeviceOptions&>(b) &&
           a.shard == b.shard;
  }
};

// ModelConfigOf: `architecture` on the study's batch and seq, in fp32, on the CPU, the
// whole model on one rank (a preset's or a config.json's run until flags say otherwise).
inline ModelConfig ModelConfigOf(const ModelArchitecture& architecture) {
  ModelConfig config;
  static_cast<ModelArchitecture&>(config) = architecture;
  return config;
}

// StudyModel: the study's block stack, `layers` blocks of `width` with `heads` heads, on
// micro-batches of `batch` sequences of `seq` tokens; everything else at its default.
inline ModelConfig StudyModel(int64_t layers, int64_t width, int64_t heads, int64_t batch,
                              int64_t seq) {
  ModelConfig config;
  config.layers = layers;
  config.width = width;
  config.heads = heads;
  config.batch = batch;
  config.seq = seq;
  return config;
}

// OptimizerKind is the optimizer whose state the step holds.
enum class OptimizerKind : uint8_t {
  kAdamW,  // exp_avg, exp_avg_sq (the study's, lr 1e-3)
  kAdam,   // exp_avg, exp_avg_sq
  kSgd,    // momentum_buffer when momentum > 0, nothing otherwise
};
absl::string_view OptimizerName(OptimizerKind kind);  // "adamw", "adam", "sgd"
absl::StatusOr<OptimizerKind> ParseOptimizer(absl::string_view name);

// OptimizerImpl is which of torch.optim's implementations steps (the `foreach` and
// `fused` arguments of torch.optim.AdamW, Adam and SGD): each allocates its own
// temporaries (torch/optim/adam.py, sgd.py).
enum class OptimizerImpl : uint8_t {
  kForLoop,  // foreach=False: _single_tensor_adam / _single_tensor_sgd, tensor by tensor
  kForeach,  // foreach=True: _multi_tensor_*, whole lists of tensors at once
  kFused,    // fused=True: torch._fused_adam(w)_ / _fused_sgd_, no temporaries
};
absl::string_view OptimizerImplName(OptimizerImpl impl);  // "for_loop", "foreach", "fused"
// ParseOptimizerImpl parses --optimizer_impl: auto, for_loop, foreach or fused. `auto` is
// what torch.optim picks when neither is given: the for-loop for CPU tensors, foreach
// for CUDA ones (torch/optim/optimizer.py, _default_to_fused_or_foreach).
absl::StatusOr<OptimizerImpl> ParseOptimizerImpl(absl::string_view name,
                                                 Device device = Device::kCpu);

// OptimizerSpec is the optimizer and how it holds the parameters.
struct OptimizerSpec {
  OptimizerKind kind = OptimizerKind::kAdamW;
  double momentum = 0;  // SGD only
  // master_weights: for a low-precision model, the optimizer steps fp32 copies of the
  // parameters (and keeps its state in fp32), as mixed-precision trainers do.
  bool master_weights = false;
  OptimizerImpl impl = OptimizerImpl::kForLoop;
  friend bool operator==(const OptimizerSpec&, const OptimizerSpec&) = default;
};

// AttentionMode selects how causal attention is computed and what it keeps.
enum class AttentionMode {
  // PyTorch 2.x CPU flash SDPA contract: keeps q, k, v (views of the QKV output), out
  // and logsumexp; never a (B, H, T, T) matrix. The default.
  kFlash,
  // Plain ops (matmul, scale, masked_fill, softmax, matmul): keeps the T x T matrices.
  kMath,
};

absl::string_view AttentionModeName(AttentionMode mode);  // "flash" or "math"

// RepeatsKv says whether a grouped-query layer copies its key/value heads up to the query
// heads (transformers' repeat_kv) before attention. transformers 5.23's sdpa attention
// passes enable_gqa=True instead when there is no mask and head_dim <= 256
// (integrations/sdpa_attention.py:43-52, use_gqa_in_sdpa; :130-138), and the CPU flash
// kernel reads the shared heads itself; the eager (math) attention always repeats.
bool RepeatsKv(AttentionMode mode, int64_t head_dim);
absl::StatusOr<AttentionMode> ParseAttentionMode(absl::string_view name);

// OpKind names the ops a selective-checkpointing policy can must-save. Their outputs
// (all of them) are cached at forward and reused at recompute.
enum class OpKind {
  kMatmul,     // the four Linear layers' addmm (the study's policy)
  kAttention,  // flash attention: out and logsumexp (flash mode only)
  kLayerNorm,  // native_layer_norm: out, mean, rstd
  kGelu,       // gelu (exact for the study, tanh for megatron-gpt): out
  kSilu,       // silu (Llama's SwiGLU gate): out
};

absl::string_view OpKindName(OpKind kind);  // "matmul", "attention", ...

inline constexpr int kNumOpKinds = static_cast<int>(OpKind::kSilu) + 1;

// SavePolicy is the set of op kinds a selective variant must-saves; empty by default
// (selective then equals full). The study's policy is StudyPolicy(): matmuls.
class SavePolicy {
 public:
  SavePolicy() = default;
  SavePolicy(std::initializer_list<OpKind> kinds) {
    for (OpKind kind : kinds) Add(kind);
  }

  bool Saves(OpKind kind) const { return (kinds_ & Bit(kind)) != 0; }
  void Add(OpKind kind) { kinds_ |= Bit(kind); }
  bool empty() const { return kinds_ == 0; }

  friend bool operator==(const SavePolicy& a, const SavePolicy& b) {
    return a.kinds_ == b.kinds_;
  }

 private:
  static uint32_t Bit(OpKind kind) { return uint32_t{1} << static_cast<int>(kind); }
  uint32_t kinds_ = 0;
};

// StudyPolicy is the study's: must-save the matmuls (mm and addmm).
inline SavePolicy StudyPolicy() { return SavePolicy{OpKind::kMatmul}; }

// ParseSavePolicy parses a comma-separated list of op kind names ("matmul",
// "matmul,gelu"); an empty list saves nothing (selective then equals full).
absl::StatusOr<SavePolicy> ParseSavePolicy(absl::string_view names);
std::string SavePolicyName(const SavePolicy& policy);  // "matmul,gelu"; "" if empty

// VariantKind is the checkpointing choice.
enum class VariantKind {
  kNone,       // no checkpointing
  kFull,       // every block checkpointed
  kEveryK,     // blocks i with i % k == 0 checkpointed
  kSelective,  // every block checkpointed, policy ops' outputs must-saved
  kPlan,       // a choice per layer (LayerChoice), e.g. a checkpoint planner's
  // Megatron's selective recompute (--recompute-granularity=selective): no layer is
  // checkpointed, but the core attention (scores, softmax, dropout, values) keeps
  // nothing and is recomputed from q, k and v in the backward (math attention).
  kCoreAttention,
};

// LayerChoice is one layer's checkpointing: not checkpointed, or checkpointed with the
// op kinds its selective cache must-saves (empty: full recompute).
struct LayerChoice {
  bool checkpointed = false;
  SavePolicy policy;  // checkpointed layers only

  // Name: "none", "full" or "selective:<policy>" (e.g. "selective:matmul,silu").
  std::string Name() const;
  friend bool operator==(const LayerChoice& a, const LayerChoice& b) {
    return a.checkpointed == b.checkpointed && (!a.checkpointed || a.policy == b.policy);
  }
};

// ParseLayerChoice parses LayerChoice::Name()'s forms.
absl::StatusOr<LayerChoice> ParseLayerChoice(absl::string_view name);

// Variant is one checkpointing choice with its parameters.
struct Variant {
  VariantKind kind = VariantKind::kNone;
  int64_t every = 2;                  // k, for kEveryK only
  SavePolicy policy = StudyPolicy();  // for kSelective only
  std::vector<LayerChoice> layers;    // for kPlan only: one per layer

  // Name is the variant's report key: "none", "full", "every_2", "selective", "plan",
  // "core_attention".
  std::string Name() const;
  // IsCheckpointed says whether block `index` runs under checkpointing.
  bool IsCheckpointed(int64_t index) const;
  // CheckpointsAnyLayer: some block runs under checkpointing (transformers then turns
  // use_cache off). Layer 0 for full, selective and every_k; a plan says so per layer.
  bool CheckpointsAnyLayer() const;
  // PolicyAt is what block `index`'s selective cache must-saves (empty when the block
  // is not checkpointed or fully recomputed).
  SavePolicy PolicyAt(int64_t index) const;
  // At is block `index`'s choice.
  LayerChoice At(int64_t index) const { return {IsCheckpointed(index), PolicyAt(index)}; }
};

// PlanVariant is the kPlan variant of per-layer choices.
Variant PlanVariant(std::vector<LayerChoice> layers);

// ParseVariants parses a comma-separated list of "none", "full", "every_k" (or
// "every_<k>", e.g. "every_3"), "selective". `every` is the k used by "every_k";
// `policy` the selective policy. Duplicate names are an error.
absl::StatusOr<std::vector<Variant>> ParseVariants(absl::string_view names, int64_t every,
                                                   absl::string_view policy);

// kMaxEvery bounds every_k's k: the step simulation replays a short model of 2k + 1
// layers and walks one period of k layers to compose a long model's peak.
inline constexpr int64_t kMaxEvery = 1024;

// The study's four variants: none, full, every_2, selective (matmul).
std::vector<Variant> DefaultVariants();

// StageRange is the part of the model one pipeline stage runs for a micro-batch (one
// model chunk, with interleaving): layers [first_layer, first_layer + layers), with the
// embedding (prologue) or not, with the head and loss or not. A stage without the
// embedding receives its input (a leaf that requires grad, kept if its first layer
// keeps it); one without the head sends its output, keeping it only if its last layer
// does (the send holds no reference, as Megatron's deallocate_output_tensor).
struct StageRange {
  int64_t first_layer = 0;
  int64_t layers = 0;
  bool prologue = true;
  bool head = true;
};
StageRange WholeModel(const ModelConfig& config);

}  // namespace memledger

#endif  // ESTIMATOR_SPEC_CONFIG_H_
