"""Emitting functional collectives into FX graphs, each annotated with what it moves and why.

Every collective is `torch.ops._c10d_functional.<op>` followed by `wait_tensor`, so inductor keeps it in the compiled
graph and a dump shows exactly where it is issued and where it is waited on.

All-gathers use the `_out` variant into a buffer the graph allocates: the plain functional all-gather goes through
`allgather_into_tensor_coalesced`, which in gloo (torch 2.13) corrupts the heap once two are in flight (prefetch);
the `_out` variant uses `_allgather_base`, as FSDP2 does. tests/test_collectives.py checks the `_out` path under prefetch-like concurrency.
"""
from __future__ import annotations

import collections
import operator

import torch
import torch.fx as fx

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
COLLECTIVE_OPS = {
    c10d.all_gather_into_tensor_out.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_reduce.default: "all_reduce",
}


def _annotate(node: fx.Node, op: str, nbytes: int, group: str, why: str, numel: int,
              dtype: torch.dtype | None = None) -> None:
    node.meta["zc_comm"] = {"op": op, "bytes": int(nbytes), "group": group, "why": why, "numel": int(numel),
                            "dtype": dtype}


def all_gather(graph: fx.Graph, shard: fx.Node, numel: int, dtype: torch.dtype, world: int, group: str,
               why: str) -> fx.Node:
    """All-gather a flat [numel] shard into a flat [world*numel] tensor; returns the wait node."""
    out = graph.call_function(aten.new_empty.default, (shard, [world * numel]))
    ag = graph.call_function(c10d.all_gather_into_tensor_out.default, (shard, world, group), {"out": out})
    _annotate(ag, "all_gather", numel * world * dtype.itemsize, group, why, numel * world, dtype)
    return graph.call_function(c10d.wait_tensor.default, (ag,))


def reduce_scatter(graph: fx.Graph, flat: fx.Node, numel: int, dtype: torch.dtype, world: int, group: str,
                   why: str) -> fx.Node:
    """Sum-reduce-scatter a flat [numel] tensor (numel divisible by world); returns the wait node."""
    rs = graph.call_function(c10d.reduce_scatter_tensor.default, (flat, "sum", world, group))
    _annotate(rs, "reduce_scatter", numel * dtype.itemsize, group, why, numel, dtype)
    return graph.call_function(c10d.wait_tensor.default, (rs,))


def all_reduce(graph: fx.Graph, tensor: fx.Node, numel: int, dtype: torch.dtype, group: str, why: str) -> fx.Node:
    ar = graph.call_function(c10d.all_reduce.default, (tensor, "sum", group))
    _annotate(ar, "all_reduce", numel * dtype.itemsize, group, why, numel, dtype)
    return graph.call_function(c10d.wait_tensor.default, (ar,))


def waits_of(node: fx.Node) -> list[fx.Node]:
    """The wait_tensor nodes of a collective (directly, or through getitem for coalesced ones)."""
    waits = []
    for u in node.users:
        if u.target is c10d.wait_tensor.default:
            waits.append(u)
        elif u.target is operator.getitem:
            waits.extend(w for w in u.users if w.target is c10d.wait_tensor.default)
    return waits


def wait_of(node: fx.Node) -> fx.Node:
    """The single wait_tensor of a (non-coalesced) collective."""
    (wait,) = node.users
    assert wait.target is c10d.wait_tensor.default, wait
    return wait


def replace_gather(graph: fx.Graph, ag: fx.Node, value: fx.Node) -> None:
    """Let `value` stand for what all-gather `ag` produced; erase `ag`, its wait and its output buffer."""
    wait = wait_of(ag)
    wait.replace_all_uses_with(value)
    graph.erase_node(wait)
    buf = ag.kwargs["out"]
    graph.erase_node(ag)
    graph.erase_node(buf)


def limit_in_flight(graph: fx.Graph, ops: tuple[str, ...]) -> None:
    """Wait for each collective of `ops` right before the next one is issued (one in flight), so its input buffer
    is released as the graph goes instead of at the end."""
    colls = [n for n in graph.nodes if n.meta.get("zc_comm", {}).get("op") in ops]
    order = {n: k for k, n in enumerate(graph.nodes)}
    for cur, nxt in zip(colls, colls[1:]):
        for w in waits_of(cur):
            if order[w] > order[nxt]:
                src = w.args[0]
                if src is not cur and order[src] > order[nxt]:  # getitem of a coalesced collective
                    nxt.prepend(src)
                nxt.prepend(w)
                w.meta["zc_note"] = "wait before the next reduction is issued (one in flight)"


def schedule(gm: fx.GraphModule) -> list[dict]:
    """The collectives of a graph in issue order, as recorded by the passes."""
    return [dict(n.meta["zc_comm"], node=n.name) for n in gm.graph.nodes if "zc_comm" in n.meta]


def mark_cross_node(gm: fx.GraphModule, topology, group_ranks) -> None:
    """Record on every collective whether its group spans more than one node."""
    cross = topology.crosses_nodes(group_ranks)
    for n in gm.graph.nodes:
        if "zc_comm" in n.meta:
            n.meta["zc_comm"]["cross_node"] = cross


# Bytes of every collective this process issued (compiled graphs and optimizer-step refreshes), by op; and the part
# of them whose group spans nodes.
TRAFFIC: collections.Counter = collections.Counter()
CROSS_NODE: collections.Counter = collections.Counter()


def count(sched: list[dict]) -> None:
    for c in sched:
        TRAFFIC[c["op"]] += c["bytes"]
        if c.get("cross_node"):
            CROSS_NODE[c["op"]] += c["bytes"]


def traffic(cross_node: bool = False) -> dict[str, int]:
    """Collective bytes issued by this process since the last reset_traffic(), by op (only those whose group spans
    nodes with cross_node=True; see the `ranks_per_node` config key)."""
    return dict(CROSS_NODE if cross_node else TRAFFIC)


def reset_traffic() -> None:
    TRAFFIC.clear()
    CROSS_NODE.clear()
