"""Every family under FSDP2: predict --fsdp against torch's fully_shard on 2 Gloo ranks.

One small config per family (real_stack_test's), trained one step under FSDP2 by
verify/witness_ranks.py (fully_shard on each decoder layer and the root, NCCL-like
collectives; tests/fsdp2_witness_test.py pins the mechanism) and predicted by
//estimator:predict --dp=2 --fsdp from the same config.json. Each rank's parameters,
optimizer state and whole-step peak (bytes and phase) must agree byte for byte.

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

    def predict(self, model):
        path = Path(self.tmp.name) / f"{model}.json"
        path.write_text(json.dumps(self.configs[model]))
        out = subprocess.run([PREDICT, f"--model={path}", f"--batch={BATCH}", f"--seq={SEQ}",
                              "--dp=2", "--fsdp", "--optimizer_impl=for_loop",
                              "--variants=none"], capture_output=True, text=True, check=False)
        self.assertEqual(out.returncode, 0, out.stderr)
        return json.loads(out.stdout)["ranks"][0]

    def test_every_family_is_exact_on_every_rank(self):
        for model in MODELS:
            with self.subTest(model=model):
                predicted = self.predict(model)
                for r, rank in enumerate(self.measured[model]):
                    self.assertEqual(rank["param_bytes"], predicted["param_bytes"], (model, r))
                    self.assertEqual(rank["optimizer_state_bytes"],
                                     predicted["optimizer_state_bytes"], (model, r))
                    self.assertEqual(
                        (rank["peak_bytes"], rank["peak_phase"]),
                        (predicted["peak_bytes"]["none"], predicted["peak"]["none"]["phase"]),
                        (model, r))


if __name__ == "__main__":
    PREDICT = os.path.realpath(sys.argv.pop(1))
    unittest.main()
