// The real-stack witness from C++: runs verify/witness.py (transformers 5.23.0's model or
// the reference study, torch.utils.checkpoint, torch.optim) with the pinned reference
// stack's Python, one case per variant, and returns what it measured under verify's
// bucket names, for `verify --witness=transformers`'s third column.
//
// Example:
//   absl::StatusOr<WitnessBuckets> w = RunWitness(config, variants, optimizer, where);
//   if (w.ok()) int64_t peak = w->at("peak_bytes.none");
#ifndef VERIFY_WITNESS_RUNNER_H_
#define VERIFY_WITNESS_RUNNER_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "estimator/request/parallel_spec.h"
#include "estimator/spec/config.h"

namespace memledger {

// WitnessBuckets: bucket name ("param_bytes", "saved_bytes.full", ...) -> bytes measured.
using WitnessBuckets = std::map<std::string, int64_t>;

// WitnessCommand is how to start the witness: a Python command (with the reference stack
// importable) and the path of witness.py.
struct WitnessCommand {
  std::string python;   // a program: the reference stack's interpreter or its wrapper
  std::string python_path;  // PYTHONPATH to set for it ("" to leave it alone)
  std::string script;   // verify/witness.py
};

// FindWitness is the witness as ./bazelw runs it: the interpreter in
// MEMLEDGER_REFERENCE_PYTHON with MEMLEDGER_TORCH_DIR on PYTHONPATH (or `python` when
// given, e.g. @reference_stack//:python), and witness.py in the workspace
// (BUILD_WORKSPACE_DIRECTORY, under `bazel run`) or beside the binary's runfiles.
// FailedPrecondition, naming what to do, when the reference stack is not at hand.
absl::StatusOr<WitnessCommand> FindWitness(const std::string& python, const std::string& argv0);

// RunWitness measures `config` (a decoder family, from its transformers config.json, or
// the study) under each variant (none, full, every_<k>, selective with its policy),
// non-reentrant checkpointing, and `optimizer` in its implementation. InvalidArgument for
// what the witness cannot run (plans, core_attention, master weights, megatron-gpt);
// Internal when the witness fails, with its last error line.
absl::StatusOr<WitnessBuckets> RunWitness(const WitnessCommand& witness,
                                          const ModelConfig& config,
                                          const std::vector<Variant>& variants,
                                          const OptimizerSpec& optimizer);

// RunRanksWitness measures `config` on parallel.dp Gloo ranks of the real stack
// (verify/witness_ranks.py) under torch's DistributedDataParallel with parallel.ddp's
// options, or FSDP2's fully_shard with parallel.fsdp's, each variant one case; by rank:
// param_bytes, grad_bytes, optimizer_state_bytes, communication_bytes (DDP's Reducer
// buckets) and peak_bytes.<variant>. InvalidArgument for a layout its ranks do not run
// (--tp, --pp, --zero, --ep, --micro_batches) besides RunWitness's refusals.
absl::StatusOr<std::vector<WitnessBuckets>> RunRanksWitness(const WitnessCommand& witness,
                                                            const ModelConfig& config,
                                                            const ParallelSpec& parallel,
                                                            const std::vector<Variant>& variants,
                                                            const OptimizerSpec& optimizer);

}  // namespace memledger

#endif  // VERIFY_WITNESS_RUNNER_H_
