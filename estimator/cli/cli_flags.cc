#include "estimator/cli/cli_flags.h"

#include <algorithm>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "estimator/cli/message_escape.h"
#include "estimator/cli/output_files.h"
#include "estimator/graph/family.h"
#include "estimator/request/parallel_spec.h"
#include "estimator/request/model_presets.h"
#include "estimator/request/run_request.h"

// --model's help lists the families' presets and model_types (ModelFlagHelp).
ABSL_FLAG(std::string, model, "study", memledger::ModelFlagHelp());
ABSL_FLAG(std::optional<int64_t>, layers, std::nullopt,
          "Number of Transformer blocks / decoder layers (>= 1; default: the model's, the "
          "study's 6).");
ABSL_FLAG(std::optional<int64_t>, width, std::nullopt,
          "Model width (hidden size) d (>= 1; default: the model's, the study's 128).");
ABSL_FLAG(std::optional<int64_t>, heads, std::nullopt,
          "Attention heads H (>= 1; default: the model's, the study's 4).");
ABSL_FLAG(std::optional<int64_t>, kv_heads, std::nullopt,
          "Key/value heads (grouped-query attention; default: the model's).");
ABSL_FLAG(std::optional<int64_t>, head_dim, std::nullopt,
          "Per-head width (default: the model's, usually width / heads).");
ABSL_FLAG(std::optional<int64_t>, intermediate, std::nullopt,
          "MLP width F (default: the model's, 4 x width for the study and GPT-2).");
ABSL_FLAG(std::optional<int64_t>, vocab, std::nullopt, "Vocabulary size V (default: the model's).");
ABSL_FLAG(int64_t, batch, 16, "Batch size B (>= 1).");
ABSL_FLAG(int64_t, seq, 64, "Sequence length T (>= 1).");
ABSL_FLAG(std::string, variants, "none,full,every_k,selective",
          "Comma-separated checkpointing variants: none, full, every_k (uses --every), "
          "every_<k> (e.g. every_3), selective (uses --policy).");
ABSL_FLAG(int64_t, every, 2, "k of every_k: blocks i with i % k == 0 are checkpointed.");
ABSL_FLAG(std::string, plan, "",
          "A checkpoint plan, one choice per layer, instead of --variants (shown beside "
          "none): a //planner plan file (--plan_out, a path ending in .json), or inline runs "
          "separated by ';', each a layer choice and after '*' how many layers take it, as "
          "//planner:search's flags write them ('full*2;selective:matmul*3;none*75'). On "
          "ranks (--dp, --pp) each stage runs its layers' part.");
ABSL_FLAG(std::string, policy, "matmul",
          "Op kinds the selective variant must-saves, comma-separated: matmul (the "
          "linears), attention (flash only), layer_norm, gelu, silu; each where the model "
          "has it (the llama family: matmul, attention, silu).");
ABSL_FLAG(std::string, attention, "flash",
          "flash (PyTorch 2.x CPU flash SDPA contract) or math (plain ops, keeps T x T).");
ABSL_FLAG(std::string, device, "cpu",
          "Where the step runs: cpu (what memledger's runtime measures) or cuda (a CUDA "
          "GPU's step: CUDA autocast's fp32 list, the CUDA SDPA kernels, native dropout's "
          "masks, host scalars, cuBLAS workspaces; peak_bytes in the caching allocator's "
          "blocks and peak_reserved_bytes in its segments).");
ABSL_FLAG(std::string, sdpa_backend, "auto",
          "The kernel scaled_dot_product_attention runs: auto (what the pinned torch picks "
          "for the dtype, head_dim, mask and grouped-query heads; on an sm90 GPU flash, then "
          "efficient, then math), flash, efficient, cudnn or math.");
ABSL_FLAG(bool, expandable_segments, false,
          "With --device=cuda: the caching allocator runs expandable segments "
          "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): each pool one segment "
          "grown by 2 MiB or 20 MiB pages, every block split at 512 B.");
ABSL_FLAG(double, cuda_context_mib, 273.75,
          "With --device=cuda: the CUDA context's device memory, outside the caching "
          "allocator (its own bucket; default: PyTorch PR #86509's measurement with lazy "
          "module loading, 287,047,680 B).");
