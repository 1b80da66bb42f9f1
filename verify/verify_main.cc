// verify: runs memledger's estimator and its LibTorch runtime on one config and shows,
// bucket by bucket and variant by variant, that the prediction is exact.
// Exit status: 0 when every ratio is exactly 1 and every gradient difference is within
// tolerance; 1 when any is not (the report says which); 2 for bad input (--device=cuda
// too: the runtime measures the CPU); 3 when LibTorch cannot run the config on the CPU.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <optional>
#include <string>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/optional.h"
#include "estimator/cli/output_files.h"
#include "estimator/cli/cli_flags.h"
#include "estimator/report/report.h"
#include "estimator/spec/option_checks.h"
#include "estimator/graph/rules.h"
#include "planner/plan_report.h"
#include "verify/verify.h"
#include "verify/verify_ranks.h"
#include "verify/verify_report.h"
#include "verify/witness_runner.h"

ABSL_FLAG(bool, skip_timing, false, "Report time_s as null (much faster).");
ABSL_FLAG(double, max_memory_gib, 0,
          "Refuse configs whose predicted footprint exceeds this many GiB; 0 means half of "
          "this machine's available memory.");
ABSL_FLAG(absl::optional<double>, grad_tolerance, absl::nullopt,
          "Largest acceptable max_grad_diff: 1e-5 by default; on ranks (--dp, --tp, --pp), "
          "which sum gradients in another order than one process, 2 sqrt(n) eps: eps the "
          "compute dtype's machine epsilon, n the step's longest reduction (width, MLP "
          "width, heads x head_dim, vocabulary or tokens).");
ABSL_FLAG(int64_t, seed, 0, "Seed for the model's parameters and input.");
ABSL_FLAG(int64_t, rank_timeout_s, 300,
          "With --dp, --tp or --pp: how long the rank processes may run before they are all "
          "killed and the rank that did not finish is reported.");
// The rank processes verify starts are verify itself with this flag (runtime/distributed.h).
ABSL_FLAG(std::string, rank_worker, "",
          "Internal: run one rank of a distributed verify (DIR:RANK).");
ABSL_FLAG(std::string, rank_fault, "",
          "Testing only: RANK:exit or RANK:hang makes that rank fail, to exercise the "
          "reporting of a dead or hung rank.");
ABSL_FLAG(std::string, witness, "none",
          "transformers: also train the step with the real stack (verify/witness.py: "
          "transformers 5.23.0's AutoModelForCausalLM or the unchanged study, "
          "torch.utils.checkpoint, torch.optim) and show it as a third column; every "
          "bucket must agree. With --dp, on as many Gloo ranks under torch's DDP or (with "
          "--fsdp) FSDP2, a column per rank beside memledger's ranks (alone where they do "
          "not run the layout). none: only memledger's runtime.");
ABSL_FLAG(std::string, witness_python, "",
          "With --witness=transformers: the reference stack's Python (default: "
          "MEMLEDGER_REFERENCE_PYTHON with MEMLEDGER_TORCH_DIR, as ./bazelw sets them).");

