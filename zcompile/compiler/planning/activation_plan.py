"""The ways out for each saved activation under a memory budget, applying the planner's choice, and its report.

A saved activation (a forward value the backward reads) can be kept, recomputed in the backward from values the
backward receives anyway (`recompute`), or, on an accelerator, copied to the host after the forward and back before
its first use (the offload_activations pass). Each comes with its cost by the cost model (timeline.CostModel):
recompute, the ops run again; offload, the two copies over the host link. On a CPU the host is the device: offload
frees nothing there and is not offered. planner.choose_activations picks among the cheapest ways out.
"""
from __future__ import annotations

import collections
import dataclasses

import torch
import torch.fx as fx

from zcompile.compiler.planning import liveness, recompute, timeline
from zcompile.compiler.planning.planner import ActivationChoice


def _group(node: fx.Node, action: str, ops: int) -> tuple:
    """The same work in another block: same op, shape, dtype and way out (so identical blocks stay identical)."""
    val = node.meta["val"]
    return (action, str(node.target), tuple(val.shape), str(val.dtype), ops)


def options(fw: fx.GraphModule, num_fwd_outputs: int, cost: timeline.CostModel, device: torch.device,
            offload_min_bytes: int) -> tuple[list[ActivationChoice], list[ActivationChoice]]:
    """Per saved storage of the partitioned forward `fw`, its cheapest way out alone (with every other saved value
    kept); and those without one (kept). Saved values on one storage (attention's output and the view of it the
    output projection reads) go out together: one alone frees nothing while the other keeps the storage."""
    saved_nodes = list(dict.fromkeys(n for n in recompute.saved_values(fw, num_fwd_outputs) if isinstance(n, fx.Node)))
    saved = {n.name for n in saved_nodes}
    # recompute.kept_storages of every other saved value, from one count instead of a scan of the graph per value
    held = collections.Counter(recompute.storage_of(n) for n in saved_nodes if n.op != "placeholder")
    held.pop(None, None)
    sharing = collections.defaultdict(list)
    for node in recompute.saved_tensors(fw, num_fwd_outputs):
        sharing[recompute.storage_of(node)].append(node)
    ways, kept = [], []
    for mine, members in sharing.items():
        node, names = members[0], {n.name for n in members}
        shape, size = tuple(node.meta["val"].shape), recompute.nbytes(node)
        others = {s for s, k in held.items() if k > (len(members) if s == mine else 0)}
        chains = [recompute.chain(fw, n, saved - names, others) for n in members]
        found = []
        if mine not in others and all(c is not None for c in chains):
            # a storage another saved value keeps (a view's base) is freed by neither, and costs nothing to save
            leaves = list(dict.fromkeys(leaf for c in chains for leaf in c.leaves))
            ops = list(dict.fromkeys(op for c in chains for op in c.ops))
            freed = size - sum(recompute.nbytes(n) for n in
                               {recompute.storage_of(leaf): leaf for leaf in leaves
                                if recompute.storage_of(leaf) not in others}.values())
            if freed > 0:
                extra = f"; saves {', '.join(n.name for n in leaves)} instead" if leaves else ""
                found.append(ActivationChoice(
                    node.name, shape, size, "recompute", sum(timeline.op_seconds(n, cost) for n in ops),
                    f"{len(ops)} op(s) ending {', '.join(n.name for n in ops[-3:])}{extra}",
                    _group(node, "recompute", len(ops)), freed, tuple(n.name for n in members[1:])))
        # offload copies a value: one whose storage other saved values share is not offered
        if device.type != "cpu" and size >= offload_min_bytes and len(members) == 1 and mine not in others:
            found.append(ActivationChoice(node.name, shape, size, "offload", 2 * size / cost.host_bytes_per_s,
                                          "to the host after the forward, back before its first use",
                                          _group(node, "offload", 0), size))
        if found:
            ways.append(min(found, key=lambda c: c.cost_s))
        else:
            kept.append(ActivationChoice(node.name, shape, size, also=tuple(n.name for n in members[1:])))
    return ways, kept


