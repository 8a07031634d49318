"""quantize_weights (ZeRO++ qwZ): forward parameter all-gathers move block-wise int8 instead of the compute dtype.

Each parameter is quantized on its own (before bucketing: a block never mixes two parameters' magnitudes), in
blocks of at most `block` elements sized to tile its shard (kernels.quantize.fit_blocks: a 32-element shard is one
block of 32, not a block of 2048 mostly padding). Each rank quantizes its shard (zero-padded to whole blocks) with zcompile.quantize_int8, appends the fp32 block
scales as bytes, and all-gathers that one int8 payload; every rank then splits the [rank][values | scales] rows and
dequantizes with zcompile.dequantize_int8 into the dtype the gather had (fp32, or bf16 under mixed precision).
A 4-byte parameter travels as ~1 byte (plus 4 bytes per block). Backward re-gathers stay exact: the gradient is taken
against the dequantized forward weights, as in ZeRO++.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from zcompile.compiler import collectives
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
    block, nb, padded = _ops.fit_blocks(s, block)
    row = padded + 4 * nb
    old_wait = collectives.wait_of(ag)
    with graph.inserting_before(ag):
        flat = src if padded == s else graph.call_function(aten.constant_pad_nd.default, (src, [0, padded - s], 0.0))
        qs = graph.call_function(zc.quantize_int8.default, (flat, block))
        q = graph.call_function(operator.getitem, (qs, 0))
        scale = graph.call_function(operator.getitem, (qs, 1))
        scale_bytes = graph.call_function(aten.view.dtype, (scale, torch.int8))
        payload = graph.call_function(aten.cat.default, ([q, scale_bytes],))
        buf = graph.call_function(aten.new_empty.default, (payload, [world * row]))
        new_ag = graph.call_function(c10d.all_gather_into_tensor_out.default, (payload, world, group), {"out": buf})
    # the same parameter (and tile: gathered alone) in int8
    new_ag.meta[collectives.KEY] = dataclasses.replace(
        comm, bytes=world * row, numel=world * row, dtype=torch.int8,
        why=f"{comm.why}; qwZ int8 in {nb} block(s) of {block} + fp32 scales")
    with graph.inserting_before(old_wait):
        wait = graph.call_function(c10d.wait_tensor.default, (new_ag,))
        rows = graph.call_function(aten.view.default, (wait, [world, row]))
        values = graph.call_function(aten.slice.Tensor, (rows, 1, 0, padded))
        values = graph.call_function(aten.clone.default, (values,), {"memory_format": torch.contiguous_format})
        values = graph.call_function(aten.view.default, (values, [world * padded]))
        scales = graph.call_function(aten.slice.Tensor, (rows, 1, padded, row))
        scales = graph.call_function(aten.clone.default, (scales,), {"memory_format": torch.contiguous_format})
        scales = graph.call_function(aten.view.dtype, (scales, torch.float32))
        scales = graph.call_function(aten.view.default, (scales, [world * nb]))
        full = graph.call_function(zc.dequantize_int8.default, (values, scales, block, dtype))
        if padded != s:
            full = graph.call_function(aten.view.default, (full, [world, padded]))
            full = graph.call_function(aten.slice.Tensor, (full, 1, 0, s))
            full = graph.call_function(aten.clone.default, (full,), {"memory_format": torch.contiguous_format})
            full = graph.call_function(aten.view.default, (full, [world * s]))
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
