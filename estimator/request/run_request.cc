#include "estimator/request/run_request.h"

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "estimator/graph/family.h"
#include "estimator/spec/input_file.h"
#include "estimator/spec/status_macros.h"
#include "estimator/request/model_presets.h"
#include "estimator/request/plan_file.h"
#include "rapidjson/document.h"
#include "rapidjson/error/en.h"

namespace memledger {
namespace {

// ReadRouting reads --routing=PATH: {"layers": [[tokens per expert, ...], ...]}, one row
// per sparse layer in order, or {"ranks": [{"layers": ...}, ...]}, every expert-parallel
// (or data-parallel) rank's, rank by rank (ValidateConfig checks the rows against the
// model).
absl::StatusOr<std::vector<std::vector<int64_t>>> ReadRouting(const std::string& path) {
  absl::StatusOr<std::string> text = ReadInputFile(path, "--routing", kMaxJsonBytes);
  if (!text.ok()) {
    if (absl::IsNotFound(text.status())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--routing: '", path, "' is neither balanced, worst nor a readable routing file"));
    }
    return text.status();
  }
  return ParseRouting(*text, path);
}

}  // namespace

absl::StatusOr<std::vector<std::vector<int64_t>>> ParseRouting(absl::string_view text,
                                                               absl::string_view path) {
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("--routing: ", path, ": ", what));
  };
  if (absl::Status s = CheckJsonNesting(text); !s.ok()) return bad(s.message());
  rapidjson::Document doc;
  doc.Parse(text.data(), text.size());
  if (doc.HasParseError()) {
    return bad(absl::StrCat("not JSON (", rapidjson::GetParseError_En(doc.GetParseError()), ")"));
  }
  const char* const kShape =
      "must be {\"layers\": [[tokens per expert, ...], ...]}, one row of integers per "
      "sparse layer, or {\"ranks\": [{\"layers\": ...}, ...]}, one per rank";
  std::vector<std::vector<int64_t>> rows;
  auto read_layers = [&](const rapidjson::Value& object) {
    if (!object.IsObject() || !object.HasMember("layers") || !object["layers"].IsArray()) {
      return false;
    }
    for (const rapidjson::Value& row : object["layers"].GetArray()) {
      if (!row.IsArray()) return false;
      std::vector<int64_t>& counts = rows.emplace_back();
      for (const rapidjson::Value& n : row.GetArray()) {
        if (!n.IsInt64()) return false;
        counts.push_back(n.GetInt64());
      }
    }
    return true;
  };
  if (doc.IsObject() && doc.HasMember("ranks")) {
    // Every expert-parallel rank's rows, rank by rank (ModelConfig::ExpertLoadFrom); the
    // same number per rank.
    if (!doc["ranks"].IsArray() || doc["ranks"].Empty()) return bad(kShape);
    size_t per_rank = 0;
    for (const rapidjson::Value& rank : doc["ranks"].GetArray()) {
      const size_t before = rows.size();
      if (!read_layers(rank)) return bad(kShape);
      if (before > 0 && rows.size() - before != per_rank) {
        return bad("every rank needs as many rows as the first");
      }
      per_rank = rows.size() - before;
    }
    return rows;
  }
  if (!read_layers(doc)) return bad(kShape);
  return rows;
}

