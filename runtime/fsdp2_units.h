// FSDP2's view of a rank's parameters in the LibTorch runtime: torch 2.15.0's
// fully_shard (torch/distributed/fsdp/_fully_shard/) on each decoder layer and on the
// root (the embedding, the final norm and the head), rendered over Gloo with the
// allocations torch makes, in its order. The estimator's program of the same rank is
// estimator/step/data_parallel_fsdp2.cc; each step below names the line it mirrors there
// and in torch.
#ifndef RUNTIME_FSDP2_UNITS_H_
#define RUNTIME_FSDP2_UNITS_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "estimator/request/parallel_spec.h"
#include "estimator/spec/config.h"
#include "runtime/checkpoint.h"

namespace memledger::runtime::distributed_internal {

// Fsdp2Units holds a rank's sharded parameters, Shard(0) per parameter: each parameter's
// rows padded to a multiple of dp, this rank's ceil(rows / dp) of them in a storage of
// their own (FSDPParam._sharded_param_data, _fsdp_param.py), of which the optimizer
// steps the rows the rank owns (the local tensor). A unit's parameters are the model's
// own tensors, each a view of an unsharded storage of its padded size that exists only
// while the unit is unsharded (resized to 0 bytes otherwise, as FSDPParam.free_storage
// does: the views the graph saved see it come back).
//
// The step's events, at the points ForwardStage and RunPipeline call them:
//  - Gather (a segment's forward begins): the unit unshards (Unshard); the head runs on
//    the root's parameters.
//  - Release (a segment's forward ends): a layer reshards after its forward (to every
//    rank, or to its post-forward mesh of reshard_after_forward ranks, keeping a slice of
//    each unsharded parameter); the head's end reshards the root (not under
//    fully_shard's default, auto) and releases the last kept all-gather output.
//  - LossMade: the head's pre-backward hook on the loss, after loss.backward()'s seed:
//    the root unshards, the last layer is prefetched, and the root's post-backward is
//    queued as the engine's final callback (_fsdp_state.py:422).
//  - BackwardPassed (the hook on a unit's input): the unit's post-backward, then the unit
//    before it unshards (its prefetched all-gather copied out) and prefetches the one
//    before that.
class Fsdp2Units : public ParameterUnits {
 public:
  struct Context {
    const ModelConfig* config = nullptr;
    FsdpOptions fsdp;
    c10d::ProcessGroupGloo* dp_group = nullptr;
    int64_t dp_rank = 0;
    int64_t dp = 1;
    // With reshard_after_forward an int N (1 < N < dp): the post-forward mesh's group,
    // the N consecutive data-parallel ranks this one is among (_get_post_forward_mesh_info,
    // _fsdp_init.py:188: the mesh viewed as (-1, N)).
    c10d::ProcessGroupGloo* post_forward_group = nullptr;
  };

  // `owned`: the model's parameters in its order, with their names (whose units
  // UnitOf names); each is sharded from its current values and becomes a view of its
  // unit's unsharded storage, freed.
  Fsdp2Units(Context context, const std::vector<at::Tensor>& owned,
             const std::vector<std::string>& names);

  void Gather(int64_t unit) override;
  void Release(int64_t unit) override;
  void LossMade(const at::Tensor& loss) override;
  void BeginBackward(int64_t /*last*/) override {}
  void BackwardPassed(int64_t unit, int64_t previous) override;
  void EndBackward() override;

  // UnshardAll and ReshardAll: every unit at once, outside a counted step (the
  // reference step without FSDP2's hooks).
  void UnshardAll();
  void ReshardAll();

  // The local tensors the optimizer steps (requires_grad leaves), in the parameters'
  // order; after a counted step's backward their .grads are views of their units'
  // reduce-scatter outputs, the mean over the ranks.
  const std::vector<at::Tensor>& Locals() const { return locals_; }
  // LocalRowsOf: this rank's rows of each of `full` (one tensor of each parameter's
  // shape, in order), as copies.
  std::vector<at::Tensor> LocalRowsOf(const std::vector<at::Tensor>& full) const;
  // SetGradients makes `grads` (LocalRowsOf's) the local tensors' .grads;
  // ClearGradients frees them (zero_grad(set_to_none)).
  void SetGradients(const std::vector<at::Tensor>& grads) const;
  void ClearGradients() const;
  // MaxGradientDiff: max |.grad - reference| over the local tensors (MaxAbsDiff: it
  // allocates nothing, so a counted step may compare).
  double MaxGradientDiff(const std::vector<at::Tensor>& reference) const;
  // ShardBytes: the padded shards' bytes, what the rank's parameters (and, reduced,
  // their gradients) hold.
  int64_t ShardBytes() const;
  // WholeParameters: every rank's local rows assembled into the parameters' flat order
  // (an all-reduce of each rank's rows in place; not for a counted step).
  at::Tensor WholeParameters() const;

 private:
  struct Parameter {
    at::Tensor model;          // the model's tensor: a view of `unsharded`
    at::Tensor unsharded;      // its padded storage, dp x shard_elements
    at::Tensor sharded;        // this rank's padded shard, shard_elements
    at::Tensor local;          // the rows it owns: the optimizer's
    at::Tensor post_forward;   // on the post-forward mesh: its slice of `unsharded`
    std::vector<int64_t> sizes;
    int64_t numel = 0;
    int64_t rows = 0, row_elements = 0, shard_rows = 0, local_rows = 0;
    int64_t shard_elements = 0;
    int64_t offset = 0;  // in the unit's padded shards
  };
  struct Unit {
    std::vector<size_t> parameters;  // indices into parameters_
    int64_t shard_elements = 0;
    bool unsharded = false;
    bool post_forward = false;  // resharded to the post-forward mesh
    at::Tensor prefetched;      // an all-gather output awaiting its copy-out
  };
  int64_t RootOr(int64_t unit) const;  // kPrologue and kHead are the root's
  Unit& UnitAt(int64_t unit) { return units_.at(RootOr(unit)); }
  at::Tensor AllGather(Unit& u);
  void Unshard(int64_t unit, bool forward);
  void Reshard(int64_t unit);
  void ReshardPostForward(int64_t unit, int64_t ranks);
  void Prefetch(int64_t unit);
  void PostBackward(int64_t unit);
  void RootPostBackward();
  static void Resize(at::Tensor& storage_of, int64_t elements);

  Context context_;
  std::vector<Parameter> parameters_;
  std::vector<at::Tensor> locals_;
  std::map<int64_t, Unit> units_;  // by layer; the root under kHead
  int64_t first_layer_ = 0;        // no unit before it but the root
  at::Tensor all_gather_state_;    // the forward's last all-gather output
  at::Tensor reduce_scatter_input_;
  bool root_post_backward_pending_ = false;
};

}  // namespace memledger::runtime::distributed_internal

#endif  // RUNTIME_FSDP2_UNITS_H_
