"""The process group zcompile communicates over, and a launcher-friendly initializer."""
from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class DistContext:
    rank: int
    world: int
    group_name: str
    device: torch.device
    group: object = dataclasses.field(compare=False, repr=False, default=None)

    @staticmethod
    def current() -> "DistContext":
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "zcompile needs an initialized torch.distributed process group before the first forward: call "
                "zcompile.init_distributed() (reads torchrun's RANK/WORLD_SIZE, defaults to a 1-rank group) or "
                "torch.distributed.init_process_group() yourself")
        group = dist.group.WORLD
        backend = dist.get_backend(group)
        if backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        return DistContext(dist.get_rank(), dist.get_world_size(), group.group_name, device, group)

    @staticmethod
    def without_group(world: int, rank: int = 0) -> "DistContext":
        """`world` ranks on the meta device and no process group: what a compile that is never committed (zcompile
        plan, single-process pass tests) sees."""
        return DistContext(rank, world, "plan", torch.device("meta"), None)


def init_distributed(backend: str | None = None, timeout_s: float | None = None, config=None) -> DistContext:
    """Initialize the default process group from torchrun's environment (or a 1-rank group without one).

    gloo on CPU, NCCL when CUDA is available. The timeout makes a rank whose peers are gone fail instead of hang:
    `timeout_s`, else the `collective_timeout_s` of `config` (a path, a mapping or a Config), else 300 s. Whatever it
    starts with, the first compile sets the group's timeout to its config's `collective_timeout_s`.
    """
    if timeout_s is None:
        from zcompile import config as zconfig
        timeout_s = zconfig.from_options({"config": config}).collective_timeout_s if config is not None else 300.0
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return DistContext.current()


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group=None) -> None:
    """Eager all-gather of equal flat shards (outside compiled graphs: optimizer-step refresh, checkpoints)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed after torch 2.11
    gather(output, shard, group=group)


def set_group_timeout(ctx: DistContext, seconds: float) -> None:
    """Make `collective_timeout_s` govern the group zcompile communicates over (and its host group), however it was
    created (a group the user made with another timeout gets this one from the first compile on)."""
    if ctx.group is not None:
        for group in (ctx.group, _HOST_GROUPS.get(ctx.group_name)):
            if group is not None:
                dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)


_HOST_GROUPS: dict[str, object] = {}  # cache: group name -> a gloo group over the same ranks (NCCL jobs)


def host_group(ctx: DistContext, timeout_s: float):
    """A group that communicates CPU tensors over the same ranks as ctx.group: the group itself under gloo; under
    NCCL a gloo group made once (every rank reaches it at its first compile), so small checks add no GPU sync."""
    if dist.get_backend(ctx.group) == "gloo":
        return ctx.group
    if ctx.group_name not in _HOST_GROUPS:
        _HOST_GROUPS[ctx.group_name] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return _HOST_GROUPS[ctx.group_name]
