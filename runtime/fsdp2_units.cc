#include "runtime/fsdp2_units.h"

#include <ATen/native/Resize.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <utility>

#include "runtime/gloo_collectives.h"
#include "runtime/zero_units.h"

namespace memledger::runtime::distributed_internal {

Fsdp2Units::Fsdp2Units(Context context, const std::vector<at::Tensor>& owned,
                       const std::vector<std::string>& names)
    : context_(context) {
  at::NoGradGuard no_grad;
  const int64_t dp = context_.dp;
  first_layer_ = kHead;
  for (size_t i = 0; i < owned.size(); ++i) {
    const int64_t unit = RootOr(UnitOf(*context_.config, names[i]));
    if (unit != kHead) first_layer_ = std::min(first_layer_, unit);
    Parameter p;
    p.model = owned[i];
    p.sizes = owned[i].sizes().vec();
    p.numel = owned[i].numel();
    // Shard(0) with padding (FSDPParam._init_sharded_param, _fsdp_param.py): ceil(rows /
    // dp) rows per rank, the last ranks' padded (or empty).
    p.rows = p.sizes.empty() ? 1 : p.sizes[0];
    p.row_elements = p.rows == 0 ? 0 : p.numel / p.rows;
    p.shard_rows = (p.rows + dp - 1) / dp;
    p.shard_elements = p.shard_rows * p.row_elements;
    p.local_rows = std::clamp<int64_t>(p.rows - context_.dp_rank * p.shard_rows, 0, p.shard_rows);
    p.sharded = at::zeros({p.shard_elements}, owned[i].options());
    const at::Tensor whole = owned[i].detach().reshape({-1});
    at::Tensor local = p.sharded.narrow(0, 0, p.local_rows * p.row_elements);
    local.copy_(whole.narrow(0, context_.dp_rank * p.shard_elements, local.numel()));
    std::vector<int64_t> local_sizes = p.sizes;
    if (!local_sizes.empty()) local_sizes[0] = p.local_rows;
    p.local = local.view(local_sizes).requires_grad_(true);
    locals_.push_back(p.local);
    // The model's tensor becomes a view of its unsharded storage, freed until unsharded.
    p.unsharded = at::empty({dp * p.shard_elements}, owned[i].options());
    at::Tensor model = p.model;  // set_data changes every handle's variable
    model.set_data(p.unsharded.narrow(0, 0, p.numel).view(p.sizes));
    Resize(p.unsharded, 0);
    Unit& u = units_[unit];
    p.offset = u.shard_elements;
    u.shard_elements += p.shard_elements;
    u.parameters.push_back(parameters_.size());
    parameters_.push_back(std::move(p));
  }
}

int64_t Fsdp2Units::RootOr(int64_t unit) const {
  return unit == kPrologue || unit == kHead ? kHead : unit;
}

void Fsdp2Units::Resize(at::Tensor& storage_of, int64_t elements) {
  c10::StorageImpl* storage = storage_of.storage().unsafeGetStorageImpl();
  storage->set_allocator(c10::GetCPUAllocator());  // the counting allocator of the moment
  at::native::resize_bytes_cpu(storage, static_cast<size_t>(elements * storage_of.element_size()));
}

// foreach_all_gather (_fsdp_collectives.py:351): the output, dp x the unit's padded
// shards, whose slice of this rank is the input (all_gather_copy_in). Gloo's
// all-gather copies: the others' slices are zeroed and the output all-reduced in place
// (x + 0 is exact); NCCL's all_gather_into_tensor holds the same bytes.
//
// A unit on its post-forward mesh of N ranks gathers from them alone (its
// _all_gather_process_group, _fsdp_param_group.py:1216): the same output, of N slices of
// each parameter's padded unsharded storage, each rank's its post-forward shards.
at::Tensor Fsdp2Units::AllGather(Unit& u) {
  at::NoGradGuard no_grad;
  const at::Tensor& any = parameters_[u.parameters.front()].sharded;
  at::Tensor output = at::empty({context_.dp * u.shard_elements}, any.options());
  output.zero_();
  if (u.post_forward) {
    const int64_t n = context_.fsdp.PostForwardRanks(context_.dp);
    const int64_t per_rank = context_.dp * u.shard_elements / n;
    for (size_t i : u.parameters) {
      const Parameter& p = parameters_[i];
      output.narrow(0, (context_.dp_rank % n) * per_rank + p.offset * context_.dp / n,
                    p.post_forward.numel())
          .copy_(p.post_forward);
    }
    AllReduce(context_.post_forward_group, output);
    return output;
  }
  for (size_t i : u.parameters) {
    const Parameter& p = parameters_[i];
    output.narrow(0, context_.dp_rank * u.shard_elements + p.offset, p.shard_elements)
        .copy_(p.sharded);
  }
  AllReduce(context_.dp_group, output);
  return output;
}

// unshard + wait_for_unshard (_fsdp_param_group.py:458, :505): the all-gather output,
// unless prefetched; in the forward the one kept from the unit before is released first
// (release_all_gather_state_for_comm_reuse); each parameter's unsharded storage
// allocated and filled from it (foreach_all_gather_copy_out, split_with_sizes_copy);
// the output kept to the next unit's copy-out in the forward, freed in the backward.
void Fsdp2Units::Unshard(int64_t unit, bool forward) {
  Unit& u = UnitAt(unit);
  if (u.unsharded) return;
  at::NoGradGuard no_grad;
  at::Tensor output = u.prefetched.defined() ? std::move(u.prefetched) : AllGather(u);
  u.prefetched = at::Tensor();
  if (forward) all_gather_state_ = at::Tensor();
  for (size_t i : u.parameters) {
    Parameter& p = parameters_[i];
    Resize(p.unsharded, context_.dp * p.shard_elements);
  }
  // Gathered from every rank, or from the post-forward mesh's n (whose slices are dp / n
  // of each parameter's padded shards), the copy-out is the same split.
  const int64_t n = u.post_forward ? context_.fsdp.PostForwardRanks(context_.dp) : context_.dp;
  const int64_t per_shard = context_.dp / n;  // padded shards per slice
  const at::Tensor by_rank = output.view({n, per_shard * u.shard_elements});
  for (size_t i : u.parameters) {
    Parameter& p = parameters_[i];
    p.unsharded.view({n, per_shard * p.shard_elements})
        .copy_(by_rank.narrow(1, per_shard * p.offset, per_shard * p.shard_elements));
  }
  // _to_unsharded (FSDPParam.to_unsharded, _fsdp_param.py:1015): the post-forward shards
  // let go.
  if (u.post_forward) {
    for (size_t i : u.parameters) parameters_[i].post_forward = at::Tensor();
    u.post_forward = false;
  }
  u.unsharded = true;
  if (forward) all_gather_state_ = std::move(output);
}

// reshard (_fsdp_param_group.py:586): the unsharded storages freed, in the parameters'
// order.
void Fsdp2Units::Reshard(int64_t unit) {
  Unit& u = UnitAt(unit);
  if (!u.unsharded) return;
  for (size_t i : u.parameters) Resize(parameters_[i].unsharded, 0);
  u.unsharded = false;
}

// reshard to the post-forward mesh (FSDPParam.to_sharded_post_forward, _fsdp_param.py:970):
// each parameter in turn clones its mesh rank's 1 / n of the unsharded storage, then
// frees the storage.
void Fsdp2Units::ReshardPostForward(int64_t unit, int64_t ranks) {
  Unit& u = UnitAt(unit);
  if (!u.unsharded) return;
  at::NoGradGuard no_grad;
  for (size_t i : u.parameters) {
    Parameter& p = parameters_[i];
    const int64_t slice = context_.dp * p.shard_elements / ranks;
    p.post_forward = p.unsharded.narrow(0, (context_.dp_rank % ranks) * slice, slice).clone();
    Resize(p.unsharded, 0);
  }
  u.unsharded = false;
  u.post_forward = true;
}

// _prefetch_unshard in the backward (_backward_prefetch, :1061): the all-gather alone;
// its copy-out waits for the unit's own pre-backward.
void Fsdp2Units::Prefetch(int64_t unit) {
  Unit& u = UnitAt(unit);
  if (u.unsharded || u.prefetched.defined()) return;
  u.prefetched = AllGather(u);
}

// post_backward (:695): reshard; the previous unit's reduce-scatter input freed
// (reduce_scatter_max_input_buffers = 1); foreach_reduce (_fsdp_collectives.py:604): the
// input, dp x the padded shards, filled by torch._chunk_cat, whose CPU kernel first
// copies each gradient whose rows are not a multiple of the ranks into a zero-padded
// tensor (all of them, then freed: ATen's _pad_chunk); the unsharded .grads freed, last
// parameter first; the output, the unit's sharded gradients in one storage that the
// local tensors' .grads view; its division by the ranks (the witness's Gloo ranks
// average by a division, as NCCL's ReduceOp.AVG does in the collective). The input
// stays until the next unit's reduction.
void Fsdp2Units::PostBackward(int64_t unit) {
  Reshard(unit);
  Unit& u = UnitAt(unit);
  at::NoGradGuard no_grad;
  const int64_t dp = context_.dp;
  reduce_scatter_input_ = at::Tensor();
  at::Tensor input =
      at::empty({dp * u.shard_elements}, parameters_[u.parameters.front()].sharded.options());
  {
    std::vector<at::Tensor> sources;
    for (size_t i : u.parameters) {
      Parameter& p = parameters_[i];
      const at::Tensor grad = p.model.grad();
      TORCH_CHECK(grad.defined(), "FSDP2: no gradient for a parameter of unit ", unit);
      if (p.rows % dp == 0) {
        sources.push_back(grad.reshape({-1}));
      } else {
        at::Tensor padded = at::zeros({dp * p.shard_elements}, grad.options());
        padded.narrow(0, 0, p.numel).copy_(grad.reshape({-1}));
        sources.push_back(std::move(padded));
      }
    }
    const at::Tensor by_rank = input.view({dp, u.shard_elements});
    for (size_t k = 0; k < u.parameters.size(); ++k) {
      const Parameter& p = parameters_[u.parameters[k]];
      by_rank.narrow(1, p.offset, p.shard_elements).copy_(sources[k].view({dp, p.shard_elements}));
    }
  }  // the padded copies freed
  for (auto it = u.parameters.rbegin(); it != u.parameters.rend(); ++it) {
    parameters_[*it].model.mutable_grad() = at::Tensor();
  }
  at::Tensor output = at::empty({u.shard_elements}, input.options());
  AllReduce(context_.dp_group, input);
  output.copy_(input.narrow(0, context_.dp_rank * u.shard_elements, u.shard_elements));
  output.div_(static_cast<double>(dp));
  for (size_t i : u.parameters) {
    Parameter& p = parameters_[i];
    p.local.mutable_grad() =
        output.narrow(0, p.offset, p.local_rows * p.row_elements).view(p.local.sizes());
  }
  reduce_scatter_input_ = std::move(input);
}

// The root's post-backward, the engine's final callback (_fsdp_state.py:422): the root
// reshards and reduces, then the last reduce-scatter input is freed.
void Fsdp2Units::RootPostBackward() {
  root_post_backward_pending_ = false;
  PostBackward(kHead);
  reduce_scatter_input_ = at::Tensor();
}

void Fsdp2Units::Gather(int64_t unit) {
  // pre_forward: the root unshards as the model's forward starts (the embedding's); the
  // head runs on the root's parameters.
  if (unit != kHead) Unshard(unit, /*forward=*/true);
}

// post_forward (:657): a layer reshards after its forward (reshard_after_forward), the
// root after the model's (not under fully_shard's default, auto), which also releases
// the last kept all-gather output.
void Fsdp2Units::Release(int64_t unit) {
  if (unit == kPrologue) return;
  const int64_t ranks = unit == kHead ? context_.fsdp.RootPostForwardRanks(context_.dp)
                                      : context_.fsdp.PostForwardRanks(context_.dp);
  if (ranks == context_.dp) {
    Reshard(unit);
  } else if (ranks > 1) {
    ReshardPostForward(unit, ranks);
  }
  if (unit == kHead) all_gather_state_ = at::Tensor();
}

// The root's pre_backward (:679), from the hook on the loss: it unshards, prefetches the
// last layer and queues its post-backward to the backward's end.
void Fsdp2Units::LossMade(const at::Tensor& loss) {
  at::Tensor handle = loss;
  handle.register_hook([this](const at::Tensor& /*grad*/) {
    Unshard(kHead, /*forward=*/false);
    if (units_.size() > 1) Prefetch(std::prev(units_.end(), 2)->first);  // the last layer
    root_post_backward_pending_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { RootPostBackward(); });
  });
}

