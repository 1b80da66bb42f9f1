#include "runtime/rank.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "estimator/graph/family.h"
#include "estimator/step/pipeline_steps.h"
#include "runtime/checkpoint.h"
#include "runtime/counting_allocator.h"
#include "runtime/ddp_reducers.h"
#include "runtime/dropout.h"
#include "runtime/fsdp2_units.h"
#include "runtime/gloo_collectives.h"
#include "runtime/megatron_functions.h"
#include "runtime/megatron_schedule.h"
#include "runtime/model.h"
#include "runtime/optimizer_runner.h"
#include "runtime/rank_exchange.h"
#include "runtime/saved_tensor_recorder.h"
#include "runtime/threads.h"
#include "runtime/zero_units.h"

namespace memledger::runtime::distributed_internal {
namespace {

// ScheduleStats: what one variant's schedule held.
struct ScheduleStats {
  int64_t held_bytes = 0;
  int64_t in_flight = 0;
};

// CountedStep is one whole step counted by the allocator (Rank::MeasureStep).
struct CountedStep {
  int64_t resident_bytes = 0;  // what exists before it
  int64_t peak_bytes = 0;      // resident_bytes + the step's largest live bytes
  PeakPoint peak;              // where; its bytes are the step's own
  double unit_grad_diff = -1;  // ZeRO-3, FSDP2 (RankVariantMeasurement::unit_grad_diff)
};

// PipelineRun is how Rank::RunPipeline runs a schedule: the verified one records each
// forward's saved bytes and scales each loss by 1 / micro-batches; the counted one marks
// the allocator's phases.
struct PipelineRun {
  ScopedCountingAllocator* counting = nullptr;
  bool record_saved = false;
  bool scale_loss = false;
  ParameterUnits* units = nullptr;  // ZeRO-3's gathering (the counted step)
  DdpReducers* ddp = nullptr;       // DDP's Reducers (the counted step)
};

struct PipelineResult {
  ScheduleStats stats;    // with record_saved
  at::Tensor total_loss;  // the losses' sum, on the rank with the model's last chunk
};

// Rank is one rank's state for the whole run.
class Rank {
 public:
  Rank(const ModelConfig& config, const ParallelSpec& parallel, const DistributedRequest& request,
       std::string dir, int64_t rank)
      : config_(config),
        parallel_(parallel),
        data_parallel_(DataParallelOf(parallel)),
        shards_(RankShardsOf(data_parallel_)),
        request_(request),
        dir_(std::move(dir)),
        position_(PositionOf(rank, parallel)),
        chunks_(ChunksOf(config, parallel, position_.stage)),
        first_(chunks_.front().prologue),
        last_(chunks_.back().head) {}

  void Run() {
    at::set_num_threads(1);  // every rank shares this machine's cores
    UseNativeKernels();
    BuildShard();
    parameters_ = built_.model->parameters();
    for (const at::Tensor& p : parameters_) parameter_storages_.insert(StorageKey(p));
    MakeGroups();
    if (parallel_.tp > 1) {
      tensor_parallel_ =
          MakeGlooTensorParallel(tp_group_, position_.tp_rank, parallel_.tp, parallel_.sp);
      built_.model->SetTensorParallel(tensor_parallel_.get());
    }
    InjectFault();

    std::ostringstream result;
    const std::vector<Variant> variants = WithReference(request_.variants);
    for (size_t v = 0; v < variants.size(); ++v) {
      for (const at::Tensor& p : parameters_) p.mutable_grad() = at::Tensor();
      Progress(absl::StrCat(variants[v].Name(), ": pipeline schedule"));
      const ScheduleStats stats = RunSchedule(variants[v]);
      if (v == 0) {
        FindOwned();
        HomeParameters();
      }
      AllReducePartialGradients();
      Progress(absl::StrCat(variants[v].Name(), ": reducing gradients"));
      ExchangeTiedGradients();
      const Piece piece =
          ReduceGradients(v == 0, RankFile(dir_, position_.rank, absl::StrCat("grad", v)));
      result << "variant " << v << " " << stats.held_bytes << " " << stats.in_flight << " "
             << piece.offset << " " << piece.length << "\n";
    }
    Progress("optimizer step");
    const Piece params = Step();
    if (RankStepModelled(config_, parallel_).ok()) {
      for (size_t v = 0; v < variants.size(); ++v) {
        Progress(absl::StrCat(variants[v].Name(), ": the whole step, counted"));
        const CountedStep step = MeasureStep(variants[v]);
        result << "peak " << v << " " << step.peak_bytes << " " << step.peak.phase << " "
               << step.peak.op << "\n";
        if (step.unit_grad_diff != -1) {
          result << "unit_grad_diff " << v << " " << step.unit_grad_diff << "\n";
        }
      }
    }
    result << "n_params " << n_params_ << "\nparam_bytes " << param_bytes_ << "\ngrad_bytes "
           << grad_bytes_ << "\noptimizer_state_bytes " << optimizer_state_bytes_
           << "\nadamw_state_bytes " << adamw_state_bytes_ << "\nparams " << params.offset << " "
           << params.length << "\n";
    for (const std::string& name : owned_names_) result << "owned " << name << "\n";
    // Written whole, then renamed: the parent reads it only after a clean exit anyway.
    const std::string path = RankFile(dir_, position_.rank, "txt");
    {
      std::ofstream out(path + ".tmp");
      out << result.str();
      TORCH_CHECK(out.good(), "cannot write ", path);
    }
    std::filesystem::rename(path + ".tmp", path);
  }

