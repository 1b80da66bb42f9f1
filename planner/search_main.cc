// search: which parallel layout of a model over N GPUs fits their memory, and which of
// those is fastest (planner/layout_search.h).
#include <cstdint>
#include <iostream>
#include <optional>
#include <string>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "estimator/cli/output_files.h"
#include "estimator/cli/cli_flags.h"
#include "estimator/cli/message_escape.h"
#include "estimator/report/report.h"
#include "estimator/report/units.h"
#include "estimator/spec/option_checks.h"
#include "planner/layout_search.h"
#include "planner/longest_seq.h"
#include "planner/search_report.h"
#include "planner/step_time.h"

ABSL_FLAG(int64_t, gpus, 0, "GPUs to lay the run out over; required.");
ABSL_FLAG(int64_t, gpus_per_node, 8,
          "GPUs per node: tensor parallelism stays within one, and groups that span more "
          "talk over the network.");
ABSL_FLAG(std::optional<double>, gpu_memory_gib, std::nullopt,
          "Memory per GPU in GiB (2^30 bytes) the most loaded rank's peak must fit "
          "(default: the --gpu preset's marketed capacity; PyTorch sees 1-2 GiB less, and "
          "the CUDA context keeps some: pass what your runs can use).");
ABSL_FLAG(int64_t, global_batch, 0,
          "Sequences per step, data-parallel ranks x micro-batch size x micro-batches; "
          "required.");
ABSL_FLAG(std::string, gpu, "h100",
          "The GPU whose datasheet the time model uses: h100, h200 or a100.");
ABSL_FLAG(double, mfu, 0.5,
          "The share of the GPU's peak FLOP/s the kernels reach, in (0, 1].");
ABSL_FLAG(int64_t, max_virtual_stages, 4,
          "The most model chunks per pipeline rank the interleaved schedule is tried with.");
ABSL_FLAG(int32_t, top, 20, "Layouts the table lists (the JSON has every layout that fits).");
ABSL_FLAG(int64_t, threads, 0, "Threads to search with; 0: one per core.");
ABSL_FLAG(int64_t, planned_layouts, 8,
          "This many layouts that must recompute and could be fastest (taken in turn by "
          "their fastest variant and by their step without recompute) are also planned "
          "per stage within the budget (the checkpoint planner's per-stage plans, "
          "replayed); a plan joins the ranking as checkpoint 'plan', its choices in the "
          "flags' --plan. 0: standard variants only.");
ABSL_FLAG(int64_t, checked_layouts, 10,
          "With --device=cuda: the best layouts, found with each storage counted as its "
          "request (exact allocated bytes with expandable segments), are replayed through "
          "the caching allocator's simulation until this many fit the GPU (reserved peak "
          "plus the CUDA context); those that do not are dropped. 0: none replayed.");
ABSL_FLAG(int64_t, longest_seq, 0,
          "Search for the longest sequence instead: the largest --seq up to this (GPT-2: "
          "its learned positions) at which some layout fits, by bisection (a step's peak "
          "grows with its sequence); the layouts listed are those at that length. 0: "
          "search at --seq.");
ABSL_FLAG(std::string, chart_svg, "",
          "Also draw every layout that fits (peak against step time, the budget, the "
          "front) as an SVG chart to this file.");

