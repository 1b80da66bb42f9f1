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
