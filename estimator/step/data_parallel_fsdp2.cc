// The data-parallel program of an FSDP2 rank (FsdpOptions): torch 2.15.0's fully_shard
// (torch/distributed/fsdp/_fully_shard/) on each decoder layer and on the root, as the
// FSDP2 witness measures it (tests/fsdp2_witness_test.py; docs/DESIGN.md,
// "Distributed", lists each buffer with its source line).
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "estimator/parallel/fsdp2_shards.h"
#include "estimator/step/data_parallel_program.h"
#include "estimator/step/liveness.h"
#include "estimator/step/segment_plan.h"

namespace memledger::liveness_internal {
namespace {

// On CUDA, FSDP2's copy-out and reduce-scatter copy-in run ATen kernels that first copy
// their int64 index vectors from pinned host memory into one device tensor (pack_vecs,
// aten/src/ATen/native/cuda/TensorShape.cu), which dies once the kernel is enqueued. Each
// vector has an entry per parameter, or per 2,048-B block of work (kCopyBytesPerBlock:
// 128 threads x 16 B).
constexpr int64_t kCopyBytesPerBlock = 2048;

int64_t DivUp(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ChunkCatMetadataBytes: _chunk_cat_out_cuda_contiguous's (foreach_reduce_scatter_copy_in,
// _fsdp_collectives.py:905, on contiguous gradients): srcs, actual_tensor_sizes,
// pad_tensor_chunk_sizes and num_blocks_per_tensor_chunk (n each),
// tensor_idx_to_start_tensor_bytes and start_block_idx_per_tensor_chunk (n + 1 each), and
// block_idx_to_tensor_idx, a block per 2,048 B of each parameter's padded chunk in the
// output's dtype (get_chunk_cat_metadata).
int64_t ChunkCatMetadataBytes(const std::vector<int64_t>& shard_elements, int64_t out_element) {
  int64_t blocks = 0;
  for (int64_t elements : shard_elements) blocks += DivUp(elements * out_element, kCopyBytesPerBlock);
  const int64_t n = static_cast<int64_t>(shard_elements.size());
  return 8 * (6 * n + 2 + blocks);
}

// SplitCopyMetadataBytes: split_with_sizes_copy_out_cuda_contiguous_no_cast's
// (foreach_all_gather_copy_out, _fsdp_collectives.py:538): dst and src addresses and chunk
// sizes (n each), blocks_cumsums (n + 1) and block_idx_to_split_idx, whose blocks each
// copy iters_per_chunk x 2,048 B of a parameter's piece per rank. iters_per_chunk follows
// the grid torch sizes for the device (max_blocks: SMs x threads per SM / 128 x 2); the
// step is modelled on an H100 or H200's 132 SMs of 2,048 threads.
int64_t SplitCopyMetadataBytes(const std::vector<int64_t>& shard_elements, int64_t element,
                               int64_t world) {
  constexpr int64_t kSms = 132, kThreadsPerSm = 2048, kThreadsPerBlock = 128;
  constexpr int64_t kMaxBlocks = kSms * kThreadsPerSm / kThreadsPerBlock * 2;
  int64_t num_blocks = 0;
  for (int64_t elements : shard_elements) num_blocks += DivUp(elements * element, kCopyBytesPerBlock);
  const int64_t iter_factor = DivUp(num_blocks * world, kMaxBlocks);
  const int64_t chunks_per_block = std::min(
      static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(iter_factor)))), world);
  const int64_t iters_per_chunk = DivUp(iter_factor, chunks_per_block);
  int64_t blocks = 0;
  for (int64_t elements : shard_elements) {
    blocks += DivUp(elements * element, kCopyBytesPerBlock * iters_per_chunk);
  }
  const int64_t n = static_cast<int64_t>(shard_elements.size());
  return 8 * (4 * n + 1 + blocks);
}

// Fsdp2: fully_shard on each layer and the root (kRootUnit: the embedding, the final
// norm and the head). Each unit's parameters in order with their padded shards'
// elements and their .grads' keys; the unsharded parameters' storages by unit; a
// prefetched unit's all-gather output awaiting its copy-out; the forward's kept
// all-gather output (all_gather_state); the last reduce-scatter input
// (reduce_scatter_states).
class Fsdp2 : public DataParallelProgram {
 public:
  using DataParallelProgram::DataParallelProgram;

