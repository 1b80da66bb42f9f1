"""Conformance on CUDA without a GPU: predict --device=cuda against the real stack's
forward on fake CUDA tensors.

verify/witness.py --device=cuda builds the real model (transformers 5.23.0's
AutoModelForCausalLM, or the unchanged reference study) under
torch._subclasses.FakeTensorMode on device cuda, turns CUDA autocast on by hand, calls
the SDPA backend's op directly (fake tensors cannot run the selection a GPU makes) and
records, through saved-tensor hooks, what autograd keeps on the device, by dtype. Those
are the meta kernels' outputs, PyTorch's own statement of each CUDA kernel's outputs.
For every family, backend, dtype and checkpointing variant below, predict's
saved_bytes and saved_bytes_by_dtype must equal the witness's byte for byte.

Run by Bazel with the reference stack's Python (tests/BUILD.bazel):
    python tests/fake_cuda_test.py PREDICT_BINARY
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
import gpu_check  # noqa: E402  (verify/gpu_check.py)
import real_stack_test  # noqa: E402  (the families' small configs)
import witness  # noqa: E402  (verify/witness.py)

PREDICT = None  # set from argv

MODELS = ("study", "llama_gqa", "llama_mha", "qwen2_tied", "gpt2_nodrop", "gpt2")
# (backend, dtype, amp): the list. Flash in bf16 and fp16; the memory-efficient
# kernel in fp32; cuDNN (the sm90 default for fp16/bf16); math; bf16 autocast over fp32
# with each kernel.
KERNELS = (("flash", "bf16", "none"), ("flash", "fp16", "none"),
           ("efficient", "fp32", "none"), ("cudnn", "bf16", "none"),
           ("math", "fp32", "none"), ("math", "bf16", "none"),
           ("flash", "fp32", "bf16"), ("efficient", "fp32", "bf16"),
           ("cudnn", "fp32", "bf16"), ("math", "fp32", "bf16"))
VARIANTS = ("none", "full", "every_2", "selective")


def run(model, backend, dtype, amp, variant, tmp, seq=16, freeze=()):
    """(predicted, measured): each {"saved_bytes": N, "by_dtype": {...}}."""
    model_case, model_flags = real_stack_test.model_case_and_flags(model, tmp)
    case = {**witness.DEFAULTS, "batch": 2, "seq": seq, "variant": variant, "dtype": dtype,
            "amp": amp, "device": "cuda", "sdpa_backend": backend, "freeze": list(freeze),
            **model_case}
    flags = ["--batch=2", f"--seq={seq}", f"--variants={variant}", f"--dtype={dtype}",
             f"--amp={amp}", "--device=cuda", f"--sdpa_backend={backend}",
             "--freeze=" + ",".join(freeze), *model_flags]
    measured = witness.measure(case)
    out = subprocess.run([PREDICT] + flags, capture_output=True, text=True)
    if out.returncode != 0:
        raise AssertionError(f"predict {' '.join(flags)}: {out.stderr.strip()}")
    p = json.loads(out.stdout)
    return ({"saved_bytes": p["saved_bytes"][variant],
             "by_dtype": p["saved_bytes_by_dtype"][variant]},
            {"saved_bytes": measured["saved_bytes"],
             "by_dtype": measured["saved_bytes_by_dtype"]})


class FakeCudaTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        warnings.filterwarnings("ignore")
        cls.tmp = tempfile.mkdtemp()

    def test_saved_bytes_by_dtype_are_exact(self):
        failures, count, skipped = [], 0, 0
        study_missing = witness.study_skip_reason()
        for model in MODELS:
            if model == "study" and study_missing:
                skipped += len(KERNELS) * len(VARIANTS)
                print(f"skipped {skipped} study cases: {study_missing}", flush=True)
                continue
            for backend, dtype, amp in KERNELS:
                # cuDNN takes no dropout of 0.1 (not a multiple of 1/16): test_refusals.
                if backend == "cudnn" and model == "gpt2":
                    continue
                for variant in VARIANTS:
                    predicted, measured = run(model, backend, dtype, amp, variant, self.tmp)
                    count += 1
                    name = f"{model}/{backend}/{dtype}/amp{amp}/{variant}"
                    if predicted != measured:
                        failures.append(f"{name}: predicted {predicted}, measured {measured}")
                    print(f"{name}: " + ("exact" if predicted == measured else "differs"),
                          flush=True)
        print(f"{count} cases")
        self.assertGreater(count + skipped, 200)
        self.assertEqual(failures, [], "\n".join(failures))

    def test_frozen_embeddings_and_head(self):
        # --freeze on CUDA: the frozen LM head's matmul saves no input for its weight's
        # gradient, and without checkpointing the first layer saves nothing for its
        # input's; with checkpointing the hook's leaf requires grad (real_stack_test has
        # the CPU's whole step).
        failures, count = [], 0
        for model, freeze in (("llama_gqa", ("embeddings", "lm_head")),
                              ("gpt2_nodrop", ("embeddings",)), ("qwen3", ("lm_head",))):
            for backend, dtype, amp in (("flash", "bf16", "none"), ("efficient", "fp32", "bf16")):
                for variant in ("none", "full", "selective"):
                    predicted, measured = run(model, backend, dtype, amp, variant, self.tmp,
                                              freeze=freeze)
                    unfrozen, _ = run(model, backend, dtype, amp, variant, self.tmp)
                    count += 1
                    name = f"{model}/{backend}/{dtype}/amp{amp}/{variant}/{'+'.join(freeze)}"
                    if predicted != measured:
                        failures.append(f"{name}: predicted {predicted}, measured {measured}")
                    # The frozen head's input (B x T x d) is saved no more.
                    if "lm_head" in freeze and not (
                            predicted["saved_bytes"] < unfrozen["saved_bytes"]):
                        failures.append(f"{name}: saves no less than unfrozen")
        self.assertEqual(count, 18)
        self.assertEqual(failures, [], "\n".join(failures))

    def test_gemma3_and_its_sliding_window_mask(self):
        # Gemma 3's text model with the memory-efficient kernel (the one of sm90's that
        # takes a mask): from seq 16 >= its window of 8 (gemma3_window) the sliding
        # layers attend through transformers' mask, made additive in q's dtype and kept
        # by the kernel as attn_bias.
        failures, count = [], 0
        for model, seq in (("gemma3", 16), ("gemma3_pattern", 16), ("gemma3_window", 16),
                           ("gemma3_window", 64)):
            for dtype, amp in (("fp32", "none"), ("bf16", "none"), ("fp32", "bf16")):
                for variant in VARIANTS:
                    predicted, measured = run(model, "efficient", dtype, amp, variant,
                                              self.tmp, seq=seq)
                    count += 1
                    if predicted != measured:
                        failures.append(f"{model}/seq{seq}/{dtype}/amp{amp}/{variant}: "
                                        f"predicted {predicted}, measured {measured}")
        self.assertEqual(count, 48)
        self.assertEqual(failures, [], "\n".join(failures))
        # auto: cuDNN for the global layers (bf16, head_dim 32), the memory-efficient
        # kernel for the masked sliding ones (cuDNN's mask and flash are refused).
        out = self.predict_process("gemma3_window", "auto", "bf16")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(json.loads(out.stdout)["sdpa_kernel"], "cudnn, masked layers efficient")

    def test_the_witness_counts_by_hand(self):
        real_stack_test.skip_without_study(self)
        # The study, 2 layers of width 32, 2 heads of 16, batch 2, seq 16 (N = 32 tokens),
        # fp32 with the memory-efficient kernel. Per layer: ln1 keeps its input (N x d =
        # 1,024 elements, 4,096 B) and mean and rstd (2 x 32 x 4 = 256 B); qkv's addmm its
        # input (4,096 B); the kernel q, k, v (views of qkv's (N, 3d) output, 12,288 B),
        # its output (4,096 B, which proj's addmm keeps too), logsumexp (B, H, T rounded
        # up to 32) = 2 x 2 x 32 x 4 = 512 B, and its philox seed and offset, 0-dim int64
        # (16 B, on the host: attention.cu keeps them there without a CUDA graph); ln2 its
        # input and stats (4,352 B); fc1 its input (4,096 B); gelu its input and fc2 its
        # input, (N, 4d) each (16,384 B each). 66,560 B of fp32 a layer; with the loss's
        # x.pow(2) keeping the output (4,096 B): 2 x 66,560 + 4,096 = 137,216 B fp32 on
        # the device, 32 B int64 off it.
        base = {**witness.DEFAULTS, "study": True, "layers": 2, "width": 32, "heads": 2,
                "batch": 2, "seq": 16, "device": "cuda"}
        efficient = witness.measure({**base, "sdpa_backend": "efficient"})
        self.assertEqual(efficient["saved_bytes_by_dtype"], {"float32": 137216})
        self.assertEqual(efficient["saved_off_device_bytes"], 32)
        # In bf16 with the flash kernel: logsumexp (B, H, T) fp32, 256 B a layer; the
        # CUDA layer norm's mean and rstd in fp32 too (2 x 256 B a layer); rng_state (2,)
        # and unused () uint64, 24 B a layer.
        flash = witness.measure({**base, "sdpa_backend": "flash", "dtype": "bf16"})
        self.assertEqual(flash["saved_bytes_by_dtype"]["float32"], 2 * (256 + 512))
        self.assertEqual(flash["saved_bytes_by_dtype"]["uint64"], 2 * 24)

    def test_auto_picks_what_an_sm90_gpu_runs(self):
        # --sdpa_backend=auto, sdp_utils.cpp's order on sm90 with the wheel's cuDNN 9.26:
        # cuDNN for bf16 or fp16 with head_dim <= 128 (16 here); flash where cuDNN
        # refuses (GPT-2's attention dropout of 0.1 is no multiple of 1/16); the
        # memory-efficient kernel for fp32, grouped-query heads or not (neither cuDNN nor
        # flash takes fp32).
        for model, dtype, expected in (("llama_gqa", "bf16", "cudnn"),
                                       ("study", "fp16", "cudnn"),
                                       ("gpt2", "bf16", "flash"),
                                       ("llama_mha", "fp32", "efficient"),
                                       ("llama_gqa", "fp32", "efficient")):
            predicted_auto = self.predict(model, "auto", dtype)
            predicted_named = self.predict(model, expected, dtype)
            self.assertEqual(predicted_auto, predicted_named, f"{model} {dtype}")
            self.assertIn(f"SDPA kernel: {expected}", self.predict_table(model, dtype))

    def test_refusals(self):
        # A kernel that cannot run the call is refused in one line, exit 2.
        for model, backend, dtype, fragment in (
                ("llama_mha", "flash", "fp32", "fp16 or bf16 only"),
                ("llama_gqa", "cudnn", "fp32", "fp16 or bf16 only"),
                ("gpt2", "cudnn", "bf16", "multiple of 1/16"),
                ("gemma3_window", "flash", "bf16", "takes no attention mask"),
                ("gemma3_window", "math", "fp32", "math kernel with a mask")):
            out = self.predict_process(model, backend, dtype)
            self.assertEqual(out.returncode, 2, out.stderr)
            self.assertEqual(len(out.stderr.strip().splitlines()), 1, out.stderr)
            self.assertIn(fragment, out.stderr)
        out = subprocess.run([PREDICT, "--sdpa_backend=efficient"], capture_output=True,
                             text=True)
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("needs --device=cuda", out.stderr)

    def test_a_checkpoints_rng_state_stays_on_the_host(self):
        # torch.get_rng_state() (5,056 B, rules.h's kCpuRngStateBytes) and the CUDA
        # generator's state are CPU tensors: with full checkpointing of llama_mha's two
        # layers a CUDA step holds, beyond what it saves, 2 x 5,056 B less after its
        # forward than the CPU step.
        held = {}
        for device in ("cpu", "cuda"):
            flags = [f for f in self.flags("llama_mha", "efficient", "fp32")
                     if not f.startswith(("--device", "--sdpa_backend", "--variants"))]
            if device == "cuda":
                flags += ["--device=cuda", "--sdpa_backend=efficient"]
            out = subprocess.run([PREDICT, "--variants=full", *flags],
                                 capture_output=True, text=True)
            self.assertEqual(out.returncode, 0, out.stderr)
            p = json.loads(out.stdout)
            held[device] = p["held_after_forward_bytes"]["full"] - p["saved_bytes"]["full"]
        self.assertEqual(held["cpu"] - held["cuda"], 2 * 5056)

    def test_the_gpu_check_runs_only_on_a_gpu(self):
        # verify/gpu_check.py trains the real step on a CUDA device; here it says there
        # is none, in one line, exit 2. Its predict half runs anywhere: the flags it builds
        # give predict's numbers for the kernel the GPU ran.
        real_stack_test.skip_without_study(self)
        out = subprocess.run([sys.executable, str(HERE.parent / "verify" / "gpu_check.py"),
                              "--study", f"--predict={PREDICT}"],
                             capture_output=True, text=True)
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertEqual(out.stderr.strip(), "gpu_check: no CUDA device: run this on a GPU "
                         "machine")
        args = gpu_check.parse(["--study", "--layers=2", "--width=32", "--heads=2",
                                "--batch=2", "--seq=16", "--dtype=bf16", "--variant=full",
                                f"--predict={PREDICT}"])
        predicted = gpu_check.predict(args, "flash")
        self.assertEqual(predicted["sdpa_kernel"], "flash")
        flash, _ = run("study", "flash", "bf16", "none", "full", self.tmp)
        self.assertEqual(predicted["saved_bytes"], flash["saved_bytes"])
        self.assertGreater(predicted["peak_reserved_bytes"], predicted["peak_bytes"])

    # Helpers: predict for a model's small config on cuda.

    def flags(self, model, backend, dtype):
        _, model_flags = real_stack_test.model_case_and_flags(model, self.tmp)
        return ["--batch=2", "--seq=16", "--variants=none", f"--dtype={dtype}",
                "--device=cuda", f"--sdpa_backend={backend}", *model_flags]

    def predict_process(self, model, backend, dtype, *extra):
        return subprocess.run([PREDICT] + self.flags(model, backend, dtype) + list(extra),
                              capture_output=True, text=True)

    def predict(self, model, backend, dtype):
        out = self.predict_process(model, backend, dtype)
        self.assertEqual(out.returncode, 0, out.stderr)
        p = json.loads(out.stdout)
        return p["saved_bytes"]["none"], p["saved_bytes_by_dtype"]["none"]

    def predict_table(self, model, dtype):
        out = self.predict_process(model, "auto", dtype, "--format=table")
        self.assertEqual(out.returncode, 0, out.stderr)
        return out.stdout


if __name__ == "__main__":
    PREDICT = os.path.realpath(sys.argv.pop(1))
    unittest.main()
