"""The GPU check: one training step of the real model on a CUDA device, measured, beside
what `predict --device=cuda` says for it.

On a machine with a CUDA GPU and the reference stack (torch, transformers), this trains
the real model the way verify/witness.py does on the CPU (AutoModelForCausalLM.from_config,
or the unchanged reference study; torch.utils.checkpoint through
gradient_checkpointing_enable; torch.optim), one warm-up step and then the measured one:

    python verify/gpu_check.py --config=config.json --dtype=bf16 --batch=2 --seq=1024 \\
        --variant=full --predict=bazel-bin/estimator/predict

It prints, and writes as JSON with --json_out, for the measured step:
  * saved_bytes and their split by dtype: the CUDA storages autograd keeps, through
    saved-tensor hooks (parameters excluded);
  * peak_bytes: torch.cuda.max_memory_allocated() over the step, which starts with the
    parameters, the optimizer's state and the input allocated;
  * peak_reserved_bytes: torch.cuda.max_memory_reserved(), after the warm-up step's
    cached segments are released (torch.cuda.empty_cache()), as predict assumes;
  * the SDPA kernel the selection ran (the warm-up step's aten op);
each beside predict's number for the same config and flags, and the difference.

Nothing in the test suite runs this (it needs a GPU); without one it says so and exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

HERE = Path(os.path.realpath(__file__)).parent
sys.path.insert(0, str(HERE))
import witness  # noqa: E402  (the models, checkpointing and optimizers, as on the CPU)

SDPA_OPS = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_attention_math": "math",
}


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model = parser.add_argument_group("model")
    model.add_argument("--config", help="a transformers config.json")
    model.add_argument("--study", action="store_true", help="the reference study instead")
    model.add_argument("--layers", type=int, default=6, help="study only")
    model.add_argument("--width", type=int, default=128, help="study only")
    model.add_argument("--heads", type=int, default=4, help="study only")
    inputs = parser.add_argument_group("input")
    inputs.add_argument("--batch", type=int, default=2)
    inputs.add_argument("--seq", type=int, default=1024)
    precision = parser.add_argument_group("precision")
    precision.add_argument("--dtype", default="bf16", choices=witness.DTYPES)
    precision.add_argument("--amp", default="none", choices=("none", "bf16", "fp16"))
    ckpt = parser.add_argument_group("checkpointing")
    ckpt.add_argument("--variant", default="none", help="none, full, every_<k>, selective")
    ckpt.add_argument("--checkpoint_impl", default="non_reentrant",
                      choices=witness.CHECKPOINT_IMPLS)
    opt = parser.add_argument_group("optimizer")
    opt.add_argument("--optimizer", default="adamw", choices=witness.OPTIMIZERS)
    opt.add_argument("--optimizer_impl", default="foreach", choices=witness.OPTIMIZER_IMPLS,
                     help="foreach is torch.optim's default for CUDA parameters")
    out = parser.add_argument_group("output")
    out.add_argument("--predict", default="bazel-bin/estimator/predict",
                     help="the predict binary (or the wheel's `memledger` command)")
    out.add_argument("--json_out", help="also write the comparison as JSON here")
    args = parser.parse_args(argv)
    if not args.config and not args.study:
        raise witness.UsageError("give --config=PATH or --study")
    return args


@contextlib.contextmanager
def sdpa_kernel_log(names):
    """Records the SDPA kernel ops that run, by their aten names."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name in SDPA_OPS:
                names.add(SDPA_OPS[name])
            return func(*args, **(kwargs or {}))

    with Log():
        yield