ABSL_FLAG(std::string, cublas_workspace_config, "",
          "With --device=cuda: CUBLAS_WORKSPACE_CONFIG as the run sets it, :SIZE:COUNT "
          "pairs in KiB (:4096:8, the default on compute capability 9 to 12, is 32 MiB per "
          "GEMM; :16:8 is 128 KiB; :0:0 none); empty: unset.");
ABSL_FLAG(std::string, offload_activations, "none",
          "With --device=cuda: cpu runs the forward under "
          "torch.autograd.graph.save_on_cpu(pin_memory=True), which copies every tensor "
          "autograd saves (a weight's too, once per node) to pinned host memory and back "
          "to the device as its node runs; a checkpoint holds its input there. none: "
          "saved tensors stay on the device.");
ABSL_FLAG(std::string, dtype, "fp32",
          "The model's dtype, for parameters, gradients and activations: fp32, bf16 or fp16 "
          "(pure low precision; PyTorch still keeps some tensors in fp32).");
ABSL_FLAG(std::string, amp, "none",
          "Autocast over the fp32 model: none, bf16 or fp16 (matmuls and SDPA in that dtype "
          "on cast copies, weights included; norms and losses in fp32).");
ABSL_FLAG(std::string, optimizer, "adamw", "The optimizer: adamw, adam or sgd.");
ABSL_FLAG(std::string, optimizer_impl, "auto",
          "torch.optim's implementation: for_loop (foreach=False), foreach (foreach=True) "
          "or fused (fused=True); auto is torch.optim's default for the device (the "
          "for-loop on the CPU).");
ABSL_FLAG(double, momentum, 0, "SGD's momentum (> 0 keeps a momentum buffer).");
ABSL_FLAG(std::string, checkpoint_impl, "non_reentrant",
          "torch.utils.checkpoint's implementation (use_reentrant): non_reentrant, the "
          "default of torch and transformers 5.23, or reentrant, whose checkpoints hold "
          "their RNG state and call arguments until the loss dies.");
ABSL_FLAG(std::string, freeze, "",
          "Parameters that do not train (requires_grad_(False)), comma-separated: "
          "embeddings (every input embedding table: embed_tokens, GPT-2's wte and wpe) "
          "and lm_head. They keep no gradient and no optimizer state, and their matmuls "
          "save nothing for the weight's gradient. A tied head is the embedding itself. "
          "Empty or none: everything trains.");
ABSL_FLAG(int64_t, lora_rank, 0,
          "peft's LoRA (get_peft_model with LoraConfig(r=...)): the adapters' rank r; every "
          "base parameter is then frozen and only lora_A (r x in) and lora_B (out x r) of "
          "each target train, in fp32 on any --dtype (autocast_adapter_dtype). 0: no "
          "adapters.");
ABSL_FLAG(double, lora_alpha, 8,
          "LoraConfig's lora_alpha (the scaling alpha / r, which changes no memory).");
ABSL_FLAG(double, lora_dropout, 0,
          "LoraConfig's lora_dropout: nn.Dropout(p) on each adapter's input (its own noise "
          "per target); 0 is an Identity.");
ABSL_FLAG(std::string, lora_targets, "",
          "LoraConfig's target_modules: the linear modules to adapt by name (q_proj, "
          "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; GPT-2's Conv1D c_attn, "
          "c_proj, c_fc), comma-separated, or all-linear (every one but the LM head). "
          "Empty: peft's default for the model type (q_proj,v_proj; GPT-2's c_attn; "
          "OLMo 3 has none).");
ABSL_FLAG(bool, use_dora, false,
          "LoraConfig's use_dora: weight-decomposed LoRA. Each target also trains a "
          "magnitude vector (out, fp32), and every forward rebuilds lora_B @ lora_A as an "
          "(out x in) matrix from an (in x in) identity and takes the adapted weight's "
          "norm: transients the size of the weight, per target. Needs --lora_rank.");
ABSL_FLAG(bool, master_weights, false,
          "With --dtype=bf16 or fp16: the optimizer steps fp32 copies of the parameters.");
ABSL_FLAG(int64_t, tp, 1,
          "Tensor-parallel ranks (Megatron's split of heads, MLP columns and vocabulary; "
          "the decoder families, not a mixture of experts): the buckets are one rank's.");
