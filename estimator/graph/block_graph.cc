#include "estimator/graph/block_graph.h"

#include <algorithm>
#include <array>
#include <compare>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "estimator/graph/family.h"
#include "estimator/graph/sdpa_kernel.h"

namespace memledger {

const char* ModelTensorName(ModelTensor id) {
  switch (id) {
    case ModelTensor::kNone:
      return "";
    case ModelTensor::kInputIds:
      return "input_ids";
    case ModelTensor::kPositionIds:
      return "position_ids";
    case ModelTensor::kRopeCos:
      return "rope.cos";
    case ModelTensor::kRopeSin:
      return "rope.sin";
    case ModelTensor::kRopeLocalCos:
      return "rope_local.cos";
    case ModelTensor::kRopeLocalSin:
      return "rope_local.sin";
    case ModelTensor::kSlidingMask:
      return "sliding_mask";
  }
  return "?";
}

namespace {

// FreezeByName freezes `graph`'s parameters named `name`.
void FreezeByName(BlockGraph& graph, const std::string& name) {
  for (TensorDef& tensor : graph.tensors) {
    if (tensor.is_parameter && tensor.name == name) tensor.frozen = true;
  }
}

// FreezeParameters marks what `freeze` names as frozen: the embeddings are every
// parameter of the prologue, the LM head's weight the parameter the head's "lm_head"
// call reads (its ops "lm_head", "lm_head.weight_t", an autocast's "lm_head.weight").
// A tied weight is one Parameter in both segments: frozen in both.
void FreezeParameters(const Freeze& freeze, ModelGraphs& graphs) {
  std::vector<std::string> names;
  if (freeze.embeddings && graphs.prologue.has_value()) {
    for (const TensorDef& tensor : graphs.prologue->tensors) {
      if (tensor.is_parameter) names.push_back(tensor.name);
    }
  }
  if (freeze.lm_head) {
    for (const OpDef& op : graphs.epilogue.ops) {
      if (op.name != "lm_head" && !absl::StartsWith(op.name, "lm_head.")) continue;
      for (int input : op.inputs) {
        if (graphs.epilogue.tensors[input].is_parameter) {
          names.push_back(graphs.epilogue.tensors[input].name);
        }
      }
    }
  }
  for (const std::string& name : names) {
    if (graphs.prologue.has_value()) FreezeByName(*graphs.prologue, name);
    FreezeByName(graphs.epilogue, name);
  }
}

// FreezeAllButAdapters: peft's get_peft_model trains the adapters alone
// (_mark_only_adapters_as_trainable, bias="none"): every other parameter is frozen.
void FreezeAllButAdapters(ModelGraphs& graphs) {
  auto freeze = [](BlockGraph& graph) {
    for (TensorDef& tensor : graph.tensors) {
      if (tensor.is_parameter && !absl::StrContains(tensor.name, ".lora_")) tensor.frozen = true;
    }
  };
  if (graphs.prologue.has_value()) freeze(*graphs.prologue);
  for (BlockGraph& kind : graphs.layer_kinds) freeze(kind);
  freeze(graphs.epilogue);
}

}  // namespace

ModelGraphs BuildModelGraphs(const ModelConfig& config, AttentionMode mode) {
  ModelGraphs graphs = FamilyOf(config.family).graphs(config, mode);
  FreezeParameters(config.freeze, graphs);
  if (config.lora.enabled()) FreezeAllButAdapters(graphs);
  if (graphs.prologue.has_value()) {
    const std::vector<bool> grad = graphs.prologue->RequiresGrad();
    graphs.prologue_output_requires_grad = grad[graphs.prologue->output];
    const int embeddings = graphs.prologue->input_embeddings;
    graphs.input_embeddings_leaf = embeddings >= 0 && !grad[embeddings];
  }
  return graphs;
}

std::vector<std::string> FrozenParameterNames(const ModelGraphs& graphs) {
  std::vector<std::string> names;
  auto add = [&](const BlockGraph& graph) {
    for (const TensorDef& tensor : graph.tensors) {
      if (tensor.frozen && std::find(names.begin(), names.end(), tensor.name) == names.end()) {
        names.push_back(tensor.name);
      }
    }
  };
  if (graphs.prologue.has_value()) add(*graphs.prologue);
  for (const BlockGraph& kind : graphs.layer_kinds) add(kind);
  add(graphs.epilogue);
  return names;
}

std::vector<bool> BlockGraph::RequiresGrad() const {
  std::vector<bool> grad(tensors.size(), false);
  for (size_t t = 0; t < tensors.size(); ++t) {
    grad[t] = tensors[t].is_parameter && !tensors[t].frozen;
  }
  for (const OpDef& op : ops) {
    bool any = false;
    if (op.no_grad) continue;  // its outputs stay false
    for (int i : RuleTable::Pinned().Of(op.type).differentiable_inputs) {
      any = any || grad[op.inputs[i]];
    }
    for (int out : op.outputs) {
      const DType dtype = tensors[out].dtype;
      grad[out] = any && dtype != DType::kInt64 && dtype != DType::kInt32 &&
                      dtype != DType::kBool;
    }
  }
  return grad;
}

// Elements is a parameter's, buffer's or global's element count for `symbols`.
CheckedInt64 Elements(const TensorDef& tensor, const SymbolValues& symbols) {
  CheckedInt64 numel = 1;
  for (const SymDim& dim : tensor.shape) numel *= dim.Evaluate(symbols);
  return numel;
}

CheckedInt64 TensorElements(const TensorDef& tensor, const ModelConfig& config) {
  return Elements(tensor, SymbolValues(config));
}

CheckedInt64 ParameterCount(const BlockGraph& graph, const ModelConfig& config, bool tied) {
  const SymbolValues symbols(config);
  CheckedInt64 count = 0;
  for (const TensorDef& tensor : graph.tensors) {
    if (!tensor.is_parameter || tensor.is_tied != tied) continue;
    count += Elements(tensor, symbols);
  }
  return count;
}

std::vector<int> BlockGraph::Parameters() const {
  std::vector<int> parameters;
  ForEachParameter([&](int t) { parameters.push_back(t); });
  return parameters;
}

int64_t ModelGraphs::LayersOfKind(int kind, int64_t first, int64_t count) const {
  // Whole periods, then the rest of the range one pattern position at a time.
  const int64_t period = Period();
  int64_t per_period = 0;
  for (int k : pattern) per_period += k == kind ? 1 : 0;
  int64_t layers = count / period * per_period;
  for (int64_t i = first + count / period * period; i < first + count; ++i) {
    layers += KindOf(i) == kind ? 1 : 0;
  }
  return layers;
}

int64_t ModelGraphs::FirstOfKind(int kind) const {
  for (int64_t i = 0; i < Period(); ++i) {
    if (pattern[i] == kind) return i;
  }
  return -1;
}

ParameterCensus StageParameters(const ModelGraphs& graphs, const ModelConfig& config,
                                const StageRange& stage) {
  ParameterCensus census;
  const SymbolValues symbols(config);
  auto add = [&](const BlockGraph& graph, int64_t copies, bool tied) {
    census.elements += CheckedInt64(copies) * ParameterCount(graph, config, tied);
    for (const TensorDef& tensor : graph.tensors) {
      if (!tensor.is_parameter || tensor.is_tied != tied) continue;
      census.tensors += copies;
      if (tensor.frozen) {
        census.frozen_elements += CheckedInt64(copies) * Elements(tensor, symbols);
        continue;
      }
      census.trainable_tensors += copies;
      census.trainable_elements += CheckedInt64(copies) * Elements(tensor, symbols);
    }
  };
  for (size_t kind = 0; kind < graphs.layer_kinds.size(); ++kind) {
    add(graphs.layer_kinds[kind],
        graphs.LayersOfKind(static_cast<int>(kind), stage.first_layer, stage.layers),
        /*tied=*/false);
  }
  if (stage.prologue && graphs.prologue.has_value()) add(*graphs.prologue, 1, false);
  if (stage.head) {
    add(graphs.epilogue, 1, false);
    if (!stage.prologue) add(graphs.epilogue, 1, /*tied=*/true);
  }
  return census;
}

std::vector<CheckedInt64> BufferSizes(const ModelGraphs& graphs, const ModelConfig& config) {
  const SymbolValues symbols(config);
  std::vector<CheckedInt64> sizes;
  std::vector<const BlockGraph*> segments = {&graphs.epilogue};
  if (graphs.prologue.has_value()) segments.push_back(&*graphs.prologue);
  for (const BlockGraph& kind : graphs.layer_kinds) segments.push_back(&kind);
  for (const BlockGraph* graph : segments) {
    for (const TensorDef& tensor : graph->tensors) {
      if (tensor.is_buffer) sizes.push_back(Elements(tensor, symbols) * ElementSizeBytes(tensor.dtype));
    }
  }
  return sizes;
}

CheckedInt64 BufferBytes(const ModelGraphs& graphs, const ModelConfig& config) {
  CheckedInt64 bytes = 0;
  for (const CheckedInt64& size : BufferSizes(graphs, config)) bytes += size;
  return bytes;
}

namespace {

// ExpertLoads: what the graphs' routed sizes are built from (none for grouped_mm without
// expert parallelism).
std::vector<std::vector<int64_t>> ExpertLoads(const ModelConfig& config) {
  std::vector<std::vector<int64_t>> loads;
  if (!config.RoutingSizesGraphs()) return loads;
  const int64_t rows = config.moe.routing == RoutingSource::kGiven ? config.SparseLayers() : 1;
  for (int64_t l = 0; l < rows; ++l) loads.push_back(config.RunLoad(l));
  return loads;
}

// SdpaKernelKey: the kernel SDPA runs for the model's unmasked or masked calls, as an
// int for the graph cache's key (-1: the backend asked for cannot run it).
int SdpaKernelKey(const ModelConfig& config, AttentionMode mode, bool masked) {
  absl::StatusOr<SdpaKernel> kernel = SdpaKernelFor(config, ModelSdpaCall(config, mode, masked));
  return kernel.ok() ? static_cast<int>(*kernel) : -1;
}

}  // namespace

std::shared_ptr<const ModelGraphs> ModelGraphsFor(const ModelConfig& config,
                                                  AttentionMode mode) {
  // Everything BuildModelGraphs branches on; a field, not a bit, each.
  struct GraphKey {
    Family family;
    AttentionMode mode;
    DType dtype;
    DType amp;
    bool megatron, sp, tp, qkv_bias, o_bias, mlp_bias, qk_norm, grouped_query, repeats_kv, tied;
    bool resid_dropout, embd_dropout, attn_dropout, use_cache;
    std::vector<LayerAttention> layer_attention;
    bool sparse, norm_topk_prob;
    MoeBlock moe_block;
    ExpertsImpl experts_impl;
    std::vector<bool> sparse_layers;
    int64_t ep;  // expert-parallel ranks (their count is in the graphs' views)
    // The eager experts' sizes: every sparse layer's tokens per expert.
    std::vector<std::vector<int64_t>> expert_loads;
    bool sliding_masked;
    Freeze freeze;
    int64_t lora_rank;
    bool lora_dropout;
    bool lora_dora;
    std::vector<std::string> lora_targets;
    Device device;
    // The kernels SDPA runs for an unmasked and a masked call (-1: none can).
    std::array<int, 2> sdpa_kernels;
    auto operator<=>(const GraphKey&) const = default;
  };
  const bool grouped_query = config.KvHeads() < config.heads;
  const GraphKey key{config.family,     mode,
                     config.dtype,      config.amp,
                     config.megatron,   config.shard.sp,
                     config.shard.tp > 1,     config.qkv_bias,
                     config.o_bias,     config.mlp_bias,
                     config.qk_norm,
                     grouped_query,     grouped_query && RepeatsKv(mode, config.HeadDim()),
                     config.tie_embeddings,
                     config.dropout.resid > 0,
                     config.dropout.embd > 0,
                     config.dropout.attn > 0,
                     config.KeepsKvCache(),
                     config.LayerAttentionPeriod(),
                     config.moe.Sparse(),
                     config.moe.norm_topk_prob,
                     config.moe.block,
                     config.moe.impl,
                     config.moe.sparse_layers,
                     config.shard.ep,
                     ExpertLoads(config),
                     config.SlidingWindowMasked(),
                     config.freeze,
                     config.lora.rank,
                     config.lora.dropout > 0,
                     config.lora.dora,
                     config.lora.enabled() ? config.lora.targets : std::vector<std::string>(),
                     config.device,
                     {SdpaKernelKey(config, mode, false), SdpaKernelKey(config, mode, true)}};
  // The graphs this thread asked for last, found without the lock: a batch of
  // predictions (predict_many, a sweep) asks for the same model again and again.
  thread_local std::optional<GraphKey> last_key;
  thread_local std::shared_ptr<const ModelGraphs> last_graphs;
  if (last_key.has_value() && *last_key == key) return last_graphs;
  static std::mutex mutex;
  static auto* const cache = new std::map<GraphKey, std::shared_ptr<const ModelGraphs>>();
  std::lock_guard<std::mutex> lock(mutex);
  std::shared_ptr<const ModelGraphs>& graphs = (*cache)[key];
  if (graphs == nullptr) {
    ModelGraphs built = BuildModelGraphs(config, mode);
    // Cached graphs never change, so their walks can be remembered (walk_memo.h).
    if (built.prologue.has_value()) built.prologue->walk_memo = std::make_shared<WalkMemo>();
    built.tensors_before_prologue.walk_memo = std::make_shared<WalkMemo>();
    built.tensors_after_prologue.walk_memo = std::make_shared<WalkMemo>();
    for (BlockGraph& kind : built.layer_kinds) kind.walk_memo = std::make_shared<WalkMemo>();
    built.epilogue.walk_memo = std::make_shared<WalkMemo>();
    graphs = std::make_shared<const ModelGraphs>(std::move(built));
  }
  last_key = key;
  last_graphs = graphs;
  return graphs;
}

}  // namespace memledger