  void SetUp(const ModelGraphs& graphs) override;
  // The hooks' points in the step: a segment's start and end in the forward, a unit's
  // backward's start and its input's gradient made (post_backward: the root's is the
  // backward's final callback), the backward's end.
  void ForwardBegins(int64_t segment) override;
  void ForwardEnds(int64_t segment) override;
  void UnitBackwardBegins(int64_t unit, std::optional<int64_t> previous) override;
  void UnitBackwardPassed(int64_t unit, std::optional<int64_t> /*previous*/) override {
    if (unit != kRootUnit) PostBackward(unit);
  }
  void GraphTaskEnding(bool /*head*/) override;
  bool GradientsPersist() const override { return false; }

  // Reduced unit by unit in the backward: the optimizer steps each parameter's shard,
  // under CPUOffloadPolicy on the host.
  absl::Status ReduceAndStep() override {
    std::vector<int64_t> shards;
    shards.reserve(parameter_order().size());
    for (const ParameterKey& parameter : parameter_order()) shards.push_back(ShardOf(parameter));
    memory().SetOnHost(Offload());
    absl::Status status = OptimizerStep(shards);
    memory().SetOnHost(false);
    return status;
  }
  // MixedPrecisionPolicy steps the fp32 shards.
  bool StepsFp32() const override { return MixedPrecision(); }

 private:
  static constexpr int64_t kRootUnit = Where::kHead;
  struct Parameter {
    ParameterKey key;
    int64_t shard_elements = 0;
    bool padded = false;  // its rows are not a multiple of the ranks
  };
  struct Unit {
    std::vector<Parameter> parameters;
    std::vector<int64_t> ShardElements() const {
      std::vector<int64_t> elements;
      for (const Parameter& p : parameters) elements.push_back(p.shard_elements);
      return elements;
    }
    int64_t shard_elements = 0;
  };
  Unit UnitAt(int64_t unit) const;
  // The unit's unshard (pre_forward, pre_backward), reshard, backward prefetch and
  // post-backward reduction, as FSDPParamGroup runs them.
  void Unshard(int64_t unit, bool forward);
  void Reshard(int64_t unit);
  void ReshardPostForward(int64_t unit, int64_t post_forward);
  void Prefetch(int64_t unit);
  int AllGather(int64_t unit);  // its output's storage
  void PostBackward(int64_t unit);
  // Under a MixedPrecisionPolicy (param_dtype other than the fp32 shards'): the gather's
  // cast input, and the reduction's dtype (reduce_dtype; the shards' otherwise).
  bool MixedPrecision() const;
  // Offload: CPUOffloadPolicy on a CUDA step (FsdpOptions::offload).
  bool Offload() const;
  DType ReduceDType() const;
  // ShardOf: a parameter's padded shard's elements (what the rank's optimizer steps).
  int64_t ShardOf(const ParameterKey& key) const;

  std::vector<Unit> layer_kinds_;  // a layer of kind k's unit, keyed to layer 0
  Unit root_;
  std::map<int64_t, std::vector<int>> unsharded_;
  std::map<int64_t, int> prefetched_;
  std::map<int64_t, std::vector<int>> post_forward_;  // a unit's post-forward shards
  int all_gather_state_ = -1;
  int reduce_scatter_input_ = -1;
};

void Fsdp2::SetUp(const ModelGraphs& graphs) {
  auto unit_of = [&](const std::vector<std::pair<const BlockGraph*, int64_t>>& members) {
    std::vector<const BlockGraph*> member_graphs;
    for (const auto& [graph, segment] : members) member_graphs.push_back(graph);
    const Fsdp2Unit shards = Fsdp2UnitOf(member_graphs, config(), parallel().dp);
    Unit unit;
    for (const Fsdp2Unit::Parameter& p : shards.parameters) {
      const auto& [graph, segment] = members[static_cast<size_t>(p.graph)];
      unit.parameters.push_back({KeyOf(*graph, segment, p.tensor), p.shard_elements, p.padded});
    }
    unit.shard_elements = shards.shard_elements;
    return unit;
  };
  layer_kinds_.clear();
  for (const BlockGraph& kind : graphs.layer_kinds) {
    layer_kinds_.push_back(unit_of({{&kind, 0}}));
  }
  std::vector<std::pair<const BlockGraph*, int64_t>> root;
  if (graphs.prologue.has_value()) root.emplace_back(&*graphs.prologue, Where::kPrologue);
  root.emplace_back(&graphs.epilogue, Where::kHead);
  root_ = unit_of(root);
}

