"""The FSDP2 witness: torch's fully_shard on 2 Gloo ranks, as torch runs it.

verify/witness_ranks.py (--ep=1) trains the issue's 2-layer Llama (hidden 64, 4 heads,
2 kv heads, head_dim 16, intermediate 160, vocab 512, untied) under FSDP2, fully_shard on
each decoder layer and then the whole model (torchtitan's way), with AdamW for_loop,
batch 2 per rank and seq 32; its collectives are NCCL's (in place, no buffers of their
own: witness_common._nccl_like_collectives). These tests pin what memledger's FSDP2 must
mirror, each fact checked against hand arithmetic or the single-process witness (the same
code without FSDP2), never against memledger:

* each parameter is its own Shard(0) (torch/distributed/fsdp/_fully_shard/
  _fsdp_param.py): here every dim 0 is even, so each rank holds half of every parameter,
  its gradient and its optimizer state, unpadded;
* after the backward a rank holds only its sharded gradients (and the loss);
* with reshard_after_forward=True every unit, the root too, frees its unsharded
  parameters after its forward: the forward leaves what one process's leaves; with False
  all of them stay, the whole model's unsharded parameters more;
* the measurement is deterministic: the same on both ranks and on a second run;
* over 3 ranks (tiny-llama's shape) each rank stores ceil(rows / 3) rows of every
  parameter, and its optimizer steps its own rows (the last rank's fewer).

The peaks are recorded as measured (docs/DESIGN.md, "Distributed", says which buffers
make them); tests/ranks_test.cc (FsdpPeaksAsTorchsFullyShard) holds memledger's
--fsdp to the first two.

Run by Bazel with the reference stack's Python (tests/BUILD.bazel):
    python tests/fsdp2_witness_test.py
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
from issue_llama import CONFIG, PARAM_BYTES, TENSORS  # noqa: E402  (tests/issue_llama.py)

witness = witness_ranks.witness

# Every dim 0 of the issue's Llama (512, 64, 32, 160) is even: a rank's Shard(0) of each
# parameter is half of it, no padding.
SHARD_BYTES = PARAM_BYTES // 2
# The last repeats the first: the same measurement run after run.
OPTIONS = [{}, {"reshard_after_forward": False},
           {"mp_param_dtype": "bf16", "mp_reduce_dtype": "fp32"},
           {"reshard_after_forward": None}, {}]
# As measured (transformers 5.23.0, torch 2.15.0; the issue measured 2,634,284 B for
# reshard_after_forward=False with Gloo's own collectives too).
PEAKS = [(2419740, "backward"), (2634284, "forward"), (1904796, "backward"),
         (2419740, "backward"), (2419740, "backward")]
# The root unit's unsharded parameters: the embedding and lm_head (512 x 64 each) and the
# final norm (64), fp32.
ROOT_BYTES = (2 * 512 * 64 + 64) * 4
FIELDS = ("param_bytes", "grad_bytes", "optimizer_state_bytes", "held_after_forward",
          "held_after_backward", "peak_bytes", "peak_phase")


def case(fsdp=None, **options):
    return {"config": CONFIG, "batch": 2, "seq": 32, "optimizer_impl": "for_loop",
            **({"fsdp": True, **options} if fsdp else {})}


class Fsdp2WitnessTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        warnings.filterwarnings("ignore")
        cls.ranks = [result["ranks"] for result in witness_ranks.measure_ranks(
            [case(True, **options) for options in OPTIONS], ep=1, dp=2)]
        cls.alone = witness.measure({**witness.DEFAULTS, **case()})

    def test_each_parameter_is_sharded_on_its_first_dimension(self):
        self.assertEqual(self.alone["param_bytes"], PARAM_BYTES)
        for options, ranks in zip(OPTIONS, self.ranks):
            for r, rank in enumerate(ranks):
                # The sharded parameters stay fp32 under a MixedPrecisionPolicy.
                self.assertEqual(rank["param_bytes"], SHARD_BYTES, (options, r))
                self.assertEqual(rank["grad_bytes"], SHARD_BYTES, (options, r))
                # AdamW's two moments of each shard, and a 4-byte step per tensor.
                self.assertEqual(rank["optimizer_state_bytes"], 2 * SHARD_BYTES + 4 * TENSORS,
                                 (options, r))

    def test_after_the_backward_a_rank_holds_its_sharded_gradients(self):
        for options, ranks in zip(OPTIONS, self.ranks):
            for r, rank in enumerate(ranks):
                self.assertEqual(rank["held_after_backward"], SHARD_BYTES + 4, (options, r))

    def test_reshard_after_forward_decides_what_the_forward_leaves(self):
        # fully_shard's default (None) reshards every unit but the root
        # (FSDPState._lazy_init), which keeps its parameters to the backward.
        resharded, kept, auto = self.ranks[0], self.ranks[1], self.ranks[3]
        for r in range(2):
            self.assertEqual(resharded[r]["held_after_forward"],
                             self.alone["held_after_forward"], r)
            self.assertEqual(kept[r]["held_after_forward"],
                             self.alone["held_after_forward"] + PARAM_BYTES, r)
            self.assertEqual(auto[r]["held_after_forward"],
                             self.alone["held_after_forward"] + ROOT_BYTES, r)

    def test_the_peaks_as_measured(self):
        for options, ranks, (peak, phase) in zip(OPTIONS, self.ranks, PEAKS):
            for r, rank in enumerate(ranks):
                self.assertEqual((rank["peak_bytes"], rank["peak_phase"]), (peak, phase),
                                 (options, r))

    def test_the_measurement_is_the_same_on_every_rank_and_every_run(self):
        for options, ranks in zip(OPTIONS, self.ranks):
            for field in FIELDS:
                self.assertEqual(ranks[0][field], ranks[1][field], (options, field))
        first, last = self.ranks[0], self.ranks[-1]
        for r in range(2):
            for field in FIELDS:
                self.assertEqual(first[r][field], last[r][field], (r, field))


class Fsdp2CheckpointingTest(unittest.TestCase):
    """transformers' gradient checkpointing (non-reentrant) inside each fully_shard
    layer: the recompute runs in the layer's backward, on the parameters its
    pre_backward gathered (FSDP2's hooks skip the recompute's forward)."""

    VARIANTS = [("full", True), ("full", False), ("selective", True), ("selective", False)]

    @classmethod
    def setUpClass(cls):
        warnings.filterwarnings("ignore")
        cls.ranks = [result["ranks"] for result in witness_ranks.measure_ranks(
            [case(True, variant=variant, reshard_after_forward=reshard)
             for variant, reshard in cls.VARIANTS], ep=1, dp=2)]

    def test_the_peaks_as_measured(self):
        peaks = [(2198492, "backward"), (2198492, "backward"), (2297500, "backward"),
                 (2346668, "forward")]
        for variant, ranks, peak in zip(self.VARIANTS, self.ranks, peaks):
            for r, rank in enumerate(ranks):
                self.assertEqual((rank["peak_bytes"], rank["peak_phase"]), peak, (variant, r))
                self.assertEqual(rank["held_after_backward"], SHARD_BYTES + 4, (variant, r))


class Fsdp2MixedPrecisionTest(unittest.TestCase):
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): bf16 unsharded
    parameters and compute over the fp32 shards, gradients reduced in fp32; ATen's own
    gemm (oneDNN's bf16 scratchpads off, as memledger predicts)."""

    VARIANTS = [(variant, reshard) for variant in ("none", "full", "selective")
                for reshard in (True, False)]

    @classmethod
    def setUpClass(cls):
        warnings.filterwarnings("ignore")
        cls.ranks = [result["ranks"] for result in witness_ranks.measure_ranks(
            [case(True, variant=variant, reshard_after_forward=reshard,
                  mp_param_dtype="bf16", mp_reduce_dtype="fp32", mkldnn=False)
             for variant, reshard in cls.VARIANTS], ep=1, dp=2)]

    def test_the_shards_stay_fp32(self):
        for variant, ranks in zip(self.VARIANTS, self.ranks):
            for r, rank in enumerate(ranks):
                self.assertEqual(rank["param_bytes"], SHARD_BYTES, (variant, r))
                self.assertEqual(rank["grad_bytes"], SHARD_BYTES, (variant, r))
                self.assertEqual(rank["optimizer_state_bytes"], 2 * SHARD_BYTES + 4 * TENSORS,
                                 (variant, r))

    def test_the_peaks_as_measured(self):
        peaks = [(1904796, "backward"), (2012844, "forward"), (1712604, "backward"),
                 (1712604, "backward"), (1731868, "backward"), (1839916, "forward")]
        for variant, ranks, peak in zip(self.VARIANTS, self.ranks, peaks):
            for r, rank in enumerate(ranks):
                self.assertEqual((rank["peak_bytes"], rank["peak_phase"]), peak, (variant, r))


