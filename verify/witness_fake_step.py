"""The whole training step on CUDA without a GPU: one process, or one rank of torch's
FSDP2, trained on fake CUDA tensors as torch runs it.

The model is the transformers model of witness.py's case, built under FakeTensorMode on
device cuda. With "dp" above 1 the process is rank 0 of `dp` under torch's fake process
group (torch.testing._internal.distributed.fake_pg: collectives that move and allocate
nothing, as NCCL's in-place ones allocate nothing of the caching allocator's) and shards
the model as witness_common.fsdp2 does (fully_shard per decoder layer, then the root;
with "offload": "cpu" CPUOffloadPolicy(pin_memory=True)). It trains a warm-up step, then
the measured one, with torch.optim (and CUDA autocast turned on by hand, as
witness.measure_fake_cuda does); with "offload_activations": "cpu" both forwards run
under torch's save_on_cpu(pin_memory=True) (`offloaded`). Fake tensors run the ops' meta
kernels, PyTorch's own statement of each CUDA kernel's outputs, and FSDP2's own Python
decides every copy, all-gather buffer and free.

What is counted: every storage alive, by device, through a TorchDispatchMode that sees
each op's inputs and outputs and a weakref finalizer per storage (its free). A CUDA
storage counts as the caching allocator's block for it: its request rounded up to
512 B (kMinBlockSize; below 1 MiB each request is its own split block of the small
pool). Host storages count their bytes.

What fake tensors cannot show, so the comparison must leave it out on both sides: what
kernels allocate for themselves (cuBLAS's workspace: run predict with
--cublas_workspace_config=:0:0, as CUBLAS_WORKSPACE_CONFIG=:0:0 makes a GPU run; the
flash and cuDNN attention backward's buffers; FSDP2's copy kernels' metadata, which is
transient inside those ops), and the pinned host allocator's power-of-two blocks
(host_bytes counts the tensors' bytes).

The process needs a CUDA build of torch that loads without a GPU: the stub runtime
and driver of tests/cuda_stub (LD_PRELOAD=libcudart.so.13, LD_LIBRARY_PATH holding
libcuda.so.1). tests/fake_cuda_step_test.py and tests/fsdp2_offload_witness_test.py run
it so.

Usage:
    python verify/witness_fake_step.py --cases=cases.jsonl  # one JSON line per case

Each case is witness.py's (a transformers "config", "batch", "seq", "variant", "dtype",
"amp", ...) with "sdpa_backend" (the kernel witness.forced_sdpa calls) and, for FSDP2,
"dp" (the world size, every case of a run the same), "reshard_after_forward", "offload"
("none" or "cpu"), "mp_param_dtype" and "mp_reduce_dtype". Bad input: one line on
stderr, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(os.path.realpath(__file__)).parent))
import witness  # noqa: E402  (verify/witness.py)

# The caching allocator's smallest block (c10/cuda/CUDACachingAllocator.cpp,
# kMinBlockSize): every request is rounded up to it.
BLOCK = 512
# The efficient kernel's philox seed and offset (outputs 2 and 3) live on the host on a
# GPU (attention.cu, _efficient_attention_forward), where the meta kernel puts them on
# the fake device (witness.forced_sdpa says the same).
HOST_OUTPUTS = {"aten._scaled_dot_product_efficient_attention.default": (2, 3)}


def stub_environment(libcudart, libcuda):
    """os.environ for a process that runs this witness over tests/cuda_stub: the stub
    runtime preloaded, the stub driver's folder searched first."""
    search = [os.path.dirname(os.path.realpath(libcuda)), os.environ.get("LD_LIBRARY_PATH")]
    return {**os.environ, "LD_PRELOAD": os.path.realpath(libcudart),
            "LD_LIBRARY_PATH": os.pathsep.join(p for p in search if p)}


