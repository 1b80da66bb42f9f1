"""The real-stack witness: one training step of the real model, measured.

memledger's predictions are judged against the code people run: transformers'
`AutoModelForCausalLM`, `torch.utils.checkpoint` and `torch.optim` of the pinned
reference stack (third_party/torch_requirements.txt), or the unchanged reference
study (22_memory_accounting.py: at $MEMLEDGER_STUDY, or in ../shared/seed/ beside the
checkout). This script trains one step the way a
training loop does and measures it two independent ways:

* saved-tensor hooks around the forward: unique storages autograd keeps, parameter
  storages excluded, plus what a selective checkpoint's policy must-saves (the study's
  measure, `saved_bytes`);
* torch.profiler's CPU allocation events (`profile_memory=True`, one intra-op thread):
  their running sum is the live-byte curve of the step. `held_after_forward` is the
  curve where the forward returns, less the loss; `peak_bytes` is what existed before
  the step (parameters, buffers, the optimizer's state, the input) plus the curve's
  maximum.

The step is the issue's: `opt.zero_grad(set_to_none=True)`, `loss = model(input_ids=ids,
labels=ids).loss`, `loss.backward()`, `opt.step()`, with the optimizer's state made by an
earlier, unmeasured step.

Usage (one JSON object on stdout, or one per line with --cases):
    python verify/witness.py --config=config.json --batch=2 --seq=64 --variant=full
    python verify/witness.py --study --layers=2 --width=32 --heads=2 --variant=selective
    python verify/witness.py --cases=cases.jsonl   # many cases, one process

Bad input: one line on stderr, exit 2. The witness needs the reference stack; predict,
the planner and the C ABI never do.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path

VARIANTS = ("none", "full", "every_2", "selective")
DTYPES = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "adam", "sgd")
OPTIMIZER_IMPLS = ("for_loop", "foreach", "fused")
CHECKPOINT_IMPLS = ("non_reentrant", "reentrant")
# The selective policy's op kinds (memledger's --policy names) and the ATen ops each
# must-saves.
POLICY_OPS = {
    "matmul": ("mm.default", "addmm.default"),
    "attention": ("_scaled_dot_product_flash_attention_for_cpu.default",),
    "layer_norm": ("native_layer_norm.default",),
    "gelu": ("gelu.default",),
    "silu": ("silu.default",),
}


sys.path.insert(0, str(Path(os.path.realpath(__file__)).parent))
from witness_common import (  # noqa: E402  (verify/witness_common.py)
    UsageError, ddp, element_bytes, expert_parallel, fsdp2, local, reduce_expert_parallel,
    torch_dtype, unique_storage_bytes, _torch)


def saved_at_forward_end(seen):
    """The bytes of the packed storages still alive as the forward ends, which the
    backward unpacks: seen maps a storage to (nbytes, ..., its StorageWeakRef). A node the
    loss never reaches (DoRA's lora_weight branch, read only detached) dies with the
    forward's locals, and what it saved with it; its storage's address may then be reused."""
    return sum(entry[0] for entry in seen.values() if not entry[-1].expired())


# pack_without_cycle: the witnesses' pack hooks return `t.detach()`, not `t`. Without
# hooks, a node that saves its own output keeps it without its grad_fn (saved_variable.cpp:
# an output's data, the grad_fn weakly); a hook that returned the tensor itself would tie
# such a node to itself, a cycle that only Python's gc frees, at no fixed time. Only a
# node the loss never reaches outlives its forward so (DoRA's weight norm of a Conv1D,
# whose transposed weight peft wraps in a new Parameter that requires grad); every other
# node lets go of what it saved when the backward runs it.


# ---------------------------------------------------------------------------------------
# Models


STUDY_FILE = "22_memory_accounting.py"
# STUDY_MISSING: the one line a missing study gives, which the tests look for to skip.
STUDY_MISSING = (f"the reference study {STUDY_FILE} is not here: set MEMLEDGER_STUDY to its "
                 "path, or put it in ../shared/seed/ beside the checkout")


def study_path():
    """The reference study's path, or None: $MEMLEDGER_STUDY, else the first
    ../shared/seed/ beside a folder holding this script (its checkout, through Bazel's
    runfiles too)."""
    if os.environ.get("MEMLEDGER_STUDY"):
        path = Path(os.environ["MEMLEDGER_STUDY"])
        return path if path.is_file() else None
    for parent in Path(__file__).resolve().parents:
        for candidate in (parent / "shared" / "seed" / STUDY_FILE,
                          parent.parent / "shared" / "seed" / STUDY_FILE):
            if candidate.is_file():
                return candidate
    return None


def study_skip_reason():
    """None where the study is here; else why a study case is skipped. With
    MEMLEDGER_REQUIRE_STUDY=1 (as .ci/run sets it) a missing study is an error instead."""
    if study_path() is not None:
        return None
    if os.environ.get("MEMLEDGER_REQUIRE_STUDY") == "1":
        raise RuntimeError(f"MEMLEDGER_REQUIRE_STUDY=1: {STUDY_MISSING}")
    return STUDY_MISSING


def load_study():
    """The unchanged reference study (study_path)."""
    path = study_path()
    if path is None:
        raise UsageError(f"--study: {STUDY_MISSING}")
    spec = importlib.util.spec_from_file_location("memory_accounting_study", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class StudyModel:
    """The study's blocks and its forward(blocks, x, mode), as a step target."""

    def __init__(self, study, case):
        torch = _torch()
        self.study = study
        self.blocks = torch.nn.ModuleList(
            study.Block(case["width"], case["heads"]) for _ in range(case["layers"]))
        if next(self.blocks.parameters()).dtype != torch_dtype(case["dtype"]):
            self.blocks.to(torch_dtype(case["dtype"]))
        self.x = torch.randn(case["batch"], case["seq"], case["width"],
                             dtype=torch_dtype(case["dtype"]))
        self.mode = "none"

    def parameters(self):
        return self.blocks.parameters()

    def buffers(self):
        return self.blocks.buffers()

    def inputs(self):
        return [self.x]

    def loss(self, counter):
        return self.study.forward(self.blocks, self.x, self.mode, counter)


class TransformersModel:
    """AutoModelForCausalLM.from_config, trained on input_ids = labels."""

    def __init__(self, case):
        torch = _torch()
        from transformers import AutoConfig, AutoModelForCausalLM

        config_dict = dict(case["config"])
        model_type = config_dict.pop("model_type", None)
        if model_type is None:
            raise UsageError("config: no model_type")
        config = AutoConfig.for_model(model_type, **config_dict)
        kwargs = {}
        if case.get("experts_impl"):  # a mixture of experts' config._experts_implementation
            kwargs["experts_implementation"] = case["experts_impl"]
        self.model = AutoModelForCausalLM.from_config(
            config, attn_implementation=case.get("attn_implementation", "sdpa"),
            dtype=torch_dtype(case["dtype"]), **kwargs)
        self.model.train()
        freeze(self.model, case.get("freeze", ()))
        if case.get("lora"):
            self.model = lora(self.model, case["lora"])
        if case.get("ep", 1) > 1:
            expert_parallel(self.model, config, case["ep"])
        if case.get("fsdp"):
            fsdp2(self.model, case)
        # The step runs through DistributedDataParallel's forward (its Reducer hooks the
        # parameters' gradients); checkpointing is still the model's (set_variant).
        self.forward, self.reducer_bytes = self.model, 0
        if case.get("ddp") is not None:
            self.forward, self.reducer_bytes = ddp(self.model, case["ddp"])
        vocab = config.vocab_size
        # Each expert-parallel rank trains its own batch.
        generator = torch.Generator().manual_seed(case.get("seed", 0) + case.get("rank", 0))
        self.ids = torch.randint(0, vocab, (case["batch"], case["seq"]), generator=generator)
        if case.get("same_token"):
            # Every position the same token: every layer's hidden states are alike, so
            # every token routes to the same experts (a mixture of experts' worst case).
            self.ids = torch.full_like(self.ids, int(self.ids[0, 0]))

    def routing(self, autocast):
        """Tokens per expert of each sparse layer, in layer order, for this model's
        weights and input: a forward without grad with hooks on the routers."""
        torch = _torch()
        rows = []

        def record(module, args, output):
            indices = output[2]  # (router_logits, router_scores, router_indices)
            rows.append(torch.bincount(indices.reshape(-1),
                                       minlength=module.num_experts).tolist())

        hooks = [m.register_forward_hook(record) for m in self.model.modules()
                 if type(m).__name__.endswith("TopKRouter")]
        try:
            with torch.no_grad(), autocast:
                self.model(input_ids=self.ids)
        finally:
            for hook in hooks:
                hook.remove()
        return rows

    def parameters(self):
        return self.model.parameters()

    def buffers(self):
        return self.model.buffers()

    def inputs(self):
        return [self.ids]

    def loss(self, counter):
        del counter  # transformers' checkpointing carries its own policy (set_variant)
        return self.forward(input_ids=self.ids, labels=self.ids).loss


FREEZABLE = ("embeddings", "lm_head")


def freeze(model, parts):
    """requires_grad_(False) on `parts` of the model, as a fine-tuning script does:
    "embeddings", every input embedding table (nn.Embedding: GPT-2's wte and wpe, the
    others' embed_tokens), and "lm_head", the output embeddings' weight. A tied head is
    the embedding's own Parameter, so freezing either freezes both."""
    torch = _torch()
    for part in parts:
        if part == "embeddings":
            tables = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
        elif part == "lm_head":
            tables = [model.get_output_embeddings()]
        else:
            raise UsageError(f"--freeze {part!r}: expected one of {', '.join(FREEZABLE)}")
        for table in tables:
            table.weight.requires_grad_(False)


def lora(model, spec):
    """peft's get_peft_model(model, LoraConfig(...)) as a fine-tuning script calls it:
    every base parameter frozen (_mark_only_adapters_as_trainable), each target module
    wrapped in lora.Linear with lora_A (r x in), lora_B (out x r) and its dropout."""
    from peft import LoraConfig, get_peft_model

    targets = spec["targets"]
    config = LoraConfig(r=spec["r"], lora_alpha=spec["alpha"], lora_dropout=spec["dropout"],
                        target_modules=targets if targets == "all-linear" else list(targets),
                        use_dora=spec.get("dora", False))
    return get_peft_model(model, config)


# ---------------------------------------------------------------------------------------
# Checkpointing


class PolicyCounter:
    """A selective policy: must-save the policy's ops, count what that caches."""

    def __init__(self, op_names):
        torch = _torch()
        self.ops = {getattr(torch.ops.aten, n.split(".")[0]).default for n in op_names}
        self.bytes = 0
        self.by_dtype = {}  # the same bytes by the outputs' dtype

    def __call__(self, ctx, op, *args, **kwargs):
        from torch.utils.checkpoint import CheckpointPolicy

        if op in self.ops:
            if not ctx.is_recompute:
                for dtype, nbytes in _output_bytes(op, args, kwargs).items():
                    self.bytes += nbytes
                    self.by_dtype[dtype] = self.by_dtype.get(dtype, 0) + nbytes
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


def _output_bytes(op, args, kwargs):
    """The bytes of op's outputs by dtype name, from running it on meta tensors of the
    same shapes."""
    torch = _torch()

    def to_meta(a):
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta") \
            if isinstance(a, torch.Tensor) else a

    out = op(*torch.utils._pytree.tree_map(to_meta, args),
             **torch.utils._pytree.tree_map(to_meta, kwargs))
    outs = out if isinstance(out, (tuple, list)) else [out]
    by_dtype = {}
    for o in outs:
        if isinstance(o, torch.Tensor):
            name = str(o.dtype).removeprefix("torch.")
            by_dtype[name] = by_dtype.get(name, 0) + o.untyped_storage().nbytes()
    return by_dtype


def set_variant(target, case, policy_counter):
    """Checkpointing as a user turns it on: transformers' gradient_checkpointing_enable
    (every_k through its every_n_layers), or the study's own forward."""
    variant = case["variant"]
    if isinstance(target, StudyModel):
        if case["checkpoint_impl"] != "non_reentrant":
            raise UsageError("--study runs the study's checkpoint (non-reentrant) unchanged")
        target.mode = variant
        return
    model = target.model
    if variant == "none":
        model.gradient_checkpointing_disable()
        return
    kwargs = {"use_reentrant": case["checkpoint_impl"] == "reentrant"}
    every = 1
    if variant.startswith("every_"):
        every = int(variant.split("_")[1])
    elif variant == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        if kwargs["use_reentrant"]:
            raise UsageError("selective checkpointing needs --checkpoint_impl=non_reentrant")
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts,
                                                 policy_counter)
    elif variant != "full":
        raise UsageError(f"--variant {variant!r}: expected one of {', '.join(VARIANTS)}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs,
                                            every_n_layers=every)


