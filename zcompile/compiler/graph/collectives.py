"""Emitting functional collectives into FX graphs, each annotated with what it moves and why.

Every collective is `torch.ops._c10d_functional.<op>` followed by `wait_tensor`, so inductor keeps it in the compiled
graph and a dump shows exactly where it is issued and where it is waited on.

All-gathers use the `_out` variant into a buffer the graph allocates: the plain functional all-gather goes through
`allgather_into_tensor_coalesced`, which in gloo (torch 2.13) corrupts the heap once two are in flight (prefetch);
the `_out` variant uses `_allgather_base`, as FSDP2 does. tests/test_collectives.py checks the `_out` path under prefetch-like concurrency.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
COLLECTIVE_OPS = {
    c10d.all_gather_into_tensor_out.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_reduce.default: "all_reduce",
    c10d.all_to_all_single.default: "all_to_all",
}


KEY = "zc_comm"  # node.meta key of a collective's record


@dataclasses.dataclass(frozen=True)
class Collective:
    """What one collective node moves and why. `bytes`: what one rank's side holds (all-gather output,
    reduce-scatter / all-to-all input); `ranks`: the group's global ranks when it is not the whole world.
    The fields after `ranks` are set by particular passes for later ones (see pass_contracts: writes/reads).
    Frozen: a copied graph shares its nodes' meta with the original, so a pass replaces a record (`update`)."""
    op: str
    bytes: int
    group: str
    why: str
    numel: int
    dtype: torch.dtype | None = None
    ranks: tuple[int, ...] | None = None
    param: int | None = None                # shard_params: argument index of the gathered parameter
    tile: tuple[int, int] | None = None     # (parameter index, tile) of a tile_linears weight tile
    members: list[int] | None = None        # bucket_collectives: per-rank segment sizes of a reduce-scatter bucket
    cross_node: bool | None = None          # mark_cross_node: the group spans nodes (None: not marked yet)
    cross_bytes: int = 0                    # mark_cross_node: of `bytes`, the share crossing nodes

    def extra_fields(self) -> set[str]:
        """The pass-written fields that are set (see pass_contracts)."""
        return {f for f in ("param", "tile", "members") if getattr(self, f) is not None}

    def as_dict(self, node: str) -> dict:
        return dict(vars(self), node=node)


def record(node: fx.Node) -> Collective | None:
    """The record of a collective node (None for any other node)."""
    return node.meta.get(KEY)


def update(node: fx.Node, **fields) -> Collective:
    """Replace the record of collective `node` by a copy with `fields` changed."""
    node.meta[KEY] = rec = dataclasses.replace(node.meta[KEY], **fields)
    return rec


def rename_groups(gm: fx.GraphModule, names: dict[str, str]) -> None:
    """Collectives over group `old` now name group `names[old]` (a subgroup spec becoming its process group)."""
    if not names:
        return
    for n in gm.graph.nodes:
        rec = record(n)
        if rec is not None and rec.group in names:
            n.args = tuple(names.get(a, a) if isinstance(a, str) else a for a in n.args)
            update(n, group=names[rec.group])
    gm.recompile()


def is_op(node: fx.Node, *ops: str) -> bool:
    rec = node.meta.get(KEY)
    return rec is not None and rec.op in ops


def annotate(node: fx.Node, op: str, nbytes: int, group: str, why: str, numel: int,
             dtype: torch.dtype | None = None, ranks: tuple[int, ...] | None = None) -> Collective:
    node.meta[KEY] = rec = Collective(op, int(nbytes), group, why, int(numel), dtype, ranks)
    return rec


def all_gather(graph: fx.Graph, shard: fx.Node, numel: int, dtype: torch.dtype, world: int, group: str,
               why: str, ranks: tuple[int, ...] | None = None) -> fx.Node:
    """All-gather a flat [numel] shard into a flat [world*numel] tensor; returns the wait node."""
    out = graph.call_function(aten.new_empty.default, (shard, [world * numel]))
    ag = graph.call_function(c10d.all_gather_into_tensor_out.default, (shard, world, group), {"out": out})
    annotate(ag, "all_gather", numel * world * dtype.itemsize, group, why, numel * world, dtype, ranks)
    return graph.call_function(c10d.wait_tensor.default, (ag,))


def all_to_all(graph: fx.Graph, rows: fx.Node, numel: int, dtype: torch.dtype, group, why: str) -> fx.Node:
    """Equal-split all-to-all of a flat [numel] tensor over `group` (a zcompile.runtime.groups.Group): row j goes to
    group rank j, and row j of the result came from group rank j. Returns the wait node."""
    split = [numel // group.size] * group.size
    a2a = graph.call_function(c10d.all_to_all_single.default, (rows, split, split, group.name))
    annotate(a2a, "all_to_all", numel * dtype.itemsize, group.name, why, numel, dtype, group.ranks)
    return graph.call_function(c10d.wait_tensor.default, (a2a,))


def reduce_scatter(graph: fx.Graph, flat: fx.Node, numel: int, dtype: torch.dtype, world: int, group: str,
                   why: str) -> fx.Node:
    """Sum-reduce-scatter a flat [numel] tensor (numel divisible by world); returns the wait node."""
    rs = graph.call_function(c10d.reduce_scatter_tensor.default, (flat, "sum", world, group))
    annotate(rs, "reduce_scatter", numel * dtype.itemsize, group, why, numel, dtype)
    return graph.call_function(c10d.wait_tensor.default, (rs,))


def all_reduce(graph: fx.Graph, tensor: fx.Node, numel: int, dtype: torch.dtype, group: str, why: str) -> fx.Node:
    ar = graph.call_function(c10d.all_reduce.default, (tensor, "sum", group))
    annotate(ar, "all_reduce", numel * dtype.itemsize, group, why, numel, dtype)
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
    colls = [n for n in graph.nodes if is_op(n, *ops)]
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
    return [n.meta[KEY].as_dict(n.name) for n in gm.graph.nodes if KEY in n.meta]


def mark_cross_node(gm: fx.GraphModule, topology, world_ranks) -> None:
    """Record on every collective whether its group spans nodes, and its bytes' share that crosses them
    (Topology.cross_fraction)."""
    for n in gm.graph.nodes:
        c = record(n)
        if c is not None:
            fraction = topology.cross_fraction(c.ranks or world_ranks)
            update(n, cross_node=fraction > 0, cross_bytes=round(c.bytes * fraction))
