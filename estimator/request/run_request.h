// RunRequest: what a caller asks for, as the command line's flags or the C ABI's JSON
// request name it, and its conversion into a validated config, attention mode, variants
// and optimizer. The CLIs and the C ABI share this path, so the same bad input gets the
// same one-line message everywhere.
//
// Example:
//   RunRequest request;
//   request.model = "llama-3-8b";
//   request.seq = 8192;
//   absl::StatusOr<RunSpec> spec = RunSpecFromRequest(request);
#ifndef ESTIMATOR_REQUEST_RUN_REQUEST_H_
#define ESTIMATOR_REQUEST_RUN_REQUEST_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "estimator/spec/config.h"
#include "estimator/request/parallel_spec.h"

namespace memledger {

// RunRequest mirrors the flags (see --help); sizes left empty take the model's.
struct RunRequest {
  std::string model = "study";  // a preset name or a config.json path
  // model_config_json: a config.json's text given inline (the C ABI's "model" as a JSON
  // object); when set it is the model, and `model` only names it.
  std::string model_config_json;
  std::optional<int64_t> layers, width, heads, kv_heads, head_dim, intermediate, vocab;
  int64_t batch = 16;
  int64_t seq = 64;
  std::string variants = "none,full,every_k,selective";
  int64_t every = 2;
  std::string policy = "matmul";
  std::string attention = "flash";
  std::string dtype = "fp32";
  std::string amp = "none";
  std::string optimizer = "adamw";
  std::string optimizer_impl = "auto";  // torch.optim's for_loop, foreach or fused
  std::string checkpoint_impl = "non_reentrant";  // torch.utils.checkpoint's use_reentrant
  std::string freeze;  // parameters that do not train: embeddings, lm_head (comma-separated)
  // peft's LoRA (LoraConfig's r, lora_alpha, lora_dropout, target_modules); rank 0: none.
  int64_t lora_rank = 0;
  double lora_alpha = 8;
  double lora_dropout = 0;
  std::string lora_targets;  // empty: peft's for the family (FamilyDef::lora_default_targets)
  bool use_dora = false;     // LoraConfig's use_dora
  double momentum = 0;
  bool master_weights = false;
  // The layout (ParallelSpec): tensor-parallel ranks (the prediction is one rank's) and
  // sequence parallelism with them; data and pipeline parallelism, where predict reports
  // every kind of rank.
  int64_t tp = 1;
  bool sp = false;
  int64_t dp = 1;
  int64_t pp = 1;
  int64_t virtual_stages = 1;
  int64_t micro_batches = 1;
  int64_t zero = 0;
  std::string schedule = "1f1b";
  // DDP's options (dp > 1 without ZeRO; ParallelSpec::ddp): unset, torch's default cap.
  std::optional<double> ddp_bucket_mb;
  bool gradient_as_bucket_view = false;
  // FSDP2 (ParallelSpec::fsdp): --fsdp, and --reshard_after_forward: true or false.
  bool fsdp = false;
  std::string reshard_after_forward = "true";
  // FSDP2's MixedPrecisionPolicy: "" (none), or fp32, bf16, fp16.
  std::string mp_param_dtype;
  std::string mp_reduce_dtype;
  // FSDP2's CPUOffloadPolicy: "none" or "cpu".
  std::string offload = "none";
  // ep: expert-parallel ranks among the dp ranks (a mixture of experts' experts split
  // over them, AllToAllEP between them).
  int64_t ep = 1;
  // A mixture of experts' experts implementation (grouped_mm, transformers 5.23's
  // default, or eager) and, for eager, the routing: balanced, worst or a routing file's
  // path ({"layers": [[tokens per expert, ...], ...]}, one row per sparse layer).
  std::string device = "cpu";         // cpu or cuda
  std::string sdpa_backend = "auto";  // auto, flash, efficient, cudnn or math
  bool expandable_segments = false;   // with device cuda
  double cuda_context_mib = static_cast<double>(kCudaContextBytes) / (1 << 20);
  // CUBLAS_WORKSPACE_CONFIG's value (":4096:8", ":16:8", ":0:0"); empty: unset.
  std::string cublas_workspace_config;
  // offload_activations: none, or cpu (the forward under save_on_cpu; with device cuda).
  std::string offload_activations = "none";
  std::string experts_impl = "grouped_mm";
  std::string routing = "balanced";
  // plan: a checkpoint plan (ReadPlan: a //planner file, or inline runs such as
  // "full*2;none*6"), predicted beside none instead of `variants`.
  std::string plan;
};

// RunSpec is a validated request.
struct RunSpec {
  ModelConfig config;
  std::string model;  // as requested: a preset name or a config.json path
  AttentionMode attention = AttentionMode::kFlash;
  std::vector<Variant> variants;
  OptimizerSpec optimizer;
  ParallelSpec parallel;
  bool table = false;  // the CLIs' --format=table, else JSON
  std::string format = "json";  // the CLIs' --format: json, table, csv or jsonl
  std::string routing = "balanced";  // as requested: balanced, worst or a file's path
};

// ParseRouting reads a routing file's text (`path` names it in errors): {"layers":
// [[tokens per expert, ...], ...]}, one row per sparse layer in order, or {"ranks":
// [{"layers": ...}, ...]}, every expert-parallel (or data-parallel) rank's, rank by rank
// (ValidateConfig checks the rows against the model). InvalidArgument, naming --routing
// and the path, for anything else.
absl::StatusOr<std::vector<std::vector<int64_t>>> ParseRouting(absl::string_view text,
                                                               absl::string_view path);

// FsdpOptionsFrom: the request's FSDP2 options (--fsdp, --reshard_after_forward,
// --mp_param_dtype, --mp_reduce_dtype), parsed; ValidateParallel checks them against a
// layout. InvalidArgument naming the flag.
absl::StatusOr<FsdpOptions> FsdpOptionsFrom(const RunRequest& request);

// RunSpecFromRequest resolves the model, applies the size overrides and validates the
// whole run (ValidateRun); errors are InvalidArgument naming the flag or key.
absl::StatusOr<RunSpec> RunSpecFromRequest(const RunRequest& request);

// ValidRun is a RunSpec that ValidRunFromRequest validated whole, once: its config
// (ValidConfig), its layout (ValidateParallel) and its run (ValidateRunOf). predict and
// the C ABI predict from it without validating again (PredictValid,
// PredictValidDistributed). What was validated cannot change; a changed run is a new
// request (RunSpecFromRequest gives a RunSpec to change).
class ValidRun {
 public:
  const RunSpec& spec() const { return spec_; }
  const ValidConfig& config() const { return config_; }
  // WithoutVariants: the same run with no fixed variants (the search's plans, which it
  // shows beside its own): fewer variants cannot make a valid run invalid.
  ValidRun WithoutVariants() const {
    ValidRun without = *this;
    without.spec_.variants.clear();
    return without;
  }
  // SetFormat: the CLIs' --format (json, table, csv or jsonl), which no check depends on.
  void SetFormat(const std::string& format) {
    spec_.format = format;
    spec_.table = format == "table";
  }

 private:
  friend absl::StatusOr<ValidRun> ValidRunFromRequest(const RunRequest& request);
  ValidRun(RunSpec spec, ValidConfig config)
      : spec_(std::move(spec)), config_(std::move(config)) {}
  RunSpec spec_;
  ValidConfig config_;
};
absl::StatusOr<ValidRun> ValidRunFromRequest(const RunRequest& request);

// RequestFlags writes a request as the command line's flags (predict's and verify's
// alike): --model, --batch and --seq always, every other flag only where it differs
// from its default. A model given inline (model_config_json) is written as its name.
std::string RequestFlags(const RunRequest& request);

}  // namespace memledger

#endif  // ESTIMATOR_REQUEST_RUN_REQUEST_H_
