// SearchLayouts: which parallel layouts of a model over N GPUs fit their memory, and
// which of those is fastest. Every combination of tensor parallelism (within a node),
// sequence parallelism, pipeline stages (1F1B, or interleaved over virtual stages),
// data parallelism with ZeRO 0-3, for a mixture of experts expert parallelism among the
// data-parallel ranks (where --ep is modelled: without tp and ZeRO), micro-batch size and
// count (their product times dp is the global batch) and checkpointing variant is
// predicted per rank, exactly
// (PredictRanks: every stage's whole-step peak, the most loaded rank's kept), and ranked
// by a modelled step time (planner/step_time.h).
//
// Most layouts need no step simulation: a rank's parameters, optimizer state and the
// saved tensors its schedule holds at once are live together, so when they exceed the
// budget the layout does not fit (the bound is checked against every simulated peak by
// layout_search_test).
//
// Example:
//   RunRequest request;  // the model, precision and optimizer, as predict's flags
//   request.model = "llama-3-70b";
//   request.seq = 8192;
//   SearchOptions options;
//   options.gpus = 64;
//   options.global_batch = 256;
//   options.budget_bytes = int64_t{80} << 30;
//   options.gpu = *GpuPreset("h100");
//   absl::StatusOr<SearchResult> r = SearchLayouts(request, options);
//   // r->layouts[0]: the fastest layout that fits, with its predict and verify flags.
#ifndef PLANNER_LAYOUT_SEARCH_H_
#define PLANNER_LAYOUT_SEARCH_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "estimator/spec/config.h"
#include "estimator/request/run_request.h"
#include "planner/step_time.h"

