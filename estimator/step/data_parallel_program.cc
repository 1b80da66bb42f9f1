// The data-parallel programs' registry, what each shares, and one rank's.
#include "estimator/step/data_parallel_program.h"

#include <memory>
#include <vector>

#include "estimator/step/simulation.h"

namespace memledger::liveness_internal {

bool ReducesAtStepEnd(DataParallel program) {
  return program == DataParallel::kOneRank || program == DataParallel::kReplicated ||
         program == DataParallel::kZero1 || program == DataParallel::kZero2;
}

bool ComposesFromPasses(DataParallel program) {
  return program != DataParallel::kDdp && program != DataParallel::kFsdp2;
}

std::unique_ptr<DataParallelProgram> MakeDataParallelProgram(Simulation& simulation,
                                                             DataParallel data_parallel) {
  switch (data_parallel) {
    case DataParallel::kOneRank: return MakeOneRankProgram(simulation);
    case DataParallel::kDdp: return MakeDdpProgram(simulation);
    case DataParallel::kReplicated: return MakeReplicatedProgram(simulation);
    case DataParallel::kZero1: return MakeZeroProgram(simulation, 1);
    case DataParallel::kZero2: return MakeZeroProgram(simulation, 2);
    case DataParallel::kZero3: return MakeZero3Program(simulation);
    case DataParallel::kFsdp2: return MakeFsdp2Program(simulation);
  }
  return MakeOneRankProgram(simulation);
}

Memory& DataParallelProgram::memory() { return simulation_.memory_; }
const Memory& DataParallelProgram::memory() const { return simulation_.memory_; }
absl::flat_hash_map<ParameterKey, int>& DataParallelProgram::grads() {
  return simulation_.grads_;
}
const ModelConfig& DataParallelProgram::config() const { return simulation_.config_; }
const ParallelSpec& DataParallelProgram::parallel() const {
  return simulation_.options_.rank.parallel;
}
int DataParallelProgram::KindOf(int64_t layer) const { return simulation_.KindOf(layer); }
ParameterKey DataParallelProgram::KeyOf(const BlockGraph& graph, int64_t segment,
                                        int tensor) const {
  return simulation_.KeyOf(graph, segment, tensor);
}
const std::vector<StageRange>& DataParallelProgram::chunks() const {
  return simulation_.chunks_;
}
const std::vector<StageRange>& DataParallelProgram::model_chunks() const {
  return simulation_.model_chunks_.empty() ? simulation_.chunks_ : simulation_.model_chunks_;
}
const std::vector<ParameterKey>& DataParallelProgram::parameter_order() const {
  return simulation_.parameter_order_;
}
const std::vector<bool>& DataParallelProgram::expert_shard() const {
  return simulation_.expert_shard_;
}
void DataParallelProgram::SetOp(int64_t segment, Where::Activity activity) {
  simulation_.memory_.SetOp(simulation_.Special(segment, activity));
}
absl::Status DataParallelProgram::OptimizerStep(const std::vector<int64_t>& numels) {
  return simulation_.OptimizerStep(numels);
}
std::vector<int64_t> DataParallelProgram::GradientNumels() {
  const int64_t element = ElementSizeBytes(config().TrainableDtype());
  std::vector<int64_t> numels;
  numels.reserve(parameter_order().size());
  for (const ParameterKey& parameter : parameter_order()) {
    numels.push_back(memory().bytes(grads().at(parameter)) / element);
  }
  return numels;
}

namespace {

// One rank: its .grads are the gradients; the optimizer steps every parameter.
class OneRank : public DataParallelProgram {
 public:
  using DataParallelProgram::DataParallelProgram;
  absl::Status ReduceAndStep() override { return OptimizerStep(GradientNumels()); }
  bool StepIsOneProcess() const override { return true; }
};

}  // namespace

std::unique_ptr<DataParallelProgram> MakeOneRankProgram(Simulation& simulation) {
  return std::make_unique<OneRank>(simulation);
}

}  // namespace memledger::liveness_internal
