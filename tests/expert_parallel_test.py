"""Conformance: predict --ep against transformers 5.23's expert parallelism on Gloo ranks.

verify/witness_ranks.py trains one step of the real Qwen3-MoE and Mixtral on 2
expert-parallel ranks (2 processes on loopback): each rank holds half of the experts
(MoEParamShard's Shard(0)) and AllToAllEP sends every routed token to its expert's rank
and the result back, each rank training its own batch. predict --dp=2 --ep=2 predicts
each rank from the same config.json and the step's routing (every rank's rows), and
every rank's parameters, gradients, optimizer state, saved bytes and the whole step's
peak (with the gradients' reduction memledger predicts: witness.reduce_expert_parallel)
must agree byte for byte.

The ranks' predictions keep no DynamicCache (estimator/predict/ranks.cc), so the
configs say use_cache false. held_after_forward is not compared: predict reports it for
one process, not per rank.

Run by Bazel with the reference stack's Python (tests/BUILD.bazel):
    python tests/expert_parallel_test.py PREDICT_BINARY
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
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "verify"))
import real_stack_test  # noqa: E402  (its small family configs)
import witness_ranks  # noqa: E402  (verify/witness_ranks.py)

PREDICT = None  # set from argv
EP = 2

# (family spec, variant, dtype, seq, experts): Qwen3-MoE with a dense first layer under
# every checkpointing variant, in fp32 and bf16; Mixtral with fp32 routing weights; the
# eager experts and transformers' default grouped_mm (whose expert-parallel module masks
# its sentinel rows). At seq 16 the step peaks in the gradients' reduction; at seq 128
# the activations outweigh it and it peaks in the forward or the backward, through the
# all-to-alls.
CASES = [
    ("qwen3_moe", "none", "fp32", 16, "eager"),
    ("qwen3_moe", "full", "fp32", 16, "eager"),
    ("qwen3_moe", "every_2", "fp32", 16, "eager"),
    ("qwen3_moe", "selective", "fp32", 16, "eager"),
    ("qwen3_moe", "none", "bf16", 16, "eager"),
    ("mixtral", "none", "fp32", 16, "eager"),
    ("mixtral", "full", "fp32", 16, "eager"),
    ("qwen3_moe", "none", "fp32", 128, "eager"),
    ("qwen3_moe", "full", "fp32", 128, "eager"),
    ("qwen3_moe", "selective", "fp32", 128, "eager"),
    ("mixtral", "every_2", "fp32", 128, "eager"),
    ("qwen3_moe", "none", "fp32", 16, "grouped_mm"),
    ("qwen3_moe", "none", "fp32", 128, "grouped_mm"),
    ("qwen3_moe", "every_2", "bf16", 128, "grouped_mm"),
    ("mixtral", "full", "fp32", 128, "grouped_mm"),
    ("mixtral", "selective", "fp32", 128, "grouped_mm"),
    # Every position one token, routed top-1: with seed 3 both ranks send everything to
    # expert 1, so rank 1 receives nothing in either sparse layer and AllToAllEP runs its
    # experts on one fake row; with seed 5 each rank receives nothing in one layer.
    ("qwen3_moe_top1", "none", "fp32", 16, "eager", 3),
    ("qwen3_moe_top1", "full", "fp32", 16, "grouped_mm", 3),
    ("qwen3_moe_top1", "none", "fp32", 128, "grouped_mm", 5),
    ("qwen3_moe_top1", "selective", "fp32", 128, "eager", 5),
]
# On 4 data-parallel ranks in 2 expert-parallel groups: the reduction of the experts'
# gradients over their own group holds the peak at seq 16, the all-to-alls at seq 128.
GROUP_CASES = [
    ("qwen3_moe", "none", "fp32", 16, "grouped_mm"),
    ("mixtral", "full", "fp32", 16, "eager"),
    ("qwen3_moe", "none", "fp32", 128, "eager"),
]


def config_of(model):
    top1 = model == "qwen3_moe_top1"
    config = real_stack_test.hf_config(real_stack_test.FAMILIES["qwen3_moe" if top1 else model])
    config["use_cache"] = False
    if top1:
        config["num_experts_per_tok"] = 1
    return config


def witness_case(model, variant, dtype, seq, experts, same_token_seed=None):
    case = {"config": config_of(model), "batch": 2, "seq": seq, "variant": variant,
            "dtype": dtype, "experts_impl": experts, "mkldnn": dtype == "fp32"}
    if same_token_seed is not None:
        case.update(same_token=True, seed=same_token_seed)
    return case


def predict(model, variant, dtype, seq, experts, routing, tmp, same_token_seed=None, dp=EP):
    del same_token_seed  # the routing file says where the tokens went
    path = Path(tmp) / f"{model}.json"
    path.write_text(json.dumps(config_of(model)))
    routing_path = Path(tmp) / f"{model}.{variant}.{dtype}.{seq}.{experts}.{dp}.routing.json"
    routing_path.write_text(json.dumps(routing))
    flags = [f"--model={path}", "--batch=2", f"--seq={seq}", f"--variants={variant}",
             f"--dtype={dtype}", f"--experts_impl={experts}", f"--routing={routing_path}",
             f"--dp={dp}", f"--ep={EP}", "--optimizer_impl=for_loop"]
    out = subprocess.run([PREDICT] + flags, capture_output=True, text=True)
    if out.returncode != 0:
        raise AssertionError(f"predict {' '.join(flags)}: {out.stderr.strip()}")
    return sorted(json.loads(out.stdout)["ranks"],
                  key=lambda rank: rank.get("dp_rank", rank["ep_rank"]))


class ExpertParallelTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        warnings.filterwarnings("ignore")
        cls.tmp = tempfile.mkdtemp()
        cls.measured = witness_ranks.measure_ranks([witness_case(*c) for c in CASES], EP)
        cls.measured_groups = witness_ranks.measure_ranks(
            [witness_case(*c) for c in GROUP_CASES], EP, dp=2 * EP)

    def compare(self, cases, measured, dp):
        """Every rank's buckets and peak, predicted against measured."""
        failures = []
        for case, result in zip(cases, measured):
            model, variant, dtype, seq, experts = case[:5]
            ranks = predict(*case[:5], result["routing"], self.tmp, dp=dp)
            self.assertEqual(len(ranks), dp)
            for r, (p, w) in enumerate(zip(ranks, result["ranks"])):
                peak = p["peak"][variant]
                for bucket, predicted, measured_bytes in (
                        ("param_bytes", p["param_bytes"], w["param_bytes"]),
                        ("grad_bytes", p["grad_bytes"], w["grad_bytes"]),
                        ("optimizer_state_bytes", p["optimizer_state_bytes"],
                         w["optimizer_state_bytes"]),
                        ("saved_bytes", p["saved_bytes"][variant], w["saved_bytes"]),
                        ("peak_bytes", peak["bytes"], w["peak_bytes"]),
                        ("peak_phase", peak["phase"], w["peak_phase"])):
                    line = f"{model}/{variant}/{dtype}/seq{seq}/{experts} dp {dp} rank {r} " \
                           f"{bucket}: predicted {predicted}, measured {measured_bytes}"
                    print(line, flush=True)
                    if predicted != measured_bytes:
                        failures.append(line)
        self.assertEqual(failures, [], "\n".join(failures))

    def test_every_rank_is_exact(self):
        self.compare(CASES, self.measured, EP)

    def test_every_rank_of_two_expert_parallel_groups_is_exact(self):
        # dp 4 = 2 groups of ep 2 ranks: each group routes its own batches, and the
        # experts' gradients are reduced over the 2 ranks that hold the same experts
        # (ranks 0 and 2, 1 and 3); predict makes a kind per data-parallel rank.
        self.compare(GROUP_CASES, self.measured_groups, 2 * EP)

    def test_the_ranks_route_differently(self):
        # Each rank trains its own batch, so their routings (and what each rank's experts
        # receive) differ: the comparison is per rank, not one rank's copied.
        rows = self.measured[0]["routing"]["ranks"]
        self.assertEqual(len(rows), EP)
        self.assertNotEqual(rows[0]["layers"], rows[1]["layers"])
        # The same-token cases route as their comments say: seed 3 sends all 32 tokens of
        # each rank to expert 1 (rank 0's) in both sparse layers.
        seed3 = self.measured[CASES.index(("qwen3_moe_top1", "none", "fp32", 16, "eager", 3))]
        for rank in seed3["routing"]["ranks"]:
            self.assertEqual(rank["layers"], [[0, 32, 0, 0], [0, 32, 0, 0]])

    def test_each_rank_holds_half_the_experts(self):
        # qwen3_moe: width 64, 4 experts of width 32 on layers 1 and 2 (layer 0 dense).
        # An expert is gate_up (2 x 32, 64) + down (64, 32) = 6,144 fp32 elements, 24,576
        # B; each rank holds 2 of the 4 in each of the 2 sparse layers: 98,304 B of
        # experts instead of 196,608, so each rank's parameters are one process's less
        # 98,304 B (both measured by the witness).
        whole = witness_ranks.witness.measure(
            {**witness_ranks.witness.DEFAULTS,
             **witness_case("qwen3_moe", "none", "fp32", 16, "eager")})
        for rank in self.measured[0]["ranks"]:
            self.assertEqual(whole["param_bytes"] - rank["param_bytes"], 98304)

if __name__ == "__main__":
    PREDICT = os.path.realpath(sys.argv.pop(1))
    unittest.main()
