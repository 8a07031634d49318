"""quantize_gradients (ZeRO++ qgZ): every gradient reduce-scatter becomes a hierarchical, int4 all-to-all reduction.

For a world of K nodes x G ranks (rank n*G + l) and a reduce-scatter of [world * S] (one gradient or a bucket):
1. slice reordering: view as [K, G, S] (destination node, local rank, shard) and transpose to [G, K, S], so the
   slices for local rank l of every node are contiguous; each parameter's segment of a shard is quantized in its
   own blocks (kernels.quantize.fit_blocks), so a small-gradient parameter is not rounded on a neighbour's scale;
2. intra-node all-to-all of int4 blocks (+ fp32 scales): local rank l receives, from each of its node's G ranks,
   the K slices destined to local rank l of every node;
3. dequantize + sum over the G senders (zcompile.dequantize_sum_int4_rows, fp32): the node's partial sums;
4. inter-node all-to-all (the K ranks with local rank l) of the int4-quantized partial sums;
5. dequantize + final sum over the K nodes in fp32: this rank's shard, cast to the reduce dtype.
Only step 4 crosses nodes: int4 partial sums, 1/G of the gradient per rank. One node (K=1) skips step 4; one rank
per node (G=1) skips steps 2-3. Step 2 is issued where the reduce-scatter was; steps 3-5 run where it was waited on.
Gradients were already scaled by 1/world (reduce_grads), so the sums are the average.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from zcompile.compiler.graph import collectives
from zcompile.runtime import groups
from zcompile.kernels import quantize as _ops  # noqa: F401  (registers torch.ops.zcompile.*)

aten = torch.ops.aten
prims = torch.ops.prims
zc = torch.ops.zcompile


def _exchange(graph: fx.Graph, x: fx.Node, rows: int, width: int, members: list[int], block: int, group,
              why: str) -> fx.Node:
    """Quantize x ([rows, width, sum(members)], row j for group rank j) to int4, each member in its own blocks, into
    one uint8 row per destination (zcompile::quantize_int4_rows), and all-to-all it; returns the wait."""
    payload = graph.call_function(zc.quantize_int4_rows.default, (x, members, block))
    nbytes = rows * _ops.int4_row_bytes(members, block, width)
    flat = graph.call_function(aten.view.default, (payload, [nbytes]))
    return collectives.all_to_all(graph, flat, nbytes, torch.uint8, group, why)


def _sum(graph: fx.Graph, wait: fx.Node, rows: int, members: list[int], block: int, width: int) -> fx.Node:
    """Dequantize the received rows and sum them in fp32: [width, sum(members)]."""
    recv = graph.call_function(aten.view.default, (wait, [rows, _ops.int4_row_bytes(members, block, width)]))
    return graph.call_function(zc.dequantize_sum_int4_rows.default, (recv, members, block, width))


def _hierarchical(graph: fx.Graph, rs: fx.Node, block: int, intra, inter) -> None:
    comm = collectives.record(rs)
    flat, world = rs.args[0], rs.args[2]
    nodes, local = inter.size, intra.size
    assert nodes * local == world, (nodes, local, world)
    s = comm.numel // world
    members = comm.members or [s]  # a bucket's per-rank segments: each is quantized in its own blocks
    what = comm.why.split(": ", 1)[-1]
    wait = collectives.wait_of(rs)
    if local > 1:
        with graph.inserting_before(rs):
            x = graph.call_function(aten.view.default, (flat, [nodes, local, s]))
            x = graph.call_function(aten.permute.default, (x, [1, 0, 2]))  # [local rank, node, shard]
            first = _exchange(graph, x, local, nodes, members, block, intra,
                              f"backward: qgZ intra-node all-to-all (int4) of {what}")
    with graph.inserting_before(wait):
        # [node, shard]: this node's partial sums for local rank `rank % local` of every node
        partial = _sum(graph, first, local, members, block, nodes) if local > 1 else \
            graph.call_function(aten.view.default, (flat, [nodes, s]))
        if nodes > 1:
            second = graph.call_function(aten.view.default, (partial, [nodes, 1, s]))
            wait2 = _exchange(graph, second, nodes, 1, members, block, inter,
                              f"backward: qgZ inter-node all-to-all (int4 partial sums) of {what}")
            partial = _sum(graph, wait2, nodes, members, block, 1)
        shard = graph.call_function(aten.view.default, (partial, [s]))
        shard = graph.call_function(prims.convert_element_type.default, (shard, comm.dtype))
    shard.meta["zc_note"] = "qgZ: this rank's reduced gradient shard"
    wait.replace_all_uses_with(shard)
    graph.erase_node(wait)
    graph.erase_node(rs)


def run(gm: fx.GraphModule, pctx) -> fx.GraphModule:
    qcfg = pctx.cfg.quantize_gradients
    if qcfg is None or pctx.kind != "backward":
        return gm
    local = pctx.topology.ranks_per_node
    intra = pctx.subgroup(groups.blocks(pctx.dist, local))
    inter = pctx.subgroup(groups.strided(pctx.dist, local))
    reductions = [n for n in gm.graph.nodes if collectives.is_op(n, "reduce_scatter")]
    for rs in reductions:
        _hierarchical(gm.graph, rs, qcfg.block, intra, inter)
    if reductions:
        gm.meta.setdefault("zc_notes", []).append(
            f"quantize_gradients: {len(reductions)} reduce-scatter(s) as int4 all-to-alls in blocks of {qcfg.block}, "
            f"{pctx.topology.nodes} node(s) x {local} (qgZ)")
    return gm
