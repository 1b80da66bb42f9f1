"""Every family under FSDP2: predict --fsdp against torch's fully_shard on 2 Gloo ranks.

One small config per family (real_stack_test's), trained one step under FSDP2 by
verify/witness_ranks.py (fully_shard on each decoder layer and the root, NCCL-like
collectives; tests/fsdp2_witness_test.py pins the mechanism) and predicted by
//estimator:predict --dp=2 --fsdp from the same config.json. Each rank's parameters,
optimizer state and whole-step peak (bytes and phase) must agree byte for byte; a wrong
prediction (the mutation test) is reported naming the rank and the bucket.

GPT-2 is run with use_cache off: with it transformers keeps a DynamicCache in training,
which memledger's ranks do not model yet (the prediction's caveats say so).

Run by Bazel with the reference stack's Python (tests/BUILD.bazel):
    python tests/fsdp2_families_test.py PREDICT_BINARY
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import unittest
import warnings
from pathlib import Path

HERE = Path(os.path.realpath(__file__)).parent
sys.path.insert(0, str(HERE.parent / "verify"))
sys.path.insert(0, str(HERE))
import real_stack_test  # noqa: E402  (tests/real_stack_test.py: the family configs)
import witness_ranks  # noqa: E402  (verify/witness_ranks.py)

PREDICT = None  # set from argv
MODELS = ["llama_gqa", "mistral", "qwen2_tied", "gpt2_nocache", "qwen3", "gemma3", "olmo3",
          "qwen3_moe", "mixtral"]
BATCH, SEQ = 2, 16


class Fsdp2FamiliesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        warnings.filterwarnings("ignore")
        cls.tmp = tempfile.TemporaryDirectory()
        cls.configs = {m: real_stack_test.hf_config(real_stack_test.FAMILIES[m])
                       for m in MODELS}
        cases = [{"config": cls.configs[m], "batch": BATCH, "seq": SEQ,
                  "optimizer_impl": "for_loop", "fsdp": True} for m in MODELS]
        cls.measured = dict(zip(MODELS, (result["ranks"] for result in
                                          witness_ranks.measure_ranks(cases, ep=1, dp=2))))

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def predict(self, model, *flags):
        path = Path(self.tmp.name) / f"{model}.json"
        path.write_text(json.dumps(self.configs[model]))
        out = subprocess.run([PREDICT, f"--model={path}", f"--batch={BATCH}", f"--seq={SEQ}",
                              "--dp=2", "--fsdp", "--optimizer_impl=for_loop",
                              "--variants=none", *flags],
                             capture_output=True, text=True, check=False)
        self.assertEqual(out.returncode, 0, out.stderr)
        return json.loads(out.stdout)["ranks"][0]

    def test_every_family_is_exact_on_every_rank(self):
        for model in MODELS:
            with self.subTest(model=model):
                self.assertEqual(mismatches(self.measured[model], self.predict(model)), [])

    def test_a_wrong_prediction_is_named_by_rank_and_bucket(self):
        # The mutation: the prediction without resharding after the forward, against ranks
        # that reshard. Every rank's peak differs (bytes and phase); nothing else does.
        found = mismatches(self.measured["llama_gqa"],
                           self.predict("llama_gqa", "--reshard_after_forward=false"))
        self.assertEqual([line.split(":")[0] for line in found],
                         ["rank 0 peak_bytes", "rank 0 peak_phase", "rank 1 peak_bytes",
                          "rank 1 peak_phase"], found)


def mismatches(measured_ranks, predicted):
    """Each bucket where a rank's measurement and the prediction differ, as "rank R
    bucket: predicted P, measured M"."""
    expected = {"param_bytes": predicted["param_bytes"],
                "optimizer_state_bytes": predicted["optimizer_state_bytes"],
                "peak_bytes": predicted["peak_bytes"]["none"],
                "peak_phase": predicted["peak"]["none"]["phase"]}
    return [f"rank {r} {bucket}: predicted {value}, measured {rank[bucket]}"
            for r, rank in enumerate(measured_ranks)
            for bucket, value in expected.items() if rank[bucket] != value]


if __name__ == "__main__":
    PREDICT = os.path.realpath(sys.argv.pop(1))
    unittest.main()
