// ZeRO's view of a stage's parameters: flat buffers, and ZeRO-3's units gathered one at
// a time around their forward and backward.
#ifndef RUNTIME_ZERO_UNITS_H_
#define RUNTIME_ZERO_UNITS_H_

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "estimator/spec/config.h"
#include "runtime/checkpoint.h"

namespace memledger::runtime::distributed_internal {

// Flat concatenates the tensors, flattened, into one buffer of `padded` elements (the
// tail zeros), in the first tensor's dtype.
at::Tensor Flat(const std::vector<at::Tensor>& tensors, int64_t padded);
// Unflatten copies flat's first elements back into the tensors, in order.
void Unflatten(const at::Tensor& flat, const std::vector<at::Tensor>& tensors);
// ShardElements: a ZeRO rank's part of n elements over dp ranks (padded).
int64_t ShardElements(int64_t n, int64_t dp);
// MaxAbsDiff is max |a - b| over two contiguous tensors of one shape and dtype, in
// plain loops: it allocates nothing (a counted step compares a unit's gradient so).
double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b);

// UnitOf names the ZeRO-3 unit (ParameterUnits) a parameter belongs to: its layer, the
// prologue's embeddings or the head (the final norm, the LM head).
int64_t UnitOf(const ModelConfig& config, const std::string& name);

// GatheredUnits is ZeRO-3 as DeepSpeed's stage 3 and FSDP run it, one unit at a time:
// the rank holds its shard of the stage's flat parameters (padded to a multiple of dp);
// a unit's parameters are views of one flat buffer whose storage exists only while the
// unit runs (resized to 0 bytes otherwise, as FSDP frees it: every view, the ones the
// graph saved included, sees it come back). Gather fills it (the others' parts zeroed,
// this rank's copied in, all-reduced in place: Gloo's all-gather copies); after the
// unit's backward its .grads are flattened into a bucket and freed, the bucket
// all-reduced in place and this rank's part added into the shard's gradient (made on
// first use), then the bucket freed and the unit released. With sequence parallelism
// the partial gradients are all-reduced over the tensor-parallel group first. A tied
// embedding (one stage only) keeps its unit gathered from the prologue's forward to the
// end of the backward, as FSDP keeps its root unit: the head reads its weight, whose
// gradient the head's backward starts and the prologue's completes.
class GatheredUnits : public ParameterUnits {
 public:
  struct Context {
    const ModelConfig* config = nullptr;
    c10d::ProcessGroupGloo* dp_group = nullptr;
    c10d::ProcessGroupGloo* tp_group = nullptr;
    int64_t dp_rank = 0;
    int64_t shard = 0;           // elements per rank
    const at::Tensor* shard_param = nullptr;
  };

  // `owned` in the stage's flat order (grouped by unit), with their names and sizes (a
  // ZeRO-3 rank's parameters hold no elements between steps).
  GatheredUnits(Context context, const std::vector<at::Tensor>& owned,
                const std::vector<std::string>& names,
                const std::vector<std::vector<int64_t>>& sizes);

  void Gather(int64_t unit) override;

  // Release after a forward; a tied embedding's unit (the head reads its weight too)
  // stays gathered until its gradients are reduced, after the prologue's backward.
  void Release(int64_t unit) override;
  // GatherAll and ReleaseAll: every unit at once (a step without ZeRO-3's gathering).
  void GatherAll() {
    for (const Unit& u : units_) Gather(u.id);
  }
  void ReleaseAll() {
    for (Unit& u : units_) Resize(u, 0);
  }

  void BeginBackward(int64_t last) override;
  void BackwardPassed(int64_t unit, int64_t previous) override;
  void EndBackward() override;

  // TakeGradient: the shard's gradient, summed over the micro-batches' backwards.
  at::Tensor TakeGradient() { return std::move(shard_grad_); }

 private:
  struct Unit {
    int64_t id = kNone;
    int64_t offset = 0;  // in the stage's flat parameters
    int64_t length = 0;
    std::vector<at::Tensor> parameters;
    std::vector<std::string> names;
    std::vector<std::vector<int64_t>> sizes;
    at::Tensor flat;
    bool gathered = false;  // its storage holds the parameters
  };
  // Where this rank's shard meets a unit: offsets in the unit and in the shard.
  struct Overlap {
    int64_t in_unit = 0, in_shard = 0, length = 0;
  };

  Unit* Find(int64_t unit) {
    for (Unit& u : units_) {
      if (u.id == unit) return &u;
    }
    return nullptr;
  }
  Overlap Mine(const Unit& u) const {
    const int64_t start = context_.dp_rank * context_.shard;
    const int64_t lo = std::max(start, u.offset);
    const int64_t hi = std::min(start + context_.shard, u.offset + u.length);
    if (hi <= lo) return {};
    return {lo - u.offset, lo - start, hi - lo};
  }
  // Resize sets the unit's storage to `elements`, allocating through the CPU allocator
  // of the moment (a counted step's), not the one it was made with.
  static void Resize(Unit& u, int64_t elements);

  void ReduceScatter(int64_t unit);

  Context context_;
  std::vector<Unit> units_;
  int64_t pending_ = kNone;
  at::Tensor shard_grad_;
};

}  // namespace memledger::runtime::distributed_internal

#endif  // RUNTIME_ZERO_UNITS_H_