namespace {

// ApplyExperts sets a mixture of experts' implementation and routing from the request.
absl::Status ApplyExperts(const RunRequest& request, ModelConfig& config) {
  if (request.experts_impl == "grouped_mm") {
    config.moe.impl = ExpertsImpl::kGroupedMm;
  } else if (request.experts_impl == "eager") {
    config.moe.impl = ExpertsImpl::kEager;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--experts_impl must be grouped_mm or eager, got '", request.experts_impl, "'"));
  }
  config.moe.routing_rows.clear();
  if (request.routing == "balanced") {
    config.moe.routing = RoutingSource::kBalanced;
  } else if (request.routing == "worst") {
    config.moe.routing = RoutingSource::kWorst;
  } else if (request.routing.empty()) {
    return absl::InvalidArgumentError("--routing must be balanced, worst or a routing file");
  } else {
    absl::StatusOr<std::vector<std::vector<int64_t>>> rows = ReadRouting(request.routing);
    if (!rows.ok()) return rows.status();
    config.moe.routing = RoutingSource::kGiven;
    config.moe.routing_rows = *std::move(rows);
  }
  const bool moe_flags = request.experts_impl != "grouped_mm" || request.routing != "balanced";
  if (moe_flags && !config.moe.Sparse()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--experts_impl and --routing apply to a mixture-of-experts model (",
        MixtureOfExpertsModels(), ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<FsdpOptions> FsdpOptionsFrom(const RunRequest& request) {
  FsdpOptions fsdp{request.fsdp, true, 0, std::nullopt, std::nullopt};
  for (const auto& [flag, text, field] :
       {std::tuple<const char*, const std::string*, std::optional<DType>*>{
            "--mp_param_dtype", &request.mp_param_dtype, &fsdp.param_dtype},
        {"--mp_reduce_dtype", &request.mp_reduce_dtype, &fsdp.reduce_dtype}}) {
    if (text->empty()) continue;
    absl::StatusOr<DType> dtype = ParseModelDType(*text);
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, " must be fp32, bf16 or fp16, got '", *text, "'"));
    }
    *field = *dtype;
  }
  if (request.offload == "cpu") {
    fsdp.offload = true;
  } else if (request.offload != "none") {
    return absl::InvalidArgumentError(
        absl::StrCat("--offload must be none or cpu, got '", request.offload, "'"));
  }
  if (request.reshard_after_forward == "false") {
    fsdp.reshard_after_forward = false;
  } else if (request.reshard_after_forward == "auto") {
    fsdp.reshard_after_forward_auto = true;
  } else if (request.reshard_after_forward != "true" &&
             !(absl::SimpleAtoi(request.reshard_after_forward,
                                &fsdp.reshard_after_forward_ranks) &&
               fsdp.reshard_after_forward_ranks > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--reshard_after_forward must be true, false, auto or a number of ranks, got '",
        request.reshard_after_forward, "'"));
  }
  return fsdp;
}

absl::StatusOr<RunSpec> RunSpecFromRequest(const RunRequest& request) {
  absl::StatusOr<ValidRun> run = ValidRunFromRequest(request);
  if (!run.ok()) return run.status();
  return run->spec();
}

