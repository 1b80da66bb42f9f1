// DataParallelProgram: how a data-parallel rank runs its step, as a program the step
// simulation (estimator/step/simulation.h) calls at each unit boundary: a unit (the
// embeddings, a decoder layer, the head) begins and ends its forward and its backward,
// a parameter's gradient is accumulated, the backward returns, the optimizer steps.
// Each strategy says there what the rank gathers, reduces, keeps and frees, mirrored
// from the code that runs it (each file cites its lines):
//   one rank           nothing: every .grad stepped (data_parallel_program.cc);
//   DDP                torch's Reducer hooks (data_parallel_ddp.cc);
//   replicated ranks   beside expert parallelism: two buckets at the step's end
//                      (data_parallel_zero.cc);
//   ZeRO 1, 2          one flat bucket at the step's end, the rank's shard stepped
//                      (data_parallel_zero.cc);
//   ZeRO 3             units gathered and reduced one by one (data_parallel_zero.cc);
//   FSDP2              torch's fully_shard (data_parallel_fsdp2.cc).
// The simulation does not know which runs: it asks the program, and
// MakeDataParallelProgram makes the one DataParallelOf (estimator/request/parallel_spec.h)
// names, a line per strategy.
#ifndef ESTIMATOR_STEP_DATA_PARALLEL_PROGRAM_H_
#define ESTIMATOR_STEP_DATA_PARALLEL_PROGRAM_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "estimator/graph/block_graph.h"
#include "estimator/request/parallel_spec.h"
#include "estimator/spec/config.h"
#include "estimator/step/step_ledger.h"

namespace memledger::liveness_internal {

// ParameterKey names a parameter's .grad: its segment instance and tensor (a tied
// weight's is its owner's, the prologue's).
using ParameterKey = std::pair<int64_t, int>;

class Simulation;

// ReducesAtStepEnd: the rank's gradients are reduced after its last backward, from
// .grads its backward left (one rank, replicated ranks, ZeRO 1 and 2), so its step's end
// is a stretch of its own (StepSimulator::ReductionStretch).
bool ReducesAtStepEnd(DataParallel program);
// ComposesFromPasses: a rank's step composes from its passes replayed short and its
// own reduction (ComposeRankPeak): not DDP, whose reduction runs in the last backward,
// nor FSDP2, whose units hand buffers on to the next.
bool ComposesFromPasses(DataParallel program);

class DataParallelProgram {
 public:
  explicit DataParallelProgram(Simulation& simulation) : simulation_(simulation) {}
  virtual ~DataParallelProgram() = default;
  DataParallelProgram(const DataParallelProgram&) = delete;
  DataParallelProgram& operator=(const DataParallelProgram&) = delete;

  // SetUp: the model's units, from its graphs, before a step or its end alone.
  virtual void SetUp(const ModelGraphs& /*graphs*/) {}

  // The forward: `segment` (Where::kPrologue, a layer, Where::kHead) begins and ends.
  virtual void ForwardBegins(int64_t /*segment*/) {}
  virtual void ForwardEnds(int64_t /*segment*/) {}

  // LastBackward: the backward about to run (true) is its chunk's last micro-batch's,
  // the one whose gradients are reduced (DDP's no_sync lifts); false once it has run.
  virtual void LastBackward(bool /*last*/) {}
  // The backward of a micro-batch: it begins (`last_unit` is its chunk's last: the
  // head, or its last layer); a unit's backward begins (Where::kHead for the head, before
  // the loss's seed) and has passed (its input's gradient is made), `previous` being the
  // unit before it (none for the chunk's first).
  virtual void BackwardBegins(int64_t /*last_unit*/) {}
  virtual void UnitBackwardBegins(int64_t /*unit*/, std::optional<int64_t> /*previous*/) {}
  virtual void UnitBackwardPassed(int64_t /*unit*/, std::optional<int64_t> /*previous*/) {}
  // The backward returns: before the graph task ends (the engine's final callbacks)
  // and after (the seed freed). `head`: the chunk ran the head (loss.backward()); else
  // the caller's output gradient was the seed.
  virtual void GraphTaskEnding(bool /*head*/) {}
  virtual void GraphTaskEnded(bool /*head*/) {}
  // GradientAccumulated: a parameter's AccumulateGrad has run (its .grad in grads).
  virtual void GradientAccumulated(const ParameterKey& /*parameter*/, DType /*dtype*/) {}
  // GradientsPersist: the .grads live from one micro-batch's backward to the next (made
  // once, added into), rather than reduced and freed unit by unit.
  virtual bool GradientsPersist() const { return true; }