class Fsdp2PostForwardMeshTest(unittest.TestCase):
    """reshard_after_forward=2 over 4 ranks: after its forward each unit keeps its
    parameters sharded over a post-forward mesh of 2 ranks (_fsdp_init.py,
    _get_post_forward_mesh_info; FSDPParam.to_sharded_post_forward), half of each on a
    rank, and its backward gathers them from those 2 ranks."""

    # (reshard_after_forward, variant, MixedPrecisionPolicy(bf16, fp32))
    CASES = [(True, "none", False), (False, "none", False), (2, "none", False),
             (2, "full", False), (2, "selective", False), (2, "none", True)]

    @classmethod
    def setUpClass(cls):
        warnings.filterwarnings("ignore")
        cls.ranks = [result["ranks"] for result in witness_ranks.measure_ranks(
            [case(True, reshard_after_forward=reshard, variant=variant,
                  **({"mp_param_dtype": "bf16", "mp_reduce_dtype": "fp32", "mkldnn": False}
                     if mixed else {}))
             for reshard, variant, mixed in cls.CASES], ep=1, dp=4)]

    def test_the_forward_leaves_half_the_unsharded_parameters(self):
        # Every dim 0 divides by 4: a rank's Shard(0) is a quarter, unpadded; True leaves
        # no unsharded parameter after the forward, False all 607,488 B, 2 half of them.
        resharded, kept, to_two = self.ranks[0], self.ranks[1], self.ranks[2]
        for r in range(4):
            self.assertEqual(resharded[r]["param_bytes"], PARAM_BYTES // 4, r)
            self.assertEqual(kept[r]["held_after_forward"] - resharded[r]["held_after_forward"],
                             PARAM_BYTES, r)
            self.assertEqual(to_two[r]["held_after_forward"]
                             - resharded[r]["held_after_forward"], PARAM_BYTES // 2, r)
            self.assertEqual(to_two[r]["held_after_backward"], PARAM_BYTES // 4 + 4, r)

    def test_the_peaks_as_measured(self):
        # tests/ranks_test.cc (FsdpReshardsToAPostForwardMesh) holds --fsdp to these.
        peaks = [(1964124, "backward"), (2178668, "forward"), (2136156, "backward"),
                 (1764316, "backward"), (1928156, "backward"), (1535452, "backward")]
        for options, ranks, peak in zip(self.CASES, self.ranks, peaks):
            for r, rank in enumerate(ranks):
                self.assertEqual((rank["peak_bytes"], rank["peak_phase"]), peak, (options, r))


# tiny-llama's shape (hidden 32, 4 heads of 8, 2 kv heads, intermediate 64, vocab 96,
# untied) over 3 ranks, where most rows are not a multiple of 3.
TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "vocab_size": 96, "tie_word_embeddings": False}


class Fsdp2PaddedShardsTest(unittest.TestCase):
    """torch.chunk's rows, ceil(rows / 3) a rank, the last ranks' fewer: every rank
    stores its shard padded (FSDPParam's padded sharded storage), its optimizer steps
    the unpadded rows."""

    @classmethod
    def setUpClass(cls):
        warnings.filterwarnings("ignore")
        cls.ranks = [result["ranks"] for result in witness_ranks.measure_ranks(
            [{"config": TINY, "batch": 2, "seq": 8, "optimizer_impl": "for_loop",
              "fsdp": True, "reshard_after_forward": reshard} for reshard in (True, False)],
            ep=1, dp=3)]

    def test_shards_by_hand(self):
        # Rank 0's padded rows: a layer's q and o 11 x 32, k and v 6 x 32, gate and up
        # 22 x 32, down 11 x 64, two norms 11: 3,222; the root's embedding and lm_head
        # 32 x 32 each and its norm 11: 2,059; 2 x 3,222 + 2,059 = 8,503 elements.
        # Rank 2's rows: 10, 4, 4, 10, 20, 20, 10 (x 64), 10 + 10 a layer: 2,836; the
        # root 1,024 + 10 + 1,024: 7,730 elements, stepped by AdamW.
        for ranks in self.ranks:
            for r, rank in enumerate(ranks):
                self.assertEqual(rank["param_bytes"], 8503 * 4, r)
                stepped = 8503 if r < 2 else 7730
                self.assertEqual(rank["optimizer_state_bytes"], 2 * stepped * 4 + 21 * 4, r)

    def test_the_peaks_as_measured(self):
        # Rank 0 and 1 alike; rank 2 holds less state.
        for ranks, peaks in zip(self.ranks, ((330284, 330284, 324100),
                                             (332668, 332668, 326484))):
            self.assertEqual(tuple(rank["peak_bytes"] for rank in ranks), peaks)


if __name__ == "__main__":
    unittest.main()
