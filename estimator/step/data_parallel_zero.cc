// The data-parallel programs that reduce through one flat bucket, as memledger's
// runtime ranks run them (runtime/rank.cc; estimator/step/liveness.h, RankStep, says
// each step): ranks replicated beside expert parallelism and ZeRO 1 and 2, at the step's
// end; ZeRO 3, unit by unit in the backward (runtime/zero_units.h, GatheredUnits).
#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "estimator/graph/family.h"
#include "estimator/step/data_parallel_program.h"
#include "estimator/step/segment_plan.h"

namespace memledger::liveness_internal {
namespace {

// StepEndBucket: a program that reduces the .grads its backward left through flat
// buckets at the step's end. A bucket of n elements over `ranks` is at::cat of the
// .grads' flat views and, when n is not a multiple of ranks, a block of zeros (which
// dies with the list of pieces). The all-reduce works in place (Gloo's own buffers are
// not ATen's).
class StepEndBucket : public DataParallelProgram {
 public:
  using DataParallelProgram::DataParallelProgram;

 protected:
  // BeginReduction: each .grad's elements, the reduction named as running.
  std::vector<int64_t> BeginReduction() {
    std::vector<int64_t> numels = GradientNumels();
    SetOp(Where::kHead, Where::Activity::kGradientReduction);
    return numels;
  }
  int MakeBucket(int64_t n, int64_t ranks) {
    const int64_t element = ElementSizeBytes(config().dtype);
    const int64_t padded = ZeroShardElements(n, ranks) * ranks;
    const int padding =
        padded > n ? memory().Alloc((padded - n) * element, MemoryCategory::kTemporary) : -1;
    const int bucket = memory().Alloc(padded * element, MemoryCategory::kTemporary);
    if (padding >= 0) memory().Unref(padding);
    return bucket;
  }
};

// Replicated: expert parallelism without ZeRO. The experts' gradients and the rest are
// reduced apart, each a bucket over its own ranks: the rest over all dp ranks, the
// experts over the dp / ep ranks that hold the same experts (Megatron's expert
// data-parallel group; one rank when dp == ep, where nothing is exchanged but the bucket
// is still made and divided by dp). The averages are copied back into the .grads and
// every parameter is stepped.
class Replicated : public StepEndBucket {
 public:
  using StepEndBucket::StepEndBucket;
  absl::Status ReduceAndStep() override {
    const std::vector<int64_t> numels = BeginReduction();
    for (const bool experts : {false, true}) {
      int64_t group_n = 0;
      for (size_t p = 0; p < numels.size(); ++p) {
        if (expert_shard()[p] == experts) group_n += numels[p];
      }
      const int64_t ranks = experts ? parallel().dp / parallel().ep : parallel().dp;
      const int bucket = MakeBucket(group_n, ranks);
      memory().ScalarOp(config().dtype);  // bucket.div_(dp)
      memory().Unref(bucket);             // copied back into the .grads
    }
    return OptimizerStep(numels);
  }
};

// Zero: ZeRO 1 and 2, one bucket of every gradient. ZeRO 1 frees the .grads and steps
// the rank's ceil(n / dp) shard of the bucket (a view), then frees the bucket; ZeRO 2
// copies the shard out of the bucket and divides it, frees the bucket and the .grads,
// and steps the copy.
class Zero : public StepEndBucket {
 public:
  Zero(Simulation& simulation, int64_t stage) : StepEndBucket(simulation), stage_(stage) {}
  absl::Status ReduceAndStep() override {
    const std::vector<int64_t> numels = BeginReduction();
    int64_t n = 0;
    for (int64_t numel : numels) n += numel;
    const int64_t shard = ZeroShardElements(n, parallel().dp);
    const int bucket = MakeBucket(n, parallel().dp);
    auto free_grads = [&]() {
      for (const ParameterKey& parameter : parameter_order()) memory().Unref(grads().at(parameter));
    };
    if (stage_ == 2) {
      const int64_t element = ElementSizeBytes(config().dtype);
      const int mine = memory().Alloc(shard * element, MemoryCategory::kGradient);
      memory().ScalarOp(config().dtype);
      memory().Unref(bucket);
      free_grads();
      absl::Status status = OptimizerStep({shard});
      memory().Unref(mine);
      return status;
    }
    memory().ScalarOp(config().dtype);  // bucket.div_(dp)
    free_grads();
    absl::Status status = OptimizerStep({shard});  // on a view of the bucket
    memory().Unref(bucket);
    return status;
  }

 private:
  int64_t stage_;  // 1 or 2
};

// Zero3: a unit (the prologue, a layer, the head: its segment) has its parameters
// gathered into one buffer for its forward and its backward; after its backward its
// .grads are flattened into a bucket and freed, the bucket all-reduced in place, this
// rank's part added into the shard's gradient (made on first use), the bucket freed and
// the unit released. At the step's end the shard's gradient is divided by dp x
// micro-batches, stepped and freed; the parameters stay sharded.
class Zero3 : public DataParallelProgram {
 public:
  using DataParallelProgram::DataParallelProgram;