 private:
  // Progress goes to the rank's log: the parent names a hung rank's last line.
  void Progress(absl::string_view what) const {
    std::cerr << "memledger rank " << position_.rank << ": " << what << std::endl;
  }

  // BuildShard: the whole seeded model and batch, as the single-process reference
  // draws them; with tensor parallelism, this rank's shard of the model (ShardOf) takes
  // its parameters from it.
  void BuildShard() {
    built_ = BuildModel(SingleProcessConfig(config_, parallel_), request_.seed);
    if (config_.shard.tp == 1) return;
    ModelAndInput shard = BuildModel(WholeBatch(config_, parallel_), request_.seed);
    std::map<std::string, at::Tensor> source;
    for (const auto& item : built_.model->named_parameters()) source[item.key()] = item.value();
    at::NoGradGuard no_grad;
    for (const auto& item : shard.model->named_parameters()) {
      item.value().copy_(
          TakeShard(source.at(item.key()), ShardOf(config_, item.key(), position_.tp_rank)));
    }
    built_.model = shard.model;  // the input stays the whole model's draw
  }

  // MakeGroups: Megatron's groups, each over a PrefixStore of one FileStore: tensor
  // parallel (same dp rank and stage), data parallel (same tp rank and stage), pipeline
  // (same tp and dp rank).
  void MakeGroups() {
    Progress("joining the process groups");
    const auto timeout = std::chrono::milliseconds(request_.timeout_s * 2000);
    store_ = c10::make_intrusive<c10d::FileStore>(
        dir_ + "/store", static_cast<int>(WorldSize(parallel_)));
    const RankPosition& p = position_;
    if (parallel_.tp > 1) {
      tp_group_ = MakeGroup(store_, absl::StrCat("tp/", p.dp_rank, "/", p.stage), p.tp_rank,
                            parallel_.tp, timeout);
    }
    if (parallel_.dp > 1) {
      dp_group_ = MakeGroup(store_, absl::StrCat("dp/", p.tp_rank, "/", p.stage), p.dp_rank,
                            parallel_.dp, timeout);
    }
    // FSDP2's post-forward mesh (reshard_after_forward=N): groups of N consecutive
    // data-parallel ranks.
    const int64_t post_forward = parallel_.fsdp.PostForwardRanks(parallel_.dp);
    if (parallel_.fsdp.enabled && post_forward > 1 && post_forward < parallel_.dp) {
      post_forward_group_ =
          MakeGroup(store_, absl::StrCat("post_forward/", p.tp_rank, "/", p.stage, "/",
                                         p.dp_rank / post_forward),
                    p.dp_rank % post_forward, post_forward, timeout);
    }
    if (parallel_.pp > 1) {
      pp_group_ = MakeGroup(store_, absl::StrCat("pp/", p.tp_rank, "/", p.dp_rank), p.stage,
                            parallel_.pp, timeout);
    }
    // Megatron's embedding group: the first and the last stage, which both hold a tied
    // embedding.
    if (parallel_.pp > 1 && config_.tie_embeddings && (first_ || last_)) {
      embedding_group_ = MakeGroup(store_, absl::StrCat("embedding/", p.tp_rank, "/", p.dp_rank),
                                   first_ ? 0 : 1, 2, timeout);
    }
  }

  void InjectFault() {
    if (request_.fault.empty()) return;
    std::vector<std::string> parts = absl::StrSplit(request_.fault, ':');
    int64_t rank = -1;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &rank) || rank != position_.rank) {
      return;
    }
    std::cerr << "memledger rank " << rank << ": injected fault " << parts[1] << std::endl;
    if (parts[1] == "exit") std::_Exit(7);
    if (parts[1] == "hang") {
      for (;;) pause();
    }
  }

  // The micro-batch j of this rank's data-parallel slice: a tensor of its own, as a
  // data loader hands it over (a view would count the whole batch where it is saved).
  at::Tensor MicroBatch(int64_t j) const {
    const int64_t first = (position_.dp_rank * parallel_.micro_batches + j) * config_.batch;
    return built_.input.narrow(0, first, config_.batch).clone();
  }

  // Place: where micro-batch j's tensors sit in the whole batch, for Megatron's dropout
  // masks.
  void Place(int64_t j) const {
    DropoutPlacement placement;
    placement.first_sequence = (position_.dp_rank * parallel_.micro_batches + j) * config_.batch;
    placement.heads = config_.heads;
    placement.first_head = position_.tp_rank * (config_.heads / config_.shard.tp);
    placement.tokens = config_.seq;
    placement.first_token =
        config_.shard.sp ? position_.tp_rank * (config_.seq / config_.shard.tp) : 0;
    SetDropoutPlacement(placement);
  }

  // RunSchedule runs every micro-batch through every local model chunk, forward and
  // backward (RunPipeline), each loss scaled by 1 / micro-batches (Megatron's mean), and
  // counts the saved bytes of the chunk micro-batches in flight.
  ScheduleStats RunSchedule(const Variant& variant) {
    std::vector<at::Tensor> inputs;
    for (int64_t j = 0; j < parallel_.micro_batches; ++j) inputs.push_back(MicroBatch(j));
    PipelineRun run;
    run.record_saved = true;
    run.scale_loss = true;
    return RunPipeline(variant, inputs, run).stats;
  }

