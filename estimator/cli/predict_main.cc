// predict: memledger's estimator on the command line. Prints every memory bucket of
// training the model for each checkpointing variant, as JSON (default) or a table.
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "estimator/spec/option_checks.h"
#include "estimator/graph/family.h"
#include "estimator/request/parallel_spec.h"
#include "estimator/cli/output_files.h"
#include "estimator/cli/cli_flags.h"
#include "estimator/report/memory_snapshot.h"
#include "estimator/predict/predict.h"
#include "estimator/predict/ranks.h"
#include "estimator/report/report.h"
#include "estimator/graph/rules.h"
#include "estimator/predict/sweep.h"
#include "estimator/spec/input_file.h"
#include "estimator/request/model_presets.h"
#include "estimator/report/timeline_svg.h"
#include "estimator/report/units.h"

ABSL_FLAG(bool, explain, false,
          "Also print the per-op breakdown: every kept storage of each kind of block.");
ABSL_FLAG(std::string, sweep, "",
          "A grid of runs, e.g. batch:1..64,seq:1024..32768 (lo..hi doubles, or v1|v2|v3; "
          "axes batch, seq, layers), printed one row per point and variant as --format=csv "
          "(default) or jsonl.");
ABSL_FLAG(int32_t, cpu_threads, 1,
          "LibTorch's intra-op threads on the CPU, which size some kernels' workspaces in "
          "the step's peak (a few KiB).");
ABSL_FLAG(std::string, snapshot_out, "",
          "Also write the step of the one variant --variants names as a PyTorch memory "
          "snapshot (torch.cuda.memory._snapshot()'s pickle) to this path, for "
          "torch.cuda._memory_viz and https://pytorch.org/memory_viz.");
ABSL_FLAG(bool, config_keys, false,
          "With --model=config.json: print, as JSON, which of its keys memledger read, which "
          "it does not read and why (they change no memory), and any it does not know; no "
          "prediction.");
ABSL_FLAG(double, budget_gib, 0,
          "With --sweep: the memory budget in GiB; each row says whether parameters, "
          "gradients, optimizer state and saved activations fit in it.");

