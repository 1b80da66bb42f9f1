"""What the real-stack witnesses share (verify/witness.py, one process, and
verify/witness_ranks.py, its data-parallel ranks): the one-line usage error, the
storage accounting both measure with, and on this process's rank transformers' expert
parallelism or torch's DistributedDataParallel, which witness.py's step runs when a case
has ep > 1 or ddp and witness_ranks.py's ranks start. It imports neither script.
"""

from __future__ import annotations


class UsageError(Exception):
    """Bad input: reported as one line, exit 2."""


def _torch():
    import torch  # imported late so --help works without the reference stack

    return torch


def torch_dtype(name):
    torch = _torch()
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def element_bytes(t):
    return t.untyped_storage().nbytes()


def local(t):
    """A DTensor's local shard (an expert-parallel rank's experts), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def unique_storage_bytes(tensors):
    """Bytes of the distinct storages among `tensors` (views count once)."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        s = local(t).untyped_storage()
        seen[s.data_ptr() if s.data_ptr() else id(s)] = s.nbytes()
    return sum(seen.values())


# ---------------------------------------------------------------------------------------
# Expert parallelism

# The process's device mesh (expert_parallel): its "ep" groups of ep consecutive ranks,
# and its "edp" groups of the ranks that hold the same experts.
_MESH = None


def expert_parallel(model, config, ep):
    """transformers 5.23's expert parallelism on this process's rank, in groups of `ep`
    consecutive ranks (memledger's data-parallel rank = group x ep + expert-parallel
    rank), as from_pretrained(distributed_config=...) applies its EP plan, without the
    FSDP2 it also requires (distributed/configuration_utils.py): the config's
    base_model_ep_plan (experts' 3-D weights Shard(0) by MoEParamShard, the experts
    module dispatching through AutoEP, which trains with AllToAllEP), by
    apply_expert_parallelism."""
    import re

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    global _MESH
    _MESH = mesh = init_device_mesh("cpu", (dist.get_world_size() // ep, ep, 1),
                                    mesh_dim_names=("edp", "ep", "tp"))
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_modules()]
    plan = {}
    for pattern, style in config.base_model_ep_plan.items():
        regex = re.compile("^model\\." + re.escape(pattern).replace("\\*", "\\d+") + "$")
        plan.update({name: style for name in names if regex.match(name)})
    if not plan:
        raise UsageError(f"--ep: {config.model_type} has no expert-parallel plan")
    apply_expert_parallelism(model, mesh["ep"], mesh["tp"], plan)
    _let_gloo_go()


def gloo_let_go(t, held=1):
    """Returns once Gloo's worker thread has dropped its reference to the collective's
    result `t` (and so to the whole work): the caller then holds only the `held`
    references it held before the collective (within 30 s; a loaded machine was seen to
    need more than the 1 s this waited before). A
    collective's wait returns before the worker lets go of the work's
    tensors; were the caller to drop its own first, the worker would free them, where
    torch.profiler (thread-local) records no free, and the witness would see a tensor
    live for the rest of the step on whichever rank lost the race. memledger's runtime
    waits the same way (runtime/gloo_collectives.h, Complete)."""
    import sys
    import time

    deadline = time.monotonic() + 30.0
    while t._use_count() > held and time.monotonic() < deadline:
        time.sleep(0.0005)
    if t._use_count() > held:
        # The runtime's Complete waits without a bound; say so rather than measure a
        # tensor the worker will free unrecorded.
        print("witness: Gloo's worker still holds a collective's result after 30 s; this "
              "rank's peak may count it to the step's end", file=sys.stderr)


def _let_gloo_go():
    """Every wait of the expert-parallel code (the functional collectives' wait_tensor,
    AllToAllEP's exchange of the counts) returns only once Gloo lets go (gloo_let_go).
    No tensor's lifetime in the code changes."""
    import torch.distributed._functional_collectives as functional
    from transformers.distributed import expert_parallel, parallel_utils

    if getattr(functional.wait_tensor, "memledger_waits", False):
        return

    def waited(fn):
        def wait_tensor(tensor):
            out = fn(tensor)
            gloo_let_go(out)
            return out

        wait_tensor.memledger_waits = True
        return wait_tensor

    def exchanged(fn):
        def all_to_all_single(output, input, *args, **kwargs):
            result = fn(output, input, *args, **kwargs)
            gloo_let_go(output)
            return result

        return all_to_all_single

    functional.wait_tensor = waited(functional.wait_tensor)
    parallel_utils.wait_tensor = waited(parallel_utils.wait_tensor)
    expert_parallel.all_to_all_single = exchanged(expert_parallel.all_to_all_single)


# ---------------------------------------------------------------------------------------
# DDP