# ---------------------------------------------------------------------------------------
# The optimizer


def make_optimizer(params, case):
    torch = _torch()
    impl = case["optimizer_impl"]
    flags = {"foreach": impl == "foreach"}
    if impl == "fused":
        flags = {"fused": True}
    elif impl == "for_loop":
        flags = {"foreach": False}
    name = case["optimizer"]
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, **flags)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3, **flags)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=case.get("momentum", 0.0), **flags)
    raise UsageError(f"--optimizer {name!r}: expected one of {', '.join(OPTIMIZERS)}")


# ---------------------------------------------------------------------------------------
# Measuring


def _mark(name):
    torch = _torch()
    handle = torch.ops.profiler._record_function_enter_new(name, None)
    torch.ops.profiler._record_function_exit._RecordFunction(handle)


def _write_trace(prof, path):
    """The measured step's allocations and frees, one line each in time order: bytes,
    the live total after it, and the innermost three ops around it (FSDP's
    record_function ranges among them), with the phase marks; appended to `path` plus
    the rank (MEMLEDGER_WITNESS_TRACE=path). How FSDP2's and DDP's buffers come and go
    was read from such traces (docs/DESIGN.md, Distributed)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    events = list(prof.profiler.kineto_results.events())
    ops = [(e.start_ns(), e.start_ns() + e.duration_ns(), e.name()) for e in events
           if e.name() != "[memory]"]
    rows, live = [], 0
    for e in sorted((e for e in events
                     if e.name() == "[memory]" or e.name().startswith("memledger.")),
                    key=lambda e: e.start_ns()):
        if e.name() != "[memory]":
            rows.append(f"---- {e.name()} live {live}")
            continue
        around = sorted((o for o in ops if o[0] <= e.start_ns() <= o[1]),
                        key=lambda o: (o[0], -o[1]))
        live += e.nbytes()
        rows.append(f"{e.nbytes():>11} {live:>11} {' > '.join(o[2] for o in around[-3:])}")
    with open(f"{path}.{rank}", "a", encoding="utf-8") as f:
        f.write("\n".join(rows) + "\n====\n")


def _events(prof):
    """(start_ns, kind, value) of the memory events and the phase marks, in time order."""
    if os.environ.get("MEMLEDGER_WITNESS_TRACE"):
        _write_trace(prof, os.environ["MEMLEDGER_WITNESS_TRACE"])
    out = []
    for e in prof.profiler.kineto_results.events():
        if e.name() == "[memory]":
            out.append((e.start_ns(), 1, e.nbytes()))
        elif e.name().startswith("memledger."):
            out.append((e.start_ns(), 0, e.name()))
    out.sort(key=lambda item: (item[0], item[1]))
    return out


def measure(case):
    """Trains one measured step of `case` and returns its buckets."""
    torch = _torch()
    # oneDNN (on by default) gives bf16/fp16 matmuls a per-call scratchpad whose size
    # depends on the CPU's ISA; memledger predicts ATen's own gemm, as its runtime runs
    # it (runtime/threads.h). case["mkldnn"] = False measures that.
    mkldnn = torch.backends.mkldnn.enabled
    if case.get("device", "cpu") == "cuda":
        return measure_fake_cuda(case)
    torch.backends.mkldnn.enabled = case.get("mkldnn", True)
    try:
        return _measure(case)
    finally:
        torch.backends.mkldnn.enabled = mkldnn


def _measure(case):
    torch = _torch()
    torch.set_num_threads(1)
    torch.manual_seed(case.get("seed", 0))
    if case.get("study"):
        target = StudyModel(load_study(), case)
    else:
        target = TransformersModel(case)
    params = list(target.parameters())
    opt = make_optimizer(params, case)
    amp = case.get("amp", "none")
    autocast = (torch.autocast("cpu", dtype=torch_dtype(amp)) if amp != "none"
                else contextlib.nullcontext())
    policy = case.get("policy", "matmul")
    op_names = [op for kind in policy.split(",") if kind for op in POLICY_OPS[kind]]

    # The earlier step that makes the optimizer's state. Under DDP two: the Reducer
    # rebuilds its buckets, in the order the first backward made the gradients, at the
    # second forward (distributed.py, _pre_forward: reducer._rebuild_buckets()), and the
    # step measured is every later one.
    for _ in range(2 if case.get("ddp") is not None else 1):
        with autocast:
            loss = target.loss(PolicyCounter(op_names))
        loss.backward()
        opt.step()
        del loss
        opt.zero_grad(set_to_none=True)

    counter = PolicyCounter(op_names)
    set_variant(target, case, counter)
    # A mixture of experts' routing in the measured step: the same forward on a copy of
    # the weights it starts from, outside the measurement.
    # Expert-parallel ranks cannot copy their model (its experts' forward is bound to the
    # original module), so they route once before the step, on the same weights.
    ep = case.get("ep", 1) > 1
    routing_copy = copy.deepcopy(target) if case.get("record_routing") and not ep else None
    routing_rows = target.routing(autocast) if case.get("record_routing") and ep else None
    gc.collect()

    param_ptrs = {local(p).untyped_storage().data_ptr() for p in params}
    param_bytes = unique_storage_bytes(params)
    buffer_bytes = unique_storage_bytes(list(target.buffers()))
    state_tensors = [v for st in opt.state.values() for v in st.values()
                     if isinstance(v, torch.Tensor)]
    optimizer_state_bytes = unique_storage_bytes(state_tensors)
    step_bytes = unique_storage_bytes([st["step"] for st in opt.state.values()
                                       if isinstance(st.get("step"), torch.Tensor)])
    input_bytes = unique_storage_bytes(target.inputs())

    seen = {}
    from torch.multiprocessing.reductions import StorageWeakRef

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in param_ptrs:
            seen[s.data_ptr()] = (s.nbytes(), StorageWeakRef(s))
        return t.detach()  # as pack_without_cycle

    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        opt.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            loss = target.loss(counter)
        saved = saved_at_forward_end(seen)
        _mark("memledger.forward_end")
        loss_bytes = element_bytes(loss)
        loss.backward()
        _mark("memledger.backward_end")
        if ep:
            reduce_expert_parallel(params, case.get("dp", case["ep"]), case["ep"])
        opt.step()
        _mark("memledger.step_end")
    grad_bytes = unique_storage_bytes([p.grad for p in params])
    del loss

    live = 0
    peak = (0, "forward")
    phase = "forward"
    marks = {}
    for _, kind, value in _events(prof):
        if kind == 0:
            marks[value] = live
            phase = {"memledger.forward_end": "backward",
                     "memledger.backward_end": "optimizer"}.get(value, "after")
            continue
        live += value
        if live > peak[0]:
            peak = (live, phase)
    reducer_bytes = getattr(target, "reducer_bytes", 0)
    resident = param_bytes + buffer_bytes + optimizer_state_bytes + input_bytes + reducer_bytes
    saved += counter.bytes
    if routing_copy is not None:
        routing_rows = routing_copy.routing(autocast)
    routing = {"routing": {"layers": routing_rows}} if routing_rows is not None else {}
    return {
        **routing,
        "case": {k: v for k, v in case.items() if k != "config"},
        "mkldnn": torch.backends.mkldnn.enabled,
        "torch": torch.__version__.split("+")[0],
        "transformers": _transformers_version(),
        "param_bytes": param_bytes,
        "buffer_bytes": buffer_bytes,
        "grad_bytes": grad_bytes,
        "optimizer_state_bytes": optimizer_state_bytes,
        "optimizer_step_tensor_bytes": step_bytes,
        "input_bytes": input_bytes,
        **({"reducer_bytes": reducer_bytes} if case.get("ddp") is not None else {}),
        "saved_bytes": saved,
        "cache_bytes": counter.bytes,
        "held_after_forward": marks["memledger.forward_end"] - loss_bytes,
        "held_after_backward": marks["memledger.backward_end"],
        "peak_bytes": resident + peak[0],
        "peak_phase": peak[1],
    }


# ---------------------------------------------------------------------------------------
# Fake CUDA: what a CUDA step's forward keeps, without a GPU


SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")
# Tensors a forced kernel made that a GPU would keep on the host (forced_sdpa), held so
# that no later storage reuses their address within the measurement.
host_tensors = []
# What SDPA calls for each backend on CUDA (aten/src/ATen/native/transformers/attention.cpp,
# scaled_dot_product_attention): fake tensors cannot run the selection a GPU makes, so the
# backend is given and its op called directly.


@contextlib.contextmanager
def forced_sdpa(backend):
    """F.scaled_dot_product_attention as a CUDA build runs it with `backend`.

    Autocast first casts q, k, v (and a float mask) to its dtype: SDPA is on CUDA
    autocast's lower-precision list, and its kernel then runs below autocast, so the
    math kernel's softmax is not autocast's fp32 softmax."""
    torch = _torch()
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention
    host_tensors.clear()

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        autocast = torch.is_autocast_enabled("cuda")
        if autocast:
            low = torch.get_autocast_dtype("cuda")

            def cast(t):
                return t.to(low) if t is not None and t.dtype == torch.float32 else t

            query, key, value, attn_mask = map(cast, (query, key, value, attn_mask))
        torch.set_autocast_enabled("cuda", False)
        try:
            if backend == "flash":
                if attn_mask is not None:
                    raise UsageError("--sdpa_backend=flash takes no attention mask")
                return torch.ops.aten._scaled_dot_product_flash_attention(
                    query, key, value, dropout_p, is_causal, False, scale=scale)[0]
            # should_compute_logsumexp: an input requires grad and grad mode is on.
            lse = torch.is_grad_enabled() and any(
                t.requires_grad for t in (query, key, value))
            if backend in ("efficient", "cudnn"):
                bias = None
                if attn_mask is not None:
                    if backend == "cudnn":
                        raise UsageError("--sdpa_backend=cudnn: no mask in this witness")
                    # SDPA's convert_boolean_attn_mask, then preprocess_mask: an additive
                    # mask in q's dtype, padded to 8 (where it is not aligned), expanded.
                    bias = attn_mask
                    if bias.dtype == torch.bool:
                        bias = torch.where(bias, 0.0, torch.scalar_tensor(
                            float("-inf"), dtype=query.dtype, device=query.device))
                    if bias.size(-1) % 8 != 0:
                        raise UsageError("a mask whose last dim is not a multiple of 8 "
                                         "(pad_bias) is not in this witness")
                    bias = bias.expand(query.size(0), query.size(1), query.size(2),
                                       key.size(2))
                op = (torch.ops.aten._scaled_dot_product_efficient_attention
                      if backend == "efficient"
                      else torch.ops.aten._scaled_dot_product_cudnn_attention)
                out = op(query, key, value, bias, lse, dropout_p, is_causal, scale=scale)
                if backend == "efficient":
                    # The CUDA kernel makes its philox seed and offset on the host unless
                    # a graph is being captured (attention.cu, _efficient_attention_forward);
                    # the meta kernel's land on the fake device.
                    host_tensors.extend(out[2:4])
                return out[0]
            return torch.ops.aten._scaled_dot_product_attention_math(
                query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale,
                enable_gqa=enable_gqa)[0]
        finally:
            torch.set_autocast_enabled("cuda", autocast)

    functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


@contextlib.contextmanager
def cuda_autocast(amp):
    """CUDA autocast turned on by hand: torch.autocast("cuda") disables itself without a
    GPU. Casts of weights are cached for the region, as torch.autocast's are, and the
    cache is cleared when it ends."""
    torch = _torch()
    if amp == "none":
        yield
        return
    torch.set_autocast_dtype("cuda", torch_dtype(amp))
    torch.set_autocast_enabled("cuda", True)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", False)
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()


DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
               "int64": "int64", "bool": "bool", "uint64": "uint64", "float64": "float64",
               "int32": "int32"}


def measure_fake_cuda(case):
    """The forward of `case` on fake CUDA tensors: what autograd keeps on the device,
    by dtype. Fake tensors run the ops' meta kernels, so nothing is computed. The
    backward needs a CUDA runtime that answers (the engine asks the device for its
    context): verify/witness_fake_step.py runs whole steps over tests/cuda_stub's."""
    torch = _torch()
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(case.get("seed", 0))
    # transformers takes fake tensors for tracing and then cannot read that each row of
    # position ids is one sequence (masking_utils.py, find_packed_sequence_indices: "if
    # not is_tracing(packed_sequence_mask) and ...all()"), so without a cache it would
    # build a packed-sequence mask. Real tensors of arange positions give None.
    packed = None
    if not case.get("study"):
        import transformers.masking_utils as masking_utils

        packed = masking_utils.find_packed_sequence_indices
        masking_utils.find_packed_sequence_indices = lambda position_ids: None
    # Module.to cannot convert fake parameters (it swaps tensors): the study's blocks are
    # made in their dtype instead, as the default dtype.
    default_dtype = torch.get_default_dtype()
    if case.get("study"):
        torch.set_default_dtype(torch_dtype(case["dtype"]))
    with FakeTensorMode(), torch.device("cuda"):
        if case.get("study"):
            target = StudyModel(load_study(), case)
        else:
            target = TransformersModel(case)
        params = list(target.parameters())
        counter = PolicyCounter([op for kind in case.get("policy", "matmul").split(",")
                                 if kind for op in POLICY_OPS[kind]])
        set_variant(target, case, counter)
        param_storages = {p.untyped_storage()._cdata for p in params}
        seen = {}
        from torch.multiprocessing.reductions import StorageWeakRef

        def pack(t):
            s = t.untyped_storage()
            if s._cdata not in param_storages:
                seen[s._cdata] = (s.nbytes(), str(t.dtype).removeprefix("torch."),
                                  t.device.type, StorageWeakRef(s))
            return t.detach()  # as pack_without_cycle

        with forced_sdpa(case["sdpa_backend"]), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                cuda_autocast(case.get("amp", "none")):
            loss = target.loss(counter)
        seen = {k: v for k, v in seen.items() if not v[-1].expired()}  # as saved_at_forward_end
        del loss
    torch.set_default_dtype(default_dtype)
    if packed is not None:
        masking_utils.find_packed_sequence_indices = packed
    by_dtype = dict(counter.by_dtype)
    off_device = 0
    host_storages = {t.untyped_storage()._cdata for t in host_tensors}
    for storage, (nbytes, dtype, device, _) in seen.items():
        # Kernels save their outputs before returning them, so which storages a GPU
        # keeps on the host is known only now.
        if device != "cuda" or storage in host_storages:
            off_device += nbytes
            continue
        by_dtype[DTYPE_NAMES[dtype]] = by_dtype.get(DTYPE_NAMES[dtype], 0) + nbytes
    return {
        "case": {k: v for k, v in case.items() if k != "config"},
        "device": "cuda (fake)",
        "torch": torch.__version__.split("+")[0],
        "transformers": _transformers_version(),
        "param_bytes": sum(p.untyped_storage().nbytes() for p in params),
        "saved_bytes": sum(by_dtype.values()),  # the selective cache's included
        "saved_bytes_by_dtype": by_dtype,
        "cache_bytes": counter.bytes,
        "saved_off_device_bytes": off_device,
    }


