"""Checkpoints: torch.distributed.checkpoint underneath, published atomically, verified before they are read.

`save_checkpoint(directory, model, optimizer)` is `get_state_dict` + `dcp.save` of the module's DTensor parameters
and the optimizer's state (so it loads at another world size or stage), plus what DCP does not keep: each rank's RNG
states (dropout resumes bit for bit at the same world size) and the caller's `extra`. A model with sharded parameters
that are not DTensors (row-tiled, NVMe-offloaded, 0-d) or an optimizer stepping host masters falls back to one file
of shards per rank ("sharded"), which loads only at the world size and stage that wrote it.

A checkpoint directory holds the payload, `rank<r>-of-<N>.pt` per rank and `zcompile.json`: the format, world
size, stages and the size and SHA-256 of every other file. It is written as `<directory>.partial` and published by
renames (`<directory>` -> `<directory>.old`, `.partial` -> `<directory>`, then `.old` removed): a save killed at any
point leaves the previous checkpoint complete under one of the two names, never a mix of steps, and
`load_checkpoint` reads `.old` when `<directory>` is gone. A damaged, truncated or foreign file is a CheckpointError
naming it, on every rank. The directory must be on a file system every rank sees (as DCP needs anyway).

`full_state_dict` gathers every parameter whole, under the names of the uncompiled model, for `model.load_state_dict`
anywhere (no zcompile at all).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.tensor import DTensor

from zcompile import config as zconfig
from zcompile.runtime import shard_store
from zcompile.runtime.dist_context import DistContext, all_gather_flat
from zcompile.errors import CheckpointError
from zcompile.config import Stage

MANIFEST = "zcompile.json"
FORMAT = "zcompile-checkpoint-v2"


def _module(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)


def _named_params(model: nn.Module):
    return list(_module(model).named_parameters())


def _rank_file(rank: int, world: int) -> str:
    return f"rank{rank}-of-{world}.pt"


# -- saving

def save_checkpoint(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    extra: dict | None = None) -> str:
    """Save the model, the optimizer and every rank's RNG state to `directory` (replacing what is there only once
    the new checkpoint is complete). Call on every rank; returns the directory."""
    ctx = DistContext.current()
    directory = os.path.abspath(directory)
    partial = directory + ".partial"
    if ctx.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
        os.makedirs(partial)
    dist.barrier(group=ctx.group)
    if optimizer is not None:
        shard_store.adopt_optimizer(optimizer)
        shard_store.land_delayed_update(optimizer)
    module = _module(model)
    kind = "sharded" if _plain_shards(module) or _steps_other_tensors(module, optimizer) else "dcp"
    mine = {"rng": _rng_state(), "extra": extra or {}}
    if kind == "dcp":
        dcp.save(_dcp_state(module, optimizer), checkpoint_id=partial, process_group=ctx.group)
    else:
        mine.update(_sharded_state(module, optimizer))
    _write_file(os.path.join(partial, _rank_file(ctx.rank, ctx.world)), lambda f: torch.save(mine, f))
    dist.barrier(group=ctx.group)
    files = _checksums(partial, ctx)
    if ctx.rank == 0:
        stages = sorted({int(zp.stage) for _, p in _named_params(model) if (zp := shard_store.owner(p)) is not None})
        manifest = {"format": FORMAT, "kind": kind, "world": ctx.world, "stages": stages,
                    "optimizer": optimizer is not None, "files": files}
        _write_file(os.path.join(partial, MANIFEST), lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        _publish(partial, directory)
    dist.barrier(group=ctx.group)
    return directory


def _steps_other_tensors(module: nn.Module, optimizer) -> bool:
    """The optimizer steps tensors that are not the module's parameters (host masters): DCP cannot map them."""
    params = {id(p) for p in module.parameters()}
    return optimizer is not None and any(id(p) not in params for g in optimizer.param_groups for p in g["params"])


def _dcp_state(module: nn.Module, optimizer) -> dict:
    if optimizer is None:
        return {"model": get_model_state_dict(module)}
    msd, osd = get_state_dict(module, optimizer)
    return {"model": msd, "optim": osd}


def _sharded_state(module: nn.Module, optimizer) -> dict:
    params, stages = {}, set()
    for name, p in module.named_parameters():
        zp = shard_store.owner(p)
        if zp is None:
            raise CheckpointError(f"parameter '{name}' is not managed by zcompile yet: run one forward pass of the "
                                  "compiled model (or load a checkpoint) before saving")
        stages.add(int(zp.stage))  # plain ints: torch.load(weights_only) refuses enums
        params[name] = (_local_values(zp) if zp.stage >= Stage.OPTIMIZER else p.detach()).clone()
    return {"stages": sorted(stages), "params": params,
            "buffers": {n: b.detach().clone() for n, b in module.named_buffers()},
            "optimizer": optimizer.state_dict() if optimizer is not None else None}


