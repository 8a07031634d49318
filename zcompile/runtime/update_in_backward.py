"""offload.update_in_backward: the host optimizer steps each gradient bucket while the rest of the backward runs
(ZeRO-Offload's overlap of the CPU update with the backward).

The backward graph calls `zcompile::grads_ready(grads, keys)` right after a bucket's reduce-scatter (pass
update_in_backward). Here that call copies the bucket's gradient shards into host buffers (pinned memory written on
a side stream, on a GPU; each freed once its update is done) and hands them to the optimizer (`CPUAdam.update_bucket`), whose thread
updates the host masters while the backward goes on. `optimizer.step()` waits for those updates, steps what the
backward did not hand over and copies every master back into its device shard, as without this option.

A bucket's parameter is stepped in the backward only where the update cannot differ from optimizer.step()'s: the
optimizer is known (it stepped the parameter before, so from the second step on), this backward's graph run is the
only one that took the parameter since the last step, the parameter had no gradient before it, and its master
matches it (no write since the last step). What would make the update wrong afterwards is an error at the next
optimizer.step() or forward: a gradient changed between backward and step (clipping, a hook), a hyper-parameter
changed between them, a second backward or forward before the step (gradient accumulation), a gradient that never
reached the parameter (torch.autograd.grad, zero_grad before the step).
"""
from __future__ import annotations

import weakref

import torch

from zcompile.errors import ZeroError
from zcompile.runtime import offload_engine

TRACKED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # key -> ShardedParam with the option on
LANDED: list = []  # ShardedParams whose update ran in this step's backward, until optimizer.step() takes them
_STREAMS: dict = {}  # device -> the side stream gradient shards leave a GPU on


def adopt(optimizer, zps) -> None:
    """optimizer.step() steps these parameters: from the next backward on, their buckets go to this optimizer."""
    if not hasattr(optimizer, "update_bucket"):
        raise TypeError(f"offload.update_in_backward is on but the optimizer is {type(optimizer).__name__}: only "
                        "zcompile.CPUAdam steps gradient buckets during the backward")
    ref = weakref.ref(optimizer)
    for zp in zps:
        zp.update_optimizer = ref


def _ready(zp) -> bool:
    opt = zp.update_optimizer() if zp.update_optimizer is not None else None
    return (opt is not None and zp.master is not None and zp.compiled_calls == 1 and zp.grad_holder.grad is None
            and (zp.dtensor is None or zp.dtensor._version == zp.master_synced))


def _host_buffer(zp, numel: int) -> torch.Tensor:
    """The master's gradient for one update, freed when it is done (pinned memory comes from torch's caching host
    allocator: after the first step, no new pinned allocation)."""
    buf = torch.empty(zp.shard_numel, dtype=torch.float32, pin_memory=zp.shard.device.type == "cuda")
    if numel < zp.shard_numel:
        buf[numel:].zero_()
    return buf


def _side_stream(device: torch.device):
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def land(grads: list[torch.Tensor], keys: list[int]) -> None:
    """A bucket's gradient shards are reduced: move them to the host and start their update."""
    by_optimizer: dict = {}
    for g, key in zip(grads, keys):
        zp = TRACKED.get(key)
        if zp is None or not _ready(zp):
            continue  # stepped by optimizer.step() as without the option
        if zp.landed:
            raise ZeroError(f"offload.update_in_backward: parameter {zp.label} got a second gradient "
                            "before optimizer.step(), but its update already ran in the first backward: run one "
                            "backward per optimizer.step() (no gradient accumulation, no retain_graph re-runs) or "
                            "set offload.update_in_backward to false")
        by_optimizer.setdefault(zp.update_optimizer(), []).append((zp, g))
    if not by_optimizer:
        return
    if not LANDED:  # the step's first bucket: see what the backward leaves in p.grad once it is over
        _at_backward_end()
    ready = None
    on_gpu = grads[0].device.type == "cuda"
    if on_gpu:  # copies on a side stream, after the reduce-scatter; the update thread waits for them
        stream = _side_stream(grads[0].device)
        stream.wait_stream(torch.cuda.current_stream(grads[0].device))
    for opt, members in by_optimizer.items():
        pairs = []
        for zp, g in members:
            flat = g.reshape(-1)
            buf = _host_buffer(zp, flat.numel())
            if on_gpu:
                with torch.cuda.stream(stream):
                    buf[: flat.numel()].copy_(flat, non_blocking=True)
                flat.record_stream(stream)  # (a copy if g was not contiguous: kept until read)
            else:
                buf[: flat.numel()].copy_(flat)
            offload_engine.count("device->cpu", flat.numel() * flat.element_size())
            zp.landed = True
            LANDED.append(zp)
            pairs.append((zp.master, buf))
        if on_gpu:
            ready = torch.cuda.Event()
            ready.record(stream)
        opt.update_bucket(pairs, ready)


