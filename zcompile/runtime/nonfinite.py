"""`nonfinite: warn|skip|error`: every rank learns at `optimizer.step()` whether any rank's loss or gradients are NaN/inf.

A NaN in one rank's batch reaches every rank through the gradient reduction and would turn every parameter into NaN
without a word. With the check on, each compiled forward records whether its scalar outputs (the loss) are finite,
and before the step each rank contributes two flags per rank (loss, reduced gradients) to one all-reduce of
2 x world int32: every rank sees the same answer, so all of them warn, skip the step (gradients dropped, the
optimizer leaves parameters and state untouched) or raise NonFiniteGradients with the step and the ranks.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from zcompile.errors import NonFiniteGradients
from zcompile.runtime.dist_context import DistContext


def note_forward(params, outputs) -> None:
    """After a compiled forward: remember, per parameter of that graph, whether a scalar output was not finite (no
    host sync: a flag tensor read at the step)."""
    scalars = [o for o in outputs if isinstance(o, torch.Tensor) and o.dim() == 0 and o.is_floating_point()]
    if not scalars:
        return
    bad = ~torch.isfinite(torch.stack([s.detach().float() for s in scalars])).all()
    for zp in params:
        zp.loss_nonfinite = bad if zp.loss_nonfinite is None else zp.loss_nonfinite | bad


def check(optimizer, zps: list) -> None:
    """Before the step (every rank): warn, skip or raise when any rank saw a non-finite loss or gradient."""
    modes = {zp.nonfinite for zp in zps} - {"off"}
    if not modes:
        return
    mode = "error" if "error" in modes else "skip" if "skip" in modes else "warn"
    step = optimizer._zc_step = getattr(optimizer, "_zc_step", 0) + 1
    zp0 = zps[0]
    grads = [g for zp in zps if (g := zp.gradient()) is not None and g.numel()]  # a rank may own no rows
    device = DistContext.current().device  # the group's: a host-offloaded shard's gradient is on the host
    flags = torch.zeros(2 * zp0.world, dtype=torch.int32, device=device)
    if grads:
        norms = torch._foreach_norm(grads, float("inf"))  # gradients need no grad: no detach per parameter
        flags[zp0.rank] = (~torch.isfinite(torch.stack([n.to(device) for n in norms])).all()).to(torch.int32)
    losses = [zp.loss_nonfinite for zp in zps if zp.loss_nonfinite is not None]
    if losses:
        flags[zp0.world + zp0.rank] = torch.stack(losses).any().to(torch.int32)
    for zp in zps:
        zp.loss_nonfinite = None
    if zp0.world > 1:
        dist.all_reduce(flags, group=zp0.group)
    flags = flags.tolist()
    grad_ranks = [r for r in range(zp0.world) if flags[r]]
    loss_ranks = [r for r in range(zp0.world) if flags[zp0.world + r]]
    if not grad_ranks and not loss_ranks:
        return
    msg = (f"optimizer step {step}: non-finite values. Ranks whose loss was NaN/inf: {loss_ranks or 'none'}; ranks "
           f"whose reduced gradients hold NaN/inf: {grad_ranks or 'none'} (the gradient reduction spreads one rank's "
           "NaN to the others, so the loss ranks name where it started)")
    if mode == "error":
        raise NonFiniteGradients(f"rank {zp0.rank}: {msg}. nonfinite: error stops here, before the parameters change")
    if mode == "skip":  # the optimizer steps each zp's shard, master or param (stray params were refused before)
        for zp in zps:
            zp.clear_grad()
        msg += "; step skipped on every rank (nonfinite: skip)"
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