def ddp(model, options):
    """torch's DistributedDataParallel around `model` on the default (Gloo) group, with
    options["bucket_cap_mb"] (None: torch's 25 MiB, and 1 MiB for the first bucket once
    they are rebuilt) and options["gradient_as_bucket_view"] (False), every other
    argument torch's default. Returns the wrapper and the bytes its construction keeps:
    the profiler's net allocation over DistributedDataParallel.__init__, whose other
    allocations (the parameters' and buffers' broadcast from rank 0) die before it
    returns, so what stays is the Reducer's (its gradient buckets)."""
    torch = _torch()
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    _broadcast_in_python(dist)
    _verify_params_in_python(dist)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        wrapped = DistributedDataParallel(
            model, bucket_cap_mb=options.get("bucket_cap_mb"),
            gradient_as_bucket_view=options.get("gradient_as_bucket_view", False))
    kept = sum(e.nbytes() for e in prof.profiler.kineto_results.events()
               if e.name() == "[memory]")
    return wrapped, kept


def _broadcast_in_python(dist):
    """dist._broadcast_coalesced (DDP's broadcast of the parameters at construction and
    of the buffers at each forward's start, forward_sync_buffers) as c10d runs it
    (torch/csrc/distributed/c10d/comm.cpp, broadcast_coalesced and BroadcastWork): the
    tensors in buckets of buffer_size (compute_bucket_assignment_by_size), each copied
    into one flat tensor (flatten_dense_tensors, a copy even of one tensor) and
    broadcast, at most two in flight; finishing one waits for it and copies it back.
    From Python, so that it also waits for Gloo's worker to let go of the flat copy
    (gloo_let_go): c10d drops its own reference first, and whenever the worker's was
    the last, the copy died on that thread where the profiler records no free, and a
    rank read the buffers' bytes held for the rest of its step."""
    if getattr(dist._broadcast_coalesced, "memledger_waits", False):
        return
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    def broadcast_coalesced(process_group, tensors, buffer_size, src):
        buckets, _ = dist._compute_bucket_assignment_by_size(tensors, [buffer_size])
        in_flight = []

        def finish():
            bucket, flat, work = in_flight.pop(0)
            work.wait()
            del work  # the work's own reference to the flat copy
            gloo_let_go(flat)
            for tensor, out in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                if out.numel() != 0:
                    tensor.copy_(out)

        for indices in buckets:
            if len(in_flight) >= 2:
                finish()
            bucket = [tensors[i] for i in indices]
            flat = _flatten_dense_tensors(bucket)
            in_flight.append((bucket, flat, dist.broadcast(flat, group=process_group,
                                                           group_src=src, async_op=True)))
            del flat
        while in_flight:
            finish()

    broadcast_coalesced.memledger_waits = True
    dist._broadcast_coalesced = broadcast_coalesced


def _verify_params_in_python(dist):
    """dist._verify_params_across_processes (DDP's check at construction that every rank
    has the same parameter shapes) as c10d runs it (torch/csrc/distributed/c10d/
    reducer.cpp, verify_params_across_processes): each parameter's sizes and strides in
    one int64 tensor, a copy of it broadcast from rank 0 and compared. From Python, to
    wait for Gloo's worker to let go of the copy (gloo_let_go); it keeps nothing."""
    if getattr(dist._verify_params_across_processes, "memledger_waits", False):
        return
    torch = _torch()

    def verify_params_across_processes(process_group, tensors, logger=None):
        del logger
        metadata = torch.tensor([n for t in tensors for n in (*t.shape, *t.stride())],
                                dtype=torch.long)
        copy = metadata.clone()
        dist.broadcast(copy, group=process_group, group_src=0)
        gloo_let_go(copy)
        if not torch.equal(copy, metadata):
            raise RuntimeError("DDP: the ranks' parameters differ in shape or stride")

    verify_params_across_processes.memledger_waits = True
    dist._verify_params_across_processes = verify_params_across_processes


# ---------------------------------------------------------------------------------------
# FSDP2