  // FindOwned: the stage's parameters are those its forward used (they have
  // gradients after the first backward), in the model's order.
  void FindOwned() {
    for (const auto& item : built_.model->named_parameters()) {
      if (!item.value().grad().defined()) continue;
      owned_.push_back(item.value());
      owned_names_.push_back(item.key());
      owned_sizes_.push_back(item.value().sizes().vec());
      n_params_ += item.value().numel();
    }
  }

  // AllReducePartialGradients: with sequence parallelism, the replicated parameters used
  // on this rank's tokens only have partial gradients, which Megatron all-reduces over
  // the tensor-parallel group (GradientIsPartial).
  void AllReducePartialGradients() {
    for (size_t i = 0; i < owned_.size(); ++i) {
      if (!GradientIsPartial(config_, owned_names_[i])) continue;
      at::Tensor grad = owned_[i].grad();
      AllReduce(tp_group_.get(), grad);
    }
  }

  // ExchangeTiedGradients: with a tied embedding and more than one stage, the first and
  // the last stage each hold the weight and add each other's gradients (Megatron's
  // embedding group). The shared names come through the store.
  void ExchangeTiedGradients() {
    if (parallel_.pp < 2 || (!first_ && !last_)) return;
    if (!tied_found_) {
      tied_found_ = true;
      const std::string prefix =
          absl::StrCat("owned/", position_.tp_rank, "/", position_.dp_rank, "/");
      const std::string own_key = absl::StrCat(prefix, position_.stage);
      const std::string joined = absl::StrJoin(owned_names_, ",");
      store_->set(own_key, std::vector<uint8_t>(joined.begin(), joined.end()));
      const int64_t peer_stage = first_ ? parallel_.pp - 1 : 0;
      const std::vector<uint8_t> peer = store_->get(absl::StrCat(prefix, peer_stage));
      const std::vector<std::string> peer_names =
          absl::StrSplit(std::string(peer.begin(), peer.end()), ',');
      for (size_t i = 0; i < owned_names_.size(); ++i) {
        if (std::find(peer_names.begin(), peer_names.end(), owned_names_[i]) != peer_names.end()) {
          tied_.push_back(owned_[i]);
        }
      }
    }
    // All-reduced in place over the embedding group, as Megatron's
    // _allreduce_embedding_grads: no buffer.
    for (const at::Tensor& weight : tied_) {
      at::Tensor grad = weight.grad();
      AllReduce(embedding_group_.get(), grad);
    }
  }