ABSL_FLAG(bool, sp, false,
          "Megatron's sequence parallelism with --tp (the decoder families; not with "
          "--amp): norms, dropouts and residuals hold seq / tp tokens per rank.");
ABSL_FLAG(int64_t, dp, 1,
          "Data-parallel ranks (predict: every kind of rank's memory, under torch's "
          "DistributedDataParallel or --zero; "
          "verify: run on that many Gloo ranks per model shard).");
ABSL_FLAG(int64_t, pp, 1,
          "Pipeline stages (the decoder families, not the study; --layers divisible by "
          "--pp x --virtual_stages): each stage holds its layers' micro-batches in flight.");
ABSL_FLAG(int64_t, virtual_stages, 1,
          "Model chunks per pipeline rank (with --schedule=interleaved).");
ABSL_FLAG(int64_t, micro_batches, 1,
          "Micro-batches per step and pipeline, each of --batch sequences.");
ABSL_FLAG(int64_t, zero, 0,
          "ZeRO stage over the --dp ranks: 1 shards the optimizer's state, 2 the "
          "gradients too, 3 the parameters too.");
ABSL_FLAG(std::optional<double>, ddp_bucket_mb, std::nullopt,
          "DDP's bucket_cap_mb, in MiB (--dp > 1 without --zero runs torch's "
          "DistributedDataParallel): unset is torch's default, 25 MiB with a first bucket of "
          "1 MiB.");
ABSL_FLAG(bool, gradient_as_bucket_view, false,
          "DDP's gradient_as_bucket_view: each .grad becomes a view of its bucket in the "
          "backward (--dp > 1 without --zero).");
ABSL_FLAG(bool, fsdp, false,
          "torch's FSDP2 over the --dp ranks: fully_shard on each decoder layer and the "
          "root, each parameter its own Shard(0) (kept apart from --zero).");
ABSL_FLAG(std::string, reshard_after_forward, "true",
          "FSDP2's reshard_after_forward: true frees each unit's unsharded parameters after "
          "its forward, false keeps them to its backward, a number N (a factor of --dp) keeps "
          "1/N of them on each rank, gathered from N ranks in the backward, auto (fully_shard's "
          "default, None) as true but for the root, which keeps its own (with --fsdp).");
ABSL_FLAG(std::string, mp_param_dtype, "",
          "FSDP2's MixedPrecisionPolicy param_dtype (bf16, fp16, fp32; with --fsdp): the "
          "unsharded parameters and the compute in it, the shards and the optimizer's state "
          "in fp32.");
ABSL_FLAG(std::string, mp_reduce_dtype, "",
          "FSDP2's MixedPrecisionPolicy reduce_dtype: the dtype gradients are reduced in "
          "(fp32 is modelled).");
ABSL_FLAG(std::string, offload, "none",
          "FSDP2's CPUOffloadPolicy: cpu keeps the shards, their gradients and the "
          "optimizer's state in pinned host memory and steps there (with --fsdp and "
          "--device=cuda); none keeps them on the device.");
ABSL_FLAG(int64_t, ep, 1,
          "Expert-parallel ranks among the --dp ranks (a mixture of experts): each holds "
          "experts / ep whole experts, and transformers' AllToAllEP sends every routed token "
          "to its expert's rank and the result back.");
ABSL_FLAG(std::string, schedule, "1f1b",
          "The pipeline schedule: 1f1b or interleaved (Megatron-LM's).");
ABSL_FLAG(std::string, experts_impl, "grouped_mm",
          "A mixture of experts' experts implementation: grouped_mm (transformers 5.23's "
          "default; its memory does not depend on the routing) or eager (a loop over the "
          "experts hit, each with its share of the tokens).");
ABSL_FLAG(std::string, routing, "balanced",
          "The eager experts' routing: balanced (an even split, the remainder to the lowest "
          "expert ids), worst (every token to the same experts) or PATH to a JSON file "
          "{\"layers\": [[tokens per expert, ...], ...]}, one row per sparse layer, each "
          "summing to batch x seq x experts per token (exact for that step); with --ep, "
          "{\"ranks\": [{\"layers\": ...}, ...]} gives each expert-parallel rank's.");
ABSL_FLAG(std::string, format, "json",
          "Output format: json or table; with predict's --sweep, csv or jsonl.");