def fsdp2(model, case):
    """torch 2.15's FSDP2 as torchtitan applies it: `fully_shard` on each decoder layer,
    then on the whole model (the root unit: the embedding, the final norm, lm_head), over
    a 1-D mesh of every rank, with case["reshard_after_forward"], when
    case["mp_param_dtype"] is set MixedPrecisionPolicy(param_dtype, reduce_dtype), and with
    case["offload"] == "cpu" CPUOffloadPolicy(pin_memory=True).

    Gloo stands in for NCCL through FSDP2's own hooks for it (set_custom_all_gather,
    set_custom_reduce_scatter), with collectives that allocate what NCCL's do, nothing
    (_nccl_like_collectives). Gloo's own all_gather_into_tensor and
    reduce_scatter_tensor copy their tensors, buffers a GPU rank never holds (the issue's
    2,469,404 B a rank against 2,419,740 B here), and let go of them on Gloo's worker
    thread, where torch.profiler (thread-local) records no free, so a rank would count a
    buffer to the step's end whenever the worker was last (runs differed by one layer's,
    172,544 B, or the root unit's, 262,400 B, on either rank)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    # On fake CUDA (verify/witness_fake_step.py) the mesh is CUDA's and the process
    # group torch's fake one, whose collectives allocate nothing, as NCCL's.
    device = case.get("device", "cpu")
    if device == "cpu":
        mesh = init_device_mesh(device, (dist.get_world_size(),))
    else:
        # The mesh reads its rank map as real numbers, outside FakeTensorMode.
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            mesh = init_device_mesh(device, (dist.get_world_size(),))
    kwargs = {"mesh": mesh, "reshard_after_forward": case.get("reshard_after_forward", True)}
    if case.get("offload", "none") == "cpu":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    if case.get("mp_param_dtype"):
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch_dtype(case["mp_param_dtype"]),
            reduce_dtype=torch_dtype(case.get("mp_reduce_dtype") or case["mp_param_dtype"]))
    # The decoder's layers: model.model.layers (Llama and its kin), model.transformer.h
    # (GPT-2); under peft's PeftModel, its base model's (get_base_model).
    base = (model.get_base_model() if hasattr(model, "get_base_model") else model).base_model
    layers = getattr(base, "layers", None)
    if layers is None:
        layers = getattr(base, "h", None)
    if layers is None:
        raise UsageError(f"fsdp: {type(model).__name__} has no decoder layer list")
    units = [*layers, model]
    for unit in units:
        fully_shard(unit, **kwargs)
    if device != "cpu":
        return
    all_gather, reduce_scatter = _nccl_like_collectives()
    for unit in units:
        unit.set_custom_all_gather(all_gather)
        unit.set_custom_reduce_scatter(reduce_scatter)


class _Done:
    """The work of a collective that has already completed (FSDP2 waits on it later)."""

    def wait(self, timeout=None):
        del timeout
        return True


def _nccl_like_collectives():
    """FSDP2's all-gather and reduce-scatter as NCCL runs them, on Gloo: in place, without
    a buffer of their own, done when they return, and only once Gloo's worker has let go
    of the tensor (gloo_let_go, down to the references FSDP2 held before: its all-gather
    result and reduce-scatter state keep the same tensors)."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin

    class InPlaceAllGather(DefaultAllocMixin, AllGather):
        """NCCL's in-place all-gather: FSDP2's input is this rank's slice of the output
        (all_gather_copy_in); the other slices, zeroed, are summed in place."""

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            n = input_tensor.numel()
            rank = group.rank()
            if input_tensor.data_ptr() != output_tensor[rank * n:].data_ptr():
                output_tensor[rank * n:(rank + 1) * n].copy_(input_tensor)
            output_tensor[:rank * n].zero_()
            output_tensor[(rank + 1) * n:].zero_()
            held = output_tensor._use_count()  # FSDP2's own references too
            dist.all_reduce(output_tensor, group=group)
            gloo_let_go(output_tensor, held)
            return _Done() if async_op else None

    class InPlaceReduceScatter(DefaultAllocMixin, ReduceScatter):
        """NCCL's reduce-scatter: the input summed in place (FSDP2 made it for this
        collective alone: foreach_reduce's reduce_scatter_input), this rank's slice
        copied to the output."""

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                raise UsageError(f"FSDP2's reduce-scatter with {op}: not witnessed")
            held = input_tensor._use_count()
            dist.all_reduce(input_tensor, group=group)
            gloo_let_go(input_tensor, held)
            n = output_tensor.numel()
            piece = input_tensor[group.rank() * n:(group.rank() + 1) * n]
            if op == dist.ReduceOp.AVG:
                piece.div_(group.size())
            output_tensor.copy_(piece.view_as(output_tensor))
            return _Done() if async_op else None

    return InPlaceAllGather(), InPlaceReduceScatter()


def reduce_expert_parallel(params, dp, ep):
    """The data-parallel reduction memledger predicts for expert-parallel ranks
    (estimator/step/data_parallel_zero.cc, Replicated): the gradients other than the
    experts' (plain tensors) concatenated into one bucket, padded with zeros to a
    multiple of dp, all-reduced over the dp ranks, divided by dp and copied back; then
    the experts' (DTensors) the same way over the dp / ep ranks that hold the same
    experts (the mesh's "edp" group; this rank alone when dp = ep)."""
    import torch.distributed as dist

    import torch

    def reduce(grads, ranks, group):  # a function, so no view of the bucket outlives it
        n = sum(g.numel() for g in grads)
        pieces = [g.view(-1) for g in grads]
        if -(-n // ranks) * ranks > n:
            pieces.append(grads[0].new_zeros(-(-n // ranks) * ranks - n))
        bucket = torch.cat(pieces)
        del pieces
        if ranks > 1:
            dist.all_reduce(bucket, group=group)
            gloo_let_go(bucket)
        bucket.div_(dp)
        for g, piece in zip(grads, bucket.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))

    for experts in (False, True):
        reduce([local(p.grad) for p in params
                if p.grad is not None and hasattr(p, "to_local") == experts],
               dp // ep if experts else dp, _MESH["edp"].get_group() if experts else None)
