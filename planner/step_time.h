// StepTime: a predicted time for one training step of a parallel layout, the layout
// search's ranking. Memory is exact (the step simulation); this is a model, and says so:
//
//   slot     = compute + tp + pp + zero3 + ep     one micro-batch on the slowest stage
//   compute  = the stage's FLOPs (forward, backward, recompute) / (peak x mfu)
//   tp       = Megatron's collectives of the layers and the ends, each a ring
//              all-reduce's 2 (tp - 1) / tp x (b, s, h) activations over NVLink
//              (sequence parallelism's all-gather + reduce-scatter move the same bytes)
//   pp       = 2 x virtual_stages point-to-point transfers of each rank's 1 / tp of
//              (b, s, h) (Megatron's scatter-gather), over NVLink within a node, else
//              the network; without sequence parallelism an all-gather over NVLink
//              restores the rest
//   zero3    = ZeRO-3's (and FSDP2's) two all-gathers and one reduce-scatter of the stage's
//              parameters per micro-batch, (dp - 1) / dp of them each
//   ep       = expert parallelism's all-to-alls (transformers' AllToAllEP): per sparse
//              layer two in the forward (the routed tokens out, the results back), two
//              in the backward and two more in a checkpointed layer's recompute, each
//              sending (ep - 1) / ep of the (b, s, k, h) routed rows (the routing
//              balanced); the group is ep adjacent data-parallel ranks
//   pipeline = (micro_batches + (pp - 1) / virtual_stages) x slot (Narayanan et al.
//              2021, section 2.2: the bubble of 1F1B and of the interleaved schedule)
//   dp       = the gradients' all-reduce (ZeRO 1 and 2: reduce-scatter + all-gather,
//              the same bytes) after the last backward, 2 (dp - 1) / dp of them; with
//              expert parallelism the experts' over the dp / ep ranks holding the same
//              experts, ep apart
//   step     = pipeline + dp + optimizer (its bytes read and written at the memory's
//              bandwidth)
//
// Nothing overlaps: Megatron-LM runs its tensor-parallel collectives in line, and its
// gradient reduction overlaps only with --overlap-grad-reduce, off by default. Ring
// collectives move their bytes at the slowest link's bandwidth: NVLink when the group
// lies within one node, the network per GPU otherwise. Ranks are laid out tensor
// first, then data, then pipeline (Megatron's order): a tensor group is tp adjacent
// GPUs, a data group spans tp x dp of them, and stage s + 1 is tp x dp GPUs further.
//
// Example:
//   StepTimeInput in;  // the layout, the slowest stage's FLOPs and bytes
//   StepTime t = PredictStepTime(*GpuPreset("h100"), /*mfu=*/0.5, in);
#ifndef PLANNER_STEP_TIME_H_
#define PLANNER_STEP_TIME_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace memledger {

// GpuSpec is one accelerator's datasheet numbers (dense, without sparsity).
struct GpuSpec {
  std::string name;
  double bf16_flops = 0;         // dense bf16/fp16 tensor-core FLOP/s
  double fp32_flops = 0;         // fp32 FLOP/s without TF32 (PyTorch's default matmul)
  double memory_gib = 0;         // the marketed capacity, the default budget
  double memory_bandwidth = 0;   // bytes/s
  double nvlink_bandwidth = 0;   // bytes/s per GPU, one direction
  double network_bandwidth = 0;  // bytes/s per GPU between nodes, one direction
  std::string source;            // where the numbers come from
};

// GpuPresets: h100, h200, a100 (SXM, in NVIDIA's DGX systems).
const std::vector<GpuSpec>& GpuPresets();
// GpuPreset: InvalidArgument naming the choices for an unknown name.
absl::StatusOr<GpuSpec> GpuPreset(absl::string_view name);

// StepTimeInput is one layout's shape and what its slowest stage does per micro-batch.
struct StepTimeInput {
  int64_t tp = 1, pp = 1, dp = 1, ep = 1;
  bool sp = false;
  // gathers_parameters: the data-parallel ranks hold their shards of the parameters and
  // gather each unit's in the forward and the backward, reduce-scattering its gradients
  // (ZeRO 3, FSDP2: RankShards::parameters).
  bool gathers_parameters = false;
  int64_t micro_batch_size = 1, micro_batches = 1, virtual_stages = 1;
  int64_t gpus_per_node = 8;
  int64_t seq = 0, width = 0;
  int64_t activation_element_bytes = 4;  // the activations' dtype (autocast's, else the model's)
  int64_t parameter_element_bytes = 4;   // the parameters' and gradients' dtype
  bool low_precision_matmul = false;     // bf16/fp16 products (the tensor cores' peak)
  // The slowest stage, per micro-batch on one rank: its FLOPs (recompute included) and
  // its tensor-parallel all-reduces of (b, s, h) activations.
  int64_t stage_flops = 0;
  int64_t tp_all_reduces = 0;
  // With expert parallelism: its all-to-alls of the routed rows, and how many rows each
  // sends (b x s x the experts per token).
  int64_t ep_all_to_alls = 0;
  int64_t routed_rows = 0;
  // The most loaded rank: its stage's parameters (before ZeRO), the elements its
  // optimizer steps and its optimizer state's bytes.
  int64_t stage_parameters = 0;
  int64_t expert_parameters = 0;  // of those, its experts' (with expert parallelism)
  int64_t stepped_elements = 0;
  int64_t optimizer_state_bytes = 0;
};

// StepTime is the predicted step in seconds, by part (see the file comment).
struct StepTime {
  double compute_s = 0;  // micro_batches x compute
  double bubble_s = 0;   // (pp - 1) / virtual_stages slots
  double tp_s = 0;       // micro_batches x tp
  double pp_s = 0;       // micro_batches x pp
  double zero3_s = 0;    // micro_batches x zero3
  double ep_s = 0;       // micro_batches x ep
  double dp_s = 0;
  double optimizer_s = 0;
  double total_s = 0;
};

StepTime PredictStepTime(const GpuSpec& gpu, double mfu, const StepTimeInput& in);

}  // namespace memledger

#endif  // PLANNER_STEP_TIME_H_
