#include "estimator/report/report.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "estimator/graph/family.h"
#include "estimator/graph/rules.h"
#include "estimator/graph/sdpa_kernel.h"
#include "estimator/parallel/ddp_buckets.h"
#include "estimator/report/units.h"
#include "rapidjson/prettywriter.h"
#include "rapidjson/stringbuffer.h"

namespace memledger {
namespace {

using Allocator = rapidjson::Document::AllocatorType;

rapidjson::Value String(const std::string& s, Allocator& allocator) {
  return rapidjson::Value(s, allocator);
}

std::string OpLabel(const BlockGraph& graph, const KeptStorage& kept) {
  if (kept.op < 0) return "checkpoint";
  const OpDef& op = graph.ops[kept.op];
  return absl::StrCat(op.name, " (", OpTypeName(op.type), ")");
}

rapidjson::Value StoragesJson(const BlockGraph& graph, const BlockWalk& walk,
                              Allocator& allocator) {
  rapidjson::Value list(rapidjson::kArrayType);
  for (const KeptStorage& kept : walk.storages) {
    rapidjson::Value entry(rapidjson::kObjectType);
    entry.AddMember("op", String(OpLabel(graph, kept), allocator), allocator);
    entry.AddMember("tensor", String(graph.tensors[kept.tensor].name, allocator), allocator);
    entry.AddMember("storage", String(graph.tensors[kept.storage_owner].name, allocator),
                    allocator);
    rapidjson::Value shape(rapidjson::kArrayType);
    for (int i = 0; i < kept.layout.ndim; ++i) {
      shape.PushBack(static_cast<int64_t>(kept.layout.sizes[i]), allocator);
    }
    entry.AddMember("shape", shape, allocator);
    entry.AddMember("dtype", rapidjson::StringRef(DTypeName(graph.tensors[kept.tensor].dtype)),
                    allocator);
    entry.AddMember("storage_bytes", kept.bytes, allocator);
    entry.AddMember("reason", rapidjson::StringRef(KeepReasonName(kept.reason)), allocator);
    list.PushBack(entry, allocator);
  }
  return list;
}

// PlanJson is a plan variant's choices, one per layer: ["none", "full",
// "selective:matmul", ...] (LayerChoice::Name()).
rapidjson::Value PlanJson(const Variant& plan, Allocator& allocator) {
  rapidjson::Value list(rapidjson::kArrayType);
  for (const LayerChoice& choice : plan.layers) {
    list.PushBack(String(choice.Name(), allocator), allocator);
  }
  return list;
}

std::string BlockKindLabel(const BlockKind& kind) {
  return absl::StrCat(kind.checkpointed ? "checkpointed" : "plain", " block",
                      kind.input_requires_grad ? "" : " 0 (input without grad)");
}

// RoutingName: "balanced", "worst" or "given" (a routing file's rows).
const char* RoutingName(RoutingSource routing) {
  switch (routing) {
    case RoutingSource::kBalanced:
      return "balanced";
    case RoutingSource::kWorst:
      return "worst";
    case RoutingSource::kGiven:
      return "given";
  }
  return "?";
}

// ConfigJson is the study's "config" object: layers, width, heads, batch, seq; for a
// decoder family also its name and the rest of the spec.
rapidjson::Value ConfigJson(const ModelConfig& config, Allocator& allocator) {
  rapidjson::Value json(rapidjson::kObjectType);
  json.AddMember("layers", config.layers, allocator);
  json.AddMember("width", config.width, allocator);
  json.AddMember("heads", config.heads, allocator);
  json.AddMember("batch", config.batch, allocator);
  json.AddMember("seq", config.seq, allocator);
  if (FamilyOf(config.family).decoder) {
    json.AddMember("family", rapidjson::StringRef(FamilyName(config.family).data()), allocator);
    json.AddMember("kv_heads", config.KvHeads(), allocator);
    json.AddMember("head_dim", config.HeadDim(), allocator);
    json.AddMember("intermediate", config.Intermediate(), allocator);
    json.AddMember("vocab", config.vocab, allocator);
    json.AddMember("max_positions", config.max_positions, allocator);
    json.AddMember("norm_eps", config.norm_eps, allocator);
    json.AddMember("tie_embeddings", config.tie_embeddings, allocator);
    json.AddMember("qkv_bias", config.qkv_bias, allocator);
    json.AddMember("o_bias", config.o_bias, allocator);
    json.AddMember("mlp_bias", config.mlp_bias, allocator);
    json.AddMember("qk_norm", config.qk_norm, allocator);
    json.AddMember("use_cache", config.use_cache, allocator);
    if (FamilyOf(config.family).dropouts && !config.megatron) {
      rapidjson::Value dropout(rapidjson::kObjectType);
      dropout.AddMember("resid", config.dropout.resid, allocator);
      dropout.AddMember("embd", config.dropout.embd, allocator);
      dropout.AddMember("attn", config.dropout.attn, allocator);
      json.AddMember("dropout", dropout, allocator);
    }
    if (config.megatron) json.AddMember("megatron", true, allocator);
    if (config.moe.Sparse()) {
      // The mixture of experts: whose block, its sizes, how the experts run, and which
      // layers are sparse (one period; absent: all).
      const MoeSpec& moe = config.moe;
      rapidjson::Value spec(rapidjson::kObjectType);
      spec.AddMember("block", rapidjson::StringRef(moe.block == MoeBlock::kMixtral ? "mixtral"
                                                                                   : "qwen3_moe"),
                     allocator);
      spec.AddMember("experts", moe.experts, allocator);
      spec.AddMember("experts_per_token", moe.top_k, allocator);
      spec.AddMember("expert_intermediate", moe.intermediate, allocator);
      spec.AddMember("norm_topk_prob", moe.norm_topk_prob, allocator);
      spec.AddMember("experts_impl", rapidjson::StringRef(moe.impl == ExpertsImpl::kEager
                                                              ? "eager"
                                                              : "grouped_mm"),
                     allocator);
      // grouped_mm's sizes never depend on the routing; the eager experts' do.
      spec.AddMember("routing", rapidjson::StringRef(moe.impl == ExpertsImpl::kEager
                                                         ? RoutingName(moe.routing)
                                                         : "any"),
                     allocator);
      if (!moe.sparse_layers.empty()) {
        rapidjson::Value period(rapidjson::kArrayType);
        for (bool sparse : moe.sparse_layers) period.PushBack(sparse, allocator);
        spec.AddMember("sparse_layers_period", period, allocator);
      }
      json.AddMember("moe", spec, allocator);
    }
    // Sizes above are the whole model's; with tp > 1 every bucket is one rank's.
    if (config.shard.tp > 1) json.AddMember("tp", config.shard.tp, allocator);
    if (config.shard.sp) json.AddMember("sp", true, allocator);
  }
  return json;
}

}  // namespace

rapidjson::Document StudyJsonHead(const ModelConfig& config, AttentionMode attention,
                                  const OptimizerSpec& optimizer,
                                  const ParameterBuckets& buckets) {
  rapidjson::Document doc(rapidjson::kObjectType);
  Allocator& a = doc.GetAllocator();
  doc.AddMember("config", ConfigJson(config, a), a);
  doc.AddMember("attention", rapidjson::StringRef(AttentionModeName(attention).data()), a);
  doc.AddMember("device", rapidjson::StringRef(DeviceName(config.device).data()), a);
  doc.AddMember("sdpa_backend",
                rapidjson::StringRef(SdpaBackendName(config.sdpa_backend).data()), a);
  doc.AddMember("sdpa_kernel", String(SdpaKernelsName(config, attention).value_or("?"), a), a);
  if (config.device == Device::kCuda) {
    doc.AddMember("expandable_segments", config.expandable_segments, a);
    // Each GEMM's cuBLAS workspace (--cublas_workspace_config), a transient in the peak.
    doc.AddMember("cublas_workspace_bytes", config.cublas_workspace_bytes, a);
    // Where autograd's saved tensors live between forward and backward
    // (--offload_activations: "cpu" under save_on_cpu).
    doc.AddMember("offload_activations",
                  rapidjson::StringRef(config.offload_activations ? "cpu" : "none"), a);
    // What the device holds outside the caching allocator, which no max_memory_* counts.
    rapidjson::Value outside(rapidjson::kObjectType);
    outside.AddMember("cuda_context", config.cuda_context_bytes, a);
    doc.AddMember("outside_allocator_bytes", outside, a);
  }
  doc.AddMember("checkpoint_impl",
                rapidjson::StringRef(CheckpointImplName(config.checkpoint_impl).data()), a);
  // The release whose saving rules the numbers follow (estimator/graph/rules.h).
  doc.AddMember("torch", rapidjson::StringRef(kTorchRelease), a);
  doc.AddMember("transformers", rapidjson::StringRef(kTransformersRelease), a);
  doc.AddMember("dtype", rapidjson::StringRef(ModelDTypeName(config.dtype).data()), a);
  doc.AddMember("amp", rapidjson::StringRef(AmpName(config.amp).data()), a);
  rapidjson::Value optimizer_json(rapidjson::kObjectType);
  optimizer_json.AddMember("name", rapidjson::StringRef(OptimizerName(optimizer.kind).data()),
                           a);
  if (optimizer.kind == OptimizerKind::kSgd) optimizer_json.AddMember("momentum", optimizer.momentum, a);
  optimizer_json.AddMember("master_weights", optimizer.master_weights, a);
  doc.AddMember("optimizer", optimizer_json, a);
  doc.AddMember("n_params", buckets.n_params, a);
  doc.AddMember("param_bytes", buckets.param_bytes, a);
  doc.AddMember("grad_bytes", buckets.grad_bytes, a);
  if (optimizer.kind == OptimizerKind::kAdamW) {
    doc.AddMember("adamw_state_bytes", buckets.adamw_state_bytes, a);
  }
  doc.AddMember("optimizer_state_bytes", buckets.optimizer_state_bytes, a);
  return doc;
}

rapidjson::Value PeakJson(const StepPeak& peak, rapidjson::Document::AllocatorType& a) {
  rapidjson::Value json(rapidjson::kObjectType);
  json.AddMember("bytes", peak.bytes, a);
  json.AddMember("phase", rapidjson::StringRef(StepPhaseName(peak.phase)), a);
  json.AddMember("op", String(peak.op, a), a);
  rapidjson::Value categories(rapidjson::kObjectType);
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    categories.AddMember(rapidjson::StringRef(MemoryCategoryName(static_cast<MemoryCategory>(c))),
                         peak.by_category[c], a);
  }
  json.AddMember("by_category", categories, a);
  return json;
}

