"""What a rank holds: model-state bytes from the shard layout, the planned step peak, and which parameters stay whole.

Model state per rank assumes fp32 master parameters and an Adam-like optimizer (two fp32 moments per element it
steps), the ZeRO paper's K=8 bytes of optimizer state per parameter on top of 4 for the parameter and 4 for the
gradient. The step peak adds a compiled graph's own peak (its inputs, which include the saved activations for the
backward, plus its transient tensors, from `liveness`) to the resident gradients and optimizer state.
"""
from __future__ import annotations

import dataclasses

from zcompile import liveness
from zcompile.shard_store import ShardedParam

OPTIM_BYTES_PER_ELEMENT = 8  # Adam's exp_avg and exp_avg_sq in fp32


@dataclasses.dataclass
class ModelState:
    param: int
    grad: int
    optim: int
    persistent_params: int = 0  # parameters (elements) kept whole at stage 3
    secondary: int = 0          # hpZ secondary partitions (compute dtype), kept between steps

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optim + self.secondary


def model_state(zps: list[ShardedParam]) -> ModelState:
    """This rank's bytes of parameters, gradients and optimizer state, as `report.memory_report` measures them."""
    param = grad = optim = persistent = secondary = 0
    for zp in zps:
        if zp.secondary_numel and not zp.keeps_full:  # a persistent parameter is never gathered
            secondary += zp.secondary_numel * zp.secondary_dtype.itemsize
        item = zp.dtype.itemsize
        stepped = zp.numel if zp.stage == 0 else zp.shard_numel
        optim += OPTIM_BYTES_PER_ELEMENT * stepped
        grad += item * (zp.numel if zp.stage < 2 else zp.shard_numel)
        if zp.stage == 0:
            param += item * zp.numel
        elif zp.keeps_full:
            param += item * zp.padded_numel
            persistent += zp.numel if zp.stage == 3 else 0
        else:
            param += item * zp.shard_numel
    return ModelState(param, grad, optim, persistent, secondary)


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
