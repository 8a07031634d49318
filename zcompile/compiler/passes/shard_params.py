"""shard_params: parameters enter the graph as flat shards; each is made whole right before its first use.

Stage 3: inserts `all_gather_into_tensor` + `wait_tensor` + slice/view before the first use of every parameter in
the forward graph, and again in the backward graph for every parameter the backward needs (the partitioner saved
only the shard, see tag_param_recompute). When every use of a parameter is a cast to a lower compute dtype, the
shard is cast first, so the gather moves bf16 bytes. The gathered tensor is freed after its last use by the
generated code (`name = None`), which is the release.

Stage 2 (and stage 3 parameters the planner keeps whole): parameters stay whole on every rank; the full tensor is
appended to the graph inputs (a side input the runtime supplies) and replaces the shard's uses. No communication in
forward.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from zcompile.compiler.graph import collectives
from zcompile.kernels import weight_tiles  # noqa: F401  (zcompile::weight_tiles)
from zcompile.config import Stage

aten = torch.ops.aten
_CASTS = {torch.ops.prims.convert_element_type.default, aten._to_copy.default}


def _cast_dtype(node: fx.Node) -> torch.dtype | None:
    if node.op != "call_function" or node.target not in _CASTS:
        return None
    if node.target is aten._to_copy.default and set(node.kwargs) - {"dtype"}:
        return None
    return node.args[1] if node.target is torch.ops.prims.convert_element_type.default else node.kwargs.get("dtype")


def _full_from_flat(graph: fx.Graph, flat: fx.Node, zp) -> fx.Node:
    if zp.padded_numel != zp.numel:
        flat = graph.call_function(aten.slice.Tensor, (flat, 0, 0, zp.numel))
    return graph.call_function(aten.view.default, (flat, list(zp.shape)))


def _gather(graph: fx.Graph, shard: fx.Node, i: int, zp, dtype: torch.dtype, pctx, cast: bool) -> fx.Node:
    src = graph.call_function(torch.ops.prims.convert_element_type.default, (shard, dtype)) if cast else shard
    why = (f"{pctx.kind}: gather param {list(zp.shape)} ({dtype}) before first use"
           + ("; re-gather, forward released it" if pctx.kind == "backward" else ""))
    flat = collectives.all_gather(graph, src, zp.shard_numel, dtype, zp.world, zp.group_name, why)
    collectives.update(flat.args[0], param=i)  # which parameter (secondary_partition pairs forward and backward)
    return _full_from_flat(graph, flat, zp)


def _gather_tiles(graph: fx.Graph, ph: fx.Node, tiles_node: fx.Node, i: int, zp, pctx, order: dict) -> None:
    """tile_linears: tile t of a row-sharded weight is slice t of every rank's shard, gathered on its own before
    the tile's first use (bucket_collectives keeps tiles apart)."""
    T = tiles_node.args[1]
    c = zp.shard_numel // T
    for g in list(tiles_node.users):
        t = g.args[1]
        uses = list(g.users)
        with graph.inserting_before(min(uses, key=lambda n: order.get(n, len(order))) if uses else g):
            src = graph.call_function(aten.slice.Tensor, (ph, 0, t * c, (t + 1) * c))
            why = (f"{pctx.kind}: gather tile {t}/{T} of param {list(zp.shape)} ({zp.dtype}) before its use"
                   + ("; re-gather, forward released it" if pctx.kind == "backward" else ""))
            flat = collectives.all_gather(graph, src, c, zp.dtype, zp.world, zp.group_name, why)
            collectives.update(flat.args[0], tile=(i, t))
            tile = graph.call_function(aten.view.default, (flat, [zp.world * c // zp.shape[1], zp.shape[1]]))
        g.replace_all_uses_with(tile)
        graph.erase_node(g)
    graph.erase_node(tiles_node)


def _side_input(gm: fx.GraphModule, zp, pctx) -> fx.Node:
    return pctx.add_side_input(gm, zp, "full", f"persistent full param {list(zp.shape)} (stage 2 or kept whole by "
                               "the planner), supplied by the shard store")


def run(gm: fx.GraphModule, pctx) -> fx.GraphModule:
    if pctx.cfg.stage < Stage.GRADIENTS:
        return gm
    graph = gm.graph
    order = {n: k for k, n in enumerate(graph.nodes)}  # users of placeholders are original nodes: computed once
    for i, ph in pctx.param_placeholders(gm).items():
        zp = pctx.params[i]
        ph.meta["zc_note"] = f"shard of param {list(zp.shape)}: {zp.shard_numel} of {zp.numel} elements"
        users = [u for u in ph.users if u.op != "output"]
        if not users:
            continue
        tiles = [u for u in users if u.target is torch.ops.zcompile.weight_tiles.default]
        if tiles and not zp.keeps_full:
            for node in tiles:
                _gather_tiles(graph, ph, node, i, zp, pctx, order)
            users = [u for u in users if u not in tiles]
            if not users:
                continue
        if zp.keeps_full:  # stage 2, or a stage 3 parameter the planner keeps whole
            full = _side_input(gm, zp, pctx)
            for u in users:
                u.replace_input_with(ph, full)
            continue
        cast_to = {_cast_dtype(u) for u in users}
        cast_first = len(cast_to) == 1 and None not in cast_to and next(iter(cast_to)).itemsize < zp.dtype.itemsize
        # gather before the first real use: a cast may sit far above the op that uses its result
        uses = [c for u in users for c in u.users] if cast_first else users
        first = min(uses or users, key=lambda n: order.get(n, len(order)))
        with graph.inserting_before(first):
            if cast_first:
                dtype = next(iter(cast_to))
                full = _gather(graph, ph, i, zp, dtype, pctx, cast=True)
                for u in users:
                    u.replace_all_uses_with(full)
                    graph.erase_node(u)
            else:
                full = _gather(graph, ph, i, zp, zp.dtype, pctx, cast=False)
                for u in users:
                    u.replace_input_with(ph, full)
    return gm