rapidjson::Document PredictionJson(const Prediction& p) {
  rapidjson::Document doc =
      StudyJsonHead(p.config, p.attention, p.optimizer,
                    {p.n_params, p.param_bytes, p.grad_bytes, p.optimizer_state_bytes,
                     p.adamw_state_bytes});
  Allocator& a = doc.GetAllocator();
  // What trains (--freeze): the frozen parameters are in param_bytes, with no gradient
  // and no optimizer state.
  doc.AddMember("freeze", String(FreezeName(p.config.freeze), a), a);
  if (p.config.lora.enabled()) {  // peft's LoraConfig; only the adapters train
    rapidjson::Value lora(rapidjson::kObjectType);
    lora.AddMember("rank", p.config.lora.rank, a);
    lora.AddMember("alpha", p.config.lora.alpha, a);
    lora.AddMember("dropout", p.config.lora.dropout, a);
    lora.AddMember("targets", String(LoraTargetsName(p.config.lora), a), a);
    lora.AddMember("use_dora", p.config.lora.dora, a);
    doc.AddMember("lora", lora, a);
  }
  doc.AddMember("n_trainable_params", p.n_trainable_params, a);
  doc.AddMember("frozen_param_bytes", p.frozen_param_bytes, a);
  doc.AddMember("buffer_bytes", p.buffer_bytes, a);
  doc.AddMember("communication_bytes", p.communication_bytes, a);
  rapidjson::Value saved(rapidjson::kObjectType), ratio(rapidjson::kObjectType),
      cache(rapidjson::kObjectType), held(rapidjson::kObjectType);
  for (const VariantPrediction& v : p.variants) {
    saved.AddMember(String(v.variant.Name(), a), rapidjson::Value(v.saved_bytes), a);
    held.AddMember(String(v.variant.Name(), a), rapidjson::Value(v.held_after_forward_bytes),
                   a);
    ratio.AddMember(String(v.variant.Name(), a),
                    rapidjson::Value(RoundTo4(v.saved_ratio_vs_none)), a);
    cache.AddMember(String(v.variant.Name(), a), rapidjson::Value(v.cache_bytes), a);
  }
  doc.AddMember("saved_bytes", saved, a);
  doc.AddMember("saved_ratio_vs_none", ratio, a);
  doc.AddMember("cache_bytes", cache, a);
  doc.AddMember("held_after_forward_bytes", held, a);
  rapidjson::Value caveats(rapidjson::kArrayType);
  for (const std::string& caveat : p.caveats) caveats.PushBack(String(caveat, a), a);
  doc.AddMember("caveats", caveats, a);
  {
    // The whole step's peak (estimator/step/liveness.h), where the simulation models it.
    // On CUDA peak_bytes counts the caching allocator's blocks (max_memory_allocated)
    // and peak_reserved_bytes its segments (max_memory_reserved).
    rapidjson::Value peak_bytes(rapidjson::kObjectType), peaks(rapidjson::kObjectType),
        reserved(rapidjson::kObjectType), offloaded(rapidjson::kObjectType);
    std::string unavailable;
    for (const VariantPrediction& v : p.variants) {
      if (!v.peak.has_value()) {
        if (!v.peak_unavailable.empty()) unavailable = v.peak_unavailable;
        continue;
      }
      peak_bytes.AddMember(String(v.variant.Name(), a), rapidjson::Value(v.peak->bytes), a);
      peaks.AddMember(String(v.variant.Name(), a), PeakJson(*v.peak, a), a);
      reserved.AddMember(String(v.variant.Name(), a), rapidjson::Value(v.peak_reserved_bytes),
                         a);
      offloaded.AddMember(String(v.variant.Name(), a), rapidjson::Value(v.offloaded_bytes), a);
    }
    if (!peak_bytes.ObjectEmpty()) {
      doc.AddMember("peak_bytes", peak_bytes, a);
      doc.AddMember("peak", peaks, a);
      if (p.config.device == Device::kCuda) doc.AddMember("peak_reserved_bytes", reserved, a);
      // Host memory, beside the device's peak (--offload_activations=cpu).
      if (p.config.offload_activations) doc.AddMember("offloaded_bytes", offloaded, a);
    }
    if (!unavailable.empty()) doc.AddMember("peak_unavailable", String(unavailable, a), a);
  }
  {
    // Which dtypes the saved bytes are in (fp32 statistics and logits next to bf16
    // activations), and autocast's weight copies among them.
    rapidjson::Value by_dtype(rapidjson::kObjectType), copies(rapidjson::kObjectType);
    for (const VariantPrediction& v : p.variants) {
      rapidjson::Value split(rapidjson::kObjectType);
      for (int d = 0; d < kNumDTypes; ++d) {
        if (v.saved_by_dtype[d] == 0) continue;
        split.AddMember(rapidjson::StringRef(DTypeName(static_cast<DType>(d))),
                        rapidjson::Value(v.saved_by_dtype[d]), a);
      }
      by_dtype.AddMember(String(v.variant.Name(), a), split, a);
      copies.AddMember(String(v.variant.Name(), a), rapidjson::Value(v.weight_copy_bytes), a);
    }
    doc.AddMember("saved_bytes_by_dtype", by_dtype, a);
    if (p.config.amp != DType::kFloat32) doc.AddMember("autocast_weight_copy_bytes", copies, a);
  }
  if (FamilyOf(p.config.family).decoder) {
    // Where the saved bytes sit: the logits' share shows in head_loss.
    rapidjson::Value segments(rapidjson::kObjectType);
    for (const VariantPrediction& v : p.variants) {
      rapidjson::Value split(rapidjson::kObjectType);
      split.AddMember("embedding", v.embedding_bytes, a);
      split.AddMember("layers", v.layers_bytes, a);
      split.AddMember("head_loss", v.head_loss_bytes, a);
      // The table's "head share".
      split.AddMember("head_loss_share",
                      RoundTo4(static_cast<double>(v.head_loss_bytes) /
                               static_cast<double>(v.saved_bytes)),
                      a);
      segments.AddMember(String(v.variant.Name(), a), split, a);
    }
    doc.AddMember("saved_bytes_by_segment", segments, a);
  }
  for (const VariantPrediction& v : p.variants) {
    if (v.variant.kind == VariantKind::kSelective) {
      doc.AddMember("policy", String(SavePolicyName(v.variant.policy), a), a);
    }
    if (v.variant.kind == VariantKind::kPlan) {
      doc.AddMember("plan", PlanJson(v.variant, a), a);
    }
  }
  doc.AddMember("predicted_saved_bytes_none", p.korthikanti_saved_bytes_none, a);
  doc.AddMember("measured_over_predicted", RoundTo4(p.saved_none_over_korthikanti), a);
  if (!p.variants.empty() && (!p.variants[0].blocks.empty())) {
    rapidjson::Value breakdown(rapidjson::kObjectType);
    for (const VariantPrediction& v : p.variants) {
      rapidjson::Value kinds(rapidjson::kArrayType);
      if (v.prologue.has_value()) {
        rapidjson::Value prologue(rapidjson::kObjectType);
        prologue.AddMember("block", "embedding", a);
        prologue.AddMember("count", 1, a);
        prologue.AddMember("storages", StoragesJson(*v.graphs->prologue, *v.prologue, a), a);
        kinds.PushBack(prologue, a);
      }
      for (const BlockKind& kind : v.blocks) {
        rapidjson::Value k(rapidjson::kObjectType);
        k.AddMember("block", String(BlockKindLabel(kind), a), a);
        k.AddMember("count", kind.count, a);
        k.AddMember("storages", StoragesJson(v.graphs->layer_kinds[kind.layer_kind], kind.walk, a), a);
        kinds.PushBack(k, a);
      }
      rapidjson::Value loss(rapidjson::kObjectType);
      loss.AddMember("block", "loss", a);
      loss.AddMember("count", 1, a);
      loss.AddMember("storages", StoragesJson(v.graphs->epilogue, v.epilogue, a), a);
      kinds.PushBack(loss, a);
      breakdown.AddMember(String(v.variant.Name(), a), kinds, a);
    }
    doc.AddMember("breakdown", breakdown, a);
  }
  return doc;
}