Fsdp2::Unit Fsdp2::UnitAt(int64_t unit) const {
  if (unit == kRootUnit) return root_;
  Unit layer = layer_kinds_[static_cast<size_t>(KindOf(unit))];
  for (Parameter& p : layer.parameters) p.key.first = unit;
  return layer;
}

// unshard + wait_for_unshard (_fsdp_param_group.py:458, :505): the all-gather output,
// world x the unit's padded shards (foreach_all_gather), unless prefetched; in the
// forward the one kept from the unit before is released first
// (release_all_gather_state_for_comm_reuse); the copy-out gives each parameter its
// unsharded storage (foreach_all_gather_copy_out); a unit resharded to its post-forward
// mesh then lets go of those shards (_to_unsharded, FSDPParam.to_unsharded: _fsdp_param.py
// :1015); then the output is kept to the next unit's copy-out in the forward, freed at
// once in the backward.
void Fsdp2::Unshard(int64_t unit, bool forward) {
  if (unsharded_.count(unit) == 1) return;  // unsharded already: unshard() returns
  const int64_t world = parallel().dp;
  const int64_t element = ElementSizeBytes(config().dtype);
  const Unit parameters = UnitAt(unit);
  int output = -1;
  if (auto prefetched = prefetched_.find(unit); prefetched != prefetched_.end()) {
    output = prefetched->second;
    prefetched_.erase(prefetched);
  } else {
    output = AllGather(unit);
  }
  SetOp(unit, Where::Activity::kParameterGather);
  if (forward && all_gather_state_ >= 0) {
    memory().Unref(all_gather_state_);
    all_gather_state_ = -1;
  }
  std::vector<int>& unsharded = unsharded_[unit];
  for (const Parameter& p : parameters.parameters) {
    unsharded.push_back(
        memory().Alloc(world * p.shard_elements * element, MemoryCategory::kParameter));
  }
  if (memory().cuda()) {
    memory().Transient(
        SplitCopyMetadataBytes(parameters.ShardElements(), element, world));
  }
  if (auto post_forward = post_forward_.find(unit); post_forward != post_forward_.end()) {
    for (int shard : post_forward->second) memory().Unref(shard);
    post_forward_.erase(post_forward);
  }
  if (forward) {
    all_gather_state_ = output;
  } else {
    memory().Unref(output);
  }
}

// reshard (:586): the unsharded storages freed, in the parameters' order.
void Fsdp2::Reshard(int64_t unit) {
  auto it = unsharded_.find(unit);
  if (it == unsharded_.end()) return;
  for (int storage : it->second) memory().Unref(storage);
  unsharded_.erase(it);
}

// reshard to the post-forward mesh (reshard_after_forward an int, post_forward ranks;
// FSDPParam.to_sharded_post_forward, _fsdp_param.py:970): each parameter in turn clones
// its 1/post_forward of the unsharded storage (in the parameters' dtype), then frees the
// storage.
void Fsdp2::ReshardPostForward(int64_t unit, int64_t post_forward) {
  auto it = unsharded_.find(unit);
  if (it == unsharded_.end()) return;
  const int64_t world = parallel().dp;
  const int64_t element = ElementSizeBytes(config().dtype);
  const Unit parameters = UnitAt(unit);
  std::vector<int>& shards = post_forward_[unit];
  for (size_t i = 0; i < parameters.parameters.size(); ++i) {
    const int64_t elements = world * parameters.parameters[i].shard_elements / post_forward;
    shards.push_back(memory().Alloc(elements * element, MemoryCategory::kParameter));
    memory().Unref(it->second[i]);
  }
  unsharded_.erase(it);
}

// _prefetch_unshard in the backward (_backward_prefetch, :1061): the all-gather alone;
// its copy-out waits for the unit's own pre_backward.
void Fsdp2::Prefetch(int64_t unit) {
  if (unsharded_.count(unit) == 1 || prefetched_.count(unit) == 1) return;
  prefetched_[unit] = AllGather(unit);
}

