#include "estimator/cli_flags.h"

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

ABSL_FLAG(int64_t, layers, 6, "Number of Transformer blocks (>= 1).");
ABSL_FLAG(int64_t, width, 128, "Model width d (>= 1, divisible by --heads).");
ABSL_FLAG(int64_t, heads, 4, "Attention heads H (>= 1).");
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
ABSL_FLAG(std::string, format, "json", "Output format: json or table.");
ABSL_FLAG(std::string, json_out, "",
          "Also write the JSON report to this file (atomically: temp file + rename).");

namespace memledger {

absl::StatusOr<RunSpec> RunSpecFromFlags() {
  RunSpec spec;
  spec.config.layers = absl::GetFlag(FLAGS_layers);
  spec.config.width = absl::GetFlag(FLAGS_width);
  spec.config.heads = absl::GetFlag(FLAGS_heads);
  spec.config.batch = absl::GetFlag(FLAGS_batch);
  spec.config.seq = absl::GetFlag(FLAGS_seq);
  if (absl::Status s = ValidateConfig(spec.config); !s.ok()) return s;

  absl::StatusOr<AttentionMode> attention = ParseAttentionMode(absl::GetFlag(FLAGS_attention));
  if (!attention.ok()) return attention.status();
  spec.attention = *attention;

  absl::StatusOr<std::vector<Variant>> variants = ParseVariants(
      absl::GetFlag(FLAGS_variants), absl::GetFlag(FLAGS_every), absl::GetFlag(FLAGS_policy));
  if (!variants.ok()) return variants.status();
  for (const Variant& variant : *variants) {
    if (variant.kind != VariantKind::kSelective) continue;
    if (absl::Status s = ValidatePolicy(variant.policy, spec.attention); !s.ok()) return s;
  }
  spec.variants = *std::move(variants);

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
