"""Global-norm gradient clipping over sharded and replicated gradients."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from zcompile.runtime import shard_store
from zcompile.runtime.dist_context import DistContext


def _grads(params: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor], object]:
    """(shard grads, replicated grads, group): a shard grad holds this rank's part of a gradient, a replicated one
    all of it. Before the step a sharded gradient sits on the DTensor or shard (an offloaded master gets it only
    while stepping)."""
    sharded, replicated, group, seen = [], [], None, set()
    for p in params:
        zp = shard_store.owner(p)
        key = zp if zp is not None else id(p)  # a parameter and its optimizer tensor count once
        if key in seen:
            continue
        seen.add(key)
        g = zp.gradient() if zp is not None else p.grad
        if g is None:
            continue
        if zp is not None and zp.grad_sharded:
            sharded.append(g)
            group = zp.group
        else:
            replicated.append(g)
    return sharded, replicated, group


def clip_grad_norm_(parameters: nn.Module | Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale all gradients so their global L2 norm is at most max_norm; returns the norm before clipping.

    Takes the compiled model or its parameters. Same result as torch.nn.utils.clip_grad_norm_ on the DTensor
    parameters, with one all-reduce in all, and also for parameters that are not DTensors (see dtensor_params).
    """
    params = parameters.parameters() if isinstance(parameters, nn.Module) else parameters
    sharded, replicated, group = _grads(params)
    # summed on the group's device: host-offloaded shards' gradients are on the host, NCCL reduces GPU tensors
    device = DistContext.current().device if group is not None else (
        (sharded + replicated)[0].device if sharded or replicated else torch.device("cpu"))
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in sharded:
        sq += g.detach().float().pow(2).sum().to(device)
    if group is not None:
        dist.all_reduce(sq, group=group)
    for g in replicated:
        sq += g.detach().float().pow(2).sum().to(device)
    norm = sq.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in sharded + replicated:
        g.detach().mul_(coef.to(g.device, g.dtype))
    return norm
