"""What a rank holds: model-state bytes from the shard layout, the planned step peak, and which parameters stay whole.

Model state per rank assumes fp32 master parameters and an Adam-like optimizer (two fp32 moments per element it
steps), the ZeRO paper's K=8 bytes of optimizer state per parameter on top of 4 for the parameter and 4 for the
gradient. The step peak adds a compiled graph's own peak (its inputs, which include the saved activations for the
backward, plus its transient tensors, from `liveness`) to the resident gradients and optimizer state.

With offload, only device-resident bytes count against the budget: `ModelState.param/grad/optim` are what stays on
the device, `host` and `nvme` what the offload tiers hold (a master copy, moments, shards, their gradients).
"""
from __future__ import annotations

import dataclasses

from zcompile.compiler import liveness
from zcompile.runtime.shard_store import ShardedParam
from zcompile.config import Stage, Tier

OPTIM_BYTES_PER_ELEMENT = 8  # Adam's exp_avg and exp_avg_sq in fp32


@dataclasses.dataclass
class ModelState:
    param: int
    grad: int
    optim: int
    persistent_params: int = 0  # parameters (elements) kept whole at stage 3
    secondary: int = 0          # hpZ secondary partitions (compute dtype), kept between steps
    host: int = 0               # offloaded to host memory
    nvme: int = 0               # offloaded to NVMe files

    @property
    def total(self) -> int:
        """Device-resident bytes."""
        return self.param + self.grad + self.optim + self.secondary


def model_state(zps: list[ShardedParam]) -> ModelState:
    """This rank's bytes of parameters, gradients and optimizer state, as `report.memory_report` measures them:
    device-resident in param/grad/optim/secondary, offloaded in host/nvme."""
    param = grad = optim = persistent = secondary = host = nvme = 0
    for zp in zps:
        if zp.secondary_numel and not zp.keeps_full:  # a persistent parameter is never gathered
            secondary += zp.secondary_numel * zp.secondary_dtype.itemsize
        item = zp.dtype.itemsize
        stepped = zp.numel if zp.stage == Stage.DDP else zp.shard_numel
        p_bytes = item * (zp.numel if zp.stage == Stage.DDP else zp.padded_numel if zp.keeps_full else zp.shard_numel)
        g_bytes = item * (zp.numel if zp.stage < Stage.GRADIENTS else zp.shard_numel)
        o_bytes = OPTIM_BYTES_PER_ELEMENT * stepped
        if zp.keeps_full and zp.stage == Stage.PARAMETERS:
            persistent += zp.numel
        if zp.param_tier != Tier.DEVICE:  # the shard and its gradient live in the tier, stepped there
            host += g_bytes + (p_bytes if zp.param_tier == Tier.CPU else 0)
            nvme += p_bytes if zp.param_tier == Tier.NVME else 0
            p_bytes = g_bytes = 0
        if zp.optim_tier in (Tier.CPU, Tier.NVME):  # "auto" before the planner decides: on the device
            host += o_bytes if zp.optim_tier == Tier.CPU else 0
            nvme += o_bytes if zp.optim_tier == Tier.NVME else 0
            host += 4 * stepped if zp.param_tier == Tier.DEVICE else 0  # the fp32 master the optimizer steps
            o_bytes = 0
        param, grad, optim = param + p_bytes, grad + g_bytes, optim + o_bytes
    return ModelState(param, grad, optim, persistent, secondary, host, nvme)


def graph_peak(live: liveness.Liveness) -> int:
    """A compiled graph's planned peak: everything it takes as input plus its transient tensors at their peak."""
    return live.input_bytes + live.peak_bytes


def step_peak(state: ModelState, graphs: dict[str, liveness.Liveness]) -> int:
    """Planned per-rank peak of one training step. Parameters (shards or whole) are graph inputs, so of the model
    state only gradients and optimizer state are added; conservative: gradients count as alive throughout."""
    return state.grad + state.optim + max((graph_peak(g) for g in graphs.values()), default=0)


def choose_persistent(candidates: list[ShardedParam], threshold_bytes: int, headroom_bytes: int | None
                      ) -> tuple[list[ShardedParam], str]:
    """Stage-3 parameters to keep whole: every one at or below `threshold_bytes`, then, if a memory budget leaves
    `headroom_bytes`, more in order of size (a small parameter costs the most per byte to gather: its all-gather is
    latency-bound) while their extra copies fit. Returns the choice and an explanation for the dumps."""
    def extra(zp):  # a whole copy instead of a shard
        return (zp.padded_numel - zp.shard_numel) * zp.dtype.itemsize

    chosen = [zp for zp in candidates if zp.numel * zp.dtype.itemsize <= threshold_bytes]
    why = [f"{len(chosen)} param(s) at or below persist_threshold {liveness.fmt(threshold_bytes)}"]
    if headroom_bytes is not None:
        left = headroom_bytes - sum(map(extra, chosen))
        by_budget = []
        for zp in sorted((zp for zp in candidates if zp not in chosen), key=lambda zp: zp.numel):
            if extra(zp) > left:
                break
            left -= extra(zp)
            by_budget.append(zp)
        chosen += by_budget
        why.append(f"{len(by_budget)} more that fit the memory budget's headroom of {liveness.fmt(headroom_bytes)}")
    cost = sum(map(extra, chosen))
    return chosen, f"persist: kept {len(chosen)} param(s) whole (+{liveness.fmt(cost)} per rank): " + "; ".join(why)
