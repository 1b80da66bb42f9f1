// planner: the checkpoint plan with the least recompute whose predicted step peak fits
// a memory budget, per layer, with the frontier of budgets and overheads.
#include <cstdint>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "estimator/spec/option_checks.h"
#include "estimator/cli/output_files.h"
#include "estimator/cli/cli_flags.h"
#include "estimator/cli/message_escape.h"
#include "estimator/report/report.h"
#include "estimator/report/units.h"
#include "planner/frontier_svg.h"
#include "planner/plan_report.h"
#include "planner/plan_run.h"

ABSL_FLAG(double, budget_gib, 0,
          "The memory budget in GiB (2^30 bytes) the step's predicted peak must fit; "
          "required. With --device=cuda it holds what the device needs under the plan: "
          "the caching allocator's reserved peak (max_memory_reserved) and the CUDA "
          "context outside it.");
ABSL_FLAG(int32_t, frontier_points, 9,
          "Budgets in the frontier, evenly from the smallest any plan fits to the peak "
          "without checkpointing; 0 for none.");
ABSL_FLAG(std::string, plan_out, "",
          "Also write the JSON report to this file, for verify --plan=FILE.");
ABSL_FLAG(double, flops_per_second, 0,
          "This machine's throughput, to predict step times (./bazelw run "
          "//runtime:runtime_benchmark prints it, measured once); 0: overheads only.");
ABSL_FLAG(std::string, frontier_svg, "",
          "Also draw the frontier (budget -> least overhead, the fixed variants, the plan) "
          "as an SVG chart to this file.");
ABSL_FLAG(int32_t, cpu_threads, 1,
          "LibTorch's intra-op threads on the CPU, which size some kernels' workspaces in "
          "the step's peak (a few KiB).");

namespace {

constexpr char kUsage[] =
    "Finds the checkpoint plan with the least recompute whose predicted training-step "
    "peak fits --budget_gib: each layer not checkpointed, checkpointed, or selective with "
    "any set of op kinds saved (matmul, attention, layer_norm, gelu, silu). Exact, by a "
    "dynamic program over layers on the step simulation's stretches.\n\n"
    "  ./bazelw run //planner -- --model=llama-3-8b --batch=1 --seq=8192 "
    "--optimizer=sgd --budget_gib=80 --format=table\n\n"
    "With --dp (ZeRO 0-2) it plans one data-parallel rank. With --pp or --micro_batches "
    "each pipeline stage gets its own plan, searched for stage by stage and checked by "
    "replaying every stage's schedule: the budget holds on every stage (no frontier).\n"
    "  ./bazelw run //planner -- --model=llama-3-8b --batch=1 --seq=8192 --amp=bf16 "
    "--tp=2 --dp=8 --zero=1 --pp=4 --micro_batches=8 --budget_gib=40 --format=table\n"
    "With --device=cuda the budget holds the allocator's reserved peak and the CUDA "
    "context.\n\n"
    "Recompute is counted in FLOPs; the overhead is (step + recompute) / step.\n"
    "Exit status: 0 on success, 2 for bad input (an output file that cannot be written, "
    "or that is another output or an input, and standard output that cannot be written, "
    "a closed pipe too: then no file is written), 3 when no plan fits (the message gives "
    "the smallest budget that would).";

}  // namespace

int main(int argc, char** argv) {
  memledger::ParseCommandLineOrExit(argc, argv, kUsage);
  // The request validated once, here: the plan takes the proof (RunPlanner).
  absl::StatusOr<memledger::ValidRun> run = memledger::ValidRunFromFlags();
  if (!run.ok()) return memledger::ReportError(run.status());
  const memledger::RunSpec* spec = &run->spec();
  if (spec->format != "json" && spec->format != "table") {
    return memledger::ReportError(absl::InvalidArgumentError(
        absl::StrCat("--format must be json or table, got '", spec->format, "'")));
  }
  const absl::StatusOr<int64_t> budget =
      memledger::BudgetBytes(absl::GetFlag(FLAGS_budget_gib));
  if (!budget.ok()) return memledger::ReportError(budget.status());
  // Every file is written, or (on an error) none; none replaces another or an input.
  memledger::OutputFiles outputs;
  if (absl::Status s = memledger::ClaimOutputs(
          outputs, {{"--json_out", absl::GetFlag(FLAGS_json_out)},
                    {"--plan_out", absl::GetFlag(FLAGS_plan_out)},
                    {"--frontier_svg", absl::GetFlag(FLAGS_frontier_svg)},
                    {"--timeline_svg", absl::GetFlag(FLAGS_timeline_svg)}});
      !s.ok()) {
    return memledger::ReportError(s);
  }
  memledger::PlanRunOptions options;
  options.budget_bytes = *budget;
  options.frontier_points = absl::GetFlag(FLAGS_frontier_points);
  options.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  options.flops_per_second = absl::GetFlag(FLAGS_flops_per_second);
  const std::string timeline_path = absl::GetFlag(FLAGS_timeline_svg);
  options.timeline = !timeline_path.empty();
  absl::StatusOr<memledger::PlanReport> planned = memledger::RunPlanner(*run, options);
  if (absl::IsResourceExhausted(planned.status())) {
    std::cerr << "error: " << memledger::EscapeForMessage(planned.status().message()) << "\n";
    return 3;
  }
  if (!planned.ok()) return memledger::ReportError(planned.status());
  const memledger::PlanReport& report = *planned;

  if (const std::string path = absl::GetFlag(FLAGS_frontier_svg); !path.empty()) {
    if (report.frontier.size() < 2) {
      return memledger::ReportError(
          absl::InvalidArgumentError("--frontier_svg needs --frontier_points >= 2"));
    }
    if (absl::Status s = outputs.Stage(
            "--frontier_svg", path, memledger::FrontierSvg(memledger::FrontierTitle(*spec), report));
        !s.ok()) {
      return memledger::ReportError(s);
    }
  }
  if (!timeline_path.empty()) {
    absl::StatusOr<std::string> svg = memledger::PlanTimelineSvg(*spec, report);
    if (!svg.ok()) return memledger::ReportError(svg.status());
    if (absl::Status s = outputs.Stage("--timeline_svg", timeline_path, *svg); !s.ok()) {
      return memledger::ReportError(s);
    }
  }
  const std::string json = memledger::JsonString(memledger::PlanReportJson(report));
  for (const auto& [flag, path] :
       {std::pair<const char*, std::string>{"--plan_out", absl::GetFlag(FLAGS_plan_out)},
        {"--json_out", absl::GetFlag(FLAGS_json_out)}}) {
    if (path.empty()) continue;
    if (absl::Status s = outputs.Stage(flag, path, json); !s.ok()) {
      return memledger::ReportError(s);
    }
  }
  if (absl::Status s =
          memledger::PrintToStdout(spec->table ? memledger::PlanReportTable(report) : json);
      !s.ok()) {
    return memledger::ReportError(s);
  }
  if (absl::Status s = outputs.Commit(); !s.ok()) return memledger::ReportError(s);
  return 0;
}
