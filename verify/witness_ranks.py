"""The real-stack witness on data-parallel ranks: verify/witness.py's step on each of
dp Gloo ranks on loopback (one process each, dp = ep unless given), every rank training
its own batch, either
* with transformers 5.23's expert parallelism in groups of ep ranks (expert_parallel:
  the experts split over a group, AllToAllEP between them), and the gradients reduced
  as memledger predicts (reduce_expert_parallel); or
* (--ep=1, a case with "ddp": {"bucket_cap_mb": ..., "gradient_as_bucket_view": ...})
  under torch's DistributedDataParallel as its defaults run it (witness_common.ddp),
  measured in the steady state after the Reducer rebuilt its buckets; each rank's
  "reducer_bytes" is what DDP's construction kept (its buckets), counted in its peak; or
* (--ep=1, a case with "fsdp": true, and optionally "reshard_after_forward" (true, false
  or a number of ranks), "mp_param_dtype" and "mp_reduce_dtype") under torch's FSDP2,
  fully_shard on each decoder layer and the root (witness_common.fsdp2), its collectives
  NCCL's: in place, without buffers of their own.

Each rank measures what witness.measure does (its buckets, saved-tensor hooks, the
profiler's held bytes and peak) and records its routing; the result is one JSON object
per case:
{"ranks": [rank 0's measurement, ...], "routing": {"ranks": [{"layers": ...}, ...]}},
the routing being predict's --routing file for the same step.

Usage:
    python verify/witness_ranks.py --ep=2 --cases=cases.jsonl
    python verify/witness_ranks.py --ep=2 --dp=4 --cases=cases.jsonl  # 2 groups of 2
    python verify/witness_ranks.py --ep=1 --dp=2 --cases=ddp_cases.jsonl  # DDP, FSDP2

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


def _rank(rank, ep, dp, store_path, cases, out_dir):
    """One rank's process: its process group, then every case in order."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, dp), rank=rank,
                            world_size=dp)
    try:
        results = [witness.measure({**witness.DEFAULTS, **case, "ep": ep, "dp": dp,
                                    "rank": rank, "record_routing": ep > 1})
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
        if ep == 1:
            results.append({"ranks": ranks})
            continue
        routing = {"ranks": [{"layers": rank.pop("routing")["layers"]} for rank in ranks]}
        results.append({"ranks": ranks, "routing": routing})
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, required=True,
                        help="expert-parallel ranks (>= 2), or 1 for DDP cases")
    parser.add_argument("--dp", type=int, default=None,
                        help="data-parallel ranks, a multiple of --ep (default: --ep)")
    parser.add_argument("--cases", required=True,
                        help="a JSON-lines file of witness.py's cases (each with a config)")
    args = parser.parse_args(argv)
    try:
        if args.ep < 1:
            raise witness.UsageError(f"--ep must be >= 1, got {args.ep}")
        if args.dp is not None and (args.dp < max(args.ep, 2) or args.dp % args.ep != 0):
            raise witness.UsageError(
                f"--dp {args.dp} must be a multiple of --ep {args.ep}, and at least 2")
        if args.ep == 1 and args.dp is None:
            raise witness.UsageError("--ep=1 (DDP) needs --dp, the number of ranks")
        path = Path(args.cases)
        if not path.is_file():
            raise witness.UsageError(f"--cases {args.cases}: not a file")
        cases = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if any("config" not in case for case in cases):
            raise witness.UsageError("--cases: every case needs a transformers config")
        for case in cases:
            data_parallel = (case.get("ddp") is not None) + bool(case.get("fsdp"))
            if data_parallel != (args.ep == 1):
                raise witness.UsageError(
                    "--cases: with --ep=1 every case runs DDP (\"ddp\": {...}) or FSDP2 "
                    "(\"fsdp\": true), one of them; with --ep >= 2 none does")
        for result in measure_ranks(cases, args.ep, args.dp):
            print(json.dumps(result), flush=True)
        return 0
    except witness.UsageError as e:
        print(f"witness_ranks: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
