"""reference_stack_repository: @reference_stack, the pinned Python stack's interpreter.

./bazelw installs the reference stack (third_party/torch_requirements.txt: torch,
transformers and their dependencies) into MEMLEDGER_TORCH_DIR with `pip install
--target`, for the interpreter it names in MEMLEDGER_REFERENCE_PYTHON. This rule writes
`python`, a wrapper that runs that interpreter with the stack on PYTHONPATH, for the
witness (verify/witness.py) and its tests. Nothing that predict, the planner or the C
ABI builds depends on it.
"""

def _reference_stack_repository_impl(ctx):
    torch_dir = ctx.os.environ.get("MEMLEDGER_TORCH_DIR", "")
    python = ctx.os.environ.get("MEMLEDGER_REFERENCE_PYTHON", "")
    if not torch_dir or not python:
        fail("@reference_stack comes from the pinned reference stack that ./bazelw " +
             "installs; run ./bazelw instead of bazel (MEMLEDGER_TORCH_DIR or " +
             "MEMLEDGER_REFERENCE_PYTHON is not set)")
    if not ctx.path(torch_dir).get_child("transformers").exists:
        fail("MEMLEDGER_TORCH_DIR=%s has no transformers; run ./bazelw to install " % torch_dir +
             "the pinned reference stack")
    ctx.file("python", "\n".join([
        "#!/bin/sh",
        "# The pinned reference stack's Python (written by //third_party:reference_stack.bzl).",
        "PYTHONPATH='%s'${PYTHONPATH:+:$PYTHONPATH} exec '%s' \"$@\"" % (torch_dir, python),
        "",
    ]), executable = True)
    ctx.file("BUILD.bazel", "\n".join([
        "package(default_visibility = [\"//visibility:public\"])",
        "exports_files([\"python\"])",
        "",
    ]))
    ctx.file("WORKSPACE", "workspace(name = \"reference_stack\")\n")

reference_stack_repository = repository_rule(
    implementation = _reference_stack_repository_impl,
    environ = ["MEMLEDGER_TORCH_DIR", "MEMLEDGER_REFERENCE_PYTHON"],
)
