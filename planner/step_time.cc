#include "planner/step_time.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace memledger {
namespace {

constexpr double kTera = 1e12;
constexpr double kGiga = 1e9;

// RingFraction is the share of its bytes a ring collective moves per GPU, per pass:
// (n - 1) / n (an all-reduce is two passes, reduce-scatter then all-gather).
double RingFraction(int64_t n) {
  return n > 1 ? static_cast<double>(n - 1) / static_cast<double>(n) : 0.0;
}

}  // namespace

const std::vector<GpuSpec>& GpuPresets() {
  // NVLink's 900 / 600 GB/s are both directions together; the network is one NIC per
  // GPU, as in NVIDIA's DGX systems.
  static const std::vector<GpuSpec>* presets = new std::vector<GpuSpec>{
      {"h100", 989.4 * kTera, 66.9 * kTera, 80, 3.35e12, 450 * kGiga, 50 * kGiga,
       "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BF16 1,979 TFLOPS with "
       "sparsity (989.4 dense), FP32 67 TFLOPS, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s; "
       "DGX H100: one ConnectX-7 400 Gb/s per GPU"},
      {"h200", 989.4 * kTera, 66.9 * kTera, 141, 4.8e12, 450 * kGiga, 50 * kGiga,
       "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: BF16 1,979 TFLOPS with "
       "sparsity (989.4 dense), FP32 67 TFLOPS, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; "
       "DGX H200: one ConnectX-7 400 Gb/s per GPU"},
      {"a100", 312 * kTera, 19.5 * kTera, 80, 2.039e12, 300 * kGiga, 25 * kGiga,
       "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM: BF16 312 TFLOPS (624 with "
       "sparsity), FP32 19.5 TFLOPS, 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s; DGX A100: "
       "one ConnectX-6 HDR 200 Gb/s per GPU"},
  };
  return *presets;
}

absl::StatusOr<GpuSpec> GpuPreset(absl::string_view name) {
  std::vector<std::string> names;
  for (const GpuSpec& gpu : GpuPresets()) {
    if (gpu.name == name) return gpu;
    names.push_back(gpu.name);
  }
  return absl::InvalidArgumentError(absl::StrCat("--gpu must be one of ",
                                                 absl::StrJoin(names, ", "), ", got '", name,
                                                 "'"));
}

StepTime PredictStepTime(const GpuSpec& gpu, double mfu, const StepTimeInput& in) {
  const double node = static_cast<double>(in.gpus_per_node);
  // The slowest link within `span` consecutive GPUs: NVLink when one node holds them.
  auto bandwidth = [&](int64_t span) {
    return static_cast<double>(span) <= node ? gpu.nvlink_bandwidth : gpu.network_bandwidth;
  };
  const double activations = static_cast<double>(in.micro_batch_size) *
                             static_cast<double>(in.seq) * static_cast<double>(in.width) *
                             static_cast<double>(in.activation_element_bytes);
  const double peak = in.low_precision_matmul ? gpu.bf16_flops : gpu.fp32_flops;
  const double compute = static_cast<double>(in.stage_flops) / (peak * mfu);
  const double tp = static_cast<double>(in.tp_all_reduces) * 2 * RingFraction(in.tp) *
                    activations / gpu.nvlink_bandwidth;
  // Stage s + 1 is tp x dp GPUs away: every micro-batch crosses every boundary, the
  // slowest one between nodes once the stages span more than one. Each tensor-parallel
  // rank sends its 1 / tp of the activations (Megatron's scatter_gather_tensors_in_
  // pipeline, on by default; with sequence parallelism they are already split), and
  // without sequence parallelism the receivers all-gather the rest over NVLink.
  const double tp_share = activations / static_cast<double>(in.tp);
  const double transfer =
      tp_share / bandwidth(in.tp * in.dp * in.pp) +
      (in.sp ? 0.0 : RingFraction(in.tp) * activations / gpu.nvlink_bandwidth);
  const double pp =
      in.pp > 1 ? 2.0 * static_cast<double>(in.virtual_stages) * transfer : 0.0;
  const double element = static_cast<double>(in.parameter_element_bytes);
  const double parameter_bytes = static_cast<double>(in.stage_parameters) * element;
  // A data group's ranks are tp apart: it spans tp x dp GPUs.
  const double dp_bandwidth = bandwidth(in.tp * in.dp);
  const double zero3 =
      in.gathers_parameters ? 3 * RingFraction(in.dp) * parameter_bytes / dp_bandwidth : 0.0;
  // An expert-parallel group is ep adjacent data-parallel ranks (transformers' mesh
  // ("edp", "ep", "tp")): it spans tp x ep GPUs. Each all-to-all sends what the rank's
  // tokens route to the other ranks' experts.
  const double routed = static_cast<double>(in.routed_rows) * static_cast<double>(in.width) *
                        static_cast<double>(in.activation_element_bytes);
  const double ep = in.ep > 1 ? static_cast<double>(in.ep_all_to_alls) *
                                    static_cast<double>(in.ep - 1) /
                                    static_cast<double>(in.ep) * routed /
                                    bandwidth(in.tp * in.ep)
                              : 0.0;
  const double slot = compute + tp + pp + zero3 + ep;
  const double m = static_cast<double>(in.micro_batches);
  StepTime t;
  t.compute_s = m * compute;
  t.tp_s = m * tp;
  t.pp_s = m * pp;
  t.zero3_s = m * zero3;
  t.ep_s = m * ep;
  t.bubble_s = static_cast<double>(in.pp - 1) / static_cast<double>(in.virtual_stages) * slot;
  // The experts' gradients are reduced over the dp / ep ranks that hold the same experts,
  // tp x ep GPUs apart (the group spans tp x dp of them); the rest over every
  // data-parallel rank.
  const double expert_bytes = static_cast<double>(in.expert_parameters) * element;
  t.dp_s = !in.gathers_parameters ? 2 * RingFraction(in.dp) * (parameter_bytes - expert_bytes) /
                                 dp_bandwidth +
                             2 * RingFraction(in.dp / std::max<int64_t>(in.ep, 1)) *
                                 expert_bytes / dp_bandwidth
                       : 0.0;
  // The step reads the parameters, gradients and state and writes the parameters and
  // state of the elements it steps.
  const double stepped = static_cast<double>(in.stepped_elements) *
                         static_cast<double>(in.parameter_element_bytes);
  t.optimizer_s =
      (3 * stepped + 2 * static_cast<double>(in.optimizer_state_bytes)) / gpu.memory_bandwidth;
  t.total_s = t.compute_s + t.tp_s + t.pp_s + t.zero3_s + t.ep_s + t.bubble_s + t.dp_s +
              t.optimizer_s;
  return t;
}

}  // namespace memledger
