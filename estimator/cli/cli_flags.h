// The model and variant flags shared by the predict and verify command lines, and the
// conversion of their values into a config and variants with one-line errors.
#ifndef ESTIMATOR_CLI_CLI_FLAGS_H_
#define ESTIMATOR_CLI_CLI_FLAGS_H_

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "estimator/cli/output_files.h"
#include "estimator/spec/config.h"
#include "estimator/request/run_request.h"

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(std::optional<int64_t>, layers);
ABSL_DECLARE_FLAG(std::optional<int64_t>, width);
ABSL_DECLARE_FLAG(std::optional<int64_t>, heads);
ABSL_DECLARE_FLAG(std::optional<int64_t>, kv_heads);
ABSL_DECLARE_FLAG(std::optional<int64_t>, head_dim);
ABSL_DECLARE_FLAG(std::optional<int64_t>, intermediate);
ABSL_DECLARE_FLAG(std::optional<int64_t>, vocab);
ABSL_DECLARE_FLAG(int64_t, batch);
ABSL_DECLARE_FLAG(int64_t, seq);
ABSL_DECLARE_FLAG(std::string, variants);
ABSL_DECLARE_FLAG(int64_t, every);
ABSL_DECLARE_FLAG(std::string, policy);
ABSL_DECLARE_FLAG(std::string, attention);
ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(std::string, amp);
ABSL_DECLARE_FLAG(std::string, optimizer);
ABSL_DECLARE_FLAG(std::string, optimizer_impl);
ABSL_DECLARE_FLAG(double, momentum);
ABSL_DECLARE_FLAG(std::string, checkpoint_impl);
ABSL_DECLARE_FLAG(std::string, freeze);
ABSL_DECLARE_FLAG(int64_t, lora_rank);
ABSL_DECLARE_FLAG(double, lora_alpha);
ABSL_DECLARE_FLAG(double, lora_dropout);
ABSL_DECLARE_FLAG(std::string, lora_targets);
ABSL_DECLARE_FLAG(bool, use_dora);
ABSL_DECLARE_FLAG(bool, master_weights);
ABSL_DECLARE_FLAG(int64_t, tp);
ABSL_DECLARE_FLAG(bool, sp);
ABSL_DECLARE_FLAG(std::string, format);
ABSL_DECLARE_FLAG(std::string, json_out);
ABSL_DECLARE_FLAG(std::string, timeline_svg);

namespace memledger {

// RunRequestFromFlags collects the shared flags as a request, unvalidated.
RunRequest RunRequestFromFlags();

// RunSpecFromFlags validates every shared flag; errors name the flag. ValidRunFromFlags
// keeps the proof (ValidRun) for a caller that predicts without changing the run.
absl::StatusOr<RunSpec> RunSpecFromFlags();
absl::StatusOr<ValidRun> ValidRunFromFlags();

// ClaimOutputs registers with `outputs` the files the shared flags make the run read
// (--model's config.json, --routing's and --plan's files), then claims each output file
// given (an empty path is a flag not given), before the run's work: an output that is
// another output or an input is refused at once (OutputFiles::Claim).
absl::Status ClaimOutputs(OutputFiles& outputs,
                          std::initializer_list<std::pair<const char*, std::string>> files);

// ReportError prints "error: <message>" on stderr, the message's control characters and
// invalid UTF-8 written out (EscapeForMessage) so that it stays one line, and returns
// the exit status: 2 for
// the user's input (InvalidArgument, OutOfRange, ResourceExhausted), 3 for a config
// LibTorch cannot run on this machine (Unimplemented: an op without a CPU kernel in that
// dtype), else 1.
int ReportError(const absl::Status& status);

// ParseCommandLineOrExit parses flags with `usage` as the help text; it exits with
// status 2 and a one-line message for an unknown flag, a value that does not parse or a
// positional argument. --help (-h, --helpshort) prints `usage` and every flag the
// program defines, grouped (model, input, precision, optimizer, checkpointing,
// parallelism, device, verification, output), on stdout, and exits 0; --helpfull adds
// Abseil's own flags. Where standard output cannot take the help (or --version), it
// exits 2 with one line instead. It ignores SIGXFSZ and SIGPIPE for the rest of the run
// (and the processes it starts): a file-size limit or a closed pipe fails the write,
// which the output writer reports, instead of killing the process mid-file. With
// MEMLEDGER_COUNT_VALIDATIONS set in the environment, the program says on stderr at exit
// how many times it validated a config and a layout (ValidateConfigCalls,
// ValidateParallelCalls).
void ParseCommandLineOrExit(int argc, char** argv, const char* usage);

}  // namespace memledger

#endif  // ESTIMATOR_CLI_CLI_FLAGS_H_