absl::StatusOr<ValidRun> ValidRunFromRequest(const RunRequest& request) {
  RunSpec spec;
  absl::StatusOr<ModelConfig> model =
      request.model_config_json.empty()
          ? ModelFromFlag(request.model)
          : ModelFromHfConfigJson(request.model_config_json, request.model);
  if (!model.ok()) return model.status();
  spec.config = *model;
  spec.model = request.model;
  for (const auto& [name, value, field] :
       {std::tuple<const char*, const std::optional<int64_t>*, int64_t*>{
            "layers", &request.layers, &spec.config.layers},
        {"width", &request.width, &spec.config.width},
        {"heads", &request.heads, &spec.config.heads},
        {"kv_heads", &request.kv_heads, &spec.config.kv_heads},
        {"head_dim", &request.head_dim, &spec.config.head_dim},
        {"intermediate", &request.intermediate, &spec.config.intermediate},
        {"vocab", &request.vocab, &spec.config.vocab}}) {
    if (!value->has_value()) continue;
    // A size given is a size: the config's 0 ("derive it") is not the user's to give.
    if (**value < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, " must be >= 1, got ", **value));
    }
    *field = **value;
  }
  // A layer_types list that names each layer without repeating has no period for another
  // count (transformers refuses such a config too).
  if (request.layers.has_value() && spec.config.layer_types_layers > 0 &&
      *request.layers != spec.config.layer_types_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--layers ", *request.layers, ": the config's layer_types name each of its ",
        spec.config.layer_types_layers, " layers and do not repeat; give a config.json with ",
        *request.layers, " layers, or no --layers"));
  }
  // Another layer count derives a config's per-layer MoE choice again (mlp_only_layers
  // names layers; repeating its period would make others dense too).
  if (request.layers.has_value()) {
    if (absl::Status s = spec.config.moe.DeriveSparseLayers(spec.config.layers); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--layers ", spec.config.layers, ": ",
                                                     s.message()));
    }
  }
  // A new width or head count redraws the head split unless it is given too; the
  // study's and GPT-2's kv heads follow the heads, their MLP the width.
  const bool width_or_heads_set = request.width.has_value() || request.heads.has_value();
  if (width_or_heads_set && !request.head_dim.has_value() && spec.config.heads > 0) {
    spec.config.head_dim = spec.config.width / spec.config.heads;
  }
  const FamilyDef& family = FamilyOf(spec.config.family);
  if (family.fused_qkv && !request.kv_heads.has_value()) {
    spec.config.kv_heads = spec.config.heads;
  }
  if (family.fused_qkv && request.width.has_value() &&
      !request.intermediate.has_value()) {
    spec.config.intermediate = 4 * spec.config.width;
  }
  MEMLEDGER_ASSIGN_OR_RETURN(spec.config.dtype, ParseModelDType(request.dtype));
  MEMLEDGER_ASSIGN_OR_RETURN(spec.config.amp, ParseAmp(request.amp));
  MEMLEDGER_ASSIGN_OR_RETURN(spec.optimizer.kind, ParseOptimizer(request.optimizer));
  MEMLEDGER_ASSIGN_OR_RETURN(spec.config.device, ParseDevice(request.device));
  MEMLEDGER_ASSIGN_OR_RETURN(spec.optimizer.impl,
                             ParseOptimizerImpl(request.optimizer_impl, spec.config.device));
  spec.optimizer.momentum = request.momentum;
  spec.optimizer.master_weights = request.master_weights;
  spec.config.batch = request.batch;
  spec.config.seq = request.seq;
  // The layout's dimensions that split the model give the config its shard.
  spec.parallel.tp = request.tp;
  spec.parallel.sp = request.sp;
  spec.parallel.ep = request.ep;
  spec.config.shard = ShardOf(spec.parallel);
  MEMLEDGER_ASSIGN_OR_RETURN(spec.config.checkpoint_impl,
                             ParseCheckpointImpl(request.checkpoint_impl));
  MEMLEDGER_ASSIGN_OR_RETURN(spec.config.freeze, ParseFreeze(request.freeze));
  const RunRequest defaults;
  if (request.lora_rank < 0 || request.lora_rank > kMaxLoraRank) {
    return absl::InvalidArgumentError(absl::StrCat("--lora_rank must be from 0 to ",
                                                   kMaxLoraRank, ", got ", request.lora_rank));
  }
  if (request.lora_rank == 0 &&
      (request.lora_alpha != defaults.lora_alpha || request.lora_dropout != defaults.lora_dropout ||
       request.lora_targets != defaults.lora_targets || request.use_dora)) {
    return absl::InvalidArgumentError(
        "--lora_alpha, --lora_dropout, --lora_targets and --use_dora describe LoRA "
        "adapters: they need --lora_rank >= 1");
  }
  spec.config.lora.rank = request.lora_rank;
  spec.config.lora.alpha = request.lora_alpha;
  spec.config.lora.dropout = request.lora_dropout;
  spec.config.lora.dora = request.use_dora;
  if (request.lora_rank > 0) {
    // No targets: peft's for the model type (LoraConfig's target_modules=None), which it
    // refuses where it has none (_prepare_adapter_config).
    if (request.lora_targets.empty() && family.lora_default_targets == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("--lora_targets: peft 0.21.2 has no default target modules for the ",
                       family.name, " family: name them, or all-linear"));
    }
    MEMLEDGER_ASSIGN_OR_RETURN(spec.config.lora.targets,
                               ParseLoraTargets(request.lora_targets.empty()
                                                    ? family.lora_default_targets
                                                    : request.lora_targets));
  }
  MEMLEDGER_ASSIGN_OR_RETURN(spec.config.sdpa_backend, ParseSdpaBackend(request.sdpa_backend));
  if (request.expandable_segments && spec.config.device != Device::kCuda) {
    return absl::InvalidArgumentError(
        "--expandable_segments is a CUDA caching allocator setting: it needs --device=cuda");
  }
  spec.config.expandable_segments = request.expandable_segments;
  if (!(request.cuda_context_mib >= 0 && request.cuda_context_mib < 1 << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--cuda_context_mib must be a number of MiB from 0, got ", request.cuda_context_mib));
  }
  // Given (not the default) on the CPU, it would be silently ignored: refused as
  // --expandable_segments is.
  if (request.cuda_context_mib != RunRequest().cuda_context_mib &&
      spec.config.device != Device::kCuda) {
    return absl::InvalidArgumentError(
        "--cuda_context_mib is the CUDA context's device memory: it needs --device=cuda");
  }
  spec.config.cuda_context_bytes =
      static_cast<int64_t>(std::llround(request.cuda_context_mib * (1 << 20)));
  if (!request.cublas_workspace_config.empty()) {
    if (spec.config.device != Device::kCuda) {
      return absl::InvalidArgumentError(
          "--cublas_workspace_config sizes cuBLAS's workspace: it needs --device=cuda");
    }
    MEMLEDGER_ASSIGN_OR_RETURN(spec.config.cublas_workspace_bytes,
                               ParseCublasWorkspaceConfig(request.cublas_workspace_config));
  }
  if (request.offload_activations == "cpu") {
    if (spec.config.device != Device::kCuda) {
      return absl::InvalidArgumentError(
          "--offload_activations=cpu copies what autograd saves from a GPU to host memory: "
          "it needs --device=cuda");
    }
    spec.config.offload_activations = true;
  } else if (request.offload_activations != "none") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--offload_activations must be none or cpu, got '", request.offload_activations, "'"));
  }
  if (absl::Status s = ApplyExperts(request, spec.config); !s.ok()) return s;
  spec.routing = request.routing;
  // The config first: the layout's and the variants' checks ask it.
  absl::StatusOr<ValidConfig> valid = ValidConfig::Of(spec.config);
  if (!valid.ok()) return valid.status();
  PipelineSchedule schedule = PipelineSchedule::k1F1B;
  MEMLEDGER_ASSIGN_OR_RETURN(schedule, ParsePipelineSchedule(request.schedule));
  absl::StatusOr<FsdpOptions> fsdp = FsdpOptionsFrom(request);
  if (!fsdp.ok()) return fsdp.status();
  spec.parallel.dp = request.dp;
  spec.parallel.pp = request.pp;
  spec.parallel.virtual_stages = request.virtual_stages;
  spec.parallel.micro_batches = request.micro_batches;
  spec.parallel.zero = request.zero;
  spec.parallel.schedule = schedule;
  spec.parallel.ddp = DdpOptions{request.ddp_bucket_mb, request.gradient_as_bucket_view};
  spec.parallel.fsdp = *fsdp;
  if (absl::Status s = ValidateParallel(spec.config, spec.parallel); !s.ok()) return s;

  MEMLEDGER_ASSIGN_OR_RETURN(spec.attention, ParseAttentionMode(request.attention));
  MEMLEDGER_ASSIGN_OR_RETURN(spec.variants,
                             ParseVariants(request.variants, request.every, request.policy));
  if (!request.plan.empty()) {
    // A plan replaces the variants: it is shown beside none.
    Variant plan;
    MEMLEDGER_ASSIGN_OR_RETURN(plan, ReadPlan(request.plan));
    spec.variants = {Variant(), std::move(plan)};
  }
  if (absl::Status s = ValidateRunOf(*valid, spec.attention, spec.variants, spec.optimizer);
      !s.ok()) {
    return s;
  }
  return ValidRun(std::move(spec), *std::move(valid));
}

