// The step simulation of an FSDP2 rank (FsdpOptions): torch 2.15.0's fully_shard
// (torch/distributed/fsdp/_fully_shard/) on each decoder layer and on the root, as the
// FSDP2 witness measures it (tests/fsdp2_witness_test.py; docs/DESIGN.md,
// "Distributed", lists each buffer with its source line).
#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>
#include <vector>

#include "estimator/parallel/fsdp2_shards.h"
#include "estimator/step/simulation.h"

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

}  // namespace

void Simulation::SetUpFsdp2(const ModelGraphs& graphs) {
  const ParallelSpec& parallel = options_.rank.parallel;
  fsdp2_ = parallel.fsdp.enabled && parallel.dp > 1;
  if (!fsdp2_) return;
  auto unit_of = [&](const std::vector<std::pair<const BlockGraph*, int64_t>>& members) {
    std::vector<const BlockGraph*> member_graphs;
    for (const auto& [graph, segment] : members) member_graphs.push_back(graph);
    const Fsdp2Unit shards = Fsdp2UnitOf(member_graphs, config_, parallel.dp);
    FsdpUnit unit;
    for (const Fsdp2Unit::Parameter& p : shards.parameters) {
      const auto& [graph, segment] = members[static_cast<size_t>(p.graph)];
      unit.parameters.push_back({KeyOf(*graph, segment, p.tensor), p.shard_elements, p.padded});
    }
    unit.shard_elements = shards.shard_elements;
    return unit;
  };
  fsdp_layer_kinds_.clear();
  for (const BlockGraph& kind : graphs.layer_kinds) {
    fsdp_layer_kinds_.push_back(unit_of({{&kind, 0}}));
  }
  std::vector<std::pair<const BlockGraph*, int64_t>> root;
  if (graphs.prologue.has_value()) root.emplace_back(&*graphs.prologue, Where::kPrologue);
  root.emplace_back(&graphs.epilogue, Where::kHead);
  fsdp_root_ = unit_of(root);
}