ABSL_FLAG(std::string, json_out, "",
          "Also write the JSON report to this file: whole or not at all, with the run's "
          "other files; only a regular file (or a link's) is replaced.");
ABSL_FLAG(std::string, timeline_svg, "",
          "Also write the step's memory timeline as an SVG chart to this path: live bytes by "
          "category along forward, backward and optimizer step, one panel per variant, the "
          "peak marked.");

namespace memledger {

RunRequest RunRequestFromFlags() {
  RunRequest request;
  request.model = absl::GetFlag(FLAGS_model);
  request.layers = absl::GetFlag(FLAGS_layers);
  request.width = absl::GetFlag(FLAGS_width);
  request.heads = absl::GetFlag(FLAGS_heads);
  request.kv_heads = absl::GetFlag(FLAGS_kv_heads);
  request.head_dim = absl::GetFlag(FLAGS_head_dim);
  request.intermediate = absl::GetFlag(FLAGS_intermediate);
  request.vocab = absl::GetFlag(FLAGS_vocab);
  request.batch = absl::GetFlag(FLAGS_batch);
  request.seq = absl::GetFlag(FLAGS_seq);
  request.variants = absl::GetFlag(FLAGS_variants);
  request.plan = absl::GetFlag(FLAGS_plan);
  request.every = absl::GetFlag(FLAGS_every);
  request.policy = absl::GetFlag(FLAGS_policy);
  request.attention = absl::GetFlag(FLAGS_attention);
  request.device = absl::GetFlag(FLAGS_device);
  request.sdpa_backend = absl::GetFlag(FLAGS_sdpa_backend);
  request.expandable_segments = absl::GetFlag(FLAGS_expandable_segments);
  request.cuda_context_mib = absl::GetFlag(FLAGS_cuda_context_mib);
  request.cublas_workspace_config = absl::GetFlag(FLAGS_cublas_workspace_config);
  request.offload_activations = absl::GetFlag(FLAGS_offload_activations);
  request.dtype = absl::GetFlag(FLAGS_dtype);
  request.amp = absl::GetFlag(FLAGS_amp);
  request.optimizer = absl::GetFlag(FLAGS_optimizer);
  request.optimizer_impl = absl::GetFlag(FLAGS_optimizer_impl);
  request.momentum = absl::GetFlag(FLAGS_momentum);
  request.checkpoint_impl = absl::GetFlag(FLAGS_checkpoint_impl);
  request.freeze = absl::GetFlag(FLAGS_freeze);
  request.lora_rank = absl::GetFlag(FLAGS_lora_rank);
  request.lora_alpha = absl::GetFlag(FLAGS_lora_alpha);
  request.lora_dropout = absl::GetFlag(FLAGS_lora_dropout);
  request.lora_targets = absl::GetFlag(FLAGS_lora_targets);
  request.use_dora = absl::GetFlag(FLAGS_use_dora);
  request.master_weights = absl::GetFlag(FLAGS_master_weights);
  request.tp = absl::GetFlag(FLAGS_tp);
  request.sp = absl::GetFlag(FLAGS_sp);
  request.dp = absl::GetFlag(FLAGS_dp);
  request.pp = absl::GetFlag(FLAGS_pp);
  request.virtual_stages = absl::GetFlag(FLAGS_virtual_stages);
  request.micro_batches = absl::GetFlag(FLAGS_micro_batches);
  request.zero = absl::GetFlag(FLAGS_zero);
  request.schedule = absl::GetFlag(FLAGS_schedule);
  request.gradient_as_bucket_view = absl::GetFlag(FLAGS_gradient_as_bucket_view);
  request.ddp_bucket_mb = absl::GetFlag(FLAGS_ddp_bucket_mb);
  request.fsdp = absl::GetFlag(FLAGS_fsdp);
  request.reshard_after_forward = absl::GetFlag(FLAGS_reshard_after_forward);
  request.mp_param_dtype = absl::GetFlag(FLAGS_mp_param_dtype);
  request.mp_reduce_dtype = absl::GetFlag(FLAGS_mp_reduce_dtype);
  request.offload = absl::GetFlag(FLAGS_offload);
  request.ep = absl::GetFlag(FLAGS_ep);
  request.experts_impl = absl::GetFlag(FLAGS_experts_impl);
  request.routing = absl::GetFlag(FLAGS_routing);
  return request;
}

absl::StatusOr<RunSpec> RunSpecFromFlags() {
  absl::StatusOr<ValidRun> run = ValidRunFromFlags();
  if (!run.ok()) return run.status();
  return run->spec();
}

absl::StatusOr<ValidRun> ValidRunFromFlags() {
  absl::StatusOr<ValidRun> run = ValidRunFromRequest(RunRequestFromFlags());
  if (!run.ok()) return run.status();

  const std::string format = absl::GetFlag(FLAGS_format);
  if (format != "json" && format != "table" && format != "csv" && format != "jsonl") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--format must be json or table (csv or jsonl with --sweep), got '", format, "'"));
  }
  run->SetFormat(format);
  return run;
}