def _at_backward_end() -> None:
    try:
        torch.autograd.Variable._execution_engine.queue_callback(_snapshot)
    except RuntimeError:  # not inside loss.backward(): nothing to snapshot; optimizer.step() says so
        pass


def _snapshot() -> None:
    """The backward is over: remember each landed parameter's gradient as it left it (the tensor and its norm, one
    foreach kernel), so that optimizer.step() can tell whether anything changed it since: torch's foreach clipping
    of DTensor gradients bumps no version counter."""
    present = [(zp, g) for zp in LANDED if (g := zp.grad_holder.grad) is not None]  # the others stay None
    norms = torch._foreach_norm([_local(g) for _, g in present]) if present else []
    for (zp, g), norm in zip(present, norms):
        zp.landed_grad = (g, norm)
    for opt in {zp.update_optimizer() for zp in LANDED} - {None}:
        opt._record("backward done", opt._steps + 1)


def _local(g: torch.Tensor) -> torch.Tensor:
    return getattr(g, "_local_tensor", g)


def before_step(optimizer, landed: list) -> None:
    """optimizer.step() is about to run: wait for the backward's updates and check they are what the step would do."""
    optimizer.wait()
    for zp in landed:
        if zp.landed_grad is None or zp.grad_holder.grad is not zp.landed_grad[0]:
            raise ZeroError(f"offload.update_in_backward: parameter {zp.label} was updated during the "
                            "backward but does not hold the gradient that backward made at optimizer.step() "
                            "(torch.autograd.grad instead of .backward(), zero_grad before the step, or p.grad "
                            "replaced): set offload.update_in_backward to false for such loops")
    if landed:
        now = torch._foreach_norm([_local(zp.grad_holder.grad) for zp in landed])
        if not torch.equal(torch.stack(now), torch.stack([zp.landed_grad[1] for zp in landed])):
            zp = next(zp for zp, n in zip(landed, now) if not torch.equal(n, zp.landed_grad[1]))
            raise ZeroError(f"offload.update_in_backward: the gradient of parameter {zp.label} "
                            "changed between the backward and optimizer.step() (gradient clipping, a hook, a "
                            "scaler's unscale_?), but its update already ran with the gradient the backward made: "
                            "set offload.update_in_backward to false to change gradients before the step")
    changed = optimizer.hyperparameters_changed()
    if changed:
        raise ZeroError(f"offload.update_in_backward: {changed} changed between the backward and optimizer.step(), "
                        "but the update already ran with the backward's values: change them after the step (as "
                        "torch's lr schedulers do) or set offload.update_in_backward to false")


def after_step(landed: list) -> None:
    for zp in landed:
        zp.landed, zp.landed_grad = False, None
    LANDED[:] = [zp for zp in LANDED if zp.landed]  # another optimizer's, if any, wait for its step


def check_no_pending(where: str) -> None:
    """A graph is about to run: updates made in a backward must have been taken by optimizer.step() first."""
    if LANDED:
        zp = LANDED[0]
        raise ZeroError(f"offload.update_in_backward: {where} ran before optimizer.step() took the update made in "
                        f"the last backward (parameter {zp.label}): call optimizer.step() after "
                        "each backward (gradient accumulation needs offload.update_in_backward false)")


@torch.library.custom_op("zcompile::grads_ready", mutates_args=("grads",))
def grads_ready(grads: list[torch.Tensor], keys: list[int]) -> None:
    """Declared as writing `grads` (it only reads them) so that no compiler drops or reorders the call."""
    land(grads, keys)


@grads_ready.register_fake
def _(grads, keys) -> None:
    return None