// A unit's input's gradient is made: its post-backward (the root's waits for the
// backward's end), then the unit before it unshards and prefetches its own previous.
void Fsdp2Units::BackwardPassed(int64_t unit, int64_t previous) {
  if (unit != kHead) PostBackward(unit);
  if (previous == kNone || previous == kPrologue) return;
  Unshard(previous, /*forward=*/false);
  if (previous - 1 >= first_layer_) Prefetch(previous - 1);
}

void Fsdp2Units::EndBackward() {
  TORCH_CHECK(!root_post_backward_pending_, "FSDP2: the root's post-backward never ran");
}

void Fsdp2Units::UnshardAll() {
  for (auto& [unit, u] : units_) Unshard(unit, /*forward=*/false);
}

void Fsdp2Units::ReshardAll() {
  for (auto& [unit, u] : units_) Reshard(unit);
}

std::vector<at::Tensor> Fsdp2Units::LocalRowsOf(const std::vector<at::Tensor>& full) const {
  TORCH_CHECK(full.size() == parameters_.size(), "FSDP2: one tensor per parameter");
  std::vector<at::Tensor> rows;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    const Parameter& p = parameters_[i];
    rows.push_back(full[i]
                       .reshape({-1})
                       .narrow(0, context_.dp_rank * p.shard_elements, p.local_rows * p.row_elements)
                       .view(p.local.sizes())
                       .clone());
  }
  return rows;
}

