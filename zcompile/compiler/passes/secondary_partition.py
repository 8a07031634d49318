"""secondary_partition (ZeRO++ hpZ): the backward re-gathers parameters inside a block of G ranks (a node), not
across the world.

Forward: right after a parameter's world all-gather, this rank copies its 1/G of the gathered parameter into a
persistent secondary buffer (a side input: `hpz_partition_size` G, rank r keeps block position r % G). Backward:
the parameter's world all-gather of the primary shard becomes an all-gather of the secondary buffers over the G
ranks of this rank's block, which hold the whole parameter between them in the same rank-major layout. With
G = ranks per node, no backward parameter byte crosses a node. Costs 1/G of the (compute-dtype) parameter per rank,
kept between steps; with qwZ the backward sees the same dequantized weights the forward used.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from zcompile.compiler.graph import collectives
from zcompile.runtime import groups
from zcompile.errors import ConfigError

aten = torch.ops.aten


def _param_gathers(graph: fx.Graph, pctx) -> list[tuple[fx.Node, object]]:
    out = []
    for n in graph.nodes:
        comm = collectives.record(n)
        if comm is not None and comm.op == "all_gather" and comm.param is not None:
            out.append((n, pctx.params[comm.param]))
    return out


def _keep_secondary(gm: fx.GraphModule, ag: fx.Node, zp, group, pctx) -> None:
    dtype = collectives.record(ag).dtype
    part = zp.padded_numel // group.size
    zp.use_secondary(part, dtype)
    buf = pctx.add_side_input(gm, zp, "secondary", f"hpZ secondary partition of param {list(zp.shape)}: "
                              f"{part} elements ({dtype}), written here for the backward")
    pos = group.index(pctx.dist.rank)
    wait = collectives.wait_of(ag)
    with gm.graph.inserting_after(wait):
        piece = gm.graph.call_function(aten.slice.Tensor, (wait, 0, pos * part, (pos + 1) * part))
    with gm.graph.inserting_after(piece):
        keep = gm.graph.call_function(aten.copy_.default, (buf, piece))
    keep.meta["zc_note"] = f"hpZ: keep this rank's 1/{group.size} of the gathered param for the backward"


def _regather_from_secondary(gm: fx.GraphModule, ag: fx.Node, zp, group, pctx) -> None:
    graph = gm.graph
    buf = pctx.add_side_input(gm, zp, "secondary", f"hpZ secondary partition of param {list(zp.shape)}, "
                              "written by the forward")
    src = ag.args[0]
    why = (f"backward: re-gather param {list(zp.shape)} ({zp.secondary_dtype}) from the hpZ secondary partition "
           f"over {group.size} ranks")
    with graph.inserting_before(ag):
        full = collectives.all_gather(graph, buf, zp.secondary_numel, zp.secondary_dtype, group.size, group.name,
                                      why, group.ranks)
    collectives.replace_gather(graph, ag, full)
    if isinstance(src, fx.Node) and src.op == "call_function" and not src.users:
        graph.erase_node(src)  # the cast of the primary shard


def run(gm: fx.GraphModule, pctx) -> fx.GraphModule:
    size = pctx.cfg.hpz_partition_size
    if size == "node":
        size = pctx.topology.ranks_per_node
    if size <= 1 or pctx.kind not in ("forward", "backward"):
        return gm
    if pctx.dist.world % size:
        raise ConfigError(f"{pctx.cfg.source}: key 'hpz_partition_size' is {size}, which does not divide the world "
                          f"of {pctx.dist.world} ranks")
    group = pctx.subgroup(groups.blocks(pctx.dist, size))
    done = skipped = 0
    for ag, zp in _param_gathers(gm.graph, pctx):
        if pctx.kind == "forward":
            _keep_secondary(gm, ag, zp, group, pctx)
            done += 1
        elif zp.secondary_numel and zp.secondary_dtype == collectives.record(ag).dtype:
            _regather_from_secondary(gm, ag, zp, group, pctx)
            done += 1
        else:
            skipped += 1  # the forward did not gather it in this dtype: keep the world gather
    what = "kept a secondary partition of" if pctx.kind == "forward" else "re-gathered from the secondary partition"
    gm.meta.setdefault("zc_notes", []).append(
        f"secondary_partition (hpZ, {size} ranks {group.ranks}): {what} {done} param(s)"
        + (f"; {skipped} gathered across the world (not gathered in that dtype by the forward)" if skipped else ""))
    return gm
