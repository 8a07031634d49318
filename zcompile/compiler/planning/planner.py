"""What a rank holds: model-state bytes from the shard layout, the planned step peak, and which parameters stay whole.

Model state per rank assumes fp32 master parameters and an Adam-like optimizer (two fp32 moments per element it
steps), the ZeRO paper's K=8 bytes of optimizer state per parameter on top of 4 for the parameter and 4 for the
gradient. The step peak adds a compiled graph's own peak (its inputs, which include the saved activations for the
backward, plus its transient tensors, from `liveness`) to the resident optimizer state, and to the gradients where
they are resident while the graphs run (accumulated over micro-batches); the optimizer's step holds the parameters,
their gradients and its state.

With offload, only device-resident bytes count against the budget: `ModelState.param/grad/optim` are what stays on
the device, `host` and `nvme` what the offload tiers hold (a master copy, moments, shards, their gradients).
"""
from __future__ import annotations

import dataclasses

from zcompile.compiler.planning import liveness
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


def _while_running(state: ModelState, live: liveness.Liveness) -> int:
    """A graph's peak with the parameters it does not read, which stay resident (stage 2 keeps every whole
    parameter; a backward need not read all of them)."""
    return graph_peak(live) + max(0, state.param - live.param_bytes)


def step_peak(state: ModelState, graphs: dict[str, liveness.Liveness], accumulate: bool = True) -> int:
    """Planned per-rank peak of one training step: the optimizer state, plus the largest of a graph's peak and the
    optimizer step's parameters and gradients. Parameters (shards or whole) are graph inputs. Gradients that
    accumulate (`accumulate`, the config's default) are resident throughout, beside the backward's new ones; a step
    starting without gradients (zero_grad sets them to None) has none while the forward runs, and the backward's
    gradient outputs, counted in its peak, become them."""
    graph = max((_while_running(state, g) for g in graphs.values()), default=0)
    return state.optim + max(graph + (state.grad if accumulate else 0), state.param + state.grad)


def peak_terms(state: ModelState, graphs: dict[str, liveness.Liveness], accumulate: bool = True
               ) -> tuple[str | None, list[tuple[str, int]]]:
    """What step_peak adds up where the step peaks: the graph kind there (None: the optimizer step) and the model
    state beside that graph's own peak, as (what, bytes)."""
    kind = max(graphs, key=lambda k: _while_running(state, graphs[k]), default=None)
    terms = [("optimizer state", state.optim)]
    if kind is None or _while_running(state, graphs[kind]) + (state.grad if accumulate else 0) < \
            state.param + state.grad:
        return None, terms + [("parameters", state.param), ("gradients", state.grad)]
    unread = max(0, state.param - graphs[kind].param_bytes)
    return kind, (terms + ([("gradients", state.grad)] if accumulate else [])
                  + ([("parameters it does not read", unread)] if unread else []))


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


@dataclasses.dataclass
class ActivationChoice:
    """What happens to one saved activation between the forward and the backward, and what it costs."""
    name: str
    shape: tuple
    nbytes: int
    action: str = "keep"      # "keep", "recompute" (in the backward) or "offload" (to the host and back)
    cost_s: float = 0.0       # added step time by the cost model (timeline.CostModel)
    detail: str = ""          # the ops recomputed, or the copies made
    group: tuple = ()         # choices that are the same work in another block are made together
    freed: int = 0            # bytes the way out frees (a recompute may save a smaller input instead)
    also: tuple = ()          # other saved values on the same storage, which go with this one

    @property
    def names(self) -> tuple:
        return (self.name,) + self.also

    def line(self) -> str:
        name = self.name + "".join(f" (+{n})" for n in self.also)
        what = f"{self.action:<9} {name} {list(self.shape)} {liveness.fmt(self.nbytes)}"
        return what + (f": +{self.cost_s * 1e3:.3f} ms ({self.detail})" if self.action != "keep" else "")


SCAN_BELOW_ALL = 8  # where recomputing every candidate does not fit, the group counts below it tried


def choose_activations(options: list[ActivationChoice], peak_of, budget: int) -> tuple[list[ActivationChoice], int]:
    """Under `budget`, the saved activations to recompute or offload: each candidate comes with its cheapest way
    out (`options`: action, cost and the bytes it frees), taken in order of cost per byte freed, a group at a time,
    and the fewest groups whose planned step peak (`peak_of(chosen)`, measured on the rewritten graphs) fits are
    chosen (bisection: the peak falls as groups are added). Where all of them do not fit, up to SCAN_BELOW_ALL
    fewer counts are tried: the bisection goes on below the first that fits, else the count with the lowest peak
    is the smallest plan. Returns the chosen ones and their peak."""
    ranked = sorted(options, key=lambda c: c.cost_s / max(c.freed, 1))
    groups: list[list[ActivationChoice]] = []
    for c in ranked:
        if groups and groups[-1][0].group == c.group:
            groups[-1].append(c)
        else:
            groups.append([c])

    def first(g: int) -> list[ActivationChoice]:
        return [c for grp in groups[:g] for c in grp]

    lo, hi = 0, len(groups)
    peak = peak_of(first(hi))
    if peak > budget:  # the peak need not fall with every group (shared recomputed ops live longer): fewer
        best = (peak, hi)
        for g in range(hi - 1, max(0, hi - SCAN_BELOW_ALL) - 1, -1):
            p = peak_of(first(g))
            best = min(best, (p, g))
            if p <= budget:
                break
        if best[0] > budget:
            return first(best[1]), best[0]
        peak, hi = best
    while hi - lo > 1:  # peak(lo) over the budget, peak(hi) within it
        mid = (lo + hi) // 2
        p = peak_of(first(mid))
        if p <= budget:
            hi, peak = mid, p
        else:
            lo = mid
    return first(hi), peak


def step_peak_at(state: ModelState, candidates: list, sizes: dict, accumulate: bool = True) -> int:
    """step_peak from liveness.peak_exprs candidates (all graphs'), at `sizes` (sympy symbol -> value)."""
    graph = max(int(e.xreplace(sizes)) for e in candidates)
    return state.optim + max(graph + (state.grad if accumulate else 0), state.param + state.grad)


def largest_fitting(state: ModelState, candidates: list, budget: int, symbol, fixed: dict, limit: int,
                    accumulate: bool = True) -> tuple[int, int | None, int | None]:
    """The largest value of `symbol` (the others at `fixed`) up to `limit` whose planned step peak fits `budget`:
    (value, its peak, the peak one above it, None at the limit); value 0 where even 1 does not fit. The peak grows
    with every size (no tensor shrinks as a batch or sequence grows), so a doubling then bisection finds it."""
    def peak(v: int) -> int:
        return step_peak_at(state, candidates, {**fixed, symbol: v}, accumulate)

    if peak(1) > budget:
        return 0, None, peak(1)
    lo, hi = 1, 2
    while hi <= limit and peak(hi) <= budget:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # peak(lo) fits, hi does not (or is past the limit)
        mid = (lo + hi) // 2
        if peak(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo, peak(lo), peak(lo + 1) if lo < limit else None