std::string JsonString(const rapidjson::Value& value) {
  rapidjson::StringBuffer buffer;
  rapidjson::PrettyWriter<rapidjson::StringBuffer> writer(buffer);
  writer.SetIndent(' ', 2);
  value.Accept(writer);
  return absl::StrCat(buffer.GetString(), "\n");
}

// MoeLine says how the mixture of experts was predicted: its size, the experts'
// implementation, and which routing the numbers hold for.
std::string MoeLine(const MoeSpec& moe) {
  const std::string routing =
      moe.impl == ExpertsImpl::kGroupedMm
          ? "grouped_mm experts: every size is the routing's total, so the numbers hold for "
            "any routing"
          : absl::StrCat("eager experts, routing ", RoutingName(moe.routing),
                         moe.routing == RoutingSource::kGiven
                             ? " (the file's tokens per expert: exact for that step)"
                             : " (saved bytes hold for any routing; the peak is this "
                               "routing's)");
  return absl::StrFormat("mixture of experts: %d experts, %d per token, width %d; %s",
                         moe.experts, moe.top_k, moe.intermediate, routing);
}

std::string PredictionTable(const Prediction& p, const std::string& scope) {
  const ModelConfig& c = p.config;
  std::string model = "";
  if (FamilyOf(c.family).decoder) {
    model = absl::StrFormat("%s family (%skv heads %d, head dim %d, intermediate %d, vocab %d), ",
                            FamilyName(c.family), c.qk_norm ? "q/k norms, " : "", c.KvHeads(),
                            c.HeadDim(), c.Intermediate(), c.vocab);
  }
  std::string out = absl::StrFormat(
      "memledger prediction: %s%d layers, width %d, %d heads, batch %d, seq %d, %s attention, "
      "%s%s, %s%s, torch %s\ndevice: %s%s, SDPA kernel: %s\n\n",
      model, c.layers, c.width, c.heads, c.batch, c.seq, AttentionModeName(p.attention),
      ModelDTypeName(c.dtype),
      c.amp == DType::kFloat32 ? "" : absl::StrCat(" with ", AmpName(c.amp), " autocast"),
      OptimizerName(p.optimizer.kind),
      p.optimizer.master_weights ? " with fp32 master weights" : "", kTorchRelease,
      DeviceName(c.device), c.expandable_segments ? " (expandable segments)" : "",
      SdpaKernelsName(c, p.attention).value_or("?"));
  if (c.moe.Sparse()) absl::StrAppend(&out, MoeLine(c.moe), "\n\n");
  if (!scope.empty()) {
    absl::StrAppend(&out, scope, "\n\n");
  } else if (c.shard.tp > 1) {
    absl::StrAppendFormat(&out,
                          "one of %d tensor-parallel ranks%s: every number below is that "
                          "rank's\n\n",
                          c.shard.tp, c.shard.sp ? " with sequence parallelism" : "");
  }
  absl::StrAppendFormat(&out, "%-22s %20s %14s\n", "bucket", "bytes", "");
  absl::StrAppendFormat(&out, "%-22s %20d %14s\n", "n_params (count)", p.n_params, "");
  if (p.n_trainable_params != p.n_params) {
    const std::string what =
        c.lora.enabled()
            ? absl::StrCat(c.lora.dora ? "DoRA" : "LoRA", " r=", c.lora.rank, " on ",
                           LoraTargetsName(c.lora))
            : absl::StrCat("frozen: ", FreezeName(c.freeze));
    absl::StrAppendFormat(&out, "%-22s %20d   %s\n", "trainable (count)", p.n_trainable_params,
                          what);
  }
  for (const auto& [name, bytes] :
       {std::pair<const char*, int64_t>{"param_bytes", p.param_bytes},
        {"frozen_param_bytes", p.frozen_param_bytes},
        {"grad_bytes", p.grad_bytes},
        {"optimizer_state_bytes", p.optimizer_state_bytes},
        {"buffer_bytes", p.buffer_bytes},
        {"communication_bytes", p.communication_bytes}}) {
    // A rank's strategy's buffers; one process has none (the row would be a 0). Frozen
    // parameters only where something is frozen.
    if (bytes == 0 && name == std::string("communication_bytes")) continue;
    if (bytes == 0 && name == std::string("frozen_param_bytes")) continue;
    absl::StrAppendFormat(&out, "%-22s %20d %14s\n", name, bytes, HumanBytes(bytes));
  }
  absl::StrAppendFormat(&out, "\n%-22s %20s %14s %10s %14s\n", "saved_bytes", "bytes", "",
                        "vs none", "cache");
  for (const VariantPrediction& v : p.variants) {
    absl::StrAppendFormat(&out, "%-22s %20d %14s %10.4f %14s\n", v.variant.Name(),
                          v.saved_bytes, HumanBytes(v.saved_bytes), v.saved_ratio_vs_none,
                          v.cache_bytes > 0 ? HumanBytes(v.cache_bytes) : "-");
  }
  if (FamilyOf(c.family).decoder) {
    absl::StrAppendFormat(&out, "\n%-22s %14s %14s %14s %10s\n", "saved by segment",
                          "embedding", "layers", "head+loss", "head share");
    for (const VariantPrediction& v : p.variants) {
      absl::StrAppendFormat(
          &out, "%-22s %14s %14s %14s %9.1f%%\n", v.variant.Name(),
          HumanBytes(v.embedding_bytes), HumanBytes(v.layers_bytes),
          HumanBytes(v.head_loss_bytes),
          100.0 * static_cast<double>(v.head_loss_bytes) / static_cast<double>(v.saved_bytes));
    }
  }
  if (c.dtype != DType::kFloat32 || c.amp != DType::kFloat32) {
    // One column per dtype any variant saves, named and split as saved_bytes_by_dtype
    // is in the JSON; then autocast's weight copies (autocast_weight_copy_bytes).
    // The floating dtypes first, then the integer and bool ones.
    std::vector<DType> saved_dtypes;
    for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64,
                    DType::kInt64, DType::kInt32, DType::kUInt64, DType::kBool}) {
      if (std::any_of(p.variants.begin(), p.variants.end(), [d](const VariantPrediction& v) {
            return v.saved_by_dtype[static_cast<int>(d)] != 0;
          })) {
        saved_dtypes.push_back(d);
      }
    }
    static_assert(kNumDTypes == 8, "a new dtype needs its place in the list above");
    absl::StrAppendFormat(&out, "\n%-22s", "saved by dtype");
    for (DType d : saved_dtypes) absl::StrAppendFormat(&out, " %14s", DTypeName(d));
    if (c.amp != DType::kFloat32) absl::StrAppendFormat(&out, " %14s", "weight copies");
    absl::StrAppend(&out, "\n");
    for (const VariantPrediction& v : p.variants) {
      absl::StrAppendFormat(&out, "%-22s", v.variant.Name());
      for (DType d : saved_dtypes) {
        absl::StrAppendFormat(&out, " %14s", HumanBytes(v.saved_by_dtype[static_cast<int>(d)]));
      }
      if (c.amp != DType::kFloat32) {
        absl::StrAppendFormat(&out, " %14s", HumanBytes(v.weight_copy_bytes));
      }
      absl::StrAppend(&out, "\n");
    }
  }
  bool any_peak = false;
  for (const VariantPrediction& v : p.variants) any_peak = any_peak || v.peak.has_value();
  if (any_peak) {
    absl::StrAppendFormat(&out, "\n%-22s %20s %14s  %s\n", "peak of the step", "bytes", "",
                          "where");
    for (const VariantPrediction& v : p.variants) {
      if (!v.peak.has_value()) continue;
      absl::StrAppendFormat(&out, "%-22s %20d %14s  %s, %s\n", v.variant.Name(), v.peak->bytes,
                            HumanBytes(v.peak->bytes), StepPhaseName(v.peak->phase),
                            v.peak->op);
    }
    if (c.device == Device::kCuda) {
      // One row per variant with a peak: `bytes` of it.
      auto rows = [&](int64_t VariantPrediction::*bytes) {
        for (const VariantPrediction& v : p.variants) {
          if (!v.peak.has_value()) continue;
          absl::StrAppendFormat(&out, "%-22s %20d %14s\n", v.variant.Name(), v.*bytes,
                                HumanBytes(v.*bytes));
        }
      };
      absl::StrAppendFormat(&out,
                            "(on cuda: the caching allocator's blocks, as "
                            "max_memory_allocated() counts them)\n\n%-22s %20s %14s\n",
                            "peak_reserved_bytes", "bytes", "");
      rows(&VariantPrediction::peak_reserved_bytes);
      if (c.offload_activations) {
        absl::StrAppendFormat(&out,
                              "\n%-22s %20s %14s  (host memory: save_on_cpu's copies when "
                              "the forward returns)\n",
                              "offloaded_bytes", "bytes", "");
        rows(&VariantPrediction::offloaded_bytes);
      }
      absl::StrAppendFormat(&out,
                            "\noutside the allocator (no max_memory_* counts it)\n"
                            "%-22s %20d %14s  (--cuda_context_mib)\n",
                            "cuda context", c.cuda_context_bytes,
                            HumanBytes(c.cuda_context_bytes));
    }
  }
  for (const VariantPrediction& v : p.variants) {
    if (!v.peak_unavailable.empty()) {
      absl::StrAppendFormat(&out, "\npeak: %s\n", v.peak_unavailable);
      break;
    }
  }
  absl::StrAppendFormat(&out, "\n%-22s %20d %14s\n", "Korthikanti (none)",
                        p.korthikanti_saved_bytes_none,
                        HumanBytes(p.korthikanti_saved_bytes_none));
  absl::StrAppendFormat(&out, "%-22s %20.4f\n", "exact / Korthikanti",
                        p.saved_none_over_korthikanti);
  if (!p.caveats.empty()) {
    absl::StrAppendFormat(&out, "\nnot modelled yet (the real stack differs):\n");
    for (const std::string& caveat : p.caveats) absl::StrAppendFormat(&out, "  - %s\n", caveat);
  }
  return out;
}

