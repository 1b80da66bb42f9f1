"""The CUDA step's peak without a GPU: predict --device=cuda against the real stack's whole
training step on fake CUDA tensors.

verify/witness_fake_step.py builds each family's real transformers model under
FakeTensorMode on device cuda (the wheel's CUDA build over tests/cuda_stub's stub runtime
and driver, so the autograd engine runs the backward too), trains a warm-up step and
then the measured one with AdamW, and counts every live storage as the caching
allocator's 512 B block. predict's peak_bytes and peak phase must equal it, byte for
byte, for every case below: each family of tests/real_stack_test.py that runs on CUDA,
SDPA's math kernel, in fp32, bf16 and under bf16 autocast, across checkpointing
variants; cuDNN's in bf16 and under autocast; the memory-efficient kernel where its
backward's own buffers are not at the peak; peft's LoRA on llama and qwen3, on fp32
and bf16 models and under autocast; and the forward under save_on_cpu
(--offload_activations=cpu), with the host bytes it holds.

Left out, and why:
* what kernels allocate for themselves, which meta kernels do not: cuBLAS's workspace
  (predict is told --cublas_workspace_config=:0:0, as CUBLAS_WORKSPACE_CONFIG=:0:0 runs
  a GPU without one), and the fused attention backwards' buffers (grad_out's copy, the
  expanded gradients of grouped-query heads, delta; flash's dq_accum): a family whose
  peak is the memory-efficient backward (qwen3, gemma3, olmo3 at head_dim 32) differs
  by them.

Run by Bazel with the reference stack's Python (tests/BUILD.bazel):
    python tests/fake_cuda_step_test.py PREDICT LIBCUDART_STUB LIBCUDA_STUB
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
import real_stack_test  # noqa: E402  (the families' small configs)
import witness_fake_step  # noqa: E402  (verify/witness_fake_step.py)

WITNESS = HERE.parent / "verify" / "witness_fake_step.py"
PREDICT = CUDART = CUDA = None  # set from argv

# (backend, dtype, amp)
MATH = (("math", "fp32", "none"), ("math", "bf16", "none"), ("math", "fp32", "bf16"))
EFFICIENT = (("efficient", "fp32", "none"),)
# The sm90 default for bf16 (its philox offset, the fourth output, was once never made).
CUDNN = (("cudnn", "bf16", "none"), ("cudnn", "fp32", "bf16"))
ALL_VARIANTS = ("none", "full", "every_2", "selective")
CHECKPOINTED = ("full", "every_2", "selective")
# (model, kernels, variants)
GRID = [
    ("llama_gqa", MATH + EFFICIENT + CUDNN, ALL_VARIANTS),
    ("llama_mha", MATH, ALL_VARIANTS),
    ("llama_mqa", MATH + CUDNN, ALL_VARIANTS),
    ("mistral", MATH + EFFICIENT, ALL_VARIANTS),
    ("qwen2_tied", MATH + CUDNN, ALL_VARIANTS),
    ("llama_bias", MATH, ALL_VARIANTS),
    ("gpt2_nodrop", MATH, ALL_VARIANTS),
    ("gpt2", MATH + EFFICIENT, ALL_VARIANTS),  # with its dropouts' masks
    ("qwen3", MATH + CUDNN, ALL_VARIANTS),
    # One kv head: the math kernel's repeat_interleave clones it, where transformers'
    # repeat_kv would view it.
    ("qwen3_tied", MATH, ALL_VARIANTS),
    # Without checkpointing each sliding-window layer's DynamicCache moves its window
    # size to the device at its first update (lazy_initialization).
    ("gemma3", MATH + CUDNN, ALL_VARIANTS),
    ("olmo3", MATH, ALL_VARIANTS),
    # transformers' grouped_mm experts (integrations/moe.py), their router's sort and
    # histc (int32 on CUDA), the experts' order restored by inv_perm.
    ("qwen3_moe", MATH + CUDNN, ALL_VARIANTS),
    ("mixtral", MATH + CUDNN, ALL_VARIANTS),
]
# With options (model, kernels, variants, options): peft's LoRA on CUDA
# (real_stack_test.L's adapters; on a bf16 model they are fp32, autocast_adapter_dtype, as
# on the CPU), and batch 4 at seq 64, where the attention's (B, H, T, T) matrices make
# the forward's and the recompute's peaks: what the math kernel holds to its return
# (attn; autocast's casts of q, k, v, held by its wrapper) is then at the peak.
LARGER = {"batch": 4, "seq": 64}
OPTION_GRID = [
    ("llama_gqa", MATH[1:] + CUDNN, ("none", "full"),
     {"lora": real_stack_test.L(8, "all-linear", 0.1)}),
    ("qwen3", MATH[:2], ("none", "selective"), {"lora": real_stack_test.L(16)}),
    ("llama_gqa", MATH[2:], ("full",), LARGER),
    ("qwen3", MATH, ("none", "full"), LARGER),
    # Under bf16 autocast a selective checkpoint's replay casts a cached linear's bias
    # again, and autocast's cache holds it to the recompute's end: the backward's peak
    # then has the q, k and v biases' casts (3 x 512 B).
    ("qwen2_tied", MATH[2:], ("selective",), LARGER),
    ("llama_bias", MATH[2:], ("selective",), LARGER),
    # Not the checkpointed variants at this size: their peak is the experts' index
    # backward, which on fake tensors takes the out-of-place index_put (FunctionsManual.cpp,
    # index_backward, for tensor-subclass-like inputs), a copy a GPU's index_put_ does not
    # make (the prediction says what the GPU's own sort makes is not counted).
    ("qwen3_moe", MATH, ("none",), LARGER),
    ("mixtral", MATH + CUDNN, ("none",), LARGER),
]
# save_on_cpu around the forward (--offload_activations=cpu), where the nodes keep nothing
# on the device: what the Python locals and the kernels hold is the peak. The host bytes
# are compared too. Not the memory-efficient kernel, whose backward's own buffers fake
# tensors cannot show and which is then the peak.
OFFLOADED = {**LARGER, "offload_activations": "cpu"}
OPTION_GRID += [
    ("llama_gqa", MATH, ("none", "selective"), OFFLOADED),
    ("llama_gqa", MATH[:1], ("full", "every_2"), {**OFFLOADED, "checkpoint_impl": "reentrant"}),
    ("llama_gqa", CUDNN[:1], ("none", "full"), OFFLOADED),
    ("qwen3", MATH[2:], ("none", "every_2"), OFFLOADED),
    ("gpt2_nodrop", MATH[1:2], ("none",), OFFLOADED),
    ("gpt2", MATH[:1], ("full",), OFFLOADED),
    ("gemma3", MATH[:1], ("none", "full"), OFFLOADED),
    ("olmo3", MATH[:1], ("none", "full"), OFFLOADED),
    ("llama_gqa", MATH[1:2], ("none",), {**OFFLOADED, "lora": real_stack_test.L(8, "all-linear")}),
]
# DoRA's rebuilt (out, in) adapter product and the base weight's norm on CUDA, and under
# save_on_cpu, whose hook copies what the dead nodes save to the host (freed with them).
OPTION_GRID += [
    ("llama_gqa", MATH, ("none", "full"), {"lora": real_stack_test.L(8, "all-linear", dora=True)}),
    ("qwen3", MATH[2:], ("selective",), {**LARGER, "lora": real_stack_test.L(16, dora=True)}),
    ("llama_gqa", MATH[1:2], ("none",),
     {**OFFLOADED, "lora": real_stack_test.L(8, "all-linear", dora=True)}),
]


def cases(tmp):
    """(witness case, predict flags, name) for every point of GRID and OPTION_GRID."""
    out = []
    for model, kernels, variants, options in [(*g, {}) for g in GRID] + OPTION_GRID:
        model_case, model_flags = real_stack_test.model_case_and_flags(model, tmp)
        batch, seq = options.get("batch", 2), options.get("seq", 16)
        extra_case, extra_flags = {}, []
        name = "" if (batch, seq) == (2, 16) else f" batch {batch} seq {seq}"
        if "lora" in options:
            lora = options["lora"]
            r, targets = lora["r"], lora["targets"]
            extra_case["lora"] = {"r": r, "alpha": 2 * r, "dropout": lora["dropout"],
                                  "targets": targets if targets == "all-linear"
                                  else targets.split(","), "dora": lora["dora"]}
            extra_flags += [f"--lora_rank={r}", f"--lora_alpha={2 * r}",
                            f"--lora_dropout={lora['dropout']}", f"--lora_targets={targets}"]
            if lora["dora"]:
                extra_flags.append("--use_dora")
            name += (f" {'dora' if lora['dora'] else 'lora'} r{r} {targets} "
                     f"dropout {lora['dropout']}")
        if "checkpoint_impl" in options:
            extra_case["checkpoint_impl"] = options["checkpoint_impl"]
            extra_flags.append(f"--checkpoint_impl={options['checkpoint_impl']}")
            name += f" {options['checkpoint_impl']}"
        if "offload_activations" in options:
            extra_case["offload_activations"] = options["offload_activations"]
            extra_flags.append(f"--offload_activations={options['offload_activations']}")
            name += f" offload_activations {options['offload_activations']}"
        for backend, dtype, amp in kernels:
            for variant in variants:
                case = {**model_case, **extra_case, "batch": batch, "seq": seq,
                        "variant": variant, "dtype": dtype, "amp": amp,
                        "sdpa_backend": backend, "optimizer_impl": "for_loop"}
                flags = [*model_flags, *extra_flags, f"--batch={batch}", f"--seq={seq}",
                         f"--variants={variant}", f"--dtype={dtype}", f"--amp={amp}",
                         "--device=cuda", f"--sdpa_backend={backend}",
                         "--cublas_workspace_config=:0:0", "--optimizer_impl=for_loop"]
                out.append((case, flags, f"{model} {backend} {dtype} amp={amp} {variant}{name}"))
    return out


class FakeCudaStepTest(unittest.TestCase):
    def test_peak_and_phase_are_exact(self):
        tmp = tempfile.mkdtemp()
        grid = cases(tmp)
        self.assertEqual(len(grid), 196 + 40 + 12 + 9 + 8 + 19 + 8)
        # Bazel's shards (tests/BUILD.bazel): every n-th case.
        shards = int(os.environ.get("TEST_TOTAL_SHARDS", "1"))
        grid = grid[int(os.environ.get("TEST_SHARD_INDEX", "0"))::shards]
        if os.environ.get("TEST_SHARD_STATUS_FILE"):
            Path(os.environ["TEST_SHARD_STATUS_FILE"]).touch()
        path = Path(tmp, "cases.jsonl")
        path.write_text("".join(json.dumps(case) + "\n" for case, _, _ in grid))
        env = witness_fake_step.stub_environment(CUDART, CUDA)
        out = subprocess.run([sys.executable, str(WITNESS), f"--cases={path}"],
                             capture_output=True, text=True, env=env)
        self.assertEqual(out.returncode, 0, out.stderr[-4000:])
        measured = [json.loads(line) for line in out.stdout.splitlines()]
        self.assertEqual(len(measured), len(grid))
        failures = []
        for (case, flags, name), m in zip(grid, measured):
            run = subprocess.run([PREDICT] + flags, capture_output=True, text=True)
            if run.returncode != 0:
                failures.append(f"{name}: predict failed: {run.stderr.strip()}")
                continue
            predicted = json.loads(run.stdout)
            peak = predicted["peak"][case["variant"]]
            if (peak["bytes"], peak["phase"]) != (m["peak_bytes"], m["peak_phase"]):
                failures.append(f"{name}: predicted {peak['bytes']} ({peak['phase']}), "
                                f"measured {m['peak_bytes']} ({m['peak_phase']})")
            if "offload_activations" in case:
                # What the host holds when the forward returns, beyond what it held before.
                host = m["after_forward"]["cpu"] - m["resident"]["cpu"]
                offloaded = predicted["offloaded_bytes"][case["variant"]]
                if offloaded != host:
                    failures.append(f"{name}: offloaded_bytes predicted {offloaded}, "
                                    f"measured {host}")
        self.assertEqual(failures, [], f"{len(failures)} of {len(grid)}:\n" +
                         "\n".join(failures))


if __name__ == "__main__":
    PREDICT, CUDART, CUDA = (os.path.realpath(p) for p in sys.argv[1:4])
    del sys.argv[1:4]
    unittest.main()