std::string RequestFlags(const RunRequest& request) {
  const RunRequest defaults;
  std::string out = absl::StrCat("--model=", request.model, " --batch=", request.batch,
                                 " --seq=", request.seq);
  for (const auto& [flag, value] :
       {std::pair<const char*, const std::optional<int64_t>*>{"layers", &request.layers},
        {"width", &request.width},
        {"heads", &request.heads},
        {"kv_heads", &request.kv_heads},
        {"head_dim", &request.head_dim},
        {"intermediate", &request.intermediate},
        {"vocab", &request.vocab}}) {
    if (value->has_value()) absl::StrAppend(&out, " --", flag, "=", **value);
  }
  auto text = [&](const char* flag, const std::string& value, const std::string& unset) {
    if (value != unset) absl::StrAppend(&out, " --", flag, "=", value);
  };
  auto number = [&](const char* flag, int64_t value, int64_t unset) {
    if (value != unset) absl::StrAppend(&out, " --", flag, "=", value);
  };
  text("variants", request.variants, defaults.variants);
  if (!request.plan.empty()) {
    // Inline runs hold ';' and '*': quoted for the shell.
    absl::StrAppend(&out, " --plan='", request.plan, "'");
  }
  number("every", request.every, defaults.every);
  text("policy", request.policy, defaults.policy);
  text("attention", request.attention, defaults.attention);
  text("dtype", request.dtype, defaults.dtype);
  text("amp", request.amp, defaults.amp);
  text("optimizer", request.optimizer, defaults.optimizer);
  text("optimizer_impl", request.optimizer_impl, defaults.optimizer_impl);
  if (request.momentum != defaults.momentum) absl::StrAppend(&out, " --momentum=", request.momentum);
  text("checkpoint_impl", request.checkpoint_impl, defaults.checkpoint_impl);
  text("freeze", request.freeze, defaults.freeze);
  number("lora_rank", request.lora_rank, defaults.lora_rank);
  if (request.lora_rank > 0) {
    if (request.lora_alpha != defaults.lora_alpha) {
      absl::StrAppend(&out, " --lora_alpha=", request.lora_alpha);
    }
    if (request.lora_dropout != defaults.lora_dropout) {
      absl::StrAppend(&out, " --lora_dropout=", request.lora_dropout);
    }
    text("lora_targets", request.lora_targets, defaults.lora_targets);
    if (request.use_dora) absl::StrAppend(&out, " --use_dora");
  }
  if (request.master_weights) absl::StrAppend(&out, " --master_weights");
  number("tp", request.tp, defaults.tp);
  if (request.sp) absl::StrAppend(&out, " --sp");
  number("dp", request.dp, defaults.dp);
  number("pp", request.pp, defaults.pp);
  number("virtual_stages", request.virtual_stages, defaults.virtual_stages);
  number("micro_batches", request.micro_batches, defaults.micro_batches);
  number("zero", request.zero, defaults.zero);
  text("schedule", request.schedule, defaults.schedule);
  if (request.ddp_bucket_mb.has_value()) {
    absl::StrAppend(&out, " --ddp_bucket_mb=", *request.ddp_bucket_mb);
  }
  if (request.gradient_as_bucket_view) absl::StrAppend(&out, " --gradient_as_bucket_view");
  if (request.fsdp) absl::StrAppend(&out, " --fsdp");
  text("reshard_after_forward", request.reshard_after_forward, defaults.reshard_after_forward);
  text("mp_param_dtype", request.mp_param_dtype, defaults.mp_param_dtype);
  text("mp_reduce_dtype", request.mp_reduce_dtype, defaults.mp_reduce_dtype);
  text("offload", request.offload, defaults.offload);
  number("ep", request.ep, defaults.ep);
  text("device", request.device, defaults.device);
  text("sdpa_backend", request.sdpa_backend, defaults.sdpa_backend);
  if (request.expandable_segments) absl::StrAppend(&out, " --expandable_segments");
  if (request.cuda_context_mib != defaults.cuda_context_mib) {
    absl::StrAppend(&out, " --cuda_context_mib=", request.cuda_context_mib);
  }
  text("cublas_workspace_config", request.cublas_workspace_config,
       defaults.cublas_workspace_config);
  text("offload_activations", request.offload_activations, defaults.offload_activations);
  text("experts_impl", request.experts_impl, defaults.experts_impl);
  text("routing", request.routing, defaults.routing);
  return out;
}

}  // namespace memledger
