"""predict --snapshot_out, read by the pinned torch's own memory tools.

The pickle must load as torch.cuda.memory._snapshot()'s dict, torch.cuda._memory_viz's
trace and trace_plot must accept it, and replaying its trace (each alloc adds its size,
each free_completed takes it away) must reach exactly predict's peak_bytes for the
variant, ending at the bytes its one segment holds as allocated.

Run by Bazel with the reference stack's Python (tests/BUILD.bazel):
    python tests/memory_snapshot_test.py PREDICT_BINARY
"""

import json
import os
import pickle
import subprocess
import sys
import tempfile
import unittest

PREDICT = None  # set from argv


def predict(*flags):
    return subprocess.run([PREDICT, *flags], capture_output=True, text=True)


def replay(snapshot):
    """(peak, live at the end) of the snapshot's trace."""
    live = peak = 0
    for e in snapshot["device_traces"][0]:
        if e["action"] == "alloc":
            live += e["size"]
        elif e["action"] == "free_completed":
            live -= e["size"]
        peak = max(peak, live)
    return peak, live


class MemorySnapshotTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()

    def snapshot(self, variant, *flags):
        path = os.path.join(self.tmp, f"{variant}.pickle")
        out = predict(f"--variants={variant}", f"--snapshot_out={path}", *flags)
        self.assertEqual(out.returncode, 0, out.stderr)
        with open(path, "rb") as f:
            return json.loads(out.stdout), pickle.load(f)

    def test_replay_reaches_the_predicted_peak(self):
        cases = [("full", "--model=tiny-llama"), ("none", "--model=tiny-gpt2"),
                 ("selective", "--model=tiny-llama", "--amp=bf16"),
                 ("every_2", "--layers=3", "--dtype=bf16", "--optimizer_impl=foreach")]
        for variant, *flags in cases:
            with self.subTest(variant=variant, flags=flags):
                p, snapshot = self.snapshot(variant, *flags)
                peak, end = replay(snapshot)
                self.assertEqual(peak, p["peak_bytes"][variant])
                self.assertEqual(end, snapshot["segments"][0]["allocated_size"])
                trace = snapshot["device_traces"][0]
                # It opens with what exists before the step, then the step's own.
                self.assertEqual(trace[0]["frames"][0]["filename"], "memledger before the step")
                self.assertIn("parameter", trace[0]["category"])
                phases = {e["frames"][0]["filename"] for e in trace}
                self.assertTrue({"memledger forward", "memledger backward",
                                 "memledger optimizer"} <= phases, phases)

    def test_on_cuda_its_sizes_are_the_allocators_blocks(self):
        # --device=cuda: every allocation is a block of the caching allocator (a multiple
        # of 512 B, at least 512: tiny-llama's 64-B norm weights included), and the trace
        # replays to peak_bytes, max_memory_allocated()'s count.
        for variant, *flags in [("full", "--model=tiny-llama", "--dtype=bf16"),
                                ("none", "--model=tiny-gpt2", "--sdpa_backend=efficient")]:
            with self.subTest(variant=variant, flags=flags):
                p, snapshot = self.snapshot(variant, "--device=cuda", *flags)
                trace = snapshot["device_traces"][0]
                sizes = [e["size"] for e in trace if e["action"] == "alloc"]
                self.assertTrue(all(s % 512 == 0 and s >= 512 for s in sizes),
                                sorted(set(s % 512 for s in sizes)))
                self.assertEqual(replay(snapshot)[0], p["peak_bytes"][variant])
        # On the CPU the same norm weights are 64-B allocations (32 bf16 elements).
        _, cpu = self.snapshot("full", "--model=tiny-llama", "--dtype=bf16")
        self.assertIn(64, [e["size"] for e in cpu["device_traces"][0]
                           if e["action"] == "alloc"])

    def test_it_opens_with_every_parameter_and_its_optimizer_state(self):
        # tiny-llama (2 layers, untied) has, by hand, 21 parameter tensors: the
        # embedding, per layer q, k, v, o, gate, up, down and two norms (2 x 9), the
        # final norm and lm_head; AdamW keeps exp_avg, exp_avg_sq and a 4-byte step for
        # each: 63 tensors. Then one allocation each for the buffers and the input.
        p, snapshot = self.snapshot("full", "--model=tiny-llama")
        trace = snapshot["device_traces"][0]
        before = [e for e in trace if e["frames"][0]["filename"] == "memledger before the step"]
        params = [e for e in before if e["category"] == "parameter"]
        state = [e for e in before if e["category"] == "optimizer_state"]
        self.assertEqual(len(params), 21)
        self.assertEqual(len(state), 63)
        self.assertEqual(sum(e["size"] for e in params), p["param_bytes"])
        self.assertEqual(sum(e["size"] for e in state), p["optimizer_state_bytes"])
        names = [e["frames"][0]["name"] for e in before]
        self.assertIn("embeddings embed_tokens.weight", names)
        self.assertIn("layer 1 down_proj.weight exp_avg_sq", names)
        self.assertIn("head lm_head.weight step", names)
        self.assertEqual([e["size"] for e in state if e["frames"][0]["name"].endswith(" step")],
                         [4] * 21)

    def test_torch_memory_viz_reads_it(self):
        from torch.cuda import _memory_viz

        _, snapshot = self.snapshot("full", "--model=tiny-llama")
        text = _memory_viz.trace(snapshot)
        self.assertIn(f"{len(snapshot['device_traces'][0])} entries", text)
        self.assertIn("TOTAL MEM", text)
        html = _memory_viz.trace_plot(snapshot)
        self.assertIn("Active Memory Timeline", html)
        self.assertIn("segments", _memory_viz.segsum(snapshot))

    def test_bad_requests_exit_two_writing_nothing(self):
        path = os.path.join(self.tmp, "never.pickle")
        for flags in (["--variants=none,full"], ["--dp=2", "--variants=none"]):
            out = predict(f"--snapshot_out={path}", *flags)
            self.assertEqual(out.returncode, 2, out.stderr)
            self.assertEqual(out.stderr.count("\n"), 1, out.stderr)
            self.assertIn("--snapshot_out writes one process's step of one variant",
                          out.stderr)
            self.assertFalse(os.path.exists(path))
        # An output path that cannot be written is bad input too (estimator/cli/
        # output_files.h): exit 2, one line naming the flag and the path.
        out = predict("--snapshot_out=/nonexistent-dir/s.pickle", "--variants=none")
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertEqual(out.stderr.count("\n"), 1, out.stderr)
        self.assertIn("--snapshot_out=/nonexistent-dir/s.pickle: cannot create", out.stderr)


if __name__ == "__main__":
    PREDICT = os.path.realpath(sys.argv.pop(1))
    unittest.main()