namespace {

std::string Usage() {
  return absl::StrCat(
      "Predicts the training memory of a stack of pre-LN Transformer blocks: parameters, "
      "gradients, AdamW state and activations saved for backward under each "
      "checkpointing variant, byte for byte as torch ", memledger::kTorchRelease,
      " and transformers ", memledger::kTransformersRelease, " keep them, and the whole training step's peak (where, and by category; "
      "--timeline_svg draws it).\n\n"
      "  ./bazelw run //:predict -- --layers=96 --width=12288 --heads=96 --batch=1 "
      "--seq=2048 --format=table\n\n"
      "Exit status: 0 on success; 2 for bad input (an output file that cannot be written "
      "too, or that is another output or an input, and then no file is written; standard "
      "output that cannot be written, a closed pipe too); 3 when the step asked for is not simulated "
      "(--timeline_svg, --snapshot_out; the message says why).");
}

// Output stages `json` for --json_out beside what `outputs` holds, prints `printed`, and
// writes every file: all of them, or (on an error) none.
int Output(memledger::OutputFiles& outputs, const std::string& json, const std::string& printed) {
  if (const std::string path = absl::GetFlag(FLAGS_json_out); !path.empty()) {
    if (absl::Status s = outputs.Stage("--json_out", path, json); !s.ok()) {
      return memledger::ReportError(s);
    }
  }
  if (absl::Status s = memledger::PrintToStdout(printed); !s.ok()) {
    return memledger::ReportError(s);
  }
  if (absl::Status s = outputs.Commit(); !s.ok()) return memledger::ReportError(s);
  return 0;
}

// RunSweep prints the grid's rows (csv unless --format=jsonl) to stdout, and to
// --json_out atomically when given.
int RunSweep(memledger::OutputFiles& outputs, const memledger::RunSpec& spec,
             const std::string& text, int64_t budget_bytes) {
  if (spec.format == "table") {
    return memledger::ReportError(
        absl::InvalidArgumentError("--sweep prints --format=csv or --format=jsonl"));
  }
  if (spec.parallel.Distributed()) {
    return memledger::ReportError(
        absl::InvalidArgumentError("--sweep does not take --dp or --pp yet"));
  }
  absl::StatusOr<memledger::SweepGrid> grid = memledger::ParseSweep(text);
  if (!grid.ok()) return memledger::ReportError(grid.status());
  // CSV unless --format=jsonl (the default json means csv here).
  const auto format = spec.format == "jsonl" ? memledger::SweepFormat::kJsonLines
                                             : memledger::SweepFormat::kCsv;
  absl::StatusOr<std::string> rows = memledger::RunSweep(
      memledger::RunRequestFromFlags(), *grid, budget_bytes, format);
  if (!rows.ok()) return memledger::ReportError(rows.status());
  return Output(outputs, *rows, *rows);
}

// PrintConfigKeys is --config_keys: the report of what --model's config.json reader did
// with each key (ConfigKeysJson).
int PrintConfigKeys(memledger::OutputFiles& outputs) {
  const std::string path = absl::GetFlag(FLAGS_model);
  absl::StatusOr<std::string> text =
      memledger::ReadInputFile(path, "--model", memledger::kMaxJsonBytes);
  if (!text.ok()) {
    return memledger::ReportError(
        absl::IsNotFound(text.status())
            ? absl::InvalidArgumentError(absl::StrCat(
                  "--config_keys reports on a config.json: '", path, "' is not a readable file"))
            : absl::InvalidArgumentError(text.status().message()));
  }
  absl::StatusOr<std::string> report = memledger::ConfigKeysJson(*text, path);
  if (!report.ok()) return memledger::ReportError(report.status());
  return Output(outputs, *report, *report);
}

// StageTimelineSvg draws each variant's predicted step timeline for `path`;
// Unimplemented, and no file, where a variant's step is not simulated.
absl::Status StageTimelineSvg(memledger::OutputFiles& outputs, const std::string& path,
                              const std::string& title,
                              const std::vector<memledger::VariantPrediction>& variants) {
  absl::StatusOr<std::string> svg = memledger::PredictedTimelineSvg(title, variants);
  if (!svg.ok()) {
    return absl::Status(svg.status().code(),
                        absl::StrCat("--timeline_svg: ", svg.status().message()));
  }
  return outputs.Stage("--timeline_svg", path, *svg);
}

// PrintRanks reports a distributed run (--dp, --pp): the most loaded rank's buckets and
// every kind of rank.
int PrintRanks(memledger::OutputFiles& outputs, const memledger::ValidRun& run,
               const memledger::PredictOptions& options, const std::string& svg_path) {
  const memledger::RunSpec& spec = run.spec();
  absl::StatusOr<memledger::DistributedPrediction> p =
      memledger::PredictValidDistributed(run.config(), spec.parallel, options);
  if (!p.ok()) return memledger::ReportError(p.status());
  if (!svg_path.empty()) {
    // The most loaded rank's step.
    absl::StatusOr<std::string> svg = memledger::RankTimelineSvg(p->ranks.kinds.front());
    if (!svg.ok()) {
      return memledger::ReportError(absl::Status(
          svg.status().code(), absl::StrCat("--timeline_svg: ", svg.status().message())));
    }
    if (absl::Status s = outputs.Stage("--timeline_svg", svg_path, *svg); !s.ok()) {
      return memledger::ReportError(s);
    }
  }
  const std::string json = memledger::JsonString(memledger::RanksJson(p->whole, p->ranks));
  return Output(outputs, json, spec.table ? memledger::RanksTable(p->whole, p->ranks) : json);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string usage = Usage();
  memledger::ParseCommandLineOrExit(argc, argv, usage.c_str());
  // Every file is written, or (on an error) none.
  memledger::OutputFiles outputs;
  // An output that is another output or an input is refused before the work.
  if (absl::Status s = memledger::ClaimOutputs(
          outputs, {{"--json_out", absl::GetFlag(FLAGS_json_out)},
                    {"--timeline_svg", absl::GetFlag(FLAGS_timeline_svg)},
                    {"--snapshot_out", absl::GetFlag(FLAGS_snapshot_out)}});
      !s.ok()) {
    return memledger::ReportError(s);
  }
  if (absl::GetFlag(FLAGS_config_keys)) return PrintConfigKeys(outputs);
  // The request is validated here, once; what predicts from it takes the proof.
  absl::StatusOr<memledger::ValidRun> run = memledger::ValidRunFromFlags();
  if (!run.ok()) return memledger::ReportError(run.status());
  const memledger::RunSpec* spec = &run->spec();
  const std::string sweep = absl::GetFlag(FLAGS_sweep);
  const double budget_gib = absl::GetFlag(FLAGS_budget_gib);
  // 0: no budget column; otherwise whole bytes that fit int64.
  const absl::StatusOr<int64_t> budget_bytes =
      memledger::BudgetBytes(budget_gib, /*zero_is_none=*/true);
  if (!budget_bytes.ok()) return memledger::ReportError(budget_bytes.status());
  if (!sweep.empty()) return RunSweep(outputs, *spec, sweep, *budget_bytes);
  if (spec->format == "csv" || spec->format == "jsonl" || budget_gib > 0) {
    return memledger::ReportError(absl::InvalidArgumentError(
        "--format=csv, --format=jsonl and --budget_gib go with --sweep"));
  }

  memledger::PredictOptions options;
  options.attention = spec->attention;
  options.variants = spec->variants;
  options.optimizer = spec->optimizer;
  options.breakdown = absl::GetFlag(FLAGS_explain);
  options.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  if (absl::Status s = memledger::CheckCpuThreads(options.cpu_threads); !s.ok()) {
    return memledger::ReportError(s);
  }
  const std::string svg_path = absl::GetFlag(FLAGS_timeline_svg);
  const std::string snapshot_path = absl::GetFlag(FLAGS_snapshot_out);
  options.timeline = !svg_path.empty() || !snapshot_path.empty();
  if (!snapshot_path.empty() && (spec->parallel.Accumulates() || options.variants.size() != 1)) {
    return memledger::ReportError(absl::InvalidArgumentError(
        "--snapshot_out writes one process's step of one variant: give --variants one "
        "name, without --dp or --pp"));
  }
  // Gradient accumulation (--micro_batches without --dp or --pp) is one rank's step too.
  if (spec->parallel.Accumulates()) return PrintRanks(outputs, *run, options, svg_path);
  absl::StatusOr<memledger::Prediction> prediction =
      memledger::PredictValid(run->config(), options);
  if (!prediction.ok()) return memledger::ReportError(prediction.status());
  if (!snapshot_path.empty()) {
    const memledger::VariantPrediction& v = prediction->variants.front();
    if (v.timeline == nullptr) {
      return memledger::ReportError(absl::UnimplementedError(
          absl::StrCat("--snapshot_out: no step simulation: ", v.peak_unavailable)));
    }
    absl::StatusOr<std::string> pickle = memledger::MemorySnapshotPickle(*v.timeline);
    if (!pickle.ok()) return memledger::ReportError(pickle.status());
    if (absl::Status s = outputs.Stage("--snapshot_out", snapshot_path, *pickle); !s.ok()) {
      return memledger::ReportError(s);
    }
  }

  if (!svg_path.empty()) {
    if (absl::Status s = StageTimelineSvg(
            outputs, svg_path,
            memledger::PredictedStepTitle(spec->config.device), prediction->variants);
        !s.ok()) {
      return memledger::ReportError(s);
    }
  }
  const std::string json = memledger::JsonString(memledger::PredictionJson(*prediction));
  std::string table;
  if (spec->table) {
    table = memledger::PredictionTable(*prediction);
    if (options.breakdown) table += "\n" + memledger::BreakdownText(*prediction);
  }
  return Output(outputs, json, spec->table ? table : json);
}