def _transformers_version():
    try:
        import transformers

        return transformers.__version__
    except ImportError:
        return None


# ---------------------------------------------------------------------------------------
# The command line


def parse_case(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model = parser.add_argument_group("model")
    model.add_argument("--config", help="a transformers config.json (model_type llama, "
                       "mistral, qwen2, qwen3, gpt2, ...)")
    model.add_argument("--study", action="store_true",
                       help="the reference study's blocks instead of a transformers model")
    model.add_argument("--layers", type=int, default=6, help="study only")
    model.add_argument("--width", type=int, default=128, help="study only")
    model.add_argument("--heads", type=int, default=4, help="study only")
    model.add_argument("--attn_implementation", default="sdpa",
                       help="transformers' attention: sdpa (default) or eager")
    model.add_argument("--experts_impl", default=None,
                       help="a mixture of experts' experts_implementation: grouped_mm "
                       "(transformers' default) or eager")
    model.add_argument("--record_routing", action="store_true",
                       help="also report the step's tokens per expert of each sparse layer "
                       "({\"routing\": {\"layers\": [...]}}, predict's --routing file)")
    model.add_argument("--same_token", action="store_true",
                       help="every input position the same token (every token then routes "
                       "to the same experts)")
    inputs = parser.add_argument_group("input")
    inputs.add_argument("--batch", type=int, default=2)
    inputs.add_argument("--seq", type=int, default=64)
    inputs.add_argument("--seed", type=int, default=0)
    precision = parser.add_argument_group("precision")
    precision.add_argument("--dtype", default="fp32", choices=DTYPES)
    precision.add_argument("--amp", default="none", choices=("none", "bf16", "fp16"))
    model.add_argument("--freeze", default="", help="comma-separated parts whose "
                       "parameters do not train: " + ", ".join(FREEZABLE))
    ckpt = parser.add_argument_group("checkpointing")
    ckpt.add_argument("--variant", default="none", help="none, full, every_<k>, selective")
    ckpt.add_argument("--policy", default="matmul",
                      help="selective's must-save op kinds: " + ", ".join(POLICY_OPS))
    ckpt.add_argument("--checkpoint_impl", default="non_reentrant", choices=CHECKPOINT_IMPLS)
    opt = parser.add_argument_group("optimizer")
    opt.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    opt.add_argument("--optimizer_impl", default="for_loop", choices=OPTIMIZER_IMPLS)
    opt.add_argument("--momentum", type=float, default=0.0)
    kernels = parser.add_argument_group("kernels")
    kernels.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                         help="cuda: the forward on fake CUDA tensors (no GPU needed), "
                         "reporting the saved bytes by dtype only")
    kernels.add_argument("--sdpa_backend", default="flash", choices=SDPA_BACKENDS,
                         help="with --device=cuda, the SDPA kernel to call")
    kernels.add_argument("--no_mkldnn", dest="mkldnn", action="store_false",
                         help="turn oneDNN off, as memledger's runtime does (its bf16/fp16 "
                         "matmuls allocate ISA-dependent scratchpads)")
    out = parser.add_argument_group("output")
    out.add_argument("--cases", help="a JSON-lines file of cases (the keys above); "
                     "one result line per case")
    args = parser.parse_args(argv)
    if args.cases:
        return None, args.cases
    case = {k: v for k, v in vars(args).items() if k not in ("cases", "config")}
    case["freeze"] = [part for part in args.freeze.split(",") if part]
    if args.config:
        case["config"] = read_config(args.config)
    elif not args.study:
        raise UsageError("give --config=PATH or --study")
    return case, None


def read_config(path):
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--config {path}: not a file")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"--config {path}: not JSON ({e.msg})") from None


DEFAULTS = {"batch": 2, "seq": 64, "seed": 0, "dtype": "fp32", "amp": "none",
            "variant": "none", "policy": "matmul", "checkpoint_impl": "non_reentrant",
            "optimizer": "adamw", "optimizer_impl": "for_loop", "momentum": 0.0,
            "attn_implementation": "sdpa", "device": "cpu", "sdpa_backend": "flash"}


def main(argv=None):
    warnings.filterwarnings("ignore")
    try:
        case, cases_path = parse_case(argv)
        if cases_path is None:
            print(json.dumps(measure({**DEFAULTS, **case})))
            return 0
        for line in Path(cases_path).read_text().splitlines():
            if line.strip():
                print(json.dumps(measure({**DEFAULTS, **json.loads(line)})), flush=True)
        return 0
    except UsageError as e:
        print(f"witness: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
