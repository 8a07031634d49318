"""Sharded checkpoints (each rank writes and reads only its shard) and consolidated full state_dict export.

A sharded checkpoint is a directory with one `rank<r>-of-<N>.pt` per rank; resuming needs the same world size and
stage, and gives bit-identical training. `full_state_dict` gathers every parameter whole, under the names of the
uncompiled model, for `model.load_state_dict` anywhere (a different world size, no zcompile at all).

The module's parameters are DTensors (dtensor_params), so torch.distributed.checkpoint (`get_state_dict` /
`set_state_dict`) also works on it, and loads at another world size or stage; this format stays for the parameters
that are not DTensors (tiled, NVMe-offloaded) and for CPUAdam's NVMe moments.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn

from zcompile import config as zconfig, shard_store
from zcompile.dist_context import DistContext, all_gather_flat

FORMAT = "zcompile-sharded-v1"
_COMPILED_PREFIX = "_orig_mod."


def _module(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)


def _named_params(model: nn.Module):
    return list(_module(model).named_parameters())


def _shard_file(directory: str, rank: int, world: int) -> str:
    return os.path.join(directory, f"rank{rank}-of-{world}.pt")


def _local_values(zp: shard_store.ShardedParam) -> torch.Tensor:
    return zp.values() if zp.stage >= 2 else zp.local_slice()


def save_checkpoint(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    extra: dict | None = None) -> str:
    """Write this rank's shard of the parameters and optimizer state. Call on every rank."""
    ctx = DistContext.current()
    params, stages = {}, set()
    for name, p in _named_params(model):
        zp = shard_store.owner(p)
        if zp is None:
            raise RuntimeError(f"parameter '{name}' is not managed by zcompile yet: run one forward pass of the "
                               "compiled model (or load a checkpoint) before saving")
        stages.add(zp.stage)
        params[name] = (_local_values(zp) if zp.stage >= 1 else p.detach()).clone()
    if optimizer is not None:
        shard_store.adopt_optimizer(optimizer)
    state = {"format": FORMAT, "world": ctx.world, "rank": ctx.rank, "stages": sorted(stages), "params": params,
             "buffers": {n: b.detach().clone() for n, b in _module(model).named_buffers()},
             "optimizer": optimizer.state_dict() if optimizer is not None else None, "extra": extra or {}}
    os.makedirs(directory, exist_ok=True)
    path = _shard_file(directory, ctx.rank, ctx.world)
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a crash never leaves a half-written shard under the real name
    dist.barrier(group=ctx.group)
    return path


def load_checkpoint(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    stage: int | None = None, config=None) -> dict:
    """Load this rank's shard into `model` (compiled with backend="zero") and `optimizer`; returns `extra`.

    Works before the first forward: parameters are sharded here for the checkpoint's stage, and the backend later
    checks that its config asks for the same stage. With offload or tiling, pass the model's `config` (path or
    mapping) so the shards are laid out and placed in their tiers as the compile will expect.
    """
    cfg = zconfig.from_options({"config": config}) if config is not None else None
    ctx = DistContext.current()
    path = _shard_file(directory, ctx.rank, ctx.world)
    if not os.path.isfile(path):
        found = sorted(f for f in os.listdir(directory) if f.endswith(".pt")) if os.path.isdir(directory) else []
        raise FileNotFoundError(f"no shard for rank {ctx.rank} of {ctx.world} at {path} (found: {found or 'none'}); "
                                "a sharded checkpoint loads only at the world size that wrote it -- use "
                                "full_state_dict() to move between world sizes")
    state = torch.load(path, map_location=ctx.device, weights_only=True)
    if state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a zcompile sharded checkpoint (format {state.get('format')!r})")
    (ckpt_stage,) = state["stages"]
    if stage is not None and stage != ckpt_stage:
        raise ValueError(f"{path} was written at stage {ckpt_stage}, asked to load it at stage {stage}")
    names = {n for n, _ in _named_params(model)}
    if names != set(state["params"]):
        raise KeyError(f"{path} does not match the model: missing {sorted(names - set(state['params']))}, "
                       f"unexpected {sorted(set(state['params']) - names)}")
    with torch.no_grad():
        for name, p in _named_params(model):
            zp = (shard_store.register(p, ckpt_stage, ctx) if cfg is None else
                  shard_store.register(p, ckpt_stage, ctx, cfg.offload, shard_store.row_multiple(cfg, p)))
            value = state["params"][name]
            target = p if zp.stage == 0 else _local_values(zp)
            if target.shape != value.shape:
                raise ValueError(f"{path}: '{name}' holds shape {tuple(value.shape)}, expected {tuple(target.shape)}"
                                 " (a checkpoint of a tiled model loads with load_checkpoint(..., config=) of it)")
            if zp.stage >= 2:
                zp.load_values(value)  # the shard, its offload master and its NVMe file
            else:
                target.copy_(value)
            if zp.keeps_full:
                shard_store.gather_full([zp])
        for name, b in _module(model).named_buffers():
            if name in state["buffers"]:
                b.copy_(state["buffers"][name])
    if optimizer is not None and state["optimizer"] is not None:
        shard_store.adopt_optimizer(optimizer)
        optimizer.load_state_dict(state["optimizer"])
    dist.barrier(group=ctx.group)
    return state["extra"]


def full_state_dict(model: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (plus buffers), keyed like the uncompiled model. Call on every rank."""
    ctx = DistContext.current()
    out: dict[str, torch.Tensor] = {}
    shard_store.refresh_stale([zp for _, p in _named_params(model) if (zp := shard_store.owner(p)) is not None])
    for name, p in _named_params(model):
        zp = shard_store.owner(p)
        if zp is None or zp.stage == 0:
            value = p.detach().clone()
        elif zp.keeps_full:
            value = zp.full_view().clone()
        else:
            flat = torch.empty(zp.padded_numel, dtype=zp.dtype, device=zp.shard.device)
            all_gather_flat(flat, zp.values().to(flat.device), zp.group)
            value = flat[: zp.numel].view(zp.shape).clone()
        out[name] = value
    # Tied parameters appear once in named_parameters(); state_dict() lists every name they are reachable under.
    for name, t in _module(model).state_dict(keep_vars=True).items():
        if name not in out:
            src = next((n for n, p in _named_params(model) if p is t), None)
            out[name] = out[src] if src is not None else t.detach().clone()
    if rank0_only and ctx.rank != 0:
        return {}
    return out
