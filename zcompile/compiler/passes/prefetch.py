"""prefetch: issue each parameter all-gather `prefetch` gathers ahead of its use, so it overlaps compute.

The k-th all-gather (single or bucketed) moves to just before the first wait of gather k-prefetch, i.e. while the
graph waits for one bucket the next `prefetch` are already on the wire; waits stay right before first use. Moving a
gather earlier makes its full parameter live longer: with a `memory_budget`, the pass lowers the distance until the
planned step peak (planner.step_peak: the graph's inputs and liveness-planned transients, plus the resident gradients
and optimizer state) fits, and says so in the dump.
"""
from __future__ import annotations

import torch.fx as fx

from zcompile.compiler.graph import collectives
from zcompile.compiler.planning import liveness, planner
from zcompile.compiler.graph import placement


def _gathers(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if collectives.is_op(n, "all_gather")]


def _apply(gm: fx.GraphModule, distance: int, moved: list) -> None:
    graph = gm.graph
    gathers = _gathers(graph)
    start = next(n for n in graph.nodes if n.op != "placeholder")
    for k, g in enumerate(gathers):
        target = start if k < distance else collectives.wait_of(gathers[k - distance])
        placement.hoist(graph, g, target, moved)


def run(gm: fx.GraphModule, pctx) -> fx.GraphModule:
    distance = pctx.cfg.prefetch
    if distance <= 0 or pctx.kind not in ("forward", "backward", "inference") or not _gathers(gm.graph):
        return gm
    budget = pctx.cfg.memory_budget_bytes(pctx.dist.device)
    state = planner.model_state(list(pctx.params.values()))
    moved: list = []
    while True:  # with a budget, each distance tried is undone before the next (a graph copy each cost more)
        _apply(gm, distance, moved)
        live = liveness.analyze(gm)
        peak = planner.step_peak(state, {pctx.kind: live}, pctx.cfg.accumulate_grads)
        if budget is None or peak <= budget or distance == 0:
            break
        placement.undo(moved)
        distance -= 1
    for g in _gathers(gm.graph):
        collectives.update(g, why=f"{collectives.record(g).why} [prefetched {distance} gather(s) ahead]")
    note = (f"prefetch distance {distance}; planned transient peak {liveness.fmt(live.peak_bytes)}, "
            f"step peak {liveness.fmt(peak)}")
    if budget is not None:
        note += f" (budget {liveness.fmt(budget)}{'' if peak <= budget else ': OVER BUDGET even without prefetch'})"
    gm.meta.setdefault("zc_notes", []).append(f"prefetch: {note}")
    return gm
