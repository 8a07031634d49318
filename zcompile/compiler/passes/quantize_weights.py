"""quantize_weights (ZeRO++ qwZ): forward parameter all-gathers move block-wise int8 instead of the compute dtype.

Each parameter is quantized on its own (before bucketing: a block never mixes two parameters' magnitudes), in
blocks of at most `block` elements sized to tile its shard (kernels.quantize.fit_blocks: a 32-element shard is one
block of 32, not a block of 2048 mostly padding). Each rank quantizes its shard (zero-padded to whole blocks) and
appends the fp32 block scales as bytes (zcompile.quantize_int8_payload), and all-gathers that one int8 payload;
every rank then splits the [rank][values | scales] rows and dequantizes them into the dtype the gather had, fp32 or
bf16 under mixed precision (zcompile.dequantize_int8_payload). One op on each side: inductor compiles no
per-parameter copies around them. A 4-byte parameter travels as ~1 byte (plus 4 bytes per block). Backward
re-gathers stay exact: the gradient is taken against the dequantized forward weights, as in ZeRO++.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from zcompile.compiler.graph import collectives
from zcompile.kernels import quantize as _ops  # noqa: F401  (registers torch.ops.zcompile.*)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
zc = torch.ops.zcompile


def _quantized_gather(graph: fx.Graph, ag: fx.Node, block: int) -> None:
    comm = collectives.record(ag)
    world, group = ag.args[1], ag.args[2]
    src = ag.args[0]
    dtype = comm.dtype
    s = comm.numel // world
    size, nb, _, row = _ops.int8_payload(s, block)
    old_wait = collectives.wait_of(ag)
    with graph.inserting_before(ag):
        payload = graph.call_function(zc.quantize_int8_payload.default, (src, block))
        buf = graph.call_function(aten.new_empty.default, (payload, [world * row]))
        new_ag = graph.call_function(c10d.all_gather_into_tensor_out.default, (payload, world, group), {"out": buf})
    # the same parameter (and tile: gathered alone) in int8
    new_ag.meta[collectives.KEY] = dataclasses.replace(
        comm, bytes=world * row, numel=world * row, dtype=torch.int8,
        why=f"{comm.why}; qwZ int8 in {nb} block(s) of {size} + fp32 scales")
    with graph.inserting_before(old_wait):
        wait = graph.call_function(c10d.wait_tensor.default, (new_ag,))
        full = graph.call_function(zc.dequantize_int8_payload.default, (wait, s, block, dtype))
    full.meta["zc_note"] = "qwZ: dequantized gathered parameter"
    collectives.replace_gather(graph, ag, full)


def run(gm: fx.GraphModule, pctx) -> fx.GraphModule:
    qcfg = pctx.cfg.quantize_weights
    if qcfg is None or pctx.kind not in ("forward", "inference"):
        return gm
    gathers = [n for n in gm.graph.nodes if collectives.is_op(n, "all_gather")
               and (collectives.record(n).dtype or torch.int8).is_floating_point]
    for ag in gathers:
        _quantized_gather(gm.graph, ag, qcfg.block)
    if gathers:
        gm.meta.setdefault("zc_notes", []).append(
            f"quantize_weights: {len(gathers)} forward gather(s) in int8 blocks of {qcfg.block} (qwZ)")
    return gm
