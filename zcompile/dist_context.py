"""The process group zcompile communicates over, and a launcher-friendly initializer."""
from __future__ import annotations

import contextlib
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
    planning: bool = False  # `zcompile plan`: meta tensors, no process group, nothing is communicated

    @staticmethod
    def current() -> "DistContext":
        if _PLANNING is not None:
            return _PLANNING
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


_PLANNING: DistContext | None = None


@contextlib.contextmanager
def planning(world: int, rank: int = 0):
    """Compile for `world` ranks without a process group, on the meta device (see zcompile.plan)."""
    global _PLANNING
    previous, _PLANNING = _PLANNING, DistContext(rank, world, "plan", torch.device("meta"), None, planning=True)
    try:
        yield _PLANNING
    finally:
        _PLANNING = previous


def init_distributed(backend: str | None = None, timeout_s: float = 300.0) -> DistContext:
    """Initialize the default process group from torchrun's environment (or a 1-rank group without one).

    gloo on CPU, NCCL when CUDA is available. The timeout makes a rank whose peers are gone fail instead of hang.
    """
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