std::string BreakdownText(const Prediction& p) {
  std::string out = absl::StrCat(
      "What each op keeps follows PyTorch ", kTorchRelease,
      " (its generated Functions.h and derivatives.yaml; see estimator/graph/rules.h).\n\n");
  auto storages = [&](const BlockGraph& graph, const BlockWalk& walk) {
    absl::StrAppendFormat(&out, "  %-34s %-30s %-30s %-20s %-8s %12s  %s\n", "op",
                          "tensor", "storage of", "shape", "dtype", "bytes", "kept by");
    for (const KeptStorage& kept : walk.storages) {
      const TensorDef& tensor = graph.tensors[kept.tensor];
      absl::StrAppendFormat(&out, "  %-34s %-30s %-30s %-20s %-8s %12d  %s\n",
                            OpLabel(graph, kept), tensor.name,
                            graph.tensors[kept.storage_owner].name,
                            kept.layout.ShapeString(), DTypeName(tensor.dtype), kept.bytes,
                            KeepReasonName(kept.reason));
    }
  };
  for (const VariantPrediction& v : p.variants) {
    absl::StrAppendFormat(&out, "variant %s: %d bytes (%s)\n", v.variant.Name(), v.saved_bytes,
                          HumanBytes(v.saved_bytes));
    if (v.prologue.has_value()) {
      absl::StrAppendFormat(&out, " embedding, x1:\n");
      storages(*v.graphs->prologue, *v.prologue);
    }
    for (const BlockKind& kind : v.blocks) {
      absl::StrAppendFormat(&out, " %s, x%d:\n", BlockKindLabel(kind), kind.count);
      storages(v.graphs->layer_kinds[kind.layer_kind], kind.walk);
    }
    absl::StrAppendFormat(&out, " loss, x1:\n");
    storages(v.graphs->epilogue, v.epilogue);
    out += "\n";
  }
  out +=
      "A block's input and output storages are shared with its neighbours and counted once\n"
      "for the model, and so are model-level storages (input_ids, RoPE's cos and sin,\n"
      "position ids) however many blocks keep them; parameter storages are not counted.\n";
  return out;
}

}  // namespace memledger

