// predict: memledger's estimator on the command line. Prints every memory bucket of
// training the model for each checkpointing variant, as JSON (default) or a table.
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "estimator/atomic_file.h"
#include "estimator/cli_flags.h"
#include "estimator/predict.h"
#include "estimator/report.h"
#include "estimator/rules.h"

ABSL_FLAG(bool, explain, false,
          "Also print the per-op breakdown: every kept storage of each kind of block.");

namespace {

std::string Usage() {
  return absl::StrCat(
      "Predicts the training memory of a stack of pre-LN Transformer blocks: parameters, "
      "gradients, AdamW state and activations saved for backward under each "
      "checkpointing variant, byte for byte as LibTorch ", memledger::kTorchRelease,
      " keeps them.\n\n"
      "  ./bazelw run //:predict -- --layers=96 --width=12288 --heads=96 --batch=1 "
      "--seq=2048 --format=table\n\n"
      "Exit status: 0 on success, 2 for bad input.");
}

}  // namespace

int main(int argc, char** argv) {
  const std::string usage = Usage();
  memledger::ParseCommandLineOrExit(argc, argv, usage.c_str());
  absl::StatusOr<memledger::RunSpec> spec = memledger::RunSpecFromFlags();
  if (!spec.ok()) return memledger::ReportError(spec.status());

  memledger::PredictOptions options;
  options.attention = spec->attention;
  options.variants = spec->variants;
  options.optimizer = spec->optimizer;
  options.breakdown = absl::GetFlag(FLAGS_explain);
  absl::StatusOr<memledger::Prediction> prediction = memledger::Predict(spec->config, options);
  if (!prediction.ok()) return memledger::ReportError(prediction.status());

  const std::string json = memledger::JsonString(memledger::PredictionJson(*prediction));
  if (const std::string path = absl::GetFlag(FLAGS_json_out); !path.empty()) {
    if (absl::Status s = memledger::WriteFileAtomically(path, json); !s.ok()) {
      return memledger::ReportError(s);
    }
  }
  if (spec->table) {
    std::cout << memledger::PredictionTable(*prediction);
    if (options.breakdown) std::cout << "\n" << memledger::BreakdownText(*prediction);
  } else {
    std::cout << json;
  }
  return 0;
}