absl::Status ClaimOutputs(OutputFiles& outputs,
                          std::initializer_list<std::pair<const char*, std::string>> files) {
  // --model reads a file only where it names no built-in model; --routing where it is
  // not balanced or worst; --plan where it names a file (Protect skips the rest).
  if (const std::string model = absl::GetFlag(FLAGS_model); !ModelFromPreset(model).ok()) {
    outputs.Protect("--model", model);
  }
  if (const std::string routing = absl::GetFlag(FLAGS_routing);
      routing != "balanced" && routing != "worst") {
    outputs.Protect("--routing", routing);
  }
  outputs.Protect("--plan", absl::GetFlag(FLAGS_plan));
  for (const auto& [flag, path] : files) {
    if (path.empty()) continue;
    if (absl::Status s = outputs.Claim(flag, path); !s.ok()) return s;
  }
  return absl::OkStatus();
}

int ReportError(const absl::Status& status) {
  const absl::StatusCode code = status.code();
  // What the user typed is in the message: its control characters are written out.
  const std::string message = EscapeForMessage(status.message());
  if (code == absl::StatusCode::kUnimplemented) {
    std::cerr << "not measurable here: " << message
              << " (predict still answers for this config)\n";
    return 3;
  }
  std::cerr << "error: " << message << "\n";
  const bool user_error = code == absl::StatusCode::kInvalidArgument ||
                          code == absl::StatusCode::kOutOfRange ||
                          code == absl::StatusCode::kResourceExhausted;
  return user_error ? 2 : 1;
}

