"""Per-rank model-state memory: measured bytes of parameters, gradients and optimizer state vs the ZeRO formula.

With fp32 master parameters and Adam's two moments (K=8 bytes/param of optimizer state), P parameters, N ranks:
  stage 0: 4P + 4P + 8P      stage 1: 4P + 4P + 8P/N      stage 2: 4P + (4+8)P/N      stage 3: (4+4+8)P/N = 16P/N
At stage 3, the Pp parameters the planner keeps whole add their full copy: 4(P-Pp)/N + 4Pp + (4+8)P/N.
Mixed precision changes compute dtype only: the persistent state is the same fp32 master, gradient and moments.
hpZ (`hpz_partition_size` G) adds a secondary partition of every gathered parameter, P/G elements in the compute
dtype; it is reported separately and added to the expected bytes.
"""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn as nn

from zcompile.compiler.planning import planner
from zcompile.runtime import nvme_files, shard_store
from zcompile.runtime.cpu_adam import CPUAdam
from zcompile.config import Stage, Tier


def expected_bytes(stage: int, P: int, N: int, persistent: int = 0) -> int:
    param = 4 * P if stage < Stage.PARAMETERS else 4 * (P - persistent) / N + 4 * persistent
    grad = 4 * P if stage < Stage.GRADIENTS else 4 * P / N
    optim = 8 * P if stage < Stage.OPTIMIZER else 8 * P / N
    return int(param + grad + optim)


@dataclasses.dataclass
class MemoryReport:
    rank: int
    world: int
    stage: int
    num_params: int
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    expected: int
    secondary_bytes: int = 0  # hpZ secondary partitions
    host_bytes: int = 0       # offloaded to host memory (not in total)
    nvme_bytes: int = 0       # offloaded to NVMe files (not in total)

    @property
    def total(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optim_bytes + self.secondary_bytes

    @property
    def ratio(self) -> float:
        """Measured over expected bytes; with offload, over every tier (expected is then the planner's)."""
        return (self.total + self.host_bytes + self.nvme_bytes) / max(1, self.expected)

    def __str__(self) -> str:
        mib = 1 / 2**20
        return (f"[rank {self.rank}/{self.world}] stage {self.stage}, P={self.num_params:,}: params "
                f"{self.param_bytes * mib:.2f} MiB + grads {self.grad_bytes * mib:.2f} MiB + optimizer "
                f"{self.optim_bytes * mib:.2f} MiB"
                + (f" + hpZ secondary {self.secondary_bytes * mib:.2f} MiB" if self.secondary_bytes else "")
                + f" = {self.total * mib:.2f} MiB on the device"
                + (f"; offloaded: host {self.host_bytes * mib:.2f} MiB, nvme {self.nvme_bytes * mib:.2f} MiB; all "
                   f"tiers vs planned {self.expected * mib:.2f} MiB (x{self.ratio:.4f})"
                   if self.host_bytes or self.nvme_bytes else
                   f"; ZeRO formula {self.expected * mib:.2f} MiB (x{self.ratio:.4f})"))


def _nbytes(t: torch.Tensor | None) -> int:
    """Bytes this rank holds for `t` (a DTensor's local part)."""
    t = getattr(t, "_local_tensor", t)
    return 0 if t is None else t.numel() * t.element_size()


def _storage_bytes(t: torch.Tensor | None, seen: set) -> int:
    """Bytes of the memory `t` keeps alive, each storage once: a DTensor gradient is a view of the graph's whole
    (stage 1) or padded (stages 2/3) gradient, or of a bucket shared by several parameters."""
    if t is None or t.untyped_storage().data_ptr() in seen:
        return 0
    seen.add(t.untyped_storage().data_ptr())
    return t.untyped_storage().nbytes()


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer) -> MemoryReport:
    """Measure this rank's model-state bytes. Call after an optimizer step (Adam creates its state lazily)."""
    shard_store.adopt_optimizer(optimizer)
    P = param_b = grad_b = host_b = nvme_b = 0
    seen: set = set()
    zps = []
    for p in model.parameters():
        zp = shard_store.owner(p)
        if zp is None:
            raise RuntimeError("memory_report needs a model compiled with backend='zero' that has run a step")
        zps.append(zp)
        P += zp.numel
        if zp.keeps_full:
            param_b += _nbytes(zp.full)  # stage 2's (and a persistent one's) shard is a view into it
        elif zp.stage == Stage.PARAMETERS and zp.param_tier == Tier.DEVICE:
            param_b += _nbytes(zp.shard)
        elif zp.stage == Stage.PARAMETERS:
            host_b += _nbytes(zp.shard) if zp.param_tier == Tier.CPU else 0
            nvme_b += _file_bytes(zp, zp.param_file)
        else:
            param_b += _nbytes(p)
        if zp.param_tier == Tier.DEVICE:
            grad_b += _storage_bytes(zp.gradient(), seen)
        else:
            host_b += _storage_bytes(zp.gradient(), seen)
        host_b += _nbytes(zp.master)
    optim_b = 0
    for zp in zps:
        state = sum(_nbytes(v) for v in optimizer.state.get(zp.optimizer_tensor(), {}).values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        if zp.optim_tier not in (Tier.CPU, Tier.NVME):
            optim_b += state
        else:
            host_b += state
            nvme_b += sum(_file_bytes(zp, f) for f in CPUAdam.moment_files(zp.optimizer_tensor()))
    stage, world = zps[0].stage, zps[0].world
    persistent = sum(zp.numel for zp in zps if zp.stage == Stage.PARAMETERS and zp.persistent)
    secondary = sum(_nbytes(zp._secondary) for zp in zps)
    planned = planner.model_state(zps)
    expected = expected_bytes(stage, P, world, persistent) + planned.secondary
    if host_b or nvme_b:  # offload: compare every tier with the planner's accounting of them
        expected = planned.total + planned.host + planned.nvme
    return MemoryReport(zps[0].rank, world, stage, P, param_b, grad_b, optim_b, expected, secondary, host_b, nvme_b)


def _file_bytes(zp, name: str) -> int:
    """Bytes of an NVMe-tier file less its 4 KiB header (the payload, rounded up to 4 KiB)."""
    if zp.nvme is None or not os.path.exists(zp.nvme.file(name)):
        return 0
    return max(0, os.path.getsize(zp.nvme.file(name)) - nvme_files.BLOCK)
