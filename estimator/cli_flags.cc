#include "estimator/cli_flags.h"

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "estimator/model_presets.h"

ABSL_FLAG(std::string, model, "study",
          "The model: a built-in name (study, gpt2, llama-2-7b, llama-3-8b, llama-3-70b, "
          "mistral-7b, qwen2.5-7b, tiny-llama, tiny-gpt2) or the path of a transformers "
          "config.json (model_type llama, mistral, qwen2 or gpt2). The size flags below "
          "override its sizes.");
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
ABSL_FLAG(std::string, policy, "matmul",
          "Op kinds the selective variant must-saves, comma-separated: matmul (the four "
          "Linear layers), attention (flash only), layer_norm, gelu.");
ABSL_FLAG(std::string, attention, "flash",
          "flash (PyTorch 2.x CPU flash SDPA contract) or math (plain ops, keeps T x T).");
ABSL_FLAG(std::string, dtype, "fp32",
          "The model's dtype, for parameters, gradients and activations: fp32, bf16 or fp16 "
          "(pure low precision; PyTorch still keeps some tensors in fp32).");
ABSL_FLAG(std::string, amp, "none",
          "Autocast over the fp32 model: none, bf16 or fp16 (matmuls and SDPA in that dtype "
          "on cast copies, weights included; norms and losses in fp32).");
ABSL_FLAG(std::string, optimizer, "adamw", "The optimizer: adamw, adam or sgd.");
ABSL_FLAG(double, momentum, 0, "SGD's momentum (> 0 keeps a momentum buffer).");
ABSL_FLAG(bool, master_weights, false,
          "With --dtype=bf16 or fp16: the optimizer steps fp32 copies of the parameters.");
ABSL_FLAG(std::string, format, "json", "Output format: json or table.");
ABSL_FLAG(std::string, json_out, "",
          "Also write the JSON report to this file (atomically: temp file + rename).");

namespace memledger {

absl::StatusOr<RunSpec> RunSpecFromFlags() {
  RunSpec spec;
  absl::StatusOr<ModelConfig> model = ModelFromFlag(absl::GetFlag(FLAGS_model));
  if (!model.ok()) return model.status();
  spec.config = *model;
  spec.model = absl::GetFlag(FLAGS_model);
  const bool width_or_heads_set = absl::GetFlag(FLAGS_width).has_value() ||
                                  absl::GetFlag(FLAGS_heads).has_value();
  for (const auto& [flag, field] :
       {std::pair<const absl::Flag<std::optional<int64_t>>*, int64_t*>{&FLAGS_layers,
                                                                       &spec.config.layers},
        {&FLAGS_width, &spec.config.width},
        {&FLAGS_heads, &spec.config.heads},
        {&FLAGS_kv_heads, &spec.config.kv_heads},
        {&FLAGS_head_dim, &spec.config.head_dim},
        {&FLAGS_intermediate, &spec.config.intermediate},
        {&FLAGS_vocab, &spec.config.vocab}}) {
    if (std::optional<int64_t> value = absl::GetFlag(*flag); value.has_value()) *field = *value;
  }
  // A new width or head count redraws the head split unless it is given too; the
  // study's and GPT-2's kv heads follow the heads.
  if (width_or_heads_set && !absl::GetFlag(FLAGS_head_dim).has_value() &&
      spec.config.heads > 0) {
    spec.config.head_dim = spec.config.width / spec.config.heads;
  }
  if (spec.config.family != Family::kLlama && !absl::GetFlag(FLAGS_kv_heads).has_value()) {
    spec.config.kv_heads = spec.config.heads;
  }
  if (spec.config.family != Family::kLlama && absl::GetFlag(FLAGS_width).has_value() &&
      !absl::GetFlag(FLAGS_intermediate).has_value()) {
    spec.config.intermediate = 4 * spec.config.width;
  }
  absl::StatusOr<DType> dtype = ParseModelDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return dtype.status();
  spec.config.dtype = *dtype;
  absl::StatusOr<DType> amp = ParseAmp(absl::GetFlag(FLAGS_amp));
  if (!amp.ok()) return amp.status();
  spec.config.amp = *amp;
  absl::StatusOr<OptimizerKind> optimizer = ParseOptimizer(absl::GetFlag(FLAGS_optimizer));
  if (!optimizer.ok()) return optimizer.status();
  spec.optimizer.kind = *optimizer;
  spec.optimizer.momentum = absl::GetFlag(FLAGS_momentum);
  spec.optimizer.master_weights = absl::GetFlag(FLAGS_master_weights);
  spec.config.batch = absl::GetFlag(FLAGS_batch);
  spec.config.seq = absl::GetFlag(FLAGS_seq);
  if (absl::Status s = ValidateConfig(spec.config); !s.ok()) return s;

  absl::StatusOr<AttentionMode> attention = ParseAttentionMode(absl::GetFlag(FLAGS_attention));
  if (!attention.ok()) return attention.status();
  spec.attention = *attention;

  absl::StatusOr<std::vector<Variant>> variants = ParseVariants(
      absl::GetFlag(FLAGS_variants), absl::GetFlag(FLAGS_every), absl::GetFlag(FLAGS_policy));
  if (!variants.ok()) return variants.status();
  spec.variants = *std::move(variants);
  if (absl::Status s =
          ValidateRun(spec.config, spec.attention, spec.variants, spec.optimizer);
      !s.ok()) {
    return s;
  }

  const std::string format = absl::GetFlag(FLAGS_format);
  if (format != "json" && format != "table") {
    return absl::InvalidArgumentError(
        absl::StrCat("--format must be json or table, got '", format, "'"));
  }
  spec.table = format == "table";
  return spec;
}

int ReportError(const absl::Status& status) {
  std::cerr << "error: " << status.message() << "\n";
  const absl::StatusCode code = status.code();
  const bool user_error = code == absl::StatusCode::kInvalidArgument ||
                          code == absl::StatusCode::kOutOfRange ||
                          code == absl::StatusCode::kResourceExhausted;
  return user_error ? 2 : 1;
}

void ParseCommandLineOrExit(int argc, char** argv, const char* usage) {
  absl::SetProgramUsageMessage(usage);
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    std::vector<std::string> extra(positional.begin() + 1, positional.end());
    std::cerr << "error: unexpected argument(s): " << absl::StrJoin(extra, " ")
              << " (flags look like --layers=6; see --help)\n";
    std::exit(2);
  }
}

}  // namespace memledger