namespace {

// kFlagGroups: where --help lists each of the CLIs' flags, in this order (a flag not
// named here is listed under "other").
constexpr std::pair<const char*, const char*> kFlagGroups[] = {
    {"model", "model"},          {"layers", "model"},         {"width", "model"},
    {"heads", "model"},          {"kv_heads", "model"},       {"head_dim", "model"},
    {"intermediate", "model"},   {"vocab", "model"},          {"attention", "model"},
    {"experts_impl", "model"},   {"config_keys", "model"},    {"routing", "input"},
    {"batch", "input"},          {"seq", "input"},            {"sweep", "input"},
    {"seed", "input"},           {"dtype", "precision"},      {"amp", "precision"},
    {"master_weights", "precision"}, {"optimizer", "optimizer"},
    {"optimizer_impl", "optimizer"}, {"momentum", "optimizer"},
    {"freeze", "fine-tuning"},      {"lora_rank", "fine-tuning"},
    {"lora_alpha", "fine-tuning"},  {"lora_dropout", "fine-tuning"},
    {"lora_targets", "fine-tuning"}, {"use_dora", "fine-tuning"},
    {"variants", "checkpointing"},   {"every", "checkpointing"},
    {"policy", "checkpointing"},     {"checkpoint_impl", "checkpointing"},
    {"plan", "checkpointing"},       {"budget_gib", "checkpointing"},
    {"frontier_points", "checkpointing"}, {"flops_per_second", "checkpointing"},
    {"tp", "parallelism"},       {"sp", "parallelism"},       {"dp", "parallelism"},
    {"pp", "parallelism"},       {"virtual_stages", "parallelism"},
    {"micro_batches", "parallelism"}, {"zero", "parallelism"}, {"ep", "parallelism"},
    {"ddp_bucket_mb", "parallelism"}, {"gradient_as_bucket_view", "parallelism"},
    {"fsdp", "parallelism"}, {"reshard_after_forward", "parallelism"},
    {"mp_param_dtype", "parallelism"}, {"mp_reduce_dtype", "parallelism"},
    {"offload", "parallelism"},
    {"schedule", "parallelism"}, {"rank_timeout_s", "parallelism"},
    {"rank_fault", "parallelism"}, {"rank_worker", "parallelism"},
    {"gpus", "parallelism"},     {"gpus_per_node", "parallelism"},
    {"global_batch", "input"},   {"longest_seq", "input"},
    {"max_virtual_stages", "parallelism"},
    {"planned_layouts", "checkpointing"},
    {"device", "device"},        {"sdpa_backend", "device"},
    {"expandable_segments", "device"}, {"cuda_context_mib", "device"},
    {"cublas_workspace_config", "device"},   {"offload_activations", "device"},
    {"gpu", "device"},           {"gpu_memory_gib", "device"}, {"mfu", "device"},
    {"cpu_threads", "device"},   {"max_memory_gib", "device"},  {"threads", "device"},
    {"checked_layouts", "device"},
    {"witness", "verification"}, {"witness_python", "verification"},
    {"grad_tolerance", "verification"}, {"skip_timing", "verification"},
    {"format", "output"},        {"json_out", "output"},      {"timeline_svg", "output"},
    {"explain", "output"},       {"plan_out", "output"},      {"frontier_svg", "output"},
    {"top", "output"},           {"chart_svg", "output"},    {"snapshot_out", "output"},
};

// Wrapped breaks `text` into lines of at most `width` columns, each indented by
// `indent` spaces and ended by a newline (a word longer than a line stays whole).
std::string Wrapped(absl::string_view text, int indent, int width) {
  std::string out, line;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (!line.empty() && static_cast<int>(line.size() + 1 + word.size()) > width - indent) {
      absl::StrAppend(&out, std::string(indent, ' '), line, "\n");
      line.clear();
    }
    absl::StrAppend(&line, line.empty() ? "" : " ", word);
  }
  if (!line.empty()) absl::StrAppend(&out, std::string(indent, ' '), line, "\n");
  return out;
}

// IsHelpRequest: --help (or -help, -h, --helpshort) with no value: the grouped list.
// --helpfull and --help=SUBSTRING stay Abseil's.
bool IsHelpRequest(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") break;
    for (absl::string_view help : {"--help", "-help", "-h", "--helpshort", "-helpshort"}) {
      if (arg == help) return true;
    }
  }
  return false;
}

// GroupedHelp is `usage` and then every flag this program defines (Abseil's own are
// left to --helpfull), by group, each with its default and its help text.
std::string GroupedHelp(const char* usage) {
  struct Entry {
    int order;
    std::string name, text;
  };
  std::vector<std::pair<std::string, std::vector<Entry>>> groups;
  auto group_of = [&](absl::string_view name) -> std::pair<std::string, int> {
    int order = 0;
    for (const auto& [flag, group] : kFlagGroups) {
      if (name == flag) return {group, order};
      ++order;
    }
    return {"other", order};
  };
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    // Abseil's own flags (--flagfile, --fromenv, ...) are defined in its sources.
    const std::string file = flag->Filename();
    if (absl::StrContains(file, "absl/")) continue;
    const auto [group, order] = group_of(name);
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == group; });
    if (it == groups.end()) {
      groups.emplace_back(group, std::vector<Entry>());
      it = groups.end() - 1;
    }
    // An optional flag without a default says in its help what it falls back to.
    const std::string value = flag->DefaultValue();
    it->second.push_back({order, std::string(name),
                          absl::StrCat("  --", name,
                                       value.empty() ? "" : absl::StrCat(" (default ", value, ")"),
                                       "\n", Wrapped(flag->Help(), 6, 88))});
  }
  // Groups in kFlagGroups' order, "other" last; flags in the table's order.
  auto rank = [&](const std::string& group) {
    int order = 0;
    for (const auto& [flag, g] : kFlagGroups) {
      if (group == g) return order;
      ++order;
    }
    return order;
  };
  std::sort(groups.begin(), groups.end(),
            [&](const auto& a, const auto& b) { return rank(a.first) < rank(b.first); });
  std::string help = absl::StrCat(usage, "\n\nFlags (--helpfull adds Abseil's own):\n");
  for (auto& [group, entries] : groups) {
    std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
      return a.order != b.order ? a.order < b.order : a.name < b.name;
    });
    absl::StrAppend(&help, "\n", group, ":\n");
    for (const Entry& e : entries) absl::StrAppend(&help, e.text);
  }
  return help;
}

