"""libtorch_repository: @libtorch from the pinned torch wheel that ./bazelw installs.

The wheel lives outside the workspace (a per-user cache, see bazelw), so its path is
only known at fetch time: this rule symlinks the wheel's headers into the repository and
writes a BUILD file whose link options carry the absolute library directory, both for
the linker (-L) and as an rpath, so `bazel run` and `bazel test` binaries start without
LD_LIBRARY_PATH. The libraries are linked from their real directory, not through
Bazel's _solib symlinks, because libtorch_cpu.so finds its own dependencies (libgomp,
libcudart, libcupti) through $ORIGIN, which the dynamic loader does not resolve through
symlinks.
"""

def _libtorch_repository_impl(ctx):
    torch_dir = ctx.os.environ.get("MEMLEDGER_TORCH_DIR", "")
    if not torch_dir:
        fail("@libtorch comes from the pinned torch wheel that ./bazelw installs; " +
             "run ./bazelw instead of bazel (MEMLEDGER_TORCH_DIR is not set)")
    torch = ctx.path(torch_dir).get_child("torch")
    lib = torch.get_child("lib")
    for needed in ["libtorch_cpu.so", "libc10.so"]:
        if not lib.get_child(needed).exists:
            fail("MEMLEDGER_TORCH_DIR=%s has no torch/lib/%s; run ./bazelw to install " %
                 (torch_dir, needed) + "the pinned torch wheel")
    ctx.symlink(torch.get_child("include"), "include")
    # c10's CUDA caching allocator and the CUDA runtime's headers (the wheel's
    # nvidia-cuda-runtime), for //tests:cuda_allocator_test. Linked through these
    # symlinks, libc10_cuda.so's $ORIGIN-relative rpath finds no real libcudart.
    cuda_include = ctx.path(torch_dir).get_child("nvidia").get_child("cu13").get_child("include")
    if cuda_include.exists and lib.get_child("libc10_cuda.so").exists:
        ctx.symlink(cuda_include, "cuda_include")
        ctx.symlink(lib.get_child("libc10_cuda.so"), "cuda_lib/libc10_cuda.so")
        ctx.symlink(lib.get_child("libc10.so"), "cuda_lib/libc10.so")
    else:
        fail("MEMLEDGER_TORCH_DIR=%s has no nvidia/cu13/include or torch/lib/libc10_cuda.so: " %
             torch_dir + "the pinned torch wheel's CUDA parts are missing")
    ctx.template("BUILD.bazel", ctx.attr.build_file_template, {"%{lib_dir}": str(lib)})
    ctx.file("WORKSPACE", "workspace(name = \"libtorch\")\n")

libtorch_repository = repository_rule(
    implementation = _libtorch_repository_impl,
    attrs = {
        "build_file_template": attr.label(allow_single_file = True, mandatory = True),
    },
    environ = ["MEMLEDGER_TORCH_DIR"],
)