  std::vector<at::Tensor> OwnedGrads() const {
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : owned_) grads.push_back(p.grad());
    return grads;
  }

  int64_t Shard() const { return ShardElements(n_params_, parallel_.dp); }

  // HomeParameters: with ZeRO-1 and -2 the stage's parameters become views of one flat
  // buffer, padded to a multiple of dp, as Megatron's distributed optimizer keeps them;
  // the optimizer steps this rank's shard of it in place (a view too), and the
  // all-gather after the step writes the others' shards into it. ZeRO-3 keeps only a
  // shard of its own (Step).
  void HomeParameters() {
    if (!shards_.flat || shards_.parameters) return;
    flat_params_ = Flat(owned_, Shard() * parallel_.dp);
    int64_t offset = 0;
    for (const at::Tensor& p : owned_) {
      at::Tensor param = p;  // set_data changes the variable shared by every handle
      param.set_data(flat_params_.narrow(0, offset, p.numel()).view(p.sizes()));
      offset += p.numel();
    }
    shard_param_ =
        flat_params_.narrow(0, position_.dp_rank * Shard(), Shard()).requires_grad_(true);
    // The recorder skips the parameters' storages: the old ones are freed (their
    // addresses may come back as activations).
    parameter_storages_.clear();
    for (const at::Tensor& p : parameters_) parameter_storages_.insert(StorageKey(p));
  }

  // CheckGathered: ZeRO-3's gathered parameters are every rank's shard as Gloo's own
  // all-gather assembles them (x + 0 is exact: equal bit for bit).
  void CheckGathered() const {
    at::NoGradGuard no_grad;
    std::vector<std::vector<at::Tensor>> shards(1);
    for (int64_t r = 0; r < parallel_.dp; ++r) shards[0].push_back(at::empty_like(shard_param_));
    std::vector<at::Tensor> mine = {shard_param_.detach()};
    Complete(dp_group_->allgather(shards, mine));
    const at::Tensor whole = at::cat(shards[0]).narrow(0, 0, n_params_);
    TORCH_CHECK(at::equal(whole, Flat(owned_, n_params_)),
                "ZeRO-3: the gathered parameters differ from the ranks' shards");
  }

  // Bucket: the gradients copied into one flat buffer (padded to a multiple of dp), the
  // buffer a reduction over the data-parallel group sends and receives in place.
  at::Tensor Bucket() const { return Flat(OwnedGrads(), Shard() * parallel_.dp); }

  // ReduceScatter: this rank's shard of the bucket summed over the data-parallel group,
  // divided by `divisor`: a copy of its shard of the all-reduced bucket. (Gloo's reduce_scatter
  // first clones its whole input on the CPU, a copy NCCL's does not make: the bucket
  // and the shard are what a reduce-scatter holds.)
  at::Tensor ReduceScatter(at::Tensor& bucket, int64_t divisor) const {
    std::vector<at::Tensor> buffer = {bucket};
    Complete(dp_group_->allreduce(buffer));
    at::Tensor mine = bucket.narrow(0, position_.dp_rank * Shard(), Shard()).clone();
    mine.div_(static_cast<double>(divisor));
    return mine;
  }

  // AllReduceBucket: the bucket summed over the data-parallel group, divided by
  // `divisor`, in place.
  void AllReduceBucket(at::Tensor& bucket, int64_t divisor) const {
    std::vector<at::Tensor> buffer = {bucket};
    Complete(dp_group_->allreduce(buffer));
    bucket.div_(static_cast<double>(divisor));
  }

  // GatherShards: every rank's updated shard into the flat parameters, in place: the
  // others' shards zeroed, then summed over the group (x + 0 is exact). Gloo's
  // all_gather allocates two output-sized buffers on the CPU; NCCL's in-place
  // all-gather, as Megatron's distributed optimizer runs it, none.
  void GatherShards() {
    at::NoGradGuard no_grad;
    const int64_t offset = position_.dp_rank * Shard();
    flat_params_.narrow(0, 0, offset).zero_();
    const int64_t after = offset + Shard();
    flat_params_.narrow(0, after, flat_params_.numel() - after).zero_();
    std::vector<at::Tensor> buffer = {flat_params_};
    Complete(dp_group_->allreduce(buffer));
  }

  // ReduceGradients averages the gradients over the data-parallel group: an all-reduce
  // of the whole flat buffer (ZeRO 0, 1) or a reduce-scatter into this rank's shard
  // (ZeRO 2, 3, after which the full gradients are freed). Writes what the rank holds
  // to `path`; with `for_step` keeps it for the optimizer and records grad_bytes.
  Piece ReduceGradients(bool for_step, const std::string& path) {
    at::Tensor flat = Bucket();
    Piece piece;
    // FSDP2's shards are per parameter, not a range of the flat buffer: its ranks check
    // the whole mean gradient, and Step takes each parameter's rows from it.
    if (shards_.gradients && shards_.flat) {
      at::Tensor mine = ReduceScatter(flat, parallel_.dp);
      flat = at::Tensor();
      for (const at::Tensor& p : owned_) p.mutable_grad() = at::Tensor();
      piece = WritePiece(path, mine, position_.dp_rank * Shard(), n_params_);
      if (for_step) {
        step_grads_ = mine;
        grad_bytes_ = TensorBytes(mine);
      }
    } else {
      if (parallel_.dp > 1) {
        AllReduceBucket(flat, parallel_.dp);
        Unflatten(flat, OwnedGrads());
      }
      piece = WritePiece(path, flat, 0, n_params_);
      if (for_step) {
        step_grads_ = flat;
        grad_bytes_ = 0;
        for (const at::Tensor& g : OwnedGrads()) grad_bytes_ += TensorBytes(g);
      }
    }
    return piece;
  }

  // StepShard steps this rank's ZeRO shard on `grad` (which it releases), then
  // all-gathers the updated shards into the flat parameters (ZeRO 1, 2).
  void StepShard(at::Tensor grad) {
    shard_param_.mutable_grad() = std::move(grad);
    optimizer_->Step();
    shard_param_.mutable_grad() = at::Tensor();
    if (!shards_.parameters) GatherShards();
  }

  // Step runs the optimizer on `none`'s reduced gradients: on every owned parameter
  // (ZeRO 0), or on this rank's shard of the flat parameters, all-gathered back into
  // the parameters (ZeRO 1, 2) or kept as all the rank holds (ZeRO 3, which frees the
  // parameters). The optimizer lives on for the counted steps (MeasureStep). Writes the
  // rank's updated parameters.
  Piece Step() {
    const std::string path = RankFile(dir_, position_.rank, "params");
    if (data_parallel_ == DataParallel::kFsdp2) return StepFsdp2(path);
    if (!shards_.optimizer_state) {
      for (const at::Tensor& p : owned_) p.mutable_grad() = at::zeros_like(p);
      Unflatten(step_grads_, OwnedGrads());
      step_grads_ = at::Tensor();
      optimizer_ = std::make_unique<OptimizerRunner>(request_.optimizer, owned_);
      optimizer_->Step();
      RecordOptimizer();
      for (const at::Tensor& p : owned_) param_bytes_ += TensorBytes(p);
      return WritePiece(path, Flat(owned_, n_params_), 0, n_params_);
    }
    const int64_t offset = position_.dp_rank * Shard();
    if (shards_.parameters) {
      shard_param_ = Flat(owned_, Shard() * parallel_.dp)
                         .narrow(0, offset, Shard())
                         .clone()
                         .requires_grad_(true);
    }
    at::Tensor grad = shards_.gradients ? step_grads_
                                        : step_grads_.narrow(0, offset, Shard()).clone();
    step_grads_ = at::Tensor();
    for (const at::Tensor& p : owned_) p.mutable_grad() = at::Tensor();
    optimizer_ =
        std::make_unique<OptimizerRunner>(request_.optimizer, std::vector<at::Tensor>{shard_param_});
    StepShard(std::move(grad));
    RecordOptimizer();
    const Piece piece = WritePiece(path, shard_param_, offset, n_params_);
    if (shards_.parameters) {
      // The rank keeps only its shard; a forward would all-gather the parameters again.
      for (const at::Tensor& p : owned_) p.set_data(at::empty({0}, p.options()));
      param_bytes_ = TensorBytes(shard_param_);
    }
    for (const at::Tensor& p : owned_) param_bytes_ += TensorBytes(p);
    return piece;
  }

  // StepFsdp2: the parameters sharded as fully_shard shards them (Fsdp2Units: the
  // model's tensors become views of freed unsharded storages), each local shard's
  // gradient its rows of the mean gradient, the optimizer over the local shards; the
  // updated shards assembled into the whole parameters for the check.
  Piece StepFsdp2(const std::string& path) {
    std::vector<at::Tensor> grads = OwnedGrads();
    for (const at::Tensor& p : owned_) p.mutable_grad() = at::Tensor();
    step_grads_ = at::Tensor();
    Fsdp2Units::Context context;
    context.config = &config_;
    context.fsdp = parallel_.fsdp;
    context.dp_group = dp_group_.get();
    context.dp_rank = position_.dp_rank;
    context.dp = parallel_.dp;
    context.post_forward_group = post_forward_group_.get();
    fsdp_ = std::make_unique<Fsdp2Units>(context, owned_, owned_names_);
    fsdp_->SetGradients(fsdp_->LocalRowsOf(grads));
    grads.clear();
    optimizer_ = std::make_unique<OptimizerRunner>(request_.optimizer, fsdp_->Locals());
    optimizer_->Step();
    fsdp_->ClearGradients();
    RecordOptimizer();
    param_bytes_ = grad_bytes_ = fsdp_->ShardBytes();
    return WritePiece(path, fsdp_->WholeParameters(), 0, n_params_);
  }

  // RunPipeline runs the rank's micro-batches as PipelineSteps lists them
  // (estimator/step/pipeline_steps.h: Megatron-LM's 1F1B or interleaved order, with its p2p
  // operations posted and waited together; with one stage, each forward then its
  // backward), checked against this runtime's own MegatronOrder. Every receive
  // allocates a new buffer; a sent output is freed once the paired operations complete
  // (deallocate_output_tensor: the graph lives on through its grad_fn's edge, from
  // which the backward runs); a received input is a leaf whose .grad is sent back after
  // its backward, then both are freed. On the model's last chunk each loss, after its
  // backward, is added into the first (a running total, as a training loop reports the
  // step's loss) and freed; the total is returned (undefined on other ranks).
  PipelineResult RunPipeline(const Variant& variant, const std::vector<at::Tensor>& inputs,
                             const PipelineRun& run) {
    const int64_t pp = parallel_.pp;
    const int64_t chunks = pp * parallel_.virtual_stages;  // model chunks in all
    const int next_rank = static_cast<int>((position_.stage + 1) % pp);
    const int previous_rank = static_cast<int>((position_.stage + pp - 1) % pp);
    // The hidden states between chunks: this rank's T / tp tokens with sequence
    // parallelism, in the parameters' dtype (autocast casts inside the layers).
    const int64_t tokens = config_.shard.sp ? config_.seq / config_.shard.tp : config_.seq;
    const std::vector<int64_t> hidden_shape = {config_.batch, tokens, config_.width};
    const at::TensorOptions hidden_options = parameters_.front().options();
    // Tags name (micro-batch, model chunk g, direction): the activation entering chunk
    // g, or the gradient leaving it backwards.
    auto tag = [&](int64_t j, int64_t g, bool gradient) {
      return static_cast<int>((j * chunks + g) * 2 + (gradient ? 1 : 0));
    };
    auto global = [&](int64_t c) { return c * pp + position_.stage; };
    struct InFlight {
      int64_t micro_batch = 0;
      at::Tensor received;                // a later chunk's input leaf
      torch::autograd::Edge output_edge;  // a chunk without the head: its output's grad_fn
      at::Tensor loss;                    // the model's last chunk's, until its backward
      int64_t saved_bytes = 0;            // with PipelineRun::record_saved
    };
    PipelineResult result;
    int64_t held = 0, held_micro_batches = 0;
    const size_t local = chunks_.size();
    std::vector<std::deque<at::Tensor>> received(local), output_grads(local);
    std::vector<std::deque<InFlight>> in_flight(local);
    std::vector<int64_t> forwards(local, 0), inputs_received(local, 0), grads_received(local, 0);
    at::Tensor last_output, last_input_grad, last_received;
    int64_t last_output_chunk = 0, last_output_micro_batch = 0;
    int64_t last_grad_chunk = 0, last_grad_micro_batch = 0;
    std::vector<c10::intrusive_ptr<c10d::Work>> pending;
    std::vector<ScheduleStep> order;  // what ran, for the check against MegatronOrder
    for (const PipelineStep& step : PipelineSteps(parallel_, position_.stage)) {
      switch (step.kind) {
        case PipelineStep::Kind::kForward: {
          const StageRange& chunk = chunks_[step.chunk];
          InFlight f;
          f.micro_batch = forwards[step.chunk]++;
          order.push_back({true, f.micro_batch, step.chunk});
          if (!chunk.prologue) {
            TORCH_CHECK(!received[step.chunk].empty(), "a forward without its received input");
            f.received = received[step.chunk].front().requires_grad_(true);
            received[step.chunk].pop_front();
          }
          Place(f.micro_batch);
          if (run.counting != nullptr) run.counting->MarkPhase("forward");
          at::Tensor output;
          {
            SavedTensorRecorder recorder(parameter_storages_);
            std::optional<ScopedSavedTensorRecording> recording;
            if (run.record_saved) recording.emplace(&recorder);
            ForwardResult forward = ForwardStage(*built_.model, chunk, f.received,
                                                 inputs[f.micro_batch], request_.attention,
                                                 variant, run.units);
            output = std::move(forward.loss);
            if (run.record_saved) {
              f.saved_bytes = recorder.bytes() + forward.cache_bytes;
              held += f.saved_bytes;
              ++held_micro_batches;
              if (held > result.stats.held_bytes) {
                result.stats.held_bytes = held;
                result.stats.in_flight = held_micro_batches;
              }
            }
          }
          if (chunk.head) {
            // The verified schedule takes the step's mean over micro-batches here, as
            // Megatron does; the counted step divides the reduced gradients instead.
            f.loss = run.scale_loss ? output / static_cast<double>(parallel_.micro_batches)
                                    : std::move(output);
          } else {
            f.output_edge = torch::autograd::impl::gradient_edge(output);
            last_output = std::move(output);
            last_output_chunk = step.chunk;
            last_output_micro_batch = f.micro_batch;
          }
          in_flight[step.chunk].push_back(std::move(f));
          break;
        }
        case PipelineStep::Kind::kBackward: {
          const StageRange& chunk = chunks_[step.chunk];
          TORCH_CHECK(!in_flight[step.chunk].empty(), "a backward before its forward");
          InFlight f = std::move(in_flight[step.chunk].front());
          in_flight[step.chunk].pop_front();
          order.push_back({false, f.micro_batch, step.chunk});
          Place(f.micro_batch);
          if (run.counting != nullptr) run.counting->MarkPhase("backward");
          held -= f.saved_bytes;
          --held_micro_batches;
          if (run.units != nullptr) {
            run.units->BeginBackward(chunk.head ? ParameterUnits::kHead
                                                : chunk.first_layer + chunk.layers - 1);
          }
          if (run.ddp != nullptr && f.micro_batch == parallel_.micro_batches - 1) {
            run.ddp->BeforeSyncingBackward(step.chunk);
          }
          if (chunk.head) {
            f.loss.backward();
            if (run.units != nullptr) run.units->EndBackward();
            // As values: a loss's graph would keep a received leaf (and its .grad)
            // alive through the leaf's AccumulateGrad node.
            if (result.total_loss.defined()) {
              result.total_loss.add_(f.loss.detach());
            } else {
              result.total_loss = f.loss.detach();
            }
            f.loss = at::Tensor();
          } else {
            TORCH_CHECK(!output_grads[step.chunk].empty(), "a backward without its gradient");
            at::Tensor output_grad = std::move(output_grads[step.chunk].front());
            output_grads[step.chunk].pop_front();
            torch::autograd::Engine::get_default_engine().execute(
                {f.output_edge}, {output_grad}, /*keep_graph=*/false, /*create_graph=*/false,
                /*accumulate_grad=*/true, /*outputs=*/{});
            if (run.units != nullptr) run.units->EndBackward();
            f.output_edge = torch::autograd::Edge();
          }
          if (!chunk.prologue) {
            last_input_grad = f.received.grad();
            last_received = std::move(f.received);
            last_grad_chunk = step.chunk;
            last_grad_micro_batch = f.micro_batch;
          }
          break;
        }
        case PipelineStep::Kind::kCommunicate: {
          auto post_receive = [&](int peer, int t) {
            std::vector<at::Tensor> buffer = {at::empty(hidden_shape, hidden_options)};
            pending.push_back(pp_group_->recv(buffer, peer, t));
            return buffer[0];
          };
          auto post_send = [&](const at::Tensor& t, int peer, int tag_value) {
            std::vector<at::Tensor> buffer = {t};
            pending.push_back(pp_group_->send(buffer, peer, tag_value));
          };
          if (step.send_output) {
            post_send(last_output.detach(), next_rank,
                      tag(last_output_micro_batch, global(last_output_chunk) + 1, false));
          }
          if (step.send_input_grad) {
            post_send(last_input_grad, previous_rank,
                      tag(last_grad_micro_batch, global(last_grad_chunk), true));
          }
          if (step.receive_input >= 0) {
            const int64_t c = step.receive_input;
            received[c].push_back(
                post_receive(previous_rank, tag(inputs_received[c]++, global(c), false)));
          }
          if (step.receive_output_grad >= 0) {
            const int64_t c = step.receive_output_grad;
            output_grads[c].push_back(
                post_receive(next_rank, tag(grads_received[c]++, global(c) + 1, true)));
          }
          for (const auto& work : pending) Complete(work);
          pending.clear();
          if (step.send_output) last_output = at::Tensor();
          if (step.send_input_grad) {
            last_input_grad = at::Tensor();
            last_received = at::Tensor();
          }
          break;
        }
      }
    }
    const std::vector<ScheduleStep> megatron = MegatronOrder(parallel_, position_.stage);
    TORCH_CHECK(order.size() == megatron.size(), "the schedule ran ", order.size(),
                " forwards and backwards, Megatron's order has ", megatron.size());
    for (size_t i = 0; i < order.size(); ++i) {
      TORCH_CHECK(order[i].forward == megatron[i].forward &&
                      order[i].micro_batch == megatron[i].micro_batch &&
                      order[i].chunk == megatron[i].chunk,
                  "the schedule's step ", i, " differs from Megatron's order");
    }
    return result;
  }

  // MeasureStep runs one more whole step of `variant` (RankStepModelled: no tensor
  // parallelism, ZeRO 0-2) under a counting allocator, as the single-process
  // runtime's MeasureStep does with the data-parallel reduction in the optimizer phase
  // (the simulation's RankStep): zero_grad(set_to_none); the stage's micro-batches in
  // Megatron's order (RunPipeline), gradients accumulating; without ZeRO, torch's DDP
  // (DdpReducers: its Reducer's hooks reduce the .grads in each chunk's last backward);
  // the tied embedding's gradients all-reduced in place between the first and last
  // stage; with FSDP2 (Fsdp2Units) each unit unsharded around its forward and backward
  // and its gradients reduce-scattered after its backward; with ZeRO the gradients
  // copied into the bucket and all-reduced (ZeRO 1) or reduce-scattered (ZeRO 2) and
  // divided by dp x micro-batches (the mean, which the verified schedule takes by
  // scaling each loss instead); the .grads freed; the optimizer's step; the updated
  // shards all-gathered.
  // Before it: the parameters (the padded flat buffer with ZeRO), the optimizer's state
  // and the micro-batches.
  CountedStep MeasureStep(const Variant& variant) {
    for (const at::Tensor& p : parameters_) p.mutable_grad() = at::Tensor();
    // The micro-batches' inputs, on a stage that reads them (the embedding's; the
    // families' head makes its labels from the ids). A middle stage reads only their
    // length: an empty stand-in.
    const bool reads_input = first_ || (last_ && FamilyOf(config_.family).decoder);
    std::vector<at::Tensor> inputs;
    for (int64_t j = 0; j < parallel_.micro_batches; ++j) {
      inputs.push_back(reads_input ? MicroBatch(j)
                                   : at::empty({config_.batch, config_.seq, 0}, at::kLong));
    }
    if (data_parallel_ == DataParallel::kZero3 && units_ == nullptr) {
      // The parameters become views of their units' flat buffers, released (0 bytes).
      GatheredUnits::Context context;
      context.config = &config_;
      context.dp_group = dp_group_.get();
      context.tp_group = config_.shard.tp > 1 ? tp_group_.get() : nullptr;
      context.dp_rank = position_.dp_rank;
      context.shard = Shard();
      context.shard_param = &shard_param_;
      units_ = std::make_unique<GatheredUnits>(context, owned_, owned_names_, owned_sizes_);
    }
    // ZeRO-3's reference: the same step's shard gradient with every unit gathered at
    // once and one reduction at the end, on the same parameters (not counted).
    at::Tensor whole_step_grad;
    if (units_ != nullptr) {
      units_->GatherAll();
      CheckGathered();
      RunPipeline(variant, inputs, PipelineRun());
      AllReducePartialGradients();
      at::Tensor bucket = Bucket();
      AllReduce(dp_group_.get(), bucket);
      whole_step_grad = bucket.narrow(0, position_.dp_rank * Shard(), Shard()).clone();
      for (const at::Tensor& p : owned_) p.mutable_grad() = at::Tensor();
      units_->ReleaseAll();
    }
    // FSDP2's reference likewise: every unit unsharded, one reduction at the end, each
    // local shard's rows of the mean.
    std::vector<at::Tensor> fsdp_reference;
    if (fsdp_ != nullptr) {
      fsdp_->UnshardAll();
      RunPipeline(variant, inputs, PipelineRun());
      std::vector<at::Tensor> grads = OwnedGrads();
      for (at::Tensor& g : grads) AllReduce(dp_group_.get(), g);
      for (at::Tensor& g : grads) g.div_(static_cast<double>(parallel_.dp));
      fsdp_reference = fsdp_->LocalRowsOf(grads);
      grads.clear();
      for (const at::Tensor& p : owned_) p.mutable_grad() = at::Tensor();
      fsdp_->ReshardAll();
    }
    const bool ddp = data_parallel_ == DataParallel::kDdp;
    if (ddp) {
      if (ddp_ == nullptr) MakeDdp();
      ddp_->BeforeStep();
    }
    CountedStep step;
    step.resident_bytes = (flat_params_.defined() ? TensorBytes(flat_params_) : param_bytes_) +
                          optimizer_state_bytes_ + (ddp ? ddp_->BucketBytes() : 0);
    // The model's buffers (RoPE's inverse frequencies), which every rank's model holds.
    for (const at::Tensor& b : built_.model->buffers()) step.resident_bytes += TensorBytes(b);
    for (const at::Tensor& input : inputs) step.resident_bytes += TensorBytes(input);
    ScopedCountingAllocator counting(ScopedCountingAllocator::Record::kTimeline);
    counting.MarkPhase("forward");
    PipelineRun run;
    run.counting = &counting;
    run.units = fsdp_ != nullptr ? static_cast<ParameterUnits*>(fsdp_.get()) : units_.get();
    run.ddp = ddp_.get();
    const at::Tensor total_loss = RunPipeline(variant, inputs, run).total_loss;
    if (units_ == nullptr && fsdp_ == nullptr) {
      AllReducePartialGradients();  // in place
      ExchangeTiedGradients();      // in place
    }
    counting.MarkPhase("optimizer");
    const int64_t divisor = parallel_.dp * parallel_.micro_batches;
    if (units_ != nullptr) {
      // ZeRO-3: the shard's gradient, reduced unit by unit in the backward.
      at::Tensor mine = units_->TakeGradient();
      step.unit_grad_diff = MaxAbsDiff(mine, whole_step_grad);  // allocates nothing
      mine.div_(static_cast<double>(divisor));
      StepShard(std::move(mine));
    } else if (fsdp_ != nullptr) {
      // FSDP2: each local shard's gradient, reduced unit by unit in the backward.
      step.unit_grad_diff = fsdp_->MaxGradientDiff(fsdp_reference);  // allocates nothing
      optimizer_->Step();
    } else if (data_parallel_ == DataParallel::kOneRank || ddp) {
      optimizer_->Step();  // DDP reduced the .grads in the backward
    } else {
      at::Tensor bucket = Bucket();
      if (data_parallel_ == DataParallel::kZero2) {
        at::Tensor mine = ReduceScatter(bucket, divisor);
        bucket = at::Tensor();
        for (const at::Tensor& p : owned_) p.mutable_grad() = at::Tensor();
        StepShard(std::move(mine));
      } else {
        AllReduceBucket(bucket, divisor);
        if (data_parallel_ == DataParallel::kReplicated) {
          Unflatten(bucket, OwnedGrads());
          bucket = at::Tensor();
          optimizer_->Step();
        } else {
          for (const at::Tensor& p : owned_) p.mutable_grad() = at::Tensor();
          at::Tensor mine = bucket.narrow(0, position_.dp_rank * Shard(), Shard());
          bucket = at::Tensor();
          StepShard(std::move(mine));
        }
      }
    }
    step.peak = counting.peak();
    step.peak_bytes = step.resident_bytes + step.peak.bytes;
    if (fsdp_ != nullptr) fsdp_->ClearGradients();
    return step;
  }

  // MakeDdp: torch's DDP over each local model chunk's parameters (owned_, grouped by
  // the chunk that runs their unit).
  void MakeDdp() {
    std::vector<std::vector<at::Tensor>> chunk_parameters(chunks_.size());
    for (size_t i = 0; i < owned_.size(); ++i) {
      const int64_t unit = UnitOf(config_, owned_names_[i]);
      size_t c = 0;
      while (c + 1 < chunks_.size() &&
             !(unit == ParameterUnits::kPrologue ? chunks_[c].prologue
               : unit == ParameterUnits::kHead   ? chunks_[c].head
                                                 : unit >= chunks_[c].first_layer &&
                                                     unit < chunks_[c].first_layer +
                                                                chunks_[c].layers)) {
        ++c;
      }
      chunk_parameters[c].push_back(owned_[i]);
    }
    ddp_ = std::make_unique<DdpReducers>(chunk_parameters, dp_group_, parallel_.ddp);
  }

  void RecordOptimizer() {
    const OptimizerStateBytes state = optimizer_->StateBytes();
    optimizer_state_bytes_ = state.total;
    adamw_state_bytes_ = request_.optimizer.kind == OptimizerKind::kAdamW ? state.moments : 0;
  }

  const ModelConfig config_;
  const ParallelSpec parallel_;
  // How the data-parallel ranks run, and what this rank holds sharded (the estimator's
  // step and predict read the same: estimator/request/parallel_spec.h).
  const DataParallel data_parallel_;
  const RankShards shards_;
  const DistributedRequest request_;
  const std::string dir_;
  const RankPosition position_;
  const std::vector<StageRange> chunks_;  // its model chunks, in order
  const bool first_;                      // runs the embedding (the first pipeline rank)
  const bool last_;                       // runs the head and loss (the last pipeline rank)

  ModelAndInput built_;
  std::vector<at::Tensor> parameters_;
  std::unordered_set<const void*> parameter_storages_;
  c10::intrusive_ptr<c10d::Store> store_;
  GroupPtr tp_group_, dp_group_, pp_group_, embedding_group_, post_forward_group_;
  std::unique_ptr<TensorParallel> tensor_parallel_;
  std::unique_ptr<GatheredUnits> units_;  // ZeRO-3's, for the counted steps
  std::unique_ptr<DdpReducers> ddp_;       // DDP's, for the counted steps
  std::unique_ptr<Fsdp2Units> fsdp_;       // FSDP2's, from the first step on
  std::vector<at::Tensor> owned_;
  std::vector<std::string> owned_names_;
  std::vector<std::vector<int64_t>> owned_sizes_;
  bool tied_found_ = false;
  std::vector<at::Tensor> tied_;
  at::Tensor step_grads_;
  at::Tensor flat_params_;  // ZeRO 1, 2: the parameters' flat buffer (HomeParameters)
  at::Tensor shard_param_;  // ZeRO 1-3: what this rank's optimizer steps
  std::unique_ptr<OptimizerRunner> optimizer_;
  int64_t n_params_ = 0, param_bytes_ = 0, grad_bytes_ = 0;
  int64_t optimizer_state_bytes_ = 0, adamw_state_bytes_ = 0;
};

}  // namespace

void RunRank(const ModelConfig& config, const ParallelSpec& parallel,
             const DistributedRequest& request, const std::string& dir, int64_t rank) {
  Rank(config, parallel, request, dir, rank).Run();
}

}  // namespace memledger::runtime::distributed_internal