namespace memledger {

Prediction RankView(const Prediction& whole, const RankKind& kind) {
  Prediction view = whole;
  view.n_params = kind.n_params;
  view.param_bytes = kind.param_bytes;
  view.grad_bytes = kind.grad_bytes;
  view.optimizer_state_bytes = kind.optimizer_state_bytes;
  view.adamw_state_bytes = kind.adamw_state_bytes;
  view.communication_bytes = kind.communication_bytes;
  view.saved_bytes_none = kind.saved_bytes_none;
  view.variants.clear();
  for (const RankVariant& v : kind.variants) view.variants.push_back(v.held);
  view.korthikanti_saved_bytes_none = kind.korthikanti_saved_bytes_none;
  view.saved_none_over_korthikanti =
      kind.korthikanti_saved_bytes_none == 0
          ? 0
          : static_cast<double>(kind.saved_bytes_none) /
                static_cast<double>(kind.korthikanti_saved_bytes_none);
  return view;
}

namespace {

// LayersText: "layers 0-19", or "layers 0-4, 20-24" for interleaved chunks.
// DdpText: "torch DDP (buckets 25 MiB, the first 1 MiB)", with the view when asked.
std::string DdpText(const DdpOptions& ddp) {
  const DdpBucketCaps caps = DdpBucketCapsOf(ddp.bucket_cap_mb);
  return absl::StrCat("torch DDP (buckets ", HumanBytes(caps.rest),
                      caps.first != caps.rest ? absl::StrCat(", the first ", HumanBytes(caps.first))
                                              : "",
                      ddp.gradient_as_bucket_view ? ", .grads as bucket views" : "", ")");
}

// ComputeView: a kind of rank's view (RankView) in the dtype its graphs run in: under
// FSDP2's MixedPrecisionPolicy param_dtype (its dtype and SDPA kernel; the shards' bytes
// stay the model's dtype's).
Prediction ComputeView(const Prediction& whole, const RanksPrediction& ranks,
                       const RankKind& kind) {
  Prediction view = RankView(whole, kind);
  view.config = FsdpComputeConfig(view.config, ranks.parallel);
  return view;
}

// FsdpReshardText: what each unit keeps between its forward and backward.
std::string FsdpReshardText(const ParallelSpec& p) {
  const int64_t ranks = p.fsdp.PostForwardRanks(p.dp);
  if (p.fsdp.reshard_after_forward_auto) {
    return "resharded after each forward but the root's (fully_shard's default)";
  }
  return ranks == p.dp ? "resharded after each forward"
         : ranks == 1  ? "not resharded after forward"
                       : absl::StrCat("resharded to ", ranks, " ranks after each forward");
}

std::string LayersText(const RankKind& kind) {
  std::vector<std::string> parts;
  for (const StageRange& chunk : kind.chunks) {
    parts.push_back(absl::StrCat(chunk.first_layer, "-", chunk.first_layer + chunk.layers - 1));
  }
  return absl::StrCat("layers ", absl::StrJoin(parts, ", "));
}

}  // namespace

rapidjson::Value ParallelJson(const ParallelSpec& p, Allocator& a) {
  rapidjson::Value parallel(rapidjson::kObjectType);
  parallel.AddMember("dp", p.dp, a);
  parallel.AddMember("tp", p.tp, a);
  parallel.AddMember("sp", p.sp, a);
  parallel.AddMember("pp", p.pp, a);
  parallel.AddMember("virtual_stages", p.virtual_stages, a);
  parallel.AddMember("micro_batches", p.micro_batches, a);
  parallel.AddMember("schedule", rapidjson::StringRef(PipelineScheduleName(p.schedule).data()), a);
  parallel.AddMember("zero", p.zero, a);
  parallel.AddMember("world_size", p.dp * p.tp * p.pp, a);
  // How the data-parallel ranks run: torch's DDP, torch's FSDP2, ZeRO (--zero), replicas
  // beside expert parallelism, or one replica; with the options that change their bytes.
  const bool ddp = TorchDdp(p);
  parallel.AddMember(
      "data_parallel",
      rapidjson::StringRef(DataParallelName(DataParallelOf(p))), a);
  if (ddp) {
    const DdpBucketCaps caps = DdpBucketCapsOf(p.ddp.bucket_cap_mb);
    rapidjson::Value options(rapidjson::kObjectType);
    options.AddMember("bucket_cap_bytes", caps.rest, a);
    options.AddMember("first_bucket_cap_bytes", caps.first, a);
    options.AddMember("gradient_as_bucket_view", p.ddp.gradient_as_bucket_view, a);
    parallel.AddMember("ddp", options, a);
  } else if (p.fsdp.enabled) {
    rapidjson::Value options(rapidjson::kObjectType);
    // fully_shard's reshard_after_forward, resolved: true, false or the post-forward ranks.
    const int64_t ranks = p.fsdp.PostForwardRanks(p.dp);
    rapidjson::Value reshard;
    if (p.fsdp.reshard_after_forward_auto) {
      reshard.SetString("auto");
    } else if (ranks == p.dp || ranks == 1) {
      reshard.SetBool(ranks == p.dp);
    } else {
      reshard.SetInt64(ranks);
    }
    options.AddMember("reshard_after_forward", reshard, a);
    if (p.fsdp.param_dtype.has_value()) {
      options.AddMember("mp_param_dtype",
                        rapidjson::StringRef(ModelDTypeName(*p.fsdp.param_dtype).data()), a);
      options.AddMember(
          "mp_reduce_dtype",
          rapidjson::StringRef(
              ModelDTypeName(p.fsdp.reduce_dtype.value_or(*p.fsdp.param_dtype)).data()),
          a);
    }
    parallel.AddMember("fsdp", options, a);
  }
  return parallel;
}

rapidjson::Document RanksJson(const Prediction& whole, const RanksPrediction& ranks) {
  rapidjson::Document doc = PredictionJson(ComputeView(whole, ranks, ranks.kinds.front()));
  Allocator& a = doc.GetAllocator();
  rapidjson::Value parallel = ParallelJson(ranks.parallel, a);
  parallel.AddMember("ep", ranks.parallel.ep, a);
  doc.AddMember("parallel", parallel, a);
  rapidjson::Value kinds(rapidjson::kArrayType);
  for (const RankKind& kind : ranks.kinds) {
    rapidjson::Value rank(rapidjson::kObjectType);
    rank.AddMember("stage", kind.stage, a);
    if (ranks.parallel.ep > 1) rank.AddMember("ep_rank", kind.ep_rank, a);
    if (ranks.ep_groups > 1) {
      rank.AddMember("dp_rank", kind.ep_group * ranks.parallel.ep + kind.ep_rank, a);
    }
    rank.AddMember("ranks", kind.ranks, a);
    rapidjson::Value layers(rapidjson::kArrayType);
    for (const StageRange& chunk : kind.chunks) {
      rapidjson::Value range(rapidjson::kArrayType);
      range.PushBack(chunk.first_layer, a);
      range.PushBack(chunk.first_layer + chunk.layers, a);
      layers.PushBack(range, a);
    }
    rank.AddMember("layers", layers, a);  // [first, end) per chunk
    bool embedding = false, head = false;
    for (const StageRange& chunk : kind.chunks) {
      embedding = embedding || (chunk.prologue && whole.graphs->prologue.has_value());
      head = head || chunk.head;
    }
    rank.AddMember("embedding", embedding, a);
    rank.AddMember("head", head, a);
    rank.AddMember("n_params", kind.n_params, a);
    rank.AddMember("param_bytes", kind.param_bytes, a);
    rank.AddMember("grad_bytes", kind.grad_bytes, a);
    rank.AddMember("optimizer_state_bytes", kind.optimizer_state_bytes, a);
    rank.AddMember("communication_bytes", kind.communication_bytes, a);
    if (kind.host_bytes > 0) rank.AddMember("host_bytes", kind.host_bytes, a);
    rapidjson::Value saved(rapidjson::kObjectType), in_flight(rapidjson::kObjectType),
        total(rapidjson::kObjectType);
    for (size_t v = 0; v < kind.variants.size(); ++v) {
      const std::string name = kind.variants[v].held.variant.Name();
      saved.AddMember(String(name, a), rapidjson::Value(kind.variants[v].held.saved_bytes), a);
      in_flight.AddMember(String(name, a), rapidjson::Value(kind.variants[v].in_flight), a);
      total.AddMember(String(name, a), rapidjson::Value(kind.Total(v)), a);
    }
    rank.AddMember("saved_bytes", saved, a);
    rank.AddMember("micro_batches_in_flight", in_flight, a);
    rank.AddMember("total_bytes", total, a);
    // The whole step's peak where it is simulated (RankStepModelled): its bytes, and
    // where it happens and what it holds (as the top level's `peak`); else why not.
    // On CUDA the peak counts the allocator's blocks, and its segments are reserved.
    rapidjson::Value peak(rapidjson::kObjectType), where(rapidjson::kObjectType),
        unavailable(rapidjson::kObjectType), reserved(rapidjson::kObjectType);
    for (const RankVariant& v : kind.variants) {
      const std::string name = v.held.variant.Name();
      if (v.held.peak.has_value()) {
        peak.AddMember(String(name, a), rapidjson::Value(v.held.peak->bytes), a);
        where.AddMember(String(name, a), PeakJson(*v.held.peak, a), a);
        reserved.AddMember(String(name, a), rapidjson::Value(v.held.peak_reserved_bytes), a);
      } else if (!v.held.peak_unavailable.empty()) {
        unavailable.AddMember(String(name, a), String(v.held.peak_unavailable, a), a);
      }
    }
    if (peak.MemberCount() > 0) {
      rank.AddMember("peak_bytes", peak, a);
      rank.AddMember("peak", where, a);
      if (whole.config.device == Device::kCuda) rank.AddMember("peak_reserved_bytes", reserved, a);
    }
    if (unavailable.MemberCount() > 0) rank.AddMember("peak_unavailable", unavailable, a);
    kinds.PushBack(rank, a);
  }
  doc.AddMember("ranks", kinds, a);
  return doc;
}

std::string RanksTable(const Prediction& whole, const RanksPrediction& ranks) {
  const ParallelSpec& p = ranks.parallel;
  const RankKind& most = ranks.kinds.front();
  const bool ddp = most.communication_bytes > 0;
  std::string scope = absl::StrFormat(
      "%d ranks (dp %d x tp %d x pp %d, %s%s, %d micro-batches, %s); every number "
      "below up to the rank table is the most loaded rank's: pipeline stage %d, %s",
      p.dp * p.tp * p.pp, p.dp, p.tp, p.pp,
      PipelineScheduleName(p.schedule),
      p.virtual_stages > 1 ? absl::StrCat(" x ", p.virtual_stages, " chunks") : "",
      p.micro_batches,
      ddp              ? DdpText(p.ddp)
      : p.fsdp.enabled
          ? absl::StrCat("torch FSDP2",
                         p.fsdp.param_dtype.has_value()
                             ? absl::StrCat(" (MixedPrecisionPolicy: ",
                                            ModelDTypeName(*p.fsdp.param_dtype),
                                            " compute over ", ModelDTypeName(whole.config.dtype),
                                            " shards, ",
                                            ModelDTypeName(p.fsdp.reduce_dtype.value_or(
                                                *p.fsdp.param_dtype)),
                                            " reduction)")
                             : "",
                         ", ", FsdpReshardText(p))
                       : absl::StrCat("ZeRO-", p.zero),
      most.stage, LayersText(most));
  if (ranks.parallel.ep > 1) {
    absl::StrAppend(&scope, "; experts over ", ranks.parallel.ep,
                    " expert-parallel ranks, this one expert-parallel rank ", most.ep_rank);
  }
  if (most.host_bytes > 0) {
    absl::StrAppend(&scope, "; CPUOffloadPolicy: ", HumanBytes(most.host_bytes),
                    " of shards, gradients and optimizer state in host memory, not in the "
                    "totals or peaks below");
  }
  std::string out = PredictionTable(ComputeView(whole, ranks, most), scope);
  absl::StrAppendFormat(&out, "\nper kind of rank (the most loaded first), total = params + "
                              "grads + optimizer state + %ssaved%s\n",
                        ddp ? "DDP buckets + " : "",
                        most.grads_in_communication
                            ? " (the .grads are views of the buckets: not counted twice)"
                            : "");
  absl::StrAppendFormat(&out, "%-6s %6s %-16s %12s %12s %12s",
                        ranks.ep_groups > 1 ? "st/dp" : ranks.parallel.ep > 1 ? "st/ep" : "stage",
                        "ranks", "layers", "params", "grads",
                        "opt state");
  if (ddp) absl::StrAppendFormat(&out, " %12s", "DDP buckets");
  for (const RankVariant& v : most.variants) {
    absl::StrAppendFormat(&out, " %14s", absl::StrCat(v.held.variant.Name(), " total"));
  }
  const bool peaks = std::any_of(most.variants.begin(), most.variants.end(),
                                 [](const RankVariant& v) { return v.held.peak.has_value(); });
  for (const RankVariant& v : most.variants) {
    if (peaks) absl::StrAppendFormat(&out, " %14s", absl::StrCat(v.held.variant.Name(), " peak"));
  }
  absl::StrAppend(&out, "\n");
  for (const RankKind& kind : ranks.kinds) {
    const std::string where =
        ranks.parallel.ep > 1
            ? absl::StrCat(kind.stage, "/", kind.ep_group * ranks.parallel.ep + kind.ep_rank)
                     : absl::StrCat(kind.stage);
    absl::StrAppendFormat(&out, "%-6s %6d %-16s %12s %12s %12s", where, kind.ranks,
                          LayersText(kind).substr(7), HumanBytes(kind.param_bytes),
                          HumanBytes(kind.grad_bytes), HumanBytes(kind.optimizer_state_bytes));
    if (ddp) absl::StrAppendFormat(&out, " %12s", HumanBytes(kind.communication_bytes));
    for (size_t v = 0; v < kind.variants.size(); ++v) {
      absl::StrAppendFormat(&out, " %14s", HumanBytes(kind.Total(v)));
    }
    for (const RankVariant& v : kind.variants) {
      if (peaks) {
        absl::StrAppendFormat(&out, " %14s",
                              v.held.peak.has_value() ? HumanBytes(v.held.peak->bytes) : "-");
      }
    }
    absl::StrAppend(&out, "\n");
  }
  return out;
}

}  // namespace memledger