// foreach_all_gather (_fsdp_collectives.py:351): the output, world x the unit's padded
// shards in the parameters' dtype (param_dtype under a MixedPrecisionPolicy, whose
// input is first a cast copy of the shards, freed once gathered: flat_foreach_copy_input,
// :445; without one the input is the output's own slice). A unit on its post-forward mesh
// gathers its larger post-forward shards over fewer ranks (_all_gather_process_group,
// _fsdp_param_group.py:1216): the output is the same.
//
// Under CPUOffloadPolicy the shards are in host memory: each parameter's all-gather input
// is first its shard copied to the device (FSDPParam.all_gather_inputs, _fsdp_param.py
// :1143: sharded_param_data.to(device)), cast to param_dtype under a
// MixedPrecisionPolicy (the copy freed once cast), all of them held until the output is
// allocated and the collective enqueued; a unit on its post-forward mesh gathers the
// device-side post-forward shards, which need neither.
int Fsdp2::AllGather(int64_t unit) {
  const int64_t world = parallel().dp;
  const int64_t element = ElementSizeBytes(config().dtype);
  const Unit parameters = UnitAt(unit);
  const int64_t output_bytes = world * parameters.shard_elements * element;
  const bool post_forward = post_forward_.count(unit) == 1;
  const int64_t group =
      post_forward ? parallel().fsdp.PostForwardRanks(world) : world;
  SetOp(unit, Where::Activity::kParameterGather);
  std::vector<int> inputs;
  if (Offload() && !post_forward) {
    // The shards' dtype: the model's (fp32 under a MixedPrecisionPolicy: ValidateParallel).
    const int64_t stored = MixedPrecision() ? ElementSizeBytes(DType::kFloat32) : element;
    for (const Parameter& p : parameters.parameters) {
      const int copy = memory().Alloc(p.shard_elements * stored, MemoryCategory::kCommunication,
                                     kFsdpAllGatherStream);
      if (MixedPrecision()) {
        inputs.push_back(memory().Alloc(p.shard_elements * element,
                                       MemoryCategory::kCommunication, kFsdpAllGatherStream));
        memory().Unref(copy);
      } else {
        inputs.push_back(copy);
      }
    }
  } else if (MixedPrecision()) {
    inputs.push_back(memory().Alloc(output_bytes / group, MemoryCategory::kCommunication,
                                   kFsdpAllGatherStream));
  }
  const int output =
      memory().Alloc(output_bytes, MemoryCategory::kCommunication, kFsdpAllGatherStream);
  for (int input : inputs) memory().Unref(input);
  return output;
}

bool Fsdp2::Offload() const {
  return parallel().fsdp.offload && memory().cuda();
}

bool Fsdp2::MixedPrecision() const {
  const FsdpOptions& fsdp = parallel().fsdp;
  return fsdp.param_dtype.has_value() && *fsdp.param_dtype != DType::kFloat32;
}

DType Fsdp2::ReduceDType() const {
  return MixedPrecision() ? parallel().fsdp.reduce_dtype.value_or(config().dtype)
                              : config().dtype;
}

// post_backward (:695): reshard; the previous unit's reduce-scatter input freed
// (reduce_scatter_max_input_buffers = 1); foreach_reduce (_fsdp_collectives.py:604): the
// reduce-scatter input (world x the padded shards), filled by torch._chunk_cat, whose
// CPU kernel first copies each gradient whose rows are not a multiple of the ranks into a
// zero-padded tensor (all of them, then freed in turn: ATen's _pad_chunk), the
// unsharded .grads freed (last parameter first), the output (the unit's sharded
// gradients, one storage the parameters' .grads view) and its division by the world
// (_div_if_needed: a wrapped
// scalar). The input stays until the next unit's reduction.
void Fsdp2::PostBackward(int64_t unit) {
  Reshard(unit);
  const int64_t world = parallel().dp;
  const int64_t element = ElementSizeBytes(config().dtype);
  const DType reduce_dtype = ReduceDType();
  const int64_t reduce_element = ElementSizeBytes(reduce_dtype);
  const Unit parameters = UnitAt(unit);
  SetOp(unit, Where::Activity::kUnitReduction);
  if (reduce_scatter_input_ >= 0) memory().Unref(reduce_scatter_input_);
  reduce_scatter_input_ = memory().Alloc(world * parameters.shard_elements * reduce_element,
                                             MemoryCategory::kCommunication);
  if (memory().cuda()) {
    // _chunk_cat_out_cuda pads inside its kernel: only its metadata.
    memory().Transient(
        ChunkCatMetadataBytes(parameters.ShardElements(), reduce_element));
  } else {
    std::vector<int> padded;
    for (const Parameter& p : parameters.parameters) {
      if (p.padded) {
        padded.push_back(
            memory().Alloc(world * p.shard_elements * element, MemoryCategory::kTemporary));
      }
    }
    for (int copy : padded) memory().Unref(copy);
  }
  for (auto it = parameters.parameters.rbegin(); it != parameters.parameters.rend(); ++it) {
    auto grad = grads().find(it->key);
    if (grad == grads().end()) continue;
    memory().Unref(grad->second);
    grads().erase(grad);
  }
  if (Offload()) {
    // The reduce-scatter's output on the device, each parameter's gradient copied from it
    // to host memory (foreach_reduce, _fsdp_collectives.py:779: new_sharded_grad.to(cpu):
    // no device bytes), then freed as foreach_reduce returns.
    memory().Unref(memory().Alloc(parameters.shard_elements * reduce_element,
                                MemoryCategory::kGradient, kFsdpReduceScatterStream));
  } else {
    memory().AllocOnce(parameters.shard_elements * reduce_element, MemoryCategory::kGradient,
                      kFsdpReduceScatterStream);
  }
  // On the Gloo ranks the witness's reduce-scatter averages by a division
  // (witness_common._nccl_like_collectives); NCCL averages in the collective
  // (_get_gradient_divide_factors, _fsdp_collectives.py:973: ReduceOp.AVG for fp32 and
  // bf16).
  if (!memory().cuda()) memory().ScalarOp(reduce_dtype);
}