namespace memledger {

// LayoutConstraints fix parts of the layout; the search enumerates the rest.
struct LayoutConstraints {
  std::optional<int64_t> tp, pp, dp, zero, micro_batch_size, virtual_stages, ep;
  std::optional<bool> sp;
};

// kMaxSearchGpus bounds --gpus: each divisor of it is a parallel size tried, and each
// layout a prediction (the largest training clusters hold about 2^17 GPUs).
inline constexpr int64_t kMaxSearchGpus = int64_t{1} << 20;

struct SearchOptions {
  int64_t gpus = 0;
  int64_t gpus_per_node = 8;  // tensor parallelism stays within a node
  int64_t budget_bytes = 0;   // per GPU
  int64_t global_batch = 0;   // sequences per step: dp x micro_batch_size x micro_batches
  GpuSpec gpu;
  double mfu = 0.5;  // the share of the peak FLOP/s the kernels reach
  // max_virtual_stages bounds the interleaved schedule's chunks per rank (each value
  // from 2 that divides the stage's layers is tried).
  int64_t max_virtual_stages = 4;
  int threads = 0;  // 0: one per core
  LayoutConstraints fixed;
  // planned_layouts: this many layouts that must recompute (a variant fits, none does
  // not) and could be fastest (their step without recompute, which no plan beats,
  // shorter than the best found), taken in turn by their fastest variant's time and by
  // that bound, are also planned per stage (planner/stage_planner.h) within the budget;
  // a plan (checkpoint "plan", its runs in `flags`' --plan) joins the ranking. 0: none.
  int64_t planned_layouts = 8;
  // checked_layouts: on --device=cuda, the best layouts replayed through the caching
  // allocator's simulation until this many fit their device's memory (reserved peak plus
  // the CUDA context); those that do not are dropped. Every layout is first found with
  // its storages counted as requests, several times cheaper. 0: none checked.
  int64_t checked_layouts = 10;
  // default_precision: how the search chose the run's precision where the request named
  // none (DefaultSearchPrecision), said in its output; empty when the request named it.
  std::string default_precision;
};

// DefaultSearchPrecision: where a search's request names no precision (`named`: none of
// --dtype, --amp, --master_weights, --mp_param_dtype and --mp_reduce_dtype given), it
// plans what large models train with rather than predict's fp32: bf16 parameters with
// fp32 master weights in the optimizer (Megatron-LM's recipe, which every layout the
// search tries runs, sequence parallelism too); with --fsdp FSDP2's
// MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), torchtitan's; with LoRA bf16
// weights (peft's adapters stay fp32). Sets `request` so and says which in
// options.default_precision.
inline void DefaultSearchPrecision(bool named, RunRequest& request, SearchOptions& options) {
  if (named) return;
  if (request.fsdp) {
    request.mp_param_dtype = "bf16";
    request.mp_reduce_dtype = "fp32";
    options.default_precision =
        "fp32 parameters, FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)";
  } else if (request.lora_rank > 0) {
    request.dtype = "bf16";
    options.default_precision = "bf16 weights, LoRA's adapters fp32";
  } else {
    request.dtype = "bf16";
    request.master_weights = true;
    options.default_precision = "bf16 parameters, fp32 master weights";
  }
}

// SearchRequest is the search's own flags (//planner:search's, the C ABI's keys) before
// validation.
struct SearchRequest {
  int64_t gpus = 0;
  int64_t gpus_per_node = 8;
  std::optional<double> gpu_memory_gib;  // default: the GPU preset's
  int64_t global_batch = 0;
  std::string gpu = "h100";
  double mfu = 0.5;
  int64_t max_virtual_stages = 4;
  int64_t threads = 0;
  LayoutConstraints fixed;
  int64_t planned_layouts = 8;
  int64_t checked_layouts = 10;
};

// SearchOptionsFrom: InvalidArgument naming the flag for an unknown GPU, a budget that
// is not a positive number of GiB below 2^33, or threads outside [0, 1024]; the rest
// SearchLayouts checks.
absl::StatusOr<SearchOptions> SearchOptionsFrom(const SearchRequest& request);

// SearchedLayout is one layout that fits, with its checkpointing variant.
struct SearchedLayout {
  int64_t tp = 1, pp = 1, dp = 1, zero = 0;
  int64_t ep = 1;  // expert parallelism among the dp ranks (a mixture of experts)
  bool fsdp = false;  // the data-parallel ranks run torch's FSDP2 (search --fsdp)
  bool sp = false;
  int64_t micro_batch_size = 1, micro_batches = 1, virtual_stages = 1;
  Variant checkpoint;
  int64_t peak_bytes = 0;  // the most loaded rank's whole-step peak
  int64_t stage = 0;       // its pipeline stage
  StepTime time;
  // tflops_per_gpu: the step's FLOPs, recompute included (Narayanan et al.'s count),
  // per GPU per second; mfu: the model's FLOPs without recompute against the peak.
  double tflops_per_gpu = 0;
  double mfu = 0;
  bool front = false;  // no faster layout has a lower peak
  std::string flags;   // predict's and verify's flags for this layout
  // On --device=cuda, peak_bytes is the most loaded rank's max_memory_allocated().
  // checked: its ranks were replayed through the caching allocator's simulation
  // (--expandable_segments as given): peak_reserved_bytes is their largest reserved
  // peak and device_bytes that plus the CUDA context, within the budget. Unchecked, its
  // storages were counted as requests (CudaBlocks::kRequests: the allocated bytes
  // exactly with expandable segments, a lower bound without), the context added; the
  // allocator may reserve more. Always checked on the CPU.
  bool checked = true;
  int64_t peak_reserved_bytes = 0;
  int64_t device_bytes = 0;
};

struct SearchResult {
  // The model as searched (batch 1, no parallelism) and its whole parameters' bytes.
  ModelConfig config;
  std::string model;
  AttentionMode attention = AttentionMode::kFlash;
  OptimizerSpec optimizer;
  FsdpOptions fsdp;  // search --fsdp's: every layout's data-parallel ranks run FSDP2
  int64_t n_params = 0, param_bytes = 0, grad_bytes = 0, optimizer_state_bytes = 0,
          adamw_state_bytes = 0;
  std::vector<SearchedLayout> layouts;  // those that fit, fastest first
  int64_t candidates = 0;  // layouts x variants enumerated
  int64_t invalid = 0;     // refused (heads not divisible by tp, ...)
  int64_t too_big = 0;     // peak above the budget
  int64_t unmodelled = 0;  // no simulated peak (RankStepModelled)
  int64_t simulated = 0;   // layouts whose ranks' steps were simulated
  int64_t planned = 0;     // layouts planned per stage (SearchOptions::planned_layouts)
  // smallest_peak_bytes: when nothing fits, the smallest peak any candidate has (what
  // the budget would need); else 0.
  int64_t smallest_peak_bytes = 0;
  // On --device=cuda: the CUDA context's bytes, outside the allocator (in every
  // layout's device bytes); how many layouts the allocator's replay checked, and how
  // many of those it dropped (their reserved peak and the context above the budget).
  bool cuda = false;
  int64_t outside_allocator_bytes = 0;
  int64_t checked = 0;
  int64_t dropped_when_checked = 0;
  // search --longest_seq's (planner/longest_seq.h): the bound --seq was bisected up to
  // and the searches that took (config.seq is the longest that fits); 0 otherwise.
  int64_t longest_seq_up_to = 0;
  int64_t longest_seq_searches = 0;
};

// SearchLayouts: InvalidArgument for bad options (naming the flag: gpus not a multiple
// of gpus_per_node above one node, a global batch no layout divides, a parallel field
// set in the request, where SearchOptions::fixed says it); ResourceExhausted when no
// layout fits, naming the smallest memory that would.
absl::StatusOr<SearchResult> SearchLayouts(const RunRequest& request,
                                           const SearchOptions& options);

}  // namespace memledger

#endif  // PLANNER_LAYOUT_SEARCH_H_
