"""memledger: the wheel's command, over the C ABI (api/memledger.h).

    memledger predict --model=llama-3-8b --seq=4096 [--format=table]
    memledger plan --model=tiny-llama --budget_gib=0.01
    memledger search --model=llama-3-70b --seq=8192 --gpus=64 --global_batch=256 [--chart_svg=PATH]

Flags are the Bazel CLIs' request fields, written as they are: --name=value, --name value,
--flag and --noflag for booleans. Output is what the Bazel CLIs print; the exit status 0,
2 for bad input (one line on stderr), 3 when no plan or layout fits, 1 otherwise.
"""

import json
import os
import sys
import tempfile

import memledger

# The request keys by JSON type (api/memledger.h); the rest are strings.
INTEGERS = {"layers", "width", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
            "batch", "seq", "every", "tp", "dp", "pp", "virtual_stages", "micro_batches",
            "zero", "frontier_points", "cpu_threads", "gpus", "gpus_per_node", "global_batch",
            "max_virtual_stages", "threads", "top"}
NUMBERS = {"momentum", "budget_gib", "gpu_memory_gib", "mfu", "cuda_context_mib"}
BOOLEANS = {"master_weights", "sp", "explain", "expandable_segments"}
STRINGS = {"model", "variants", "policy", "attention", "dtype", "amp", "optimizer",
           "optimizer_impl", "checkpoint_impl", "schedule", "format", "experts_impl",
           "routing", "gpu", "device", "sdpa_backend"}
# Flags the command handles itself: search's chart, written from the C ABI's "svg".
FILES = {"chart_svg"}
GROUPS = [
    ("model", ["model", "layers", "width", "heads", "kv_heads", "head_dim", "intermediate",
               "vocab", "attention", "experts_impl"]),
    ("input", ["batch", "seq", "routing", "global_batch (search)"]),
    ("precision", ["dtype", "amp", "master_weights"]),
    ("optimizer", ["optimizer", "optimizer_impl", "momentum"]),
    ("checkpointing", ["variants", "every", "policy", "checkpoint_impl", "budget_gib (plan)",
                       "frontier_points (plan)"]),
    ("parallelism", ["tp", "sp", "dp", "pp", "virtual_stages", "micro_batches", "zero",
                     "schedule", "gpus (search)", "gpus_per_node (search)",
                     "max_virtual_stages (search)"]),
    ("device", ["device", "sdpa_backend", "expandable_segments", "cuda_context_mib",
                "cpu_threads (plan)", "gpu (search)", "gpu_memory_gib (search)",
                "mfu (search)", "threads (search)"]),
    ("output", ["format (json or table)", "explain (predict)", "top (search)",
                "chart_svg (search)"]),
]
COMMANDS = ("predict", "plan", "search")


class UsageError(Exception):
    pass


def usage():
    lines = [__doc__.strip(), "", "Flags:"]
    for group, names in GROUPS:
        lines.append(f"  {group}: " + ", ".join(f"--{n}" for n in names))
    lines.append("\nSee `predict --help` (./bazelw run //:predict -- --help) for each flag's "
                 "meaning and default.")
    return "\n".join(lines)


def parse(args):
    """The request dict of `args` (flags only)."""
    request = {}
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--"):
            raise UsageError(f"unexpected argument {arg!r} (flags look like --layers=6; see --help)")
        name, eq, value = arg[2:].partition("=")
        if not eq and name.startswith("no") and name[2:] in BOOLEANS:
            request[name[2:]] = False
            continue
        if name not in INTEGERS | NUMBERS | BOOLEANS | STRINGS | FILES:
            raise UsageError(f"unknown flag --{name} (see --help)")
        if not eq:
            if name in BOOLEANS:
                request[name] = True
                continue
            if i >= len(args):
                raise UsageError(f"--{name} needs a value")
            value = args[i]
            i += 1
        try:
            if name in INTEGERS:
                request[name] = int(value)
            elif name in NUMBERS:
                request[name] = float(value)
            elif name in BOOLEANS:
                if value not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                request[name] = value in ("true", "1")
            else:
                request[name] = value
        except ValueError:
            raise UsageError(f"--{name}: Illegal value '{value}' specified for flag '{name}'")
    return request


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    command, args = argv[0], argv[1:]
    if any(a in ("-h", "--help", "--helpfull") for a in args):
        print(usage())
        return 0
    try:
        if command not in COMMANDS:
            raise UsageError(f"unknown command {command!r}: memledger predict, plan or search")
        request = parse(args)
        chart = request.pop("chart_svg", None)
        if chart is not None and command != "search":
            raise UsageError(f"--chart_svg is search's (memledger {command} has no chart)")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    code, text = memledger._call(command, json.dumps(request))
    if code == 0 and chart is not None:
        svg_code, svg = memledger._call(command, json.dumps(dict(request, format="svg")))
        if svg_code != 0:
            code, text = svg_code, svg
        else:
            try:  # whole or not at all: a temporary file beside it, renamed over it
                directory = os.path.dirname(os.path.abspath(chart))
                with tempfile.NamedTemporaryFile("w", dir=directory, delete=False) as f:
                    f.write(svg)
                os.replace(f.name, chart)
            except OSError as e:
                print(f"error: --chart_svg: {e}", file=sys.stderr)
                return 2
    if code == 0:
        sys.stdout.write(text)
        return 0
    print(f"error: {text}", file=sys.stderr)
    return {2: 2, 3: 3}.get(code, 1)


if __name__ == "__main__":
    sys.exit(main())