namespace {

std::string Usage() {
  return absl::StrCat(
      "Measures the real LibTorch ", memledger::kTorchRelease,
      " (the release of the reference stack, with transformers ",
      memledger::kTransformersRelease, ") training run for each checkpointing variant and compares every memory bucket "
      "with memledger's prediction.\n\n"
      "  ./bazelw run //verify -- --skip_timing --format=table\n"
      "  ./bazelw run //verify -- --plan=plan.json  (a //planner plan, same model flags)\n\n"
      "Exit status: 0 all exact, 1 a mismatch or gradient difference, 2 bad input "
      "(--device=cuda too: memledger's runtime measures the step on the CPU; "
      "verify/gpu_check.py measures a GPU's), 3 a config LibTorch cannot run on the CPU.");
}

// GradTolerance is --grad_tolerance, or `fallback` when it is not given. An infinite
// tolerance would pass any gradient (a NaN one too), so it is no tolerance.
absl::StatusOr<double> GradTolerance(double fallback) {
  const double tolerance = absl::GetFlag(FLAGS_grad_tolerance).value_or(fallback);
  if (!(tolerance >= 0) || !std::isfinite(tolerance)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--grad_tolerance must be a finite number >= 0, got ", tolerance));
  }
  return tolerance;
}

// CheckMeasurable refuses what the runtime cannot measure: it runs the step on the CPU
// (LibTorch's CPU allocator, Gloo between ranks), so a CUDA step's prediction would be
// compared with a CPU measurement and reported as a mismatch.
absl::Status CheckMeasurable(const memledger::RunSpec& spec) {
  if (spec.config.device == memledger::Device::kCuda) {
    return absl::InvalidArgumentError(
        "--device=cuda: verify measures the step on the CPU only (memledger's runtime has "
        "no CUDA device); verify/gpu_check.py measures a GPU's step beside predict's");
  }
  return absl::OkStatus();
}

// ClaimOutputs registers the files the run reads (the witness's Python too) and claims
// the ones it writes, before the measurement: an output that is another output or an
// input is refused at once.
absl::Status ClaimOutputs(memledger::OutputFiles& outputs) {
  outputs.Protect("--witness_python", absl::GetFlag(FLAGS_witness_python));
  return memledger::ClaimOutputs(outputs,
                                 {{"--json_out", absl::GetFlag(FLAGS_json_out)},
                                  {"--timeline_svg", absl::GetFlag(FLAGS_timeline_svg)}});
}

// MaxMemoryBytes is --max_memory_gib in bytes (0: VerifyOptions' default).
absl::StatusOr<int64_t> MaxMemoryBytes() {
  return memledger::GibFlagBytes("--max_memory_gib", absl::GetFlag(FLAGS_max_memory_gib),
                                 "half the available memory");
}

// WitnessFromFlags: --witness's command (nullopt for none), or the error naming it.
absl::StatusOr<std::optional<memledger::WitnessCommand>> WitnessFromFlags(const char* argv0) {
  const std::string witness = absl::GetFlag(FLAGS_witness);
  if (witness != "none" && witness != "transformers") {
    return absl::InvalidArgumentError(
        absl::StrCat("--witness must be none or transformers, got '", witness, "'"));
  }
  if (witness == "none") return std::optional<memledger::WitnessCommand>();
  absl::StatusOr<memledger::WitnessCommand> found =
      memledger::FindWitness(absl::GetFlag(FLAGS_witness_python), argv0);
  if (!found.ok()) return found.status();
  return std::optional<memledger::WitnessCommand>(*found);
}

// VerifyOnRanks: --dp, --tp, --pp. verify starts the rank processes as itself plus
// --rank_worker; that flag makes this process one of them. With --witness=transformers
// the real stack runs on as many Gloo ranks too (torch's DDP or FSDP2), a column per
// rank; FSDP2's MixedPrecisionPolicy, which the LibTorch ranks do not run, is checked
// against it alone.
int VerifyOnRanks(const memledger::RunSpec& spec, int argc, char** argv) {
  memledger::runtime::DistributedRequest request;
  request.attention = spec.attention;
  request.variants = spec.variants;
  request.optimizer = spec.optimizer;
  request.seed = absl::GetFlag(FLAGS_seed);
  request.timeout_s = absl::GetFlag(FLAGS_rank_timeout_s);
  request.fault = absl::GetFlag(FLAGS_rank_fault);
  if (const std::string worker = absl::GetFlag(FLAGS_rank_worker); !worker.empty()) {
    return memledger::runtime::RunRankWorker(spec.config, spec.parallel, request, worker);
  }
  if (!absl::GetFlag(FLAGS_timeline_svg).empty()) {
    return memledger::ReportError(absl::InvalidArgumentError(
        "--timeline_svg draws one process's step; drop it with --dp, --tp or --pp"));
  }
  // Every file is written, or (on an error) none.
  memledger::OutputFiles outputs;
  if (absl::Status s = ClaimOutputs(outputs); !s.ok()) return memledger::ReportError(s);
  // Ranks sum gradients in another order than one process: unless the flag is given,
  // the tolerance follows the dtype and the reductions' length (RankGradTolerance).
  absl::StatusOr<double> tolerance =
      GradTolerance(memledger::RankGradTolerance(spec.config, spec.parallel));
  if (!tolerance.ok()) return memledger::ReportError(tolerance.status());
  absl::StatusOr<int64_t> max_memory_bytes = MaxMemoryBytes();
  if (!max_memory_bytes.ok()) return memledger::ReportError(max_memory_bytes.status());
  absl::StatusOr<std::optional<memledger::WitnessCommand>> witness = WitnessFromFlags(argv[0]);
  if (!witness.ok()) return memledger::ReportError(witness.status());
  absl::StatusOr<memledger::RanksVerifyReport> report =
      memledger::VerifyRanks(spec.config, spec.parallel, request, *tolerance, *max_memory_bytes,
                             std::vector<std::string>(argv, argv + argc));
  if (absl::IsUnimplemented(report.status()) && witness->has_value()) {
    // What the rank runtime does not run (FSDP2's MixedPrecisionPolicy) the real stack
    // still measures.
    report = memledger::PredictedRanksReport(spec.config, spec.parallel, request);
  }
  if (!report.ok()) return memledger::ReportError(report.status());
  if (witness->has_value()) {
    absl::StatusOr<std::vector<memledger::WitnessBuckets>> measured = memledger::RunRanksWitness(
        **witness, spec.config, spec.parallel, spec.variants, spec.optimizer);
    if (!measured.ok()) return memledger::ReportError(measured.status());
    if (absl::Status s = memledger::AddRanksWitness(*measured, &*report); !s.ok()) {
      return memledger::ReportError(s);
    }
  }
  const std::string json = memledger::JsonString(memledger::RanksVerifyJson(*report));
  if (const std::string path = absl::GetFlag(FLAGS_json_out); !path.empty()) {
    if (absl::Status s = outputs.Stage("--json_out", path, json); !s.ok()) {
      return memledger::ReportError(s);
    }
  }
  if (absl::Status s =
          memledger::PrintToStdout(spec.table ? memledger::RanksVerifyTable(*report) : json);
      !s.ok()) {
    return memledger::ReportError(s);
  }
  if (absl::Status s = outputs.Commit(); !s.ok()) return memledger::ReportError(s);
  return report->Passed() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string usage = Usage();
  memledger::ParseCommandLineOrExit(argc, argv, usage.c_str());
  absl::StatusOr<memledger::RunSpec> spec = memledger::RunSpecFromFlags();
  if (!spec.ok()) return memledger::ReportError(spec.status());
  if (absl::Status s = CheckMeasurable(*spec); !s.ok()) return memledger::ReportError(s);
  if (spec->parallel.Distributed() || spec->config.shard.tp > 1) {
    return VerifyOnRanks(*spec, argc, argv);
  }
  if (spec->parallel.micro_batches > 1) {
    return memledger::ReportError(absl::InvalidArgumentError(absl::StrCat(
        "--micro_batches ", spec->parallel.micro_batches,
        " without --dp or --pp: one process's gradient accumulation is predicted, not "
        "measured yet")));
  }
  absl::StatusOr<int64_t> max_memory_bytes = MaxMemoryBytes();
  if (!max_memory_bytes.ok()) return memledger::ReportError(max_memory_bytes.status());
  absl::StatusOr<double> tolerance = GradTolerance(1e-5);
  if (!tolerance.ok()) return memledger::ReportError(tolerance.status());
  // Every file is written, or (on an error) none.
  memledger::OutputFiles outputs;
  if (absl::Status s = ClaimOutputs(outputs); !s.ok()) return memledger::ReportError(s);

  memledger::VerifyOptions options;
  options.attention = spec->attention;
  options.variants = spec->variants;
  options.optimizer = spec->optimizer;
  options.grad_tolerance = *tolerance;
  options.max_memory_bytes = *max_memory_bytes;
  options.run.skip_timing = absl::GetFlag(FLAGS_skip_timing);
  options.run.seed = absl::GetFlag(FLAGS_seed);
  // Progress only once the run has taken a second: quick runs stay quiet.
  const auto start = std::chrono::steady_clock::now();
  options.run.progress = [start](absl::string_view what) {
    if (std::chrono::steady_clock::now() - start >= std::chrono::seconds(1)) {
      std::cerr << "verify: measuring " << what << "...\n";
    }
  };

  absl::StatusOr<std::optional<memledger::WitnessCommand>> witness = WitnessFromFlags(argv[0]);
  if (!witness.ok()) return memledger::ReportError(witness.status());
  const std::optional<memledger::WitnessCommand>& witness_command = *witness;

  const std::string svg_path = absl::GetFlag(FLAGS_timeline_svg);
  options.timeline = !svg_path.empty();
  absl::StatusOr<memledger::VerifyReport> report = memledger::Verify(spec->config, options);
  if (!report.ok()) return memledger::ReportError(report.status());
  if (witness_command.has_value()) {
    options.run.progress("the real stack (transformers)");
    absl::StatusOr<memledger::WitnessBuckets> measured = memledger::RunWitness(
        *witness_command, spec->config, options.variants, options.optimizer);
    if (!measured.ok()) return memledger::ReportError(measured.status());
    memledger::AddWitness(*measured, &*report);
  }
  if (!svg_path.empty()) {
    absl::StatusOr<std::string> svg = memledger::VerifyTimelineSvg(*report);
    if (!svg.ok()) return memledger::ReportError(svg.status());
    if (absl::Status s = outputs.Stage("--timeline_svg", svg_path, *svg); !s.ok()) {
      return memledger::ReportError(s);
    }
  }

  const std::string json = memledger::JsonString(memledger::VerifyJson(*report));
  if (const std::string path = absl::GetFlag(FLAGS_json_out); !path.empty()) {
    if (absl::Status s = outputs.Stage("--json_out", path, json); !s.ok()) {
      return memledger::ReportError(s);
    }
  }
  if (absl::Status s =
          memledger::PrintToStdout(spec->table ? memledger::VerifyTable(*report) : json);
      !s.ok()) {
    return memledger::ReportError(s);
  }
  if (absl::Status s = outputs.Commit(); !s.ok()) return memledger::ReportError(s);
  return report->Passed() ? 0 : 1;
}
