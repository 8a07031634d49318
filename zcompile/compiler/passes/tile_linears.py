"""tile_linears (memory-centric tiling, ZeRO-Infinity): a big linear is computed one weight tile at a time.

A stage-3 linear whose weight has at least `tiling.min_bytes` is rewritten, before AOTAutograd, into `tiling.tiles`
linears over tiles of whole weight rows (`zcompile::weight_tiles`); the partial outputs are put back in row order
and the bias added once. Such weights are sharded by whole rows (shard_store, `row_multiple`), so shard_params
gathers each tile on its own right before its use and frees it after: the forward and backward hold one tile of
the weight (plus the prefetched next) instead of all of it. Results equal the untiled linear up to the matmul's
floating-point summation order. Only weights every use of which is a linear's weight are tiled (a tied embedding
is gathered whole anyway). With bf16 compute the tiles are gathered in the parameter dtype and cast after.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from zcompile.kernels import weight_tiles  # noqa: F401  (registers zcompile::weight_tiles)
from zcompile.config import Stage

_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)


def _is_linear_weight(node: fx.Node, w: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _LINEAR:
        return False
    weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    return weight is w and node.args[0] is not w


def _cast_of(node: fx.Node) -> bool:
    return node.op == "call_method" and node.target == "to" and len(node.users) > 0


def run(gm: fx.GraphModule, pctx) -> fx.GraphModule:
    tiling = pctx.cfg.tiling
    if tiling is None or pctx.cfg.stage != Stage.PARAMETERS:
        return gm
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    order = {n: k for k, n in enumerate(graph.nodes)}  # the nodes placed before are original ones
    tiled = 0
    for i, zp in pctx.params.items():
        if not zp.row_multiple:
            continue
        ph = placeholders[i]
        users = list(ph.users)
        cast = users[0] if len(users) == 1 and _cast_of(users[0]) else None
        w = cast if cast is not None else ph
        linears = list(w.users)
        if not linears or not all(_is_linear_weight(u, w) for u in linears):
            continue
        T = tiling.tiles
        rows = zp.shard_numel // zp.shape[1]
        with graph.inserting_before(min(linears + ([cast] if cast else []), key=order.get)):
            tiles_node = graph.call_function(torch.ops.zcompile.weight_tiles.default, (ph, T, zp.world, rows))
            tile_w = []
            for t in range(T):
                piece = graph.call_function(operator.getitem, (tiles_node, t))
                if cast is not None:
                    piece = graph.call_method("to", (piece,) + tuple(cast.args[1:]), dict(cast.kwargs))
                tile_w.append(piece)
        tiles_node.meta["zc_note"] = f"tile_linears: {T} tiles of {rows // T} rows per rank of {list(zp.shape)}"
        for lin in linears:
            x = lin.args[0]
            bias = lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("bias")
            with graph.inserting_before(lin):
                parts = [graph.call_function(torch._C._nn.linear, (x, tw)) for tw in tile_w]
                y = graph.call_function(torch.stack, (parts,), {"dim": -2})           # [..., T, world*R/T]
                y = graph.call_method("unflatten", (y, -1, (zp.world, rows // T)))   # [..., T, world, R/T]
                y = graph.call_method("transpose", (y, -3, -2))                      # [..., world, T, R/T]
                y = graph.call_method("flatten", (y, -3))                            # [..., world*R]: row order
                y = graph.call_method("narrow", (y, -1, 0, zp.shape[0]))
                if bias is not None:
                    y = graph.call_function(operator.add, (y, bias))
            lin.replace_all_uses_with(y)
            graph.erase_node(lin)
        if cast is not None and not cast.users:
            graph.erase_node(cast)
        tiled += 1
    if tiled:
        gm.meta.setdefault("zc_notes", []).append(f"tile_linears: tiled {tiled} weight(s) into {tiling.tiles} tiles")
    return gm