def apply(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, chosen: list[ActivationChoice],
          cost: timeline.CostModel) -> tuple[list[ActivationChoice], float]:
    """Rewrite the partition for the chosen recomputes (offloads are the offload_activations pass's). Returns the
    choices in effect (a recompute whose chain the others made impossible stays saved; an offload whose storage a
    saved value keeps is not made) and the seconds the recomputed ops add (an op shared by several recomputed values
    counts once)."""
    done, seconds = recompute.apply(fw, bw, num_fwd_outputs,
                                    {n for c in chosen if c.action == "recompute" for n in c.names}, cost)
    offload = {c.name for c in chosen if c.action == "offload"}
    # an offload frees nothing where another saved value (a recompute's new input) keeps its storage on the device
    held = recompute.kept_storages(fw, {n.name for n in recompute.saved_values(fw, num_fwd_outputs)
                                        if isinstance(n, fx.Node)} - offload)
    nodes = {n.name: n for n in fw.graph.nodes}
    return [c for c in chosen if (set(c.names) <= done if c.action == "recompute" else
                                  c.name in nodes and recompute.storage_of(nodes[c.name]) not in held)], seconds


def report(every: list[ActivationChoice], chosen: list[ActivationChoice], recompute_s: float, peak: int,
           planned: int, budget: int) -> list[str]:
    """A summary line, then one line per saved activation (the decision and its cost), for the dumps and plan."""
    f = liveness.fmt
    by_name = {c.name: c for c in chosen}
    lines = [by_name[c.name].line() if c.name in by_name else dataclasses.replace(c, action="keep").line()
             for c in every]
    parts = []
    for action in ("recompute", "offload"):
        mine = [c for c in chosen if c.action == action]
        if mine:
            seconds = recompute_s if action == "recompute" else sum(c.cost_s for c in mine)
            parts.append(f"{action} {len(mine)} ({f(sum(c.nbytes for c in mine))}, +{seconds * 1e3:.2f} ms)")
    kept = [c for c in every if c.name not in by_name]
    parts.append(f"keep {len(kept)} ({f(sum(c.nbytes for c in kept))})")
    head = (f"activation plan: memory_budget {f(budget)}, planned step peak {f(peak)} with every saved activation "
            f"kept; " + ", ".join(parts) + f" (added time by the cost model): planned step peak {f(planned)}"
            + ("" if planned <= budget else ", over the budget: the smallest plan found"))
    return [head] + ["  " + line for line in lines]


def partition_report(fw: fx.GraphModule, bw: fx.GraphModule, fw_b: fx.GraphModule, bw_b: fx.GraphModule,
                     num_fwd_outputs: int, fraction: float, cost: timeline.CostModel, peak: int, planned: int,
                     budget: int) -> list[str]:
    """The knapsack's decisions (activation_search's _knapsack_partition): what it no longer saves at `fraction`
    (`fw_b`, `bw_b`) against the default partition (`fw`, `bw`), what it saves instead, and the backward's added time
    by the cost model. A summary line, then one line per saved activation of either, as report() gives them."""
    f = liveness.fmt
    before = {n.name: n for n in recompute.saved_tensors(fw, num_fwd_outputs)}
    after = {n.name: n for n in recompute.saved_tensors(fw_b, num_fwd_outputs)}

    def seconds(gm):
        return sum(timeline.op_seconds(n, cost) for n in gm.graph.nodes if n.op == "call_function")

    added = seconds(bw_b) - seconds(bw)
    dropped = [n for name, n in before.items() if name not in after]
    new = [n for name, n in after.items() if name not in before]
    lines = [f"  recompute {n.name} {list(n.meta['val'].shape)} {f(recompute.nbytes(n))}" for n in dropped]
    lines += [f"  keep      {n.name} {list(n.meta['val'].shape)} {f(recompute.nbytes(n))}" for n in after.values()]
    head = (f"activation plan: memory_budget {f(budget)}, planned step peak {f(peak)} with every saved activation "
            f"kept; the partitioner's recompute knapsack (activation_memory_budget {fraction:.3g}) recomputes "
            f"{len(dropped)} ({f(sum(map(recompute.nbytes, dropped)))}) and saves {len(new)} other(s) "
            f"({f(sum(map(recompute.nbytes, new)))}), +{added * 1e3:.2f} ms in the backward (added time by the "
            f"cost model): planned step peak {f(planned)}")
    return [head] + lines