def measure(args):
    torch = witness._torch()
    if not torch.cuda.is_available():
        raise witness.UsageError("no CUDA device: run this on a GPU machine")
    case = {**witness.DEFAULTS, "batch": args.batch, "seq": args.seq, "dtype": args.dtype,
            "amp": args.amp, "variant": args.variant, "checkpoint_impl": args.checkpoint_impl,
            "optimizer": args.optimizer, "optimizer_impl": args.optimizer_impl}
    if args.study:
        case.update(study=True, layers=args.layers, width=args.width, heads=args.heads)
        target = witness.StudyModel(witness.load_study(), case)
        target.blocks.cuda()
        target.x = target.x.cuda()
    else:
        case["config"] = witness.read_config(args.config)
        target = witness.TransformersModel(case)
        target.model.cuda()
        target.ids = target.ids.cuda()
    params = list(target.parameters())
    opt = witness.make_optimizer(params, case)
    counter = witness.PolicyCounter(witness.POLICY_OPS["matmul"])
    witness.set_variant(target, case, counter)
    autocast = (torch.autocast("cuda", dtype=witness.torch_dtype(args.amp))
                if args.amp != "none" else contextlib.nullcontext())

    # The warm-up step makes the optimizer's state; it also says which SDPA kernel runs.
    kernels = set()
    with sdpa_kernel_log(kernels), autocast:
        loss = target.loss(counter)
    loss.backward()
    opt.step()
    del loss
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()

    param_storages = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if t.device.type == "cuda" and s.data_ptr() not in param_storages:
            seen[s.data_ptr()] = (s.nbytes(), str(t.dtype).removeprefix("torch."))
        return t

    counter = witness.PolicyCounter(witness.POLICY_OPS["matmul"])
    witness.set_variant(target, case, counter)
    opt.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        loss = target.loss(counter)
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    by_dtype = dict(counter.by_dtype)
    for nbytes, dtype in seen.values():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": witness._transformers_version(),
        "sdpa_kernel": ",".join(sorted(kernels)) or "none",
        "saved_bytes": sum(by_dtype.values()),
        "saved_bytes_by_dtype": by_dtype,
        "peak_bytes": torch.cuda.max_memory_allocated(),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
    }


def predict(args, kernel):
    flags = [f"--batch={args.batch}", f"--seq={args.seq}", f"--dtype={args.dtype}",
             f"--amp={args.amp}", f"--variants={args.variant}", "--device=cuda",
             f"--checkpoint_impl={args.checkpoint_impl}", f"--optimizer={args.optimizer}",
             f"--optimizer_impl={args.optimizer_impl}"]
    if kernel in ("flash", "efficient", "cudnn", "math"):
        flags.append(f"--sdpa_backend={kernel}")
    if args.study:
        flags += ["--model=study", f"--layers={args.layers}", f"--width={args.width}",
                  f"--heads={args.heads}"]
    else:
        flags.append(f"--model={args.config}")
    command = [args.predict] + (["predict"] if Path(args.predict).name == "memledger" else [])
    out = subprocess.run(command + flags, capture_output=True, text=True)
    if out.returncode != 0:
        raise witness.UsageError(f"predict {' '.join(flags)}: {out.stderr.strip()}")
    p = json.loads(out.stdout)
    v = args.variant
    return {
        "flags": " ".join(flags),
        "sdpa_kernel": p["sdpa_kernel"],
        "saved_bytes": p["saved_bytes"][v],
        "saved_bytes_by_dtype": p["saved_bytes_by_dtype"][v],
        "peak_bytes": p.get("peak_bytes", {}).get(v),
        "peak_reserved_bytes": p.get("peak_reserved_bytes", {}).get(v),
    }


def main(argv=None):
    warnings.filterwarnings("ignore")
    try:
        args = parse(argv)
        measured = measure(args)
        predicted = predict(args, measured["sdpa_kernel"])
    except witness.UsageError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    print(f"{measured['device']}, torch {measured['torch']}, transformers "
          f"{measured['transformers']}; SDPA ran {measured['sdpa_kernel']}, predict's "
          f"auto picks {predicted['sdpa_kernel']}\npredict {predicted['flags']}\n")
    print(f"{'bucket':<22} {'predicted':>16} {'measured':>16} {'difference':>12}")
    for key in ("saved_bytes", "peak_bytes", "peak_reserved_bytes"):
        p, m = predicted[key], measured[key]
        diff = "" if p is None or not m else f"{(p - m) / m:+.2%}"
        print(f"{key:<22} {str(p):>16} {m:>16} {diff:>12}")
    for dtype in sorted(set(predicted["saved_bytes_by_dtype"]) |
                        set(measured["saved_bytes_by_dtype"])):
        p = predicted["saved_bytes_by_dtype"].get(dtype, 0)
        m = measured["saved_bytes_by_dtype"].get(dtype, 0)
        print(f"{'  saved ' + dtype:<22} {p:>16} {m:>16}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"predicted": predicted,
                                                   "measured": measured}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
