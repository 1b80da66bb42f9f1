"""The DDP witness: torch's DistributedDataParallel on 2 Gloo ranks, as torch runs it.

verify/witness_ranks.py (--ep=1) trains the issue's 2-layer Llama (hidden 64, 4 heads,
2 kv heads, head_dim 16, intermediate 160, vocab 512, untied) under
DistributedDataParallel with AdamW for_loop, batch 2 per rank and seq 32, and measures
the step after the Reducer rebuilt its buckets. These tests pin what memledger's DDP
must mirror, each fact checked against hand arithmetic or the single-process witness
(the same code without DDP), never against memledger:

* DDP's construction keeps one bucket element per parameter element (torch/csrc/
  distributed/c10d/reducer.cpp, initialize_buckets: bucket.gradients =
  at::empty({offset})) and nothing else; the buckets rebuilt at the second forward hold
  the same elements, split by the cap;
* the steady-state step allocates nothing else at its peak: a rank's peak is the single
  process's plus the buckets;
* with gradient_as_bucket_view the .grads are views of the buckets, so after the
  backward none is held apart;
* the measurement is deterministic (Gloo's worker lets go before the witness goes on).

Run by Bazel with the reference stack's Python (tests/BUILD.bazel):
    python tests/ddp_witness_test.py
"""

from __future__ import annotations

import os
import sys
import unittest
import warnings
from pathlib import Path

HERE = Path(os.path.realpath(__file__)).parent
sys.path.insert(0, str(HERE.parent / "verify"))
sys.path.insert(0, str(HERE))
import witness_ranks  # noqa: E402  (verify/witness_ranks.py)
from issue_llama import CONFIG, PARAM_BYTES  # noqa: E402  (tests/issue_llama.py)

witness = witness_ranks.witness

# DDP's options: torch's defaults (bucket_cap_mb 25, the first rebuilt bucket 1 MiB,
# gradient_as_bucket_view False), then each changed; the defaults again last.
OPTIONS = [{}, {"gradient_as_bucket_view": True}, {"bucket_cap_mb": 0.1},
           {"bucket_cap_mb": 0.1, "gradient_as_bucket_view": True}, {}]
FIELDS = ("param_bytes", "grad_bytes", "optimizer_state_bytes", "saved_bytes",
          "reducer_bytes", "held_after_forward", "held_after_backward", "peak_bytes",
          "peak_phase")


def case(ddp=None):
    return {"config": CONFIG, "batch": 2, "seq": 32, "optimizer_impl": "for_loop",
            **({"ddp": ddp} if ddp is not None else {})}


class DdpWitnessTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        warnings.filterwarnings("ignore")
        cls.ranks = [result["ranks"] for result in witness_ranks.measure_ranks(
            [case(options) for options in OPTIONS], ep=1, dp=2)]
        cls.alone = witness.measure({**witness.DEFAULTS, **case()})

    def test_the_reducer_keeps_one_bucket_element_per_parameter_element(self):
        for options, ranks in zip(OPTIONS, self.ranks):
            for r, rank in enumerate(ranks):
                self.assertEqual(rank["param_bytes"], PARAM_BYTES, (options, r))
                self.assertEqual(rank["reducer_bytes"], PARAM_BYTES, (options, r))

    def test_a_ranks_step_is_the_single_process_step_beside_the_buckets(self):
        # The issue's measurement, 3,503,004 B a rank with the defaults: the single
        # process's peak plus the buckets, in the same phase.
        self.assertEqual(self.ranks[0][0]["peak_bytes"], 3503004)
        for options, ranks in zip(OPTIONS, self.ranks):
            for r, rank in enumerate(ranks):
                self.assertEqual(rank["peak_bytes"] - rank["reducer_bytes"],
                                 self.alone["peak_bytes"], (options, r))
                self.assertEqual(rank["peak_phase"], self.alone["peak_phase"], (options, r))
                self.assertEqual(rank["held_after_forward"], self.alone["held_after_forward"],
                                 (options, r))
                self.assertEqual(rank["saved_bytes"], self.alone["saved_bytes"], (options, r))

    def test_gradients_as_bucket_views_are_held_in_the_buckets(self):
        for options, ranks in zip(OPTIONS, self.ranks):
            view = options.get("gradient_as_bucket_view", False)
            for r, rank in enumerate(ranks):
                # Apart: the single process's .grads (607,488 B) are held after the
                # backward; as views, none but the loss's 4 B.
                held = self.alone["held_after_backward"] - (PARAM_BYTES if view else 0)
                self.assertEqual(rank["held_after_backward"], held, (options, r))

    def test_the_measurement_is_the_same_on_every_rank_and_every_run(self):
        for options, ranks in zip(OPTIONS, self.ranks):
            for field in FIELDS:
                self.assertEqual(ranks[0][field], ranks[1][field], (options, field))
        first, last = self.ranks[0], self.ranks[-1]
        for r in range(2):
            for field in FIELDS:
                self.assertEqual(first[r][field], last[r][field], (r, field))


# What trains under DDP: peft's LoRA (r 8 on q_proj and v_proj, DDP's defaults) and the
# embeddings and head frozen (full checkpointing, 0.1 MiB buckets).
LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "targets": ["q_proj", "v_proj"]}
FINE_TUNING = [{**case({}), "lora": LORA},
               {**case({"bucket_cap_mb": 0.1}), "freeze": ["embeddings", "lm_head"],
                "variant": "full"}]
# Their trainable bytes, by hand: LoRA's (8 x 64 + 64 x 8) + (8 x 64 + 32 x 8) = 1,792
# fp32 parameters a layer, 3,584 in 2 layers; the whole model less the embedding and the
# head, 2 x 512 x 64 fp32 each.
TRAINABLE_BYTES = [3584 * 4, PARAM_BYTES - 2 * 512 * 64 * 4]


class DdpFineTuningTest(unittest.TestCase):
    """The Reducer buckets only the parameters that require grad (reducer.cpp builds its
    buckets from the parameters with requires_grad), and the rank's step is the single
    process's beside them; tests/data_parallel_ranks_test.cc's DdpBucketsOnlyWhatTrains
    holds memledger to the peaks pinned here."""

    @classmethod
    def setUpClass(cls):
        warnings.filterwarnings("ignore")
        cls.ranks = [result["ranks"] for result in
                     witness_ranks.measure_ranks(FINE_TUNING, ep=1, dp=2)]
        cls.alone = [witness.measure({**witness.DEFAULTS,
                                      **{k: v for k, v in c.items() if k != "ddp"}})
                     for c in FINE_TUNING]

    def test_the_buckets_hold_what_trains_beside_the_single_process_step(self):
        for c, (ranks, alone, trainable) in enumerate(
                zip(self.ranks, self.alone, TRAINABLE_BYTES)):
            for r, rank in enumerate(ranks):
                self.assertEqual(rank["reducer_bytes"], trainable, (c, r))
                self.assertEqual(rank["grad_bytes"], trainable, (c, r))
                self.assertEqual(rank["peak_bytes"] - rank["reducer_bytes"],
                                 alone["peak_bytes"], (c, r))
                self.assertEqual(rank["peak_phase"], alone["peak_phase"], (c, r))

    def test_the_peaks_memledger_is_held_to(self):
        self.assertEqual([ranks[0]["peak_bytes"] for ranks in self.ranks], [1516424, 2278484])
        for ranks in self.ranks:
            self.assertEqual(ranks[0]["peak_bytes"], ranks[1]["peak_bytes"])
            self.assertEqual(ranks[0]["peak_phase"], "backward")


if __name__ == "__main__":
    unittest.main()