def _local_values(zp: shard_store.ShardedParam) -> torch.Tensor:
    return zp.values() if zp.stage >= Stage.GRADIENTS else zp.local_slice()


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _write_file(path: str, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _checksums(directory: str, ctx: DistContext) -> dict:
    """{file: [bytes, sha256]} of every file in `directory`; the ranks share the hashing."""
    names = sorted(n for n in os.listdir(directory) if n != MANIFEST)
    mine = {n: _digest(os.path.join(directory, n)) for n in _my_share(names, ctx)}
    parts: list = [None] * ctx.world
    dist.all_gather_object(parts, mine, group=ctx.group)
    return {n: digest for part in parts for n, digest in part.items()}


def _my_share(names: list, ctx: DistContext) -> list:
    """The files this rank hashes, of the sorted `names` (every k-th)."""
    return sorted(names)[ctx.rank::ctx.world]


def _digest(path: str) -> list:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return [os.path.getsize(path), h.hexdigest()]


def _publish(partial: str, directory: str) -> None:
    """At every moment one complete checkpoint is at `directory` or, only between the two renames, at `.old`."""
    old = directory + ".old"
    if os.path.exists(directory):
        shutil.rmtree(old, ignore_errors=True)  # left by a kill after the renames: `directory` is complete
        os.rename(directory, old)
    # else `.old` may be the only complete checkpoint (a kill between the renames): keep it until this rename
    os.rename(partial, directory)
    shutil.rmtree(old, ignore_errors=True)


# -- loading

def load_checkpoint(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    config=None) -> dict:
    """Load a checkpoint of save_checkpoint into `model` (compiled with backend="zero" or not) and `optimizer`;
    restores this rank's RNG state when the world size is the one that saved; returns the saved `extra`.

    Works before the first forward. Pass the model's `config` (path or mapping) to shard the parameters first, so
    no rank holds whole parameters while loading (and, for a "sharded" checkpoint with offload or tiling, so the
    shards are laid out and placed in their tiers as the compile will expect). Call on every rank.
    """
    ctx = DistContext.current()
    directory = _resolve(os.path.abspath(directory))
    manifest = _verified_manifest(directory, ctx)
    if optimizer is not None and not manifest["optimizer"]:
        raise CheckpointError(f"{directory} was saved without an optimizer: load it with optimizer=None")
    cfg = zconfig.from_options({"config": config}) if config is not None else None
    same_world = manifest["world"] == ctx.world
    mine = _read_rank_file(directory, manifest, ctx.rank if same_world else 0, ctx)
    if manifest["kind"] == "dcp":
        _load_dcp(directory, model, optimizer, cfg, ctx)
    elif not same_world:
        raise CheckpointError(f"{directory} holds parameters that are not DTensors (tiled or NVMe-offloaded), saved "
                              f"by {manifest['world']} ranks: it loads only at that world size, not {ctx.world} -- "
                              "use full_state_dict() to move between world sizes")
    else:
        _load_sharded(directory, mine, model, optimizer, cfg, ctx)
    if same_world:
        torch.set_rng_state(mine["rng"]["cpu"])
        if "cuda" in mine["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(mine["rng"]["cuda"])
    dist.barrier(group=ctx.group)
    return mine["extra"]


def _resolve(directory: str) -> str:
    if os.path.isfile(os.path.join(directory, MANIFEST)):
        return directory
    if os.path.isfile(os.path.join(directory + ".old", MANIFEST)):  # a save was killed between its two renames
        return directory + ".old"
    if os.path.isdir(directory):
        raise CheckpointError(f"{directory} is not a zcompile checkpoint (no {MANIFEST}); a directory written by "
                              "dcp.save alone loads with torch.distributed.checkpoint")
    left = " (an interrupted save left only its .partial)" if os.path.isdir(directory + ".partial") else ""
    raise CheckpointError(f"no checkpoint at {directory}{left}")


def _verified_manifest(directory: str, ctx: DistContext) -> dict:
    """The manifest, after every rank checked its share of the files; any problem is raised on every rank."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}, expected {FORMAT!r}")
        problems = []
        for name in _my_share(list(manifest["files"]), ctx):
            size, digest = manifest["files"][name]
            file = os.path.join(directory, name)
            if not os.path.isfile(file):
                problems.append(f"{file} is missing")
            elif _digest(file) != [size, digest]:
                problems.append(f"{file} is damaged (its size or SHA-256 differs from {MANIFEST})")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        problems = [f"{path} is not a readable zcompile manifest: {e}"]
    found: list = [None] * ctx.world
    dist.all_gather_object(found, problems, group=ctx.group)
    problems = sorted({p for part in found for p in part})
    if problems:
        raise CheckpointError("cannot load the checkpoint: " + "; ".join(problems))
    return manifest


def _read_rank_file(directory: str, manifest: dict, rank: int, ctx: DistContext) -> dict:
    """A rank file's contents: what was saved on the host stays on the host (RNG states, host tensors in the
    caller's `extra`, as torch.load returns them), what was saved on an accelerator comes to this rank's device
    (another rank's file when the world size changed)."""
    path = os.path.join(directory, _rank_file(rank, manifest["world"]))
    return torch.load(path, map_location=_HostStaysHost(ctx.device), weights_only=True)


class _HostStaysHost(dict):
    """torch.load's map_location: a host location stays, any other becomes `device`. A dict, not a function:
    torch.load takes no function for tensor subclasses (DTensor) and asks a dict's `get` for each location."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = str(device)

    def get(self, location, default=None):
        return location if str(location) == "cpu" else self.device


def _load_dcp(directory: str, model: nn.Module, optimizer, cfg, ctx: DistContext) -> None:
    module = _module(model)
    if cfg is not None:
        from zcompile.runtime.dtensor_params import shard_parameters
        shard_parameters(module, cfg)
    if optimizer is not None:
        shard_store.adopt_optimizer(optimizer)  # built on the parameters the DTensors replaced
    plain = _plain_shards(module)
    if any(zp.param.untyped_storage().nbytes() == 0 for zp in plain if zp.stage == Stage.PARAMETERS):
        raise CheckpointError(f"{directory}: this model's tiled or NVMe-offloaded parameters already gave their values "
                              "to the shards; load a torch.distributed.checkpoint checkpoint into it before its first "
                              "forward")
    if _steps_other_tensors(module, optimizer):
        raise CheckpointError(f"{directory}: the optimizer steps tensors that are not the module's parameters (host "
                              "masters); load it before the first forward (build the optimizer on model.parameters())")
    state = _dcp_state(module, optimizer)
    dcp.load(state, checkpoint_id=directory, process_group=ctx.group)
    if optimizer is None:
        set_model_state_dict(module, state["model"])
    else:
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for p in module.parameters():  # DCP may write local tensors without bumping version counters
        if (zp := shard_store.owner(p)) is not None:
            zp.written = True
    with torch.no_grad():
        for zp in plain:  # registered from the values before loading: take the loaded ones
            if zp.stage >= Stage.GRADIENTS:
                zp.load_rows(zp.param.detach().reshape(-1)[zp.lo:zp.hi])


def _plain_shards(module: nn.Module) -> list:
    """ShardedParams of the module's parameters that are sharded (stages 1-3) but not DTensors."""
    return [zp for p in module.parameters() if not isinstance(p, DTensor)
            and (zp := shard_store.owner(p)) is not None and zp.stage >= Stage.OPTIMIZER]


def _load_sharded(directory: str, state: dict, model: nn.Module, optimizer, cfg, ctx: DistContext) -> None:
    path = os.path.join(directory, _rank_file(ctx.rank, ctx.world))
    (ckpt_stage,) = state["stages"]
    names = {n for n, _ in _named_params(model)}
    if names != set(state["params"]):
        raise CheckpointError(f"{path} does not match the model: missing {sorted(names - set(state['params']))}, "
                              f"unexpected {sorted(set(state['params']) - names)}")
    with torch.no_grad():
        for name, p in _named_params(model):
            zp = (shard_store.register(p, ckpt_stage, ctx) if cfg is None else
                  shard_store.register(p, ckpt_stage, ctx, cfg.offload, shard_store.row_multiple(cfg, p),
                                       compute_dtype=shard_store.compute_dtype(cfg, p)))
            value = state["params"][name]
            target = p if zp.stage == Stage.DDP else _local_values(zp)
            if target.shape != value.shape:
                raise CheckpointError(f"{path}: '{name}' holds shape {tuple(value.shape)}, expected "
                                      f"{tuple(target.shape)} (a checkpoint of a tiled model loads with "
                                      "load_checkpoint(..., config=) of it)")
            if zp.stage >= Stage.GRADIENTS:
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


# -- consolidated export

def full_state_dict(model: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (plus buffers), keyed like the uncompiled model. Call on every rank."""
    ctx = DistContext.current()
    out: dict[str, torch.Tensor] = {}
    shard_store.refresh_stale([zp for _, p in _named_params(model) if (zp := shard_store.owner(p)) is not None])
    for name, p in _named_params(model):
        zp = shard_store.owner(p)
        if zp is None or zp.stage == Stage.DDP:
            value = p.detach().clone()
        elif zp.keeps_full:
            value = zp.full_view().clone()
        else:
            # on the group's device: a host-offloaded shard under NCCL is gathered through the GPU
            flat = torch.empty(zp.padded_numel, dtype=zp.dtype, device=ctx.device)
            all_gather_flat(flat, zp.values().to(flat.device), zp.group)
            value = flat[: zp.numel].view(zp.shape).to(zp.shard.device, copy=True)
        out[name] = value
    # Tied parameters appear once in named_parameters(); state_dict() lists every name they are reachable under.
    for name, t in _module(model).state_dict(keep_vars=True).items():
        if name not in out:
            src = next((n for n, p in _named_params(model) if p is t), None)
            out[name] = out[src] if src is not None else t.detach().clone()
    if rank0_only and ctx.rank != 0:
        return {}
    return out