  // Each unit's parameter bytes (a tied weight is its owner's), and the rank's shard of
  // its stage's parameters (the real stage's, when its chunks are replayed short).
  void SetUp(const ModelGraphs& graphs) override {
    const int64_t element = ElementSizeBytes(config().dtype);
    auto parameter_bytes = [&](const BlockGraph& graph) {
      return (ParameterCount(graph, config()) * element).value();
    };
    prologue_bytes_ = graphs.prologue.has_value() ? parameter_bytes(*graphs.prologue) : 0;
    head_bytes_ = parameter_bytes(graphs.epilogue);
    layer_bytes_.clear();
    for (const BlockGraph& kind : graphs.layer_kinds) layer_bytes_.push_back(parameter_bytes(kind));
    int64_t stage_bytes = 0;
    for (const StageRange& chunk : model_chunks()) {
      stage_bytes += (chunk.prologue ? prologue_bytes_ : 0) + (chunk.head ? head_bytes_ : 0);
      for (size_t kind = 0; kind < layer_bytes_.size(); ++kind) {
        stage_bytes += graphs.LayersOfKind(static_cast<int>(kind), chunk.first_layer,
                                           chunk.layers) *
                       layer_bytes_[kind];
      }
    }
    shard_elements_ = ZeroShardElements(stage_bytes / element, parallel().dp);
  }

  void ForwardBegins(int64_t segment) override { Gather(segment); }
  // A tied embedding's unit stays gathered: the head reads its weight, and its gradient
  // is complete after the prologue's backward.
  void ForwardEnds(int64_t segment) override {
    if (segment == Where::kPrologue && config().tie_embeddings) return;
    Release(segment);
  }

  void BackwardBegins(int64_t last_unit) override {
    pending_unit_ = last_unit;
    Gather(last_unit);
  }
  // The unit's input's hook: its reduction, then the unit before it gathered.
  void UnitBackwardPassed(int64_t unit, std::optional<int64_t> previous) override {
    ReduceScatter(unit);
    pending_unit_ = previous;
    if (previous.has_value()) Gather(*previous);
  }
  // The backward returns: the unit whose input's hook never ran (the embeddings', the
  // study's first layer's) reduces its gradients. A received output gradient is the
  // caller's until then; loss.backward()'s seed died with the graph.
  void GraphTaskEnding(bool head) override {
    if (!head) EndBackward();
  }
  void GraphTaskEnded(bool head) override {
    if (head) EndBackward();
  }
  bool GradientsPersist() const override { return false; }

  absl::Status ReduceAndStep() override {
    // The shard's gradient, reduced unit by unit in the backward, divided by dp x
    // micro-batches, stepped and freed.
    SetOp(Where::kHead, Where::Activity::kGradientReduction);
    memory().ScalarOp(config().dtype);
    absl::Status status = OptimizerStep({shard_elements_});
    if (shard_grad_ >= 0) memory().Unref(shard_grad_);
    return status;
  }
  // The backward reduced every unit into the shard's gradient.
  bool PrepareStepEnd() override {
    shard_grad_ = memory().Alloc(shard_elements_ * ElementSizeBytes(config().dtype),
                                 MemoryCategory::kGradient);
    return false;
  }
  // The shard's gradient is the rank's, made by whichever of its chunks' backwards runs
  // first: with several chunks a chunk's first backward may or may not make it.
  std::optional<int64_t> ChunkShard(size_t chunks) const override {
    if (chunks > 1) return std::nullopt;
    return shard_elements_;
  }

 private:
  int64_t UnitBytes(int64_t segment) const {
    if (segment == Where::kPrologue) return prologue_bytes_;
    if (segment == Where::kHead) return head_bytes_;
    return layer_bytes_[static_cast<size_t>(KindOf(segment))];
  }
  void Gather(int64_t segment) {
    const int64_t bytes = UnitBytes(segment);
    if (bytes == 0 || gathered_.count(segment) == 1) return;
    SetOp(segment, Where::Activity::kParameterGather);
    gathered_[segment] = memory().Alloc(bytes, MemoryCategory::kParameter);
  }
  void Release(int64_t segment) {
    auto it = gathered_.find(segment);
    if (it == gathered_.end()) return;
    memory().Unref(it->second);
    gathered_.erase(it);
  }
  void ReduceScatter(int64_t segment) {
    const int64_t bytes = UnitBytes(segment);
    if (bytes == 0) return;
    SetOp(segment, Where::Activity::kUnitReduction);
    const int bucket = memory().Alloc(bytes, MemoryCategory::kTemporary);
    // The unit's .grads die in its tensors' order.
    std::vector<std::pair<int, int>> unit_grads;  // (tensor, storage)
    for (const auto& [key, storage] : grads()) {
      if (key.first == segment) unit_grads.emplace_back(key.second, storage);
    }
    std::sort(unit_grads.begin(), unit_grads.end());
    for (const auto& [tensor, storage] : unit_grads) {
      memory().Unref(storage);
      grads().erase(ParameterKey{segment, tensor});
    }
    if (shard_grad_ < 0) {  // the first backward's alone (Memory::AllocOnce)
      shard_grad_ = memory().AllocOnce(shard_elements_ * ElementSizeBytes(config().dtype),
                                       MemoryCategory::kGradient);
    }
    memory().Unref(bucket);
    Release(segment);
  }
  void EndBackward() {
    if (pending_unit_.has_value()) ReduceScatter(*pending_unit_);
    pending_unit_.reset();
  }

  int64_t prologue_bytes_ = 0, head_bytes_ = 0;
  std::vector<int64_t> layer_bytes_;  // by kind
  int64_t shard_elements_ = 0;
  std::map<int64_t, int> gathered_;
  int shard_grad_ = -1;
  std::optional<int64_t> pending_unit_;  // the unit whose backward runs
};

}  // namespace

std::unique_ptr<DataParallelProgram> MakeReplicatedProgram(Simulation& simulation) {
  return std::make_unique<Replicated>(simulation);
}
std::unique_ptr<DataParallelProgram> MakeZeroProgram(Simulation& simulation, int64_t stage) {
  return std::make_unique<Zero>(simulation, stage);
}
std::unique_ptr<DataParallelProgram> MakeZero3Program(Simulation& simulation) {
  return std::make_unique<Zero3>(simulation);
}

}  // namespace memledger::liveness_internal
