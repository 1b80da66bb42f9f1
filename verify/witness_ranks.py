"""The real-stack witness on expert-parallel ranks: verify/witness.py's step on each of
dp Gloo ranks on loopback (one process each, dp = ep unless given), every rank training
its own batch with transformers 5.23's expert parallelism in groups of ep ranks
(expert_parallel below: the experts split over a group, AllToAllEP between them), and
the gradients reduced as memledger predicts (reduce_expert_parallel below).

Each rank measures what witness.measure does (its buckets, saved-tensor hooks, the
profiler's held bytes and peak) and records its routing; the result is one JSON object
per case:
{"ranks": [rank 0's measurement, ...], "routing": {"ranks": [{"layers": ...}, ...]}},
the routing being predict's --routing file for the same step.

Usage:
    python verify/witness_ranks.py --ep=2 --cases=cases.jsonl
    python verify/witness_ranks.py --ep=2 --dp=4 --cases=cases.jsonl  # 2 groups of 2

Bad input: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(os.path.realpath(__file__)).parent))
import witness  # noqa: E402  (verify/witness.py)


# The process's device mesh (expert_parallel): its "ep" groups of ep consecutive ranks,
# and its "edp" groups of the ranks that hold the same experts.
_MESH = None


def expert_parallel(model, config, ep):
    """transformers 5.23's expert parallelism on this process's rank, in groups of `ep`
    consecutive ranks (memledger's data-parallel rank = group x ep + expert-parallel
    rank), as from_pretrained(distributed_config=...) applies its EP plan, without the
    FSDP2 it also requires (distributed/configuration_utils.py): the config's
    base_model_ep_plan (experts' 3-D weights Shard(0) by MoEParamShard, the experts
    module dispatching through AutoEP, which trains with AllToAllEP), by
    apply_expert_parallelism."""
    import re

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    global _MESH
    _MESH = mesh = init_device_mesh("cpu", (dist.get_world_size() // ep, ep, 1),
                                    mesh_dim_names=("edp", "ep", "tp"))
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_modules()]
    plan = {}
    for pattern, style in config.base_model_ep_plan.items():
        regex = re.compile("^model\\." + re.escape(pattern).replace("\\*", "\\d+") + "$")
        plan.update({name: style for name in names if regex.match(name)})
    if not plan:
        raise witness.UsageError(f"--ep: {config.model_type} has no expert-parallel plan")
    apply_expert_parallelism(model, mesh["ep"], mesh["tp"], plan)
    _let_gloo_go()


def gloo_let_go(t):
    """Returns once Gloo's worker thread has dropped its reference to the collective's
    result `t` (and so to the whole work): the caller then holds the only one (a second
    at most 1 s). A collective's wait returns before the worker lets go of the work's
    tensors; were the caller to drop its own first, the worker would free them, where
    torch.profiler (thread-local) records no free, and the witness would see a tensor
    live for the rest of the step on whichever rank lost the race. memledger's runtime
    waits the same way (runtime/gloo_collectives.h, Complete)."""
    import time

    deadline = time.monotonic() + 1.0
    while t._use_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.0005)


def _let_gloo_go():
    """Every wait of the expert-parallel code (the functional collectives' wait_tensor,
    AllToAllEP's exchange of the counts) returns only once Gloo lets go (gloo_let_go).
    No tensor's lifetime in the code changes."""
    import torch.distributed._functional_collectives as functional
    from transformers.distributed import expert_parallel, parallel_utils

    if getattr(functional.wait_tensor, "memledger_waits", False):
        return

    def waited(fn):
        def wait_tensor(tensor):
            out = fn(tensor)
            gloo_let_go(out)
            return out

        wait_tensor.memledger_waits = True
        return wait_tensor

    def exchanged(fn):
        def all_to_all_single(output, input, *args, **kwargs):
            result = fn(output, input, *args, **kwargs)
            gloo_let_go(output)
            return result

        return all_to_all_single

    functional.wait_tensor = waited(functional.wait_tensor)
    parallel_utils.wait_tensor = waited(parallel_utils.wait_tensor)
    expert_parallel.all_to_all_single = exchanged(expert_parallel.all_to_all_single)


def reduce_expert_parallel(params, dp, ep):
    """The data-parallel reduction memledger predicts for expert-parallel ranks
    (estimator/step/simulation_step.cc, ReduceAndStep): the gradients other than the
    experts' (plain tensors) concatenated into one bucket, padded with zeros to a
    multiple of dp, all-reduced over the dp ranks, divided by dp and copied back; then
    the experts' (DTensors) the same way over the dp / ep ranks that hold the same
    experts (the mesh's "edp" group; this rank alone when dp = ep)."""
    import torch.distributed as dist

    import torch

    def reduce(grads, ranks, group):  # a function, so no view of the bucket outlives it
        n = sum(g.numel() for g in grads)
        pieces = [g.view(-1) for g in grads]
        if -(-n // ranks) * ranks > n:
            pieces.append(grads[0].new_zeros(-(-n // ranks) * ranks - n))
        bucket = torch.cat(pieces)
        del pieces
        if ranks > 1:
            dist.all_reduce(bucket, group=group)
            gloo_let_go(bucket)
        bucket.div_(dp)
        for g, piece in zip(grads, bucket.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))

    for experts in (False, True):
        reduce([witness.local(p.grad) for p in params
                if p.grad is not None and hasattr(p, "to_local") == experts],
               dp // ep if experts else dp, _MESH["edp"].get_group() if experts else None)


def _rank(rank, ep, dp, store_path, cases, out_dir):
    """One rank's process: its process group, then every case in order."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, dp), rank=rank,
                            world_size=dp)
    try:
        results = [witness.measure({**witness.DEFAULTS, **case, "ep": ep, "dp": dp,
                                    "rank": rank, "record_routing": True})
                   for case in cases]
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def measure_ranks(cases, ep, dp=None):
    """Every case measured on dp data-parallel ranks (ep by default) in groups of `ep`
    expert-parallel ranks, one result per case, its ranks in data-parallel order."""
    import torch.multiprocessing as mp

    dp = dp or ep
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank, args=(ep, dp, os.path.join(out_dir, "store"), cases, out_dir),
                 nprocs=dp)
        per_rank = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(dp)]
    results = []
    for c in range(len(cases)):
        ranks = [per_rank[r][c] for r in range(dp)]
        routing = {"ranks": [{"layers": rank.pop("routing")["layers"]} for rank in ranks]}
        results.append({"ranks": ranks, "routing": routing})
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, required=True, help="expert-parallel ranks (>= 2)")
    parser.add_argument("--dp", type=int, default=None,
                        help="data-parallel ranks, a multiple of --ep (default: --ep)")
    parser.add_argument("--cases", required=True,
                        help="a JSON-lines file of witness.py's cases (each with a config)")
    args = parser.parse_args(argv)
    try:
        if args.ep < 2:
            raise witness.UsageError(f"--ep must be >= 2, got {args.ep}")
        if args.dp is not None and (args.dp < args.ep or args.dp % args.ep != 0):
            raise witness.UsageError(f"--dp {args.dp} must be a multiple of --ep {args.ep}")
        path = Path(args.cases)
        if not path.is_file():
            raise witness.UsageError(f"--cases {args.cases}: not a file")
        cases = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if any("config" not in case for case in cases):
            raise witness.UsageError("--cases: every case needs a transformers config")
        for result in measure_ranks(cases, args.ep, args.dp):
            print(json.dumps(result), flush=True)
        return 0
    except witness.UsageError as e:
        print(f"witness_ranks: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
