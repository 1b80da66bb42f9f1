// SdpaKernelFor: which kernel F.scaled_dot_product_attention runs for one call of a
// model's attention, on the model's device, as the pinned torch selects it
// (--sdpa_backend=auto) or as --sdpa_backend forces it, and why a forced backend cannot
// run a call.
//
// Example:
//   ModelConfig config = ...;  // bf16, device kCuda
//   absl::StatusOr<SdpaKernel> kernel = SdpaKernelFor(config, SdpaCall{});
//   // kCudnn: on sm90 cuDNN comes first, and takes bf16 with head_dim <= 128
#ifndef ESTIMATOR_GRAPH_SDPA_KERNEL_H_
#define ESTIMATOR_GRAPH_SDPA_KERNEL_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "estimator/spec/config.h"

namespace memledger {

enum class SdpaKernel : uint8_t {
  kCpuFlash,       // _scaled_dot_product_flash_attention_for_cpu
  kCudaFlash,      // _scaled_dot_product_flash_attention (FlashAttention-2)
  kCudaEfficient,  // _scaled_dot_product_efficient_attention (the cutlass kernel)
  kCudnn,          // _scaled_dot_product_cudnn_attention (cuDNN's fused attention)
  kMath,           // _scaled_dot_product_attention_math: ATen ops, keeps T x T
};
// "flash", "efficient", "cudnn", "math"
absl::string_view SdpaKernelName(SdpaKernel kernel);

// SdpaCall is what a call passes SDPA besides q, k and v of (B, heads, T, head_dim).
struct SdpaCall {
  bool masked = false;      // an attn_mask instead of is_causal
  bool enable_gqa = false;  // k and v with fewer heads than q, passed as they are
  bool dropout = false;     // dropout_p > 0 (transformers' attention dropout in training)
};

// SdpaKernelFor resolves config.sdpa_backend on config.device for the call, with q in
// the dtype it has there (autocast's over an fp32 model); InvalidArgument names
// --sdpa_backend when the backend asked for cannot run the call.
absl::StatusOr<SdpaKernel> SdpaKernelFor(const ModelConfig& config, const SdpaCall& call);

// ModelSdpaCall is the call the model's attention makes, unmasked or with a sliding
// window's mask: transformers passes enable_gqa=True to grouped-query layers without a
// mask whose head_dim SDPA takes (integrations/sdpa_attention.py, use_gqa_in_sdpa),
// and otherwise repeats the kv heads itself.
SdpaCall ModelSdpaCall(const ModelConfig& config, AttentionMode mode, bool masked);

// SdpaKernelsName names the kernels the model's calls run: "flash"; "flash, masked
// layers efficient" where a sliding window's mask makes a second call; "none" for
// --attention=math. InvalidArgument as SdpaKernelFor.
absl::StatusOr<std::string> SdpaKernelsName(const ModelConfig& config, AttentionMode mode);

}  // namespace memledger

#endif  // ESTIMATOR_GRAPH_SDPA_KERNEL_H_