void Fsdp2Units::SetGradients(const std::vector<at::Tensor>& grads) const {
  for (size_t i = 0; i < locals_.size(); ++i) locals_[i].mutable_grad() = grads[i];
}

void Fsdp2Units::ClearGradients() const {
  for (const at::Tensor& local : locals_) local.mutable_grad() = at::Tensor();
}

double Fsdp2Units::MaxGradientDiff(const std::vector<at::Tensor>& reference) const {
  double worst = 0;
  for (size_t i = 0; i < locals_.size(); ++i) {
    const double diff = MaxAbsDiff(locals_[i].grad(), reference[i]);
    if (!(diff <= worst)) worst = diff;  // a NaN stays
  }
  return worst;
}

int64_t Fsdp2Units::ShardBytes() const {
  int64_t bytes = 0;
  for (const Parameter& p : parameters_) {
    bytes += p.shard_elements * static_cast<int64_t>(p.sharded.element_size());
  }
  return bytes;
}

at::Tensor Fsdp2Units::WholeParameters() const {
  at::NoGradGuard no_grad;
  int64_t n = 0;
  for (const Parameter& p : parameters_) n += p.numel;
  at::Tensor flat = at::zeros({n}, parameters_.front().sharded.options());
  int64_t offset = 0;
  for (const Parameter& p : parameters_) {
    flat.narrow(0, offset + context_.dp_rank * p.shard_elements, p.local_rows * p.row_elements)
        .copy_(p.local.detach().reshape({-1}));
    offset += p.numel;
  }
  AllReduce(context_.dp_group, flat);
  return flat;
}

}  // namespace memledger::runtime::distributed_internal