  // ReduceAndStep: the step's end, from what the backward left: the reduction and the
  // optimizer's step.
  virtual absl::Status ReduceAndStep() = 0;
  // PrepareStepEnd: for the step's end alone (Simulation::RunReduction), what the
  // backward would have left beside the .grads; false where it leaves no .grads.
  virtual bool PrepareStepEnd() { return true; }

  // What the schedule asks:
  // SyncsInLastBackward: the reduction runs in each chunk's last backward, so one more
  // micro-batch is replayed (a backward without it follows the first).
  virtual bool SyncsInLastBackward() const { return false; }
  // StepIsOneProcess: the optimizer's step is one process's, every parameter's .grad
  // stepped with nothing reduced around it (one rank, DDP): its per-layer bytes compose.
  virtual bool StepIsOneProcess() const { return false; }
  // StepsFp32: the optimizer steps fp32 shards of a lower-precision compute copy.
  virtual bool StepsFp32() const { return false; }
  // ChunkShard: what a pipeline chunk's passes depend on beyond its shape (the rank's
  // shard, ZeRO 3's); nullopt where its passes cannot be shared with another chunk.
  virtual std::optional<int64_t> ChunkShard(size_t /*chunks*/) const { return 0; }

 protected:
  // The simulation's state a program works on.
  Memory& memory();
  const Memory& memory() const;
  absl::flat_hash_map<ParameterKey, int>& grads();
  const ModelConfig& config() const;
  const ParallelSpec& parallel() const;
  int KindOf(int64_t layer) const;
  ParameterKey KeyOf(const BlockGraph& graph, int64_t segment, int tensor) const;
  // The rank's model chunks: as replayed, and the real ones (a short replay's).
  const std::vector<StageRange>& chunks() const;
  const std::vector<StageRange>& model_chunks() const;
  const std::vector<ParameterKey>& parameter_order() const;
  const std::vector<bool>& expert_shard() const;
  // SetOp: what the ledger names as running: `activity` of `segment`.
  void SetOp(int64_t segment, Where::Activity activity);
  // OptimizerStep: torch.optim's step on tensors of these element counts.
  absl::Status OptimizerStep(const std::vector<int64_t>& numels);
  // GradientNumels: each parameter's .grad's elements, in the optimizer's order.
  std::vector<int64_t> GradientNumels();

 private:
  Simulation& simulation_;
};

// MakeDataParallelProgram: the program DataParallelOf chooses, one line per strategy.
std::unique_ptr<DataParallelProgram> MakeDataParallelProgram(Simulation& simulation,
                                                             DataParallel data_parallel);
// The strategies' own files make them.
std::unique_ptr<DataParallelProgram> MakeOneRankProgram(Simulation& simulation);
std::unique_ptr<DataParallelProgram> MakeDdpProgram(Simulation& simulation);
std::unique_ptr<DataParallelProgram> MakeReplicatedProgram(Simulation& simulation);
std::unique_ptr<DataParallelProgram> MakeZeroProgram(Simulation& simulation, int64_t stage);
std::unique_ptr<DataParallelProgram> MakeZero3Program(Simulation& simulation);
std::unique_ptr<DataParallelProgram> MakeFsdp2Program(Simulation& simulation);

}  // namespace memledger::liveness_internal

#endif  // ESTIMATOR_STEP_DATA_PARALLEL_PROGRAM_H_
