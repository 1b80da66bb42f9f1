# LibTorch (CPU) from the pinned torch wheel: headers and libtorch_cpu + c10 only.
# Written by //third_party:libtorch.bzl; %{lib_dir} is the wheel's torch/lib.
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "libtorch",
    hdrs = glob(["include/**"]),
    # The C++ frontend's headers (<torch/nn/...>) live under torch/csrc/api/include;
    # `includes` propagates both roots to every dependent as -isystem.
    includes = [
        "include",
        "include/torch/csrc/api/include",
    ],
    linkopts = [
        "-L%{lib_dir}",
        "-Wl,-rpath,%{lib_dir}",
        "-ltorch_cpu",
        "-lc10",
    ],
)

# The pinned release's generated backward nodes: //tests:rules_functions_h_test checks
# the estimator's keep rules against it.
filegroup(
    name = "functions_h",
    srcs = ["include/torch/csrc/autograd/generated/Functions.h"],
)

# The CUDA runtime's headers (cuda_runtime_api.h): a stub libcudart is built against
# them (//tests/cuda_stub).
cc_library(
    name = "cuda_runtime_headers",
    hdrs = glob(["cuda_include/**"]),
    includes = ["cuda_include"],
)

# c10 with its CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp compiled), for
# //tests:cuda_allocator_test, which runs it over a stub libcudart.so.13. Not LibTorch:
# nothing else of the wheel's CUDA libraries is linked.
cc_library(
    name = "c10_cuda",
    srcs = [
        "cuda_lib/libc10.so",
        "cuda_lib/libc10_cuda.so",
    ],
    hdrs = glob(["include/c10/**"]),
    includes = ["include"],
    deps = [":cuda_runtime_headers"],
)
