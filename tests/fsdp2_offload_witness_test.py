"""FSDP2 on CUDA, CPUOffloadPolicy among it, exact against torch's own fully_shard run on
fake CUDA tensors.

verify/witness_fake_step.py trains the issue's 2-layer Llama (tests/issue_llama.py) as
rank 0 of 2 under torch's fake process group, every tensor a fake CUDA (or host) tensor:
FSDP2's own Python decides each shard's device, each copy to and from the host, each
all-gather buffer and each free; the meta kernels state each CUDA kernel's outputs. The
witness counts every live storage, a CUDA one as the caching allocator's 512 B block, so
predict --device=cuda --dp=2 --fsdp must give the same peak, in the same phase, and the
same host bytes, on every case below:

* CPUOffloadPolicy(pin_memory=True) with reshard_after_forward True and False, under no,
  full and selective checkpointing, and with MixedPrecisionPolicy(bf16, fp32) (with the
  memory-efficient kernel, and with cuDNN's, which auto picks for bf16);
* the same model without offloading, which tests/fsdp2_witness_test.py measures on Gloo
  ranks on the CPU: here its CUDA rendition (the all-gather and reduce-scatter streams'
  buffers, the efficient kernel's outputs) is checked too.

Both sides leave out what fake tensors cannot show: the cuBLAS workspace (predict is told
CUBLAS_WORKSPACE_CONFIG=:0:0, which makes a GPU run allocate none) and the copy kernels'
metadata, which lives inside those ops only, never at these peaks.

The witness process runs the wheel's CUDA build over the stub runtime and driver of
tests/cuda_stub (no GPU). Run by Bazel with the reference stack's Python
(tests/BUILD.bazel):
    python tests/fsdp2_offload_witness_test.py PREDICT LIBCUDART_STUB LIBCUDA_STUB
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

HERE = Path(os.path.realpath(__file__)).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "verify"))
import witness_fake_step  # noqa: E402  (verify/witness_fake_step.py)
from issue_llama import CONFIG, PARAM_BYTES, TENSORS  # noqa: E402  (tests/issue_llama.py)

WITNESS = HERE.parent / "verify" / "witness_fake_step.py"
CONFIG_PATH = HERE / "testdata" / "issue_llama.config.json"
PREDICT = CUDART = CUDA = None  # set from argv

BASE = {"config": CONFIG, "batch": 2, "seq": 32, "dp": 2, "optimizer_impl": "for_loop",
        "sdpa_backend": "efficient", "variant": "none", "reshard_after_forward": True}
CASES = [
    {"offload": "cpu"},
    {"offload": "cpu", "reshard_after_forward": False},
    {"offload": "cpu", "variant": "full"},
    {"offload": "cpu", "variant": "selective"},
    {"offload": "cpu", "mp_param_dtype": "bf16", "mp_reduce_dtype": "fp32"},
    # The kernel auto picks for the bf16 compute on sm90 (checked below: predict says so).
    {"offload": "cpu", "mp_param_dtype": "bf16", "mp_reduce_dtype": "fp32",
     "sdpa_backend": "cudnn"},
    {"offload": "none"},
    {"offload": "none", "reshard_after_forward": False},
]


def flags(case):
    out = [f"--model={CONFIG_PATH}", "--batch=2", "--seq=32", "--dp=2", "--fsdp",
           "--device=cuda", "--cublas_workspace_config=:0:0", "--optimizer_impl=for_loop",
           # An explicit cudnn is refused on the fp32 model beneath a bf16
           # MixedPrecisionPolicy; auto gives it to the ranks' bf16 compute.
           "--sdpa_backend=" + ("auto" if case["sdpa_backend"] == "cudnn"
                                else case["sdpa_backend"]),
           f"--variants={case['variant']}",
           f"--offload={case['offload']}",
           f"--reshard_after_forward={str(case['reshard_after_forward']).lower()}"]
    for key in ("mp_param_dtype", "mp_reduce_dtype"):
        if case.get(key):
            out.append(f"--{key}={case[key]}")
    return out


def name(case):
    return ", ".join(f"{k}={v}" for k, v in case.items() if k not in BASE or BASE[k] != v)


class Fsdp2OffloadWitnessTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cases = [{**BASE, **case} for case in CASES]
        env = witness_fake_step.stub_environment(CUDART, CUDA)
        with tempfile.TemporaryDirectory() as tmp:
            cases = Path(tmp, "cases.jsonl")
            cases.write_text("".join(json.dumps(case) + "\n" for case in cls.cases))
            out = subprocess.run([sys.executable, str(WITNESS), f"--cases={cases}"],
                                 capture_output=True, text=True, env=env)
        if out.returncode != 0:
            raise AssertionError(f"the witness failed:\n{out.stderr[-4000:]}")
        cls.measured = [json.loads(line) for line in out.stdout.splitlines()]
        cls.predicted = []
        for case in cls.cases:
            out = subprocess.run([PREDICT] + flags(case), capture_output=True, text=True)
            if out.returncode != 0:
                raise AssertionError(f"predict {' '.join(flags(case))}: {out.stderr.strip()}")
            cls.predicted.append(json.loads(out.stdout))

    def test_peak_phase_and_host_bytes_are_exact_on_the_rank(self):
        failures = []
        for case, measured, predicted in zip(self.cases, self.measured, self.predicted):
            self.assertEqual(predicted["sdpa_kernel"], case["sdpa_backend"], name(case))
            rank = predicted["ranks"][0]
            peak = rank["peak"][case["variant"]]
            got = {"peak_bytes": peak["bytes"], "peak_phase": peak["phase"],
                   "host_bytes": rank.get("host_bytes", 0)}
            want = {"peak_bytes": measured["peak_bytes"], "peak_phase": measured["peak_phase"],
                    # torch.optim's step counts are host scalars on CUDA too; only
                    # CPUOffloadPolicy puts the rest there.
                    "host_bytes": measured["host_bytes"] if case["offload"] == "cpu" else 0}
            for key in want:
                if got[key] != want[key]:
                    failures.append(f"rank 0, {name(case)}: {key} predicted {got[key]}, "
                                    f"measured {want[key]}")
        self.assertEqual(failures, [], "\n".join(failures))

    def test_offloading_leaves_the_device_only_its_buffers_and_input(self):
        # By hand: input_ids (2 x 32 int64, 512 B), RoPE's inv_freq and its clone
        # original_inv_freq (8 fp32 each): three storages, three 512 B blocks. The shards
        # (half of 151,872 fp32 elements), their gradients and AdamW's exp_avg and
        # exp_avg_sq are on the host, with the 21 step counts (4 B each).
        shards = PARAM_BYTES // 2
        for case, measured in zip(self.cases, self.measured):
            if case["offload"] != "cpu":
                continue
            self.assertEqual(measured["resident"]["cuda"], 3 * 512, name(case))
            self.assertEqual(measured["host_bytes"], shards + shards + 2 * shards + TENSORS * 4,
                             name(case))

    def test_offloading_lowers_the_peak_by_the_resident_shards_at_least(self):
        # Without offloading the device holds every shard and its AdamW state between
        # steps; with it, none. (Each is measured, so this checks the witness's own
        # bookkeeping, not memledger.)
        by_name = {name(c): m for c, m in zip(self.cases, self.measured)}
        on_device = by_name["offload=none"]["resident"]["cuda"]
        self.assertGreaterEqual(on_device, 3 * (PARAM_BYTES // 2))
        self.assertLess(by_name["offload=cpu"]["peak_bytes"],
                        by_name["offload=none"]["peak_bytes"] - 3 * (PARAM_BYTES // 2) + 1)


if __name__ == "__main__":
    PREDICT, CUDART, CUDA = (os.path.realpath(p) for p in sys.argv[1:4])
    del sys.argv[1:4]
    unittest.main()