// CheckFlagsOrExit looks at every --flag[=value] before Abseil parses them, so that an
// unknown flag or a value that does not parse exits 2 with one line, like every other
// bad input (Abseil's own parser exits 1).
void CheckFlagsOrExit(int argc, char** argv) {
  auto fail = [](const std::string& message) {
    std::exit(ReportError(absl::InvalidArgumentError(message)));
  };
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (!absl::ConsumePrefix(&arg, "--") && !absl::ConsumePrefix(&arg, "-")) continue;
    const size_t equals = arg.find('=');
    absl::string_view name = arg.substr(0, equals);
    // Flags come from the command line only: Abseil's flagfiles and environment flags
    // would read whatever they name (a device, a FIFO, a file that includes itself)
    // before any of memledger's checks.
    for (absl::string_view indirect : {"flagfile", "fromenv", "tryfromenv"}) {
      if (name == indirect) {
        fail(absl::StrCat("--", name,
                          " is not supported: give the flags on the command line"));
      }
    }
    for (absl::string_view builtin : {"help", "helpfull", "helpshort", "helppackage",
                                      "version", "only_check_args", "undefok"}) {
      if (name == builtin) name = "";
    }
    if (name.empty()) continue;
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && equals == absl::string_view::npos) {
      // --noexplain is --explain=false.
      absl::string_view positive = name;
      if (absl::ConsumePrefix(&positive, "no")) {
        absl::CommandLineFlag* boolean = absl::FindCommandLineFlag(positive);
        if (boolean != nullptr && boolean->IsOfType<bool>()) continue;
      }
    }
    if (flag == nullptr) fail(absl::StrCat("unknown flag --", name, " (see --help)"));
    std::string value;
    if (equals != absl::string_view::npos) {
      value = std::string(arg.substr(equals + 1));
    } else if (flag->IsOfType<bool>()) {
      continue;
    } else if (i + 1 < argc) {
      value = argv[++i];  // --flag value
    } else {
      fail(absl::StrCat("--", name, " needs a value"));
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      fail(absl::StrCat("--", name, ": ", error));
    }
  }
}

}  // namespace

void ParseCommandLineOrExit(int argc, char** argv, const char* usage) {
  // Under a file-size limit (ulimit -f) a write past it fails with EFBIG, which the
  // output writer reports, instead of killing the process with SIGXFSZ mid-file.
  std::signal(SIGXFSZ, SIG_IGN);
  // A closed pipe on standard output (`predict | head -c 10`) fails the write with EPIPE,
  // which PrintToStdout reports (exit 2, no file written, no temporary file left),
  // instead of SIGPIPE killing the run between staging its files and renaming them.
  std::signal(SIGPIPE, SIG_IGN);
  // What Abseil prints itself (--version, --helpfull) is checked at exit as well.
  CheckStandardOutputAtExit();
  absl::SetProgramUsageMessage(usage);
  if (IsHelpRequest(argc, argv)) {
    if (absl::Status s = PrintToStdout(GroupedHelp(usage)); !s.ok()) std::exit(ReportError(s));
    std::exit(0);
  }
  CheckFlagsOrExit(argc, argv);
  // MEMLEDGER_COUNT_VALIDATIONS set: at exit, stderr says how many times the request's
  // config and layout were validated (predict_cli_test and planner_cli_test hold a
  // request to one of each).
  if (std::getenv("MEMLEDGER_COUNT_VALIDATIONS") != nullptr) {
    std::atexit([] {
      std::cerr << "validations: config " << ValidateConfigCalls() << ", layout "
                << ValidateParallelCalls() << "\n";
    });
  }
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    std::vector<std::string> extra(positional.begin() + 1, positional.end());
    std::exit(ReportError(absl::InvalidArgumentError(
        absl::StrCat("unexpected argument(s): ", absl::StrJoin(extra, " "),
                     " (flags look like --layers=6; see --help)"))));
  }
}

}  // namespace memledger
