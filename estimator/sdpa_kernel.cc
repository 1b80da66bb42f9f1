#include "estimator/sdpa_kernel.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace memledger {
namespace {

absl::Status Refused(SdpaBackend backend, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("--sdpa_backend=", SdpaBackendName(backend), ": ", why));
}

// FlashRefuses says why the CUDA flash kernel cannot run the call ("" if it can):
// sdp_utils.cpp, can_use_flash_attention.
std::string FlashRefuses(const ModelConfig& config, const SdpaCall& call, DType dtype) {
  if (dtype == DType::kFloat32) return "the flash kernel takes fp16 or bf16 only";
  if (call.masked) return "the flash kernel takes no attention mask";
  if (config.HeadDim() > 256) return "the flash kernel takes head_dim <= 256";
  if (config.HeadDim() % 8 != 0) {
    return "head_dim not a multiple of 8 (SDPA pads it for flash) is not modelled yet";
  }
  return "";
}

// EfficientRefuses: sdp_utils.cpp, can_use_mem_efficient_attention.
std::string EfficientRefuses(const ModelConfig& config, const SdpaCall& call, DType dtype) {
  if (call.enable_gqa) return "the memory-efficient kernel has no grouped-query heads";
  if (call.masked) return "a mask with the memory-efficient kernel is not modelled yet";
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
        return SdpaKernel::kMath;
      case SdpaBackend::kEfficient:
      case SdpaBackend::kCudnn:
        return Refused(backend, "a CUDA kernel: needs --device=cuda");
    }
  }
  const DType dtype = config.amp != DType::kFloat32 ? config.amp : config.dtype;
  switch (backend) {
    case SdpaBackend::kAuto: {
      if (FlashRefuses(config, call, dtype).empty()) return SdpaKernel::kCudaFlash;
      if (EfficientRefuses(config, call, dtype).empty()) return SdpaKernel::kCudaEfficient;
      return SdpaKernel::kMath;
    }
    case SdpaBackend::kFlash: {
      const std::string why = FlashRefuses(config, call, dtype);
      if (!why.empty()) return Refused(backend, why);
      return SdpaKernel::kCudaFlash;
    }
    case SdpaBackend::kEfficient: {
      const std::string why = EfficientRefuses(config, call, dtype);
      if (!why.empty()) return Refused(backend, why);
      return SdpaKernel::kCudaEfficient;
    }
    case SdpaBackend::kMath:
      return SdpaKernel::kMath;
    case SdpaBackend::kCudnn:
      return Refused(backend, "the cuDNN kernel is not modelled yet");
  }
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