def block_bytes(nbytes):
    return -(-nbytes // BLOCK) * BLOCK


class StorageCounter:
    """Live storages by device, the peak and its phase, fed by a TorchDispatchMode."""

    def __init__(self):
        self.live = {}  # storage key -> (weakref, device type)
        self.phase = "forward"
        self.peak = {"cuda": (0, "forward"), "cpu": (0, "forward")}

    def add(self, t, host=False):
        torch = witness._torch()
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        if not isinstance(t, torch.Tensor):
            return
        if is_traceable_wrapper_subclass(t):  # a DTensor holds nothing; its local tensor does
            for name in t.__tensor_flatten__()[0]:
                self.add(getattr(t, name), host)
            return
        if t.device.type not in ("cuda", "cpu"):
            return  # meta tensors (selective checkpointing's) hold nothing
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live and self.live[key][0]() is not None:
            return
        self.live[key] = (weakref.ref(storage), "cpu" if host else t.device.type)
        weakref.finalize(storage, self.live.pop, key, None)

    def now(self):
        out = {"cuda": 0, "cpu": 0}
        for ref, device in list(self.live.values()):
            storage = ref()
            if storage is not None:
                n = storage.nbytes()
                out[device] += block_bytes(n) if device == "cuda" else n
        return out

    def observe(self):
        for device, value in self.now().items():
            if value > self.peak[device][0]:
                self.peak[device] = (value, self.phase)

    def mode(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                result = func(*args, **(kwargs or {}))
                host = HOST_OUTPUTS.get(str(func), ())
                if host:
                    for i in host:
                        counter.add(result[i], host=True)
                # Inputs too: a storage FSDP2 resizes in place (its all-gather output's
                # untyped_storage().resize_) is seen at its new size.
                for t in tree_flatten((args, kwargs, result))[0]:
                    counter.add(t)
                counter.observe()
                return result

        return Mode()


@contextlib.contextmanager
def fake_pinning():
    """Fake tensors have no pin_memory kernel: pinning a fake host tensor returns it
    (the bytes are the same; pinned memory's own blocks are not counted)."""
    torch = witness._torch()
    from torch._subclasses.fake_tensor import FakeTensor

    pin, is_pinned = torch.Tensor.pin_memory, torch.Tensor.is_pinned

    def fake_pin(self, *args, **kwargs):
        return self if isinstance(self, FakeTensor) else pin(self, *args, **kwargs)

    def fake_is_pinned(self, *args, **kwargs):
        if isinstance(self, FakeTensor):
            return self.device.type == "cpu"
        return is_pinned(self, *args, **kwargs)

    torch.Tensor.pin_memory, torch.Tensor.is_pinned = fake_pin, fake_is_pinned
    try:
        yield
    finally:
        torch.Tensor.pin_memory, torch.Tensor.is_pinned = pin, is_pinned


@contextlib.contextmanager
def fake_adapters():
    """peft moves each new lora.Linear to its base layer's device (_replace_module's
    module.to(weight.device)) and each adapter to its dtype too
    (_move_adapter_to_device_of_base_layer), then get_peft_model's autocast_adapter_dtype
    upcasts a bf16 or fp16 adapter back to fp32. On fake tensors module._apply swaps every
    parameter for its converted self (torch.utils.swap_tensors), which a fresh fake
    parameter refuses ("has weakref associated with it"). The adapters are made on the
    fake device already (the case's torch.device), in fp32, where peft's moves and upcast
    leave them: the dtype move is skipped, and a swap for a tensor of the same storage,
    dtype and shape (a move to the device it is on) is the no-op it means. Only the
    model's making changes; its step is peft's."""
    torch = witness._torch()
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # no peft: no adapters to make
        yield
        return
    move, swap = BaseTunerLayer._move_adapter_to_device_of_base_layer, torch.utils.swap_tensors

    def same_or_swap(t1, t2):
        if (t1.untyped_storage()._cdata == t2.untyped_storage()._cdata and
                t1.dtype == t2.dtype and t1.shape == t2.shape):
            return None
        return swap(t1, t2)

    BaseTunerLayer._move_adapter_to_device_of_base_layer = lambda self, *a, **k: None
    torch.utils.swap_tensors = same_or_swap
    try:
        yield
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer = move
        torch.utils.swap_tensors = swap


def offloaded(case):
    """The forward's saved-tensor hooks: with offload_activations "cpu", torch's
    save_on_cpu(pin_memory=True), which copies every tensor autograd saves to pinned host
    memory and back to the device when its node runs (torch/autograd/graph.py).

    Its pack_to_cpu makes the host copy with torch.empty and no device: the default
    device, which is the CPU in a training script but the witness's torch.device("cuda")
    context here, where a checkpoint's save_inputs (called from Python, not inside an op)
    would pack onto the device. The pack runs under torch.device("cpu"), a script's
    default; the hooks are torch's own."""
    torch = witness._torch()
    if case.get("offload_activations", "none") != "cpu":
        return contextlib.nullcontext()
    hooks = torch.autograd.graph.save_on_cpu(pin_memory=True)
    pack = hooks.pack_hook

    def pack_on_host(tensor):
        with torch.device("cpu"):
            return pack(tensor)

    hooks.pack_hook = pack_on_host
    return hooks


def measure(case):
    """The measured step of `case` (on rank 0): the device's peak (blocks) and its phase,
    and what the host holds after the optimizer's step."""
    torch = witness._torch()
    import torch.distributed as dist
    import transformers.masking_utils as masking_utils
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    case = {**witness.DEFAULTS, **case, "device": "cuda"}
    case["fsdp"] = case.get("dp", 1) > 1
    if case["fsdp"] and not dist.is_initialized():
        dist.init_process_group(backend="fake", store=FakeStore(), rank=0,
                                world_size=case["dp"])
    elif case["fsdp"] and dist.get_world_size() != case["dp"]:
        raise witness.UsageError("every FSDP2 case of one run needs the same dp")
    torch.manual_seed(case.get("seed", 0))
    # As witness.measure_fake_cuda: transformers cannot read fake position ids as one
    # sequence per row, and would build a packed-sequence mask.
    packed = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    counter = StorageCounter()
    try:
        with FakeTensorMode(), torch.device("cuda"), fake_pinning(), \
                witness.forced_sdpa(case["sdpa_backend"]):
            with fake_adapters():
                target = witness.TransformersModel(case)
            params = list(target.parameters())
            opt = witness.make_optimizer(params, case)
            # The warm-up step makes the optimizer's state, as witness.measure's does.
            with witness.cuda_autocast(case["amp"]), offloaded(case):
                loss = target.loss(None)
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
            policy = [op for kind in case.get("policy", "matmul").split(",") if kind
                      for op in witness.POLICY_OPS[kind]]
            witness.set_variant(target, case, witness.PolicyCounter(policy))
            state = [v for st in opt.state.values() for v in st.values()]
            for t in [*params, *target.buffers(), *target.inputs(), *state]:
                counter.add(t)
            resident = counter.now()
            with counter.mode():
                counter.phase = "forward"
                with witness.cuda_autocast(case["amp"]), offloaded(case):
                    loss = target.loss(None)
                after_forward = counter.now()
                counter.phase = "backward"
                loss.backward()
                after_backward = counter.now()
                counter.phase = "optimizer"
                opt.step()
                after_step = counter.now()
                # What FSDP2 keeps on the host: the shards, their gradients and the
                # optimizer's state (its step counts too).
                kept = [*params, *(p.grad for p in params if p.grad is not None),
                        *(v for st in opt.state.values() for v in st.values())]
                host = {}
                for t in kept:
                    storage = witness.local(t).untyped_storage()
                    if witness.local(t).device.type == "cpu":
                        host[storage._cdata] = storage.nbytes()
                host_bytes = sum(host.values())
                # The loss lives to the step's end, as witness.measure's does.
                del loss
                opt.zero_grad(set_to_none=True)
    finally:
        masking_utils.find_packed_sequence_indices = packed
    peak, phase = counter.peak["cuda"]
    return {
        "case": {k: v for k, v in case.items() if k != "config"},
        "device": ("cuda (fake), rank 0 of a fake process group" if case["fsdp"]
                   else "cuda (fake)"),
        "torch": torch.__version__.split("+")[0],
        "resident": resident,
        "after_forward": after_forward,
        "after_backward": after_backward,
        "after_step": after_step,
        "peak_bytes": peak,
        "peak_phase": phase,
        "host_bytes": host_bytes,
        "host_peak_bytes": counter.peak["cpu"][0],
        "host_peak_phase": counter.peak["cpu"][1],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", required=True, help="a JSON-lines file of cases")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    try:
        path = Path(args.cases)
        if not path.is_file():
            raise witness.UsageError(f"--cases {args.cases}: not a file")
        cases = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for case in cases:
            if "config" not in case:
                raise witness.UsageError("--cases: every case needs a transformers config")
            if not isinstance(case.get("dp", 1), int) or case.get("dp", 1) < 1:
                raise witness.UsageError("--cases: dp must be a number of ranks from 1")
        for case in cases:
            print(json.dumps(measure(case)), flush=True)
        return 0
    except witness.UsageError as e:
        print(f"witness_fake_step: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
