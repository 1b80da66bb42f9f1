#include "estimator/graph/sdpa_kernel.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace memledger {
namespace {

absl::Status Refused(SdpaBackend backend, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("--sdpa_backend=", SdpaBackendName(backend), ": ", why));
}

// The pinned torch's CUDA selection (aten/src/ATen/native/transformers/cuda/
// sdp_utils.cpp, select_sdp_backend), read for the wheel's commit d0f2af8b: the first
// backend of the priority order whose can_use_* accepts the call. The order is flash,
// efficient, math, cudnn (ATen/Context.h, sdp_priority_order), but priority_order()
// moves cudnn first where check_prefer_cudnn_attention() holds: cuDNN > 9.15 on sm90 or
// sm100 (the wheel, a CUDA 13.2 build, ships cuDNN 9.26), unless
// TORCH_CUDNN_SDPA_DEPRIORITIZED=1.

// CudnnRefuses says why cuDNN cannot run the call ("" if it can): can_use_cudnn_attention
// takes fp16 or bf16 (check_dtypes_low_precision), a head_dim that is a multiple of 8
// and at most 128 (check_cudnn_tensor_shapes: 256 on sm90 only where the build's cuDNN
// frontend supports it, which the wheel does not say), and in training only d <= 128
// or 256 (check_cudnn_d256_bprop_head_dim); dropout a multiple of 1/16.
std::string CudnnRefuses(const ModelConfig& config, const SdpaCall& call, DType dtype) {
  if (dtype == DType::kFloat32) return "the cuDNN kernel takes fp16 or bf16 only";
  if (call.masked) return "a mask with the cuDNN kernel is not modelled yet";
  if (config.HeadDim() > 128 || config.HeadDim() % 8 != 0) {
    return "the cuDNN kernel takes head_dim a multiple of 8 and <= 128 here";
  }
  if (call.dropout) {
    const double sixteenths = config.dropout.attn * 16;
    if (sixteenths != static_cast<double>(static_cast<int64_t>(sixteenths))) {
      return "the cuDNN kernel takes a dropout that is a multiple of 1/16";
    }
  }
  return "";
}

// FlashRefuses: can_use_flash_attention takes fp16 or bf16 (sm80_dtypes), no mask
// (check_for_attn_mask) and head_dim <= 256; grouped-query heads read in place
// (check_batch_size_and_num_heads_dense<true, ...>).
std::string FlashRefuses(const ModelConfig& config, const SdpaCall& call, DType dtype) {
  if (dtype == DType::kFloat32) return "the flash kernel takes fp16 or bf16 only";
  if (call.masked) return "the flash kernel takes no attention mask";
  if (config.HeadDim() > 256) return "the flash kernel takes head_dim <= 256";
  if (config.HeadDim() % 8 != 0) {
    return "head_dim not a multiple of 8 (SDPA pads it for flash) is not modelled yet";
  }
  return "";
}

// EfficientRefuses: can_use_mem_efficient_attention takes fp32, fp16 and bf16 with
// head_dim a multiple of the gemm alignment (8 for fp16/bf16, 4 for fp32 on sm90), and
// grouped-query heads on CUDA in this release (supports_gqa).
std::string EfficientRefuses(const ModelConfig& config, const SdpaCall& call, DType dtype) {
  // A mask is made additive and, unless its rows are 8-aligned, padded (attention.cpp,
  // preprocess_mask, pad_bias<8>): the padding is not modelled.
  if (call.masked && config.seq % 8 != 0) {
    return "a mask whose rows are not a multiple of 8 long (padded) is not modelled yet";
  }
  const int64_t alignment = dtype == DType::kFloat32 ? 4 : 8;
  if (config.HeadDim() % alignment != 0) {
    return absl::StrCat("the memory-efficient kernel takes head_dim a multiple of ",
                        alignment);
  }
  return "";
}

}  // namespace

absl::string_view SdpaKernelName(SdpaKernel kernel) {
  switch (kernel) {
    case SdpaKernel::kCpuFlash:
    case SdpaKernel::kCudaFlash:
      return "flash";
    case SdpaKernel::kCudaEfficient:
      return "efficient";
    case SdpaKernel::kCudnn:
      return "cudnn";
    case SdpaKernel::kMath:
      return "math";
  }
  return "?";
}

absl::StatusOr<SdpaKernel> SdpaKernelFor(const ModelConfig& config, const SdpaCall& call) {
  const SdpaBackend backend = config.sdpa_backend;
  if (config.device == Device::kCpu) {
    // sdp_utils_cpp.cpp: the CPU has the flash kernel and math; flash refuses dropout
    // (check_for_dropout).
    switch (backend) {
      case SdpaBackend::kAuto:
        return call.dropout ? SdpaKernel::kMath : SdpaKernel::kCpuFlash;
      case SdpaBackend::kFlash:
        if (call.dropout) return Refused(backend, "the CPU flash kernel has no dropout");
        return SdpaKernel::kCpuFlash;
      case SdpaBackend::kMath:
        if (call.masked) {
          return Refused(backend, "SDPA's math kernel with a mask is not modelled yet");
        }
        return SdpaKernel::kMath;
      case SdpaBackend::kEfficient:
      case SdpaBackend::kCudnn:
        return Refused(backend, "a CUDA kernel: needs --device=cuda");
    }
  }
  const DType dtype = config.amp != DType::kFloat32 ? config.amp : config.dtype;
  struct Candidate {
    SdpaBackend backend;
    SdpaKernel kernel;
    std::string (*refuses)(const ModelConfig&, const SdpaCall&, DType);
  };
  // The sm90 priority order: cudnn, flash, efficient; math takes every call.
  constexpr Candidate kOrder[] = {
      {SdpaBackend::kCudnn, SdpaKernel::kCudnn, CudnnRefuses},
      {SdpaBackend::kFlash, SdpaKernel::kCudaFlash, FlashRefuses},
      {SdpaBackend::kEfficient, SdpaKernel::kCudaEfficient, EfficientRefuses},
  };
  if (backend != SdpaBackend::kMath) {
    for (const Candidate& candidate : kOrder) {
      if (backend != SdpaBackend::kAuto && backend != candidate.backend) continue;
      const std::string why = candidate.refuses(config, call, dtype);
      if (why.empty()) return candidate.kernel;
      if (backend != SdpaBackend::kAuto) return Refused(backend, why);
    }
  }
  if (call.masked) return Refused(backend, "SDPA's math kernel with a mask is not modelled yet");
  return SdpaKernel::kMath;
}

SdpaCall ModelSdpaCall(const ModelConfig& config, AttentionMode mode, bool masked) {
  return SdpaCall{.masked = masked,
                  .enable_gqa = !masked && config.KvHeads() < config.heads &&
                                !RepeatsKv(mode, config.HeadDim()),
                  .dropout = config.dropout.attn > 0};
}

absl::StatusOr<std::string> SdpaKernelsName(const ModelConfig& config, AttentionMode mode) {
  if (mode == AttentionMode::kMath) return std::string("none");
  absl::StatusOr<SdpaKernel> plain = SdpaKernelFor(config, ModelSdpaCall(config, mode, false));
  if (!plain.ok()) return plain.status();
  std::string name(SdpaKernelName(*plain));
  if (config.SlidingWindowMasked()) {
    absl::StatusOr<SdpaKernel> masked =
        SdpaKernelFor(config, ModelSdpaCall(config, mode, true));
    if (!masked.ok()) return masked.status();
    absl::StrAppend(&name, ", masked layers ", SdpaKernelName(*masked));
  }
  return name;
}

}  // namespace memledger