Simulation::FsdpUnit Simulation::FsdpUnitAt(int64_t unit) const {
  if (unit == kRootUnit) return fsdp_root_;
  FsdpUnit layer = fsdp_layer_kinds_[static_cast<size_t>(KindOf(unit))];
  for (FsdpParameter& p : layer.parameters) p.key.first = unit;
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
void Simulation::FsdpUnshard(int64_t unit, bool forward) {
  if (fsdp_unsharded_.count(unit) == 1) return;  // unsharded already: unshard() returns
  const int64_t world = options_.rank.parallel.dp;
  const int64_t element = ElementSizeBytes(config_.dtype);
  const FsdpUnit parameters = FsdpUnitAt(unit);
  int output = -1;
  if (auto prefetched = fsdp_prefetched_.find(unit); prefetched != fsdp_prefetched_.end()) {
    output = prefetched->second;
    fsdp_prefetched_.erase(prefetched);
  } else {
    output = FsdpAllGather(unit);
  }
  memory_.SetOp(Special(unit, Where::Activity::kParameterGather));
  if (forward && fsdp_all_gather_state_ >= 0) {
    memory_.Unref(fsdp_all_gather_state_);
    fsdp_all_gather_state_ = -1;
  }
  std::vector<int>& unsharded = fsdp_unsharded_[unit];
  for (const FsdpParameter& p : parameters.parameters) {
    unsharded.push_back(
        memory_.Alloc(world * p.shard_elements * element, MemoryCategory::kParameter));
  }
  if (memory_.cuda()) {
    memory_.Transient(
        SplitCopyMetadataBytes(parameters.ShardElements(), element, world));
  }
  if (auto post_forward = fsdp_post_forward_.find(unit); post_forward != fsdp_post_forward_.end()) {
    for (int shard : post_forward->second) memory_.Unref(shard);
    fsdp_post_forward_.erase(post_forward);
  }
  if (forward) {
    fsdp_all_gather_state_ = output;
  } else {
    memory_.Unref(output);
  }
}

// reshard (:586): the unsharded storages freed, in the parameters' order.
void Simulation::FsdpReshard(int64_t unit) {
  auto it = fsdp_unsharded_.find(unit);
  if (it == fsdp_unsharded_.end()) return;
  for (int storage : it->second) memory_.Unref(storage);
  fsdp_unsharded_.erase(it);
}

// reshard to the post-forward mesh (reshard_after_forward an int, post_forward ranks;
// FSDPParam.to_sharded_post_forward, _fsdp_param.py:970): each parameter in turn clones
// its 1/post_forward of the unsharded storage (in the parameters' dtype), then frees the
// storage.
void Simulation::FsdpReshardPostForward(int64_t unit, int64_t post_forward) {
  auto it = fsdp_unsharded_.find(unit);
  if (it == fsdp_unsharded_.end()) return;
  const int64_t world = options_.rank.parallel.dp;
  const int64_t element = ElementSizeBytes(config_.dtype);
  const FsdpUnit parameters = FsdpUnitAt(unit);
  std::vector<int>& shards = fsdp_post_forward_[unit];
  for (size_t i = 0; i < parameters.parameters.size(); ++i) {
    shards.push_back(memory_.Alloc(world * parameters.parameters[i].shard_elements / post_forward * element,
                                   MemoryCategory::kParameter));
    memory_.Unref(it->second[i]);
  }
  fsdp_unsharded_.erase(it);
}

// _prefetch_unshard in the backward (_backward_prefetch, :1061): the all-gather alone;
// its copy-out waits for the unit's own pre_backward.
void Simulation::FsdpPrefetch(int64_t unit) {
  if (fsdp_unsharded_.count(unit) == 1 || fsdp_prefetched_.count(unit) == 1) return;
  fsdp_prefetched_[unit] = FsdpAllGather(unit);
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
int Simulation::FsdpAllGather(int64_t unit) {
  const int64_t world = options_.rank.parallel.dp;
  const int64_t element = ElementSizeBytes(config_.dtype);
  const FsdpUnit parameters = FsdpUnitAt(unit);
  const int64_t output_bytes = world * parameters.shard_elements * element;
  const bool post_forward = fsdp_post_forward_.count(unit) == 1;
  const int64_t group =
      post_forward ? options_.rank.parallel.fsdp.PostForwardRanks(world) : world;
  memory_.SetOp(Special(unit, Where::Activity::kParameterGather));
  std::vector<int> inputs;
  if (FsdpOffload() && !post_forward) {
    // The shards' dtype: the model's (fp32 under a MixedPrecisionPolicy: ValidateParallel).
    const int64_t stored = FsdpMixedPrecision() ? ElementSizeBytes(DType::kFloat32) : element;
    for (const FsdpParameter& p : parameters.parameters) {
      const int copy = memory_.Alloc(p.shard_elements * stored, MemoryCategory::kCommunication,
                                     kFsdpAllGatherStream);
      if (FsdpMixedPrecision()) {
        inputs.push_back(memory_.Alloc(p.shard_elements * element,
                                       MemoryCategory::kCommunication, kFsdpAllGatherStream));
        memory_.Unref(copy);
      } else {
        inputs.push_back(copy);
      }
    }
  } else if (FsdpMixedPrecision()) {
    inputs.push_back(memory_.Alloc(output_bytes / group, MemoryCategory::kCommunication,
                                   kFsdpAllGatherStream));
  }
  const int output =
      memory_.Alloc(output_bytes, MemoryCategory::kCommunication, kFsdpAllGatherStream);
  for (int input : inputs) memory_.Unref(input);
  return output;
}

bool Simulation::FsdpOffload() const {
  return options_.rank.parallel.fsdp.offload && memory_.cuda();
}

bool Simulation::FsdpMixedPrecision() const {
  const FsdpOptions& fsdp = options_.rank.parallel.fsdp;
  return fsdp.param_dtype.has_value() && *fsdp.param_dtype != DType::kFloat32;
}

DType Simulation::FsdpReduceDType() const {
  return FsdpMixedPrecision() ? options_.rank.parallel.fsdp.reduce_dtype.value_or(config_.dtype)
                              : config_.dtype;
}

// post_backward (:695): reshard; the previous unit's reduce-scatter input freed
// (reduce_scatter_max_input_buffers = 1); foreach_reduce (_fsdp_collectives.py:604): the
// reduce-scatter input (world x the padded shards), filled by torch._chunk_cat, whose
// CPU kernel first copies each gradient whose rows are not a multiple of the ranks into a
// zero-padded tensor (all of them, then freed in turn: ATen's _pad_chunk), the
// unsharded .grads freed (last parameter first), the output (the unit's sharded gradients, one storage the
// parameters' .grads view) and its division by the world (_div_if_needed: a wrapped
// scalar). The input stays until the next unit's reduction.
void Simulation::FsdpPostBackward(int64_t unit) {
  FsdpReshard(unit);
  const int64_t world = options_.rank.parallel.dp;
  const int64_t element = ElementSizeBytes(config_.dtype);
  const DType reduce_dtype = FsdpReduceDType();
  const int64_t reduce_element = ElementSizeBytes(reduce_dtype);
  const FsdpUnit parameters = FsdpUnitAt(unit);
  memory_.SetOp(Special(unit, Where::Activity::kUnitReduction));
  if (fsdp_reduce_scatter_input_ >= 0) memory_.Unref(fsdp_reduce_scatter_input_);
  fsdp_reduce_scatter_input_ = memory_.Alloc(world * parameters.shard_elements * reduce_element,
                                             MemoryCategory::kCommunication);
  if (memory_.cuda()) {
    // _chunk_cat_out_cuda pads inside its kernel: only its metadata.
    memory_.Transient(
        ChunkCatMetadataBytes(parameters.ShardElements(), reduce_element));
  } else {
    std::vector<int> padded;
    for (const FsdpParameter& p : parameters.parameters) {
      if (p.padded) {
        padded.push_back(
            memory_.Alloc(world * p.shard_elements * element, MemoryCategory::kTemporary));
      }
    }
    for (int copy : padded) memory_.Unref(copy);
  }
  for (auto it = parameters.parameters.rbegin(); it != parameters.parameters.rend(); ++it) {
    auto grad = grads_.find(it->key);
    if (grad == grads_.end()) continue;
    memory_.Unref(grad->second);
    grads_.erase(grad);
  }
  if (FsdpOffload()) {
    // The reduce-scatter's output on the device, each parameter's gradient copied from it
    // to host memory (foreach_reduce, _fsdp_collectives.py:779: new_sharded_grad.to(cpu):
    // no device bytes), then freed as foreach_reduce returns.
    memory_.Unref(memory_.Alloc(parameters.shard_elements * reduce_element,
                                MemoryCategory::kGradient, kFsdpReduceScatterStream));
  } else {
    memory_.AllocOnce(parameters.shard_elements * reduce_element, MemoryCategory::kGradient,
                      kFsdpReduceScatterStream);
  }
  // On the Gloo ranks the witness's reduce-scatter averages by a division
  // (witness_common._nccl_like_collectives); NCCL averages in the collective
  // (_get_gradient_divide_factors, _fsdp_collectives.py:973: ReduceOp.AVG for fp32 and
  // bf16).
  if (!memory_.cuda()) memory_.ScalarOp(reduce_dtype);
}

// pre_forward: the root unshards as the model's forward starts (the embedding's
// segment), each layer as its own does; the head runs on the root's.
void Simulation::FsdpForwardBegins(int64_t segment) {
  if (segment == Where::kHead) return;
  FsdpUnshard(segment == Where::kPrologue ? kRootUnit : segment, /*forward=*/true);
}

// post_forward (:657): a layer reshards after its forward (reshard_after_forward: to
// every rank, or to its post-forward mesh; reshard, :586), the root after the model's
// (not under fully_shard's default, auto), which also releases the last kept all-gather
// output.
void Simulation::FsdpForwardEnds(int64_t segment) {
  if (segment == Where::kPrologue) return;
  const int64_t world = options_.rank.parallel.dp;
  const FsdpOptions& fsdp = options_.rank.parallel.fsdp;
  auto reshard = [&](int64_t unit) {
    const int64_t post_forward =
        unit == kRootUnit ? fsdp.RootPostForwardRanks(world) : fsdp.PostForwardRanks(world);
    if (post_forward == world) {
      FsdpReshard(unit);
    } else if (post_forward > 1) {
      FsdpReshardPostForward(unit, post_forward);
    }
  };
  if (segment != Where::kHead) {
    reshard(segment);
    return;
  }
  reshard(kRootUnit);
  if (fsdp_all_gather_state_ >= 0) {
    memory_.Unref(fsdp_all_gather_state_);
    fsdp_all_gather_state_ = -1;
  }
}

// pre_backward (:679): the unit unshards (its copy-out, where prefetched), then
// prefetches the unit before it in the forward's order (post_forward_order: the layers,
// then the root); the first layer's has none.
void Simulation::FsdpBackwardBegins(int64_t unit, std::optional<int64_t> previous) {
  FsdpUnshard(unit, /*forward=*/false);
  if (previous.has_value()) FsdpPrefetch(*previous);
}

int64_t Simulation::FsdpShardOf(const ParameterKey& key) const {
  const FsdpUnit& unit = key.first >= 0 ? fsdp_layer_kinds_[static_cast<size_t>(KindOf(key.first))]
                                        : fsdp_root_;
  for (const FsdpParameter& p : unit.parameters) {
    if (p.key.second == key.second && (key.first >= 0 || p.key.first == key.first)) {
      return p.shard_elements;
    }
  }
  return 0;
}

// The root's post-backward final callback (_fsdp_state.py:422): the root unit reshards
// and reduces, then the last reduce-scatter input is freed.
void Simulation::FsdpBackwardEnds() {
  FsdpPostBackward(kRootUnit);
  if (fsdp_reduce_scatter_input_ >= 0) memory_.Unref(fsdp_reduce_scatter_input_);
  fsdp_reduce_scatter_input_ = -1;
}

}  // namespace memledger::liveness_internal
