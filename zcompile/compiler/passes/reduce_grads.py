"""reduce_grads: average every parameter gradient over the data-parallel group where the backward produces it.

Stage 0/1: `all_reduce` of the full gradient (replicated on every rank).
Stage 2/3: the gradient is flattened, zero-padded to world*s, `reduce_scatter_tensor`-ed, and only this rank's
s-element shard leaves the graph, so the full gradient dies inside the backward.

Each reduction is issued right where the backward produces its gradient, and waited on just before the next
reduction is issued (one in flight, collectives.limit_in_flight): the full gradient is freed as the backward goes,
instead of every gradient of the model living until the end of the backward.

Gradients are pre-scaled by 1/world (a sum of pre-divided values: no overflow, no AVG support needed from gloo) and
communicated in mixed_precision.reduce_dtype; a gradient that the backward just up-cast from that dtype is
reduced before the cast.

A weight tiled by tile_linears arrives as `zcompile::weight_tiles_grad` of its tile gradients: each tile gradient
is reduce-scattered on its own where it is produced (tile t of the gradient is slice t of every rank's shard), and
the shard gradient is the concatenation of the pieces, so no full gradient of that weight ever exists.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from zcompile.compiler.graph import collectives
from zcompile.kernels import weight_tiles  # noqa: F401  (zcompile::weight_tiles_grad)
from zcompile.config import Stage

aten = torch.ops.aten
prims = torch.ops.prims


def _in_dtype(graph: fx.Graph, g: fx.Node, dtype: torch.dtype) -> fx.Node:
    val = g.meta.get("val")
    if val is not None and val.dtype == dtype:
        return g
    if g.op == "call_function" and g.target is prims.convert_element_type.default:
        src = g.args[0]
        if isinstance(src, fx.Node) and src.meta.get("val") is not None and src.meta["val"].dtype == dtype:
            return src
    return graph.call_function(prims.convert_element_type.default, (g, dtype))


def _scaled(graph: fx.Graph, g: fx.Node, rdtype: torch.dtype, world: int, flat: bool, copy: bool = False) -> fx.Node:
    """g / world in the reduce dtype; contiguous when it is to be flattened (`copy`: through a copy even if it is
    contiguous already)."""
    val = g.meta.get("val")
    g = _in_dtype(graph, g, rdtype)
    if flat and (copy or val is not None and not val.is_contiguous()):
        g = graph.call_function(aten.clone.default, (g,), {"memory_format": torch.contiguous_format})
    return graph.call_function(aten.mul.Tensor, (g, 1.0 / world))


def _reduce(graph: fx.Graph, g: fx.Node, zp, pctx) -> fx.Node:
    """Reduction chain inserted at the current point; returns its wait node."""
    rdtype = pctx.cfg.mixed_precision.reduce_dtype
    world, group = pctx.dist.world, pctx.dist.group_name
    scaled = _scaled(graph, g, rdtype, world, flat=pctx.cfg.stage >= Stage.GRADIENTS)
    if pctx.cfg.stage < Stage.GRADIENTS:
        why = f"backward: average grad {list(zp.shape)} over {world} ranks (replicated)"
        out = collectives.all_reduce(graph, scaled, zp.numel, rdtype, group, why)
    else:
        flat = graph.call_function(aten.view.default, (scaled, [zp.numel]))
        if zp.padded_numel != zp.numel:
            flat = graph.call_function(aten.constant_pad_nd.default, (flat, [0, zp.padded_numel - zp.numel], 0.0))
        why = f"backward: average grad {list(zp.shape)} over {world} ranks, keep shard of {zp.shard_numel}"
        out = collectives.reduce_scatter(graph, flat, zp.padded_numel, rdtype, world, group, why)
    return out


def _reduce_tiles(graph: fx.Graph, g: fx.Node, i: int, zp, pctx) -> fx.Node:
    rdtype = pctx.cfg.mixed_precision.reduce_dtype
    world, group = pctx.dist.world, pctx.dist.group_name
    tiles = g.args[0]
    numel = zp.shard_numel * world // len(tiles)
    out = graph.output_node()
    waits = []
    for t, gt in enumerate(tiles):
        with graph.inserting_before(gt.next):
            # copied, as first written: without the copy the measured backward peak of a tiled weight exceeds the
            # planned one (by 224 KiB on tests' wide_mlp; cause not found)
            scaled = _scaled(graph, gt, rdtype, world, flat=True, copy=True)
            flat = graph.call_function(aten.view.default, (scaled, [numel]))
            why = (f"backward: average grad tile {t}/{len(tiles)} of {list(zp.shape)} over {world} ranks, keep "
                   f"{numel // world} of its elements")
            wait = collectives.reduce_scatter(graph, flat, numel, rdtype, world, group, why)
        collectives.update(wait.args[0], tile=(i, t))
        out.prepend(wait)
        waits.append(wait)
    with graph.inserting_before(out):
        shard = graph.call_function(aten.cat.default, (waits,))
    return shard


def run(gm: fx.GraphModule, pctx) -> fx.GraphModule:
    if pctx.kind != "backward":
        return gm
    graph = gm.graph
    out = graph.output_node()
    grads = list(out.args[0])
    if len(grads) < pctx.num_args:
        raise RuntimeError(f"backward graph returns {len(grads)} gradients for {pctx.num_args} inputs")
    tiled = []
    for i, zp in pctx.params.items():
        g = grads[i]
        if g is None:
            continue
        tiled_grad = g.target is torch.ops.zcompile.weight_tiles_grad.default
        if tiled_grad and pctx.cfg.stage == Stage.PARAMETERS and not zp.keeps_full:
            wait = _reduce_tiles(graph, g, i, zp, pctx)
            tiled.append(g)
        else:
            with graph.inserting_before(g.next):  # as soon as the gradient exists
                wait = _reduce(graph, g, zp, pctx)
            out.prepend(wait)  # collectives.limit_in_flight pulls it up to the next reduction
        if pctx.cfg.mixed_precision.reduce_dtype != zp.dtype:
            with graph.inserting_before(out):
                wait = graph.call_function(prims.convert_element_type.default, (wait, zp.dtype))
        grads[i] = wait
    out.args = (type(out.args[0])(grads),)
    for g in tiled:  # its tiles were reduced one by one; the stacked gradient is never built
        graph.erase_node(g)
    collectives.limit_in_flight(graph, ("reduce_scatter", "all_reduce"))
    return gm