namespace {

constexpr char kUsage[] =
    "Searches the parallel layouts of a model over --gpus GPUs: tensor parallelism "
    "(within a node), sequence parallelism, pipeline stages (1F1B or interleaved), data "
    "parallelism with ZeRO 0-3, expert parallelism for a mixture of experts (--ep without "
    "tp or ZeRO), the micro-batch size and count, and the checkpointing "
    "variants (--variants). It keeps those whose most loaded rank's exact step peak fits "
    "--gpu_memory_gib and ranks them by a modelled step time. --tp, --sp, --pp, --dp, "
    "--zero, --ep, --virtual_stages and --batch (the micro-batch size), when given, fix that "
    "part of the layout.\n\n"
    "  ./bazelw run //planner:search -- --model=llama-3-70b --seq=8192 --gpus=64 "
    "--global_batch=256 --dtype=bf16 --master_weights --format=table\n\n"
    "Without --dtype, --amp, --master_weights or --mp_param_dtype the search plans what "
    "large models train with, and says so: bf16 parameters with fp32 master weights (with "
    "--fsdp, FSDP2's MixedPrecisionPolicy(bf16, fp32); with --lora_rank, bf16 weights).\n"
    "Memory is exact; the step time is a model (FLOPs at the GPU's peak x --mfu, the "
    "pipeline bubble, communication at the preset's bandwidths, nothing overlapped).\n"
    "Exit status: 0 on success, 2 for bad input (an output file that cannot be written, "
    "or that is another output or an input, and standard output that cannot be written, "
    "a closed pipe too: then no file is written), 3 when no layout fits (the message "
    "gives the smallest memory that would).";

// Given: whether --name (or -name) is on the command line, with a value or not.
bool Given(int argc, char** argv, absl::string_view name) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (!absl::ConsumePrefix(&arg, "--") && !absl::ConsumePrefix(&arg, "-")) continue;
    if (arg == name || absl::StartsWith(arg, absl::StrCat(name, "="))) return true;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  memledger::ParseCommandLineOrExit(argc, argv, kUsage);
  // The micro-batches follow from the global batch, the schedule from --virtual_stages;
  // predict's own outputs do not apply.
  for (const char* flag : {"micro_batches", "schedule", "timeline_svg"}) {
    if (Given(argc, argv, flag)) {
      return memledger::ReportError(absl::InvalidArgumentError(absl::StrCat(
          "--", flag, std::string(flag) == "timeline_svg"
                          ? " draws one step: run predict with a layout's flags"
                          : " follows from the layout: give --global_batch (micro-batches = "
                            "global batch / (dp x micro-batch size)) and --virtual_stages")));
    }
  }
  memledger::RunRequest request = memledger::RunRequestFromFlags();
  // Layout flags given on the command line fix that part of the layout.
  memledger::LayoutConstraints fixed;
  if (Given(argc, argv, "tp")) fixed.tp = request.tp;
  if (Given(argc, argv, "pp")) fixed.pp = request.pp;
  if (Given(argc, argv, "dp")) fixed.dp = request.dp;
  if (Given(argc, argv, "zero")) fixed.zero = request.zero;
  if (Given(argc, argv, "virtual_stages")) fixed.virtual_stages = request.virtual_stages;
  if (Given(argc, argv, "batch")) fixed.micro_batch_size = request.batch;
  if (Given(argc, argv, "sp") || Given(argc, argv, "nosp")) fixed.sp = request.sp;
  if (Given(argc, argv, "ep")) fixed.ep = request.ep;
  const memledger::RunRequest defaults;
  request.tp = defaults.tp;
  request.pp = defaults.pp;
  request.dp = defaults.dp;
  request.zero = defaults.zero;
  request.virtual_stages = defaults.virtual_stages;
  request.sp = defaults.sp;
  request.ep = defaults.ep;
  const std::string format = absl::GetFlag(FLAGS_format);
  if (format != "json" && format != "table") {
    return memledger::ReportError(absl::InvalidArgumentError(
        absl::StrCat("--format must be json or table, got '", format, "'")));
  }
  const int32_t top = absl::GetFlag(FLAGS_top);
  if (absl::Status s = memledger::CheckTop(top); !s.ok()) return memledger::ReportError(s);
  // Every file is written, or (on an error) none; none replaces another or an input.
  memledger::OutputFiles outputs;
  if (absl::Status s = memledger::ClaimOutputs(
          outputs, {{"--json_out", absl::GetFlag(FLAGS_json_out)},
                    {"--chart_svg", absl::GetFlag(FLAGS_chart_svg)}});
      !s.ok()) {
    return memledger::ReportError(s);
  }
  memledger::SearchRequest search;
  search.gpus = absl::GetFlag(FLAGS_gpus);
  search.gpus_per_node = absl::GetFlag(FLAGS_gpus_per_node);
  search.gpu_memory_gib = absl::GetFlag(FLAGS_gpu_memory_gib);
  search.global_batch = absl::GetFlag(FLAGS_global_batch);
  search.gpu = absl::GetFlag(FLAGS_gpu);
  search.mfu = absl::GetFlag(FLAGS_mfu);
  search.max_virtual_stages = absl::GetFlag(FLAGS_max_virtual_stages);
  search.threads = absl::GetFlag(FLAGS_threads);
  search.planned_layouts = absl::GetFlag(FLAGS_planned_layouts);
  search.checked_layouts = absl::GetFlag(FLAGS_checked_layouts);
  search.fixed = fixed;
  absl::StatusOr<memledger::SearchOptions> searched = memledger::SearchOptionsFrom(search);
  if (!searched.ok()) return memledger::ReportError(searched.status());
  memledger::SearchOptions options = *searched;
  bool precision_named = false;
  for (const char* flag : {"dtype", "amp", "master_weights", "nomaster_weights",
                           "mp_param_dtype", "mp_reduce_dtype"}) {
    precision_named = precision_named || Given(argc, argv, flag);
  }
  memledger::DefaultSearchPrecision(precision_named, request, options);
  const int64_t longest_seq = absl::GetFlag(FLAGS_longest_seq);
  if (longest_seq != 0 && Given(argc, argv, "seq")) {
    return memledger::ReportError(absl::InvalidArgumentError(
        "--longest_seq bisects --seq: give one of them, not both"));
  }
  absl::StatusOr<memledger::SearchResult> result =
      longest_seq != 0 ? memledger::SearchLongestSequence(request, options, longest_seq)
                       : memledger::SearchLayouts(request, options);
  if (absl::IsResourceExhausted(result.status())) {
    std::cerr << "error: " << memledger::EscapeForMessage(result.status().message()) << "\n";
    return 3;
  }
  if (!result.ok()) return memledger::ReportError(result.status());
  const std::string json = memledger::JsonString(memledger::SearchJson(*result, options));
  if (const std::string path = absl::GetFlag(FLAGS_json_out); !path.empty()) {
    if (absl::Status s = outputs.Stage("--json_out", path, json); !s.ok()) {
      return memledger::ReportError(s);
    }
  }
  if (const std::string path = absl::GetFlag(FLAGS_chart_svg); !path.empty()) {
    if (absl::Status s =
            outputs.Stage("--chart_svg", path, memledger::SearchSvg(*result, options));
        !s.ok()) {
      return memledger::ReportError(s);
    }
  }
  if (absl::Status s = memledger::PrintToStdout(
          format == "table" ? memledger::SearchTable(*result, options, static_cast<size_t>(top))
                            : json);
      !s.ok()) {
    return memledger::ReportError(s);
  }
  if (absl::Status s = outputs.Commit(); !s.ok()) return memledger::ReportError(s);
  return 0;
}