// pre_forward: the root unshards as the model's forward starts (the embedding's
// segment), each layer as its own does; the head runs on the root's.
void Fsdp2::ForwardBegins(int64_t segment) {
  if (segment == Where::kHead) return;
  Unshard(segment == Where::kPrologue ? kRootUnit : segment, /*forward=*/true);
}

// post_forward (:657): a layer reshards after its forward (reshard_after_forward: to
// every rank, or to its post-forward mesh; reshard, :586), the root after the model's
// (not under fully_shard's default, auto), which also releases the last kept all-gather
// output.
void Fsdp2::ForwardEnds(int64_t segment) {
  if (segment == Where::kPrologue) return;
  const int64_t world = parallel().dp;
  const FsdpOptions& fsdp = parallel().fsdp;
  auto reshard = [&](int64_t unit) {
    const int64_t post_forward =
        unit == kRootUnit ? fsdp.RootPostForwardRanks(world) : fsdp.PostForwardRanks(world);
    if (post_forward == world) {
      Reshard(unit);
    } else if (post_forward > 1) {
      ReshardPostForward(unit, post_forward);
    }
  };
  if (segment != Where::kHead) {
    reshard(segment);
    return;
  }
  reshard(kRootUnit);
  if (all_gather_state_ >= 0) {
    memory().Unref(all_gather_state_);
    all_gather_state_ = -1;
  }
}

// pre_backward (:679): the unit unshards (its copy-out, where prefetched), then
// prefetches the unit before it in the forward's order (post_forward_order: the layers,
// then the root); the first layer's has none (the root's embeddings precede it).
void Fsdp2::UnitBackwardBegins(int64_t unit, std::optional<int64_t> previous) {
  Unshard(unit, /*forward=*/false);
  // The embeddings are the root's, unsharded already: no unit to prefetch.
  if (previous.has_value() && *previous != Where::kPrologue) Prefetch(*previous);
}

int64_t Fsdp2::ShardOf(const ParameterKey& key) const {
  const Unit& unit = key.first >= 0 ? layer_kinds_[static_cast<size_t>(KindOf(key.first))]
                                        : root_;
  for (const Parameter& p : unit.parameters) {
    if (p.key.second == key.second && (key.first >= 0 || p.key.first == key.first)) {
      return p.shard_elements;
    }
  }
  return 0;
}

// The root's post-backward final callback (_fsdp_state.py:422): the root unit reshards
// and reduces, then the last reduce-scatter input is freed.
void Fsdp2::GraphTaskEnding(bool /*head*/) {
  PostBackward(kRootUnit);
  if (reduce_scatter_input_ >= 0) memory().Unref(reduce_scatter_input_);
  reduce_scatter_input_ = -1;
}

}  // namespace

std::unique_ptr<DataParallelProgram> MakeFsdp2Program(Simulation& simulation) {
  return std::make_unique<Fsdp2>(simulation);
}

}  // namespace memledger::liveness_internal
