#include "runtime/zero_units.h"

#include <ATen/Dispatch.h>
#include <ATen/native/Resize.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "runtime/gloo_collectives.h"
#include "runtime/family.h"
#include "runtime/model.h"

namespace memledger::runtime::distributed_internal {

at::Tensor Flat(const std::vector<at::Tensor>& tensors, int64_t padded) {
  std::vector<at::Tensor> pieces;
  int64_t n = 0;
  for (const at::Tensor& t : tensors) {
    pieces.push_back(t.detach().reshape({-1}));
    n += t.numel();
  }
  if (padded > n) pieces.push_back(at::zeros({padded - n}, tensors.front().options()));
  return at::cat(pieces);
}

void Unflatten(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) {
  at::NoGradGuard no_grad;
  int64_t offset = 0;
  for (const at::Tensor& t : tensors) {
    t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
}

int64_t ShardElements(int64_t n, int64_t dp) { return (n + dp - 1) / dp; }

double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.numel() == b.numel() &&
                  a.scalar_type() == b.scalar_type(),
              "MaxAbsDiff: two contiguous tensors of one shape and dtype");
  double worst = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "MaxAbsDiff", [&] {
    const scalar_t* x = a.data_ptr<scalar_t>();
    const scalar_t* y = b.data_ptr<scalar_t>();
    for (int64_t i = 0; i < a.numel(); ++i) {
      const double d = std::abs(static_cast<double>(x[i]) - static_cast<double>(y[i]));
      if (!(d <= worst)) worst = d;  // a NaN stays
    }
  });
  return worst;
}

int64_t UnitOf(const ModelConfig& config, const std::string& name) {
  if (absl::StartsWith(name, "layers.")) {
    int64_t layer = 0;
    const std::string index = name.substr(7, name.find('.', 7) - 7);
    TORCH_CHECK(absl::SimpleAtoi(index, &layer), "no layer index in ", name);
    return layer;
  }
  for (const std::string& prefix : RuntimeFamilyOf(config.family).prologue_prefixes) {
    if (absl::StartsWith(name, prefix)) return ParameterUnits::kPrologue;
  }
  return ParameterUnits::kHead;
}

GatheredUnits::GatheredUnits(Context context, const std::vector<at::Tensor>& owned,
              const std::vector<std::string>& names,
              const std::vector<std::vector<int64_t>>& sizes)
    : context_(context) {
  at::NoGradGuard no_grad;
  int64_t offset = 0;
  for (size_t i = 0; i < owned.size(); ++i) {
    const int64_t unit = UnitOf(*context_.config, names[i]);
    if (units_.empty() || units_.back().id != unit) {
      Unit u;
      u.id = unit;
      u.offset = offset;
      units_.push_back(std::move(u));
    }
    Unit& u = units_.back();
    const int64_t numel = c10::multiply_integers(sizes[i]);
    u.parameters.push_back(owned[i]);
    u.names.push_back(names[i]);
    u.sizes.push_back(sizes[i]);
    u.length += numel;
    offset += numel;
  }
  for (Unit& u : units_) {
    u.flat = at::empty({u.length}, owned.front().options());
    int64_t at = 0;
    for (size_t i = 0; i < u.parameters.size(); ++i) {
      const int64_t numel = c10::multiply_integers(u.sizes[i]);
      at::Tensor p = u.parameters[i];  // set_data changes every handle's variable
      p.set_data(u.flat.narrow(0, at, numel).view(u.sizes[i]));
      at += numel;
    }
    Resize(u, 0);
  }
}

void GatheredUnits::Gather(int64_t unit) {
  Unit* u = Find(unit);
  if (u == nullptr || u->gathered) return;
  at::NoGradGuard no_grad;
  Resize(*u, u->length);
  u->flat.zero_();
  const Overlap mine = Mine(*u);
  if (mine.length > 0) {
    u->flat.narrow(0, mine.in_unit, mine.length)
        .copy_(context_.shard_param->detach().narrow(0, mine.in_shard, mine.length));
  }
  AllReduce(context_.dp_group, u->flat);
}

void GatheredUnits::Release(int64_t unit) {
  if (unit == kPrologue && context_.config->tie_embeddings) return;
  if (Unit* u = Find(unit); u != nullptr) Resize(*u, 0);
}

void GatheredUnits::BeginBackward(int64_t last) {
  pending_ = last;
  Gather(last);
}

void GatheredUnits::BackwardPassed(int64_t unit, int64_t previous) {
  TORCH_CHECK(unit == pending_, "ZeRO-3: unit ", unit, "'s backward ended, expected ", pending_);
  ReduceScatter(unit);
  pending_ = previous;
  if (previous != kNone) Gather(previous);
}

void GatheredUnits::EndBackward() {
  if (pending_ != kNone) ReduceScatter(pending_);
  pending_ = kNone;
}

void GatheredUnits::Resize(Unit& u, int64_t elements) {
  c10::StorageImpl* storage = u.flat.storage().unsafeGetStorageImpl();
  storage->set_allocator(c10::GetCPUAllocator());
  at::native::resize_bytes_cpu(storage, static_cast<size_t>(elements * u.flat.element_size()));
  u.gathered = elements > 0;
}

void GatheredUnits::ReduceScatter(int64_t unit) {
  Unit* u = Find(unit);
  if (u == nullptr) return;
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (size_t i = 0; i < u->parameters.size(); ++i) {
    at::Tensor grad = u->parameters[i].grad();
    TORCH_CHECK(grad.defined(), "ZeRO-3: no gradient for ", u->names[i]);
    if (context_.tp_group != nullptr && GradientIsPartial(*context_.config, u->names[i])) {
      AllReduce(context_.tp_group, grad);
    }
    grads.push_back(grad);
  }
  at::Tensor bucket = Flat(grads, u->length);
  grads.clear();
  for (at::Tensor& p : u->parameters) p.mutable_grad() = at::Tensor();
  AllReduce(context_.dp_group, bucket);
  if (!shard_grad_.defined()) shard_grad_ = at::zeros({context_.shard}, bucket.options());
  const Overlap mine = Mine(*u);
  if (mine.length > 0) {
    shard_grad_.narrow(0, mine.in_shard, mine.length)
        .add_(bucket.narrow(0, mine.in_unit, mine.length));
  }
  bucket = at::Tensor();
  Resize(*u, 0);
}

}  // namespace memledger::runtime::distributed_internal
