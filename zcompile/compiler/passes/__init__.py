"""Graph passes, one per file. Each is `run(gm, pctx) -> gm` over one phase of the compile; what it needs and gives
is its contract in `zcompile.pass_contracts` (checked when the config is read, and after each pass here).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from zcompile.compiler.graph import collectives
from zcompile.compiler.graph.meta_keys import PARAMETER
from zcompile.compiler.graph.pass_context import PassContext
from zcompile.config import Stage, Tier
from zcompile.pass_contracts import CONTRACTS, written_fields
from zcompile.compiler.passes import (bucket_collectives, chunk_loss, mixed_precision, offload_activations,
                                      offload_grads, offload_params, prefetch, quantize_gradients, quantize_weights,
                                      reduce_grads, secondary_partition, shard_params, tag_param_recompute,
                                      tile_linears, update_in_backward)

PASSES: dict[str, Callable] = {m.__name__.rsplit(".", 1)[1]: m.run for m in (
    mixed_precision, chunk_loss, tile_linears, tag_param_recompute, shard_params, offload_params,
    secondary_partition, quantize_weights, reduce_grads, bucket_collectives, quantize_gradients, offload_grads,
    update_in_backward, offload_activations, prefetch)}
assert PASSES.keys() == CONTRACTS.keys(), "every pass has a contract and every contract a pass"


def check_records(gm: fx.GraphModule, allowed: frozenset, after: str) -> None:
    """Every collective record sets only the fields the passes run so far declare writing (their contracts)."""
    for n in gm.graph.nodes:
        rec = collectives.record(n)
        if rec is not None:
            extra = rec.extra_fields() - allowed
            if extra:
                raise AssertionError(f"after pass '{after}': collective {n.name} carries field(s) {sorted(extra)} "
                                     "that no pass run so far declares in its contract's `writes`")


def run_phase(phase: str, gm: fx.GraphModule, pctx,
              on_pass: Callable[[str, fx.GraphModule], None] | None = None) -> fx.GraphModule:
    """Run the pipeline's passes of one phase in order; on_pass(name, gm) sees the graph after each (for dumps).
    The Python code is regenerated and the graph linted once at the end (after each pass only for on_pass): on a
    deep model each regeneration takes about a second, each lint a few hundredths."""
    names, ran = pctx.cfg.passes, []
    for k, name in enumerate(names):
        if CONTRACTS[name].phase != phase:
            continue
        gm = PASSES[name](gm, pctx)
        ran.append(name)
        check_records(gm, written_fields(names[:k + 1]), name)
        if on_pass is not None:
            _lint(gm, [name])
            gm.recompile()
            on_pass(name, gm)
    if ran and on_pass is None:  # with on_pass, each pass's graph was linted already
        _lint(gm, ran)
    gm.recompile()
    return gm


def _lint(gm: fx.GraphModule, ran: list[str]) -> None:
    try:
        gm.graph.lint()
    except Exception as e:
        raise AssertionError(f"the graph after pass(es) {ran} is malformed: {e} (with dump_dir set, each pass's "
                             "graph is checked and dumped)") from e


def fake_shard_inputs(gm: fx.GraphModule, pctx: PassContext) -> None:
    """Shard placeholders take shard-shaped fake values; side-input placeholders take full-shape ones. A whole
    parameter's shard is a view of its full buffer, as at run time, so liveness counts that storage once."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([n.meta.get("val") for n in phs if "val" in n.meta])
    buffers: dict = {}

    def full_buffer(zp):
        if zp not in buffers:
            buffers[zp] = torch.empty(zp.padded_numel, dtype=zp.dtype, device=pctx.dist.device)
        return buffers[zp]

    with fake_mode:
        for ph in pctx.param_placeholders(gm).values():
            ph.meta[PARAMETER] = True
        if pctx.cfg.stage >= Stage.GRADIENTS:
            for i, ph in pctx.param_placeholders(gm).items():
                zp = pctx.params[i]
                if zp.keeps_full:
                    ph.meta["val"] = full_buffer(zp)[zp.rank * zp.shard_numel:(zp.rank + 1) * zp.shard_numel]
                else:
                    where = pctx.dist.device if zp.param_tier == Tier.DEVICE else "cpu"
                    ph.meta["val"] = torch.empty(zp.shard_numel, dtype=zp.dtype, device=where)
                pctx.own_placeholders.add(ph.name)
        for ph in phs:
            side = ph.meta.get("zc_side")
            if side is None:
                continue
            zp = side.zp
            if side.kind == "full":
                ph.meta["val"] = full_buffer(zp)[: zp.numel].view(zp.shape)
                ph.meta[PARAMETER] = True
            else:
                ph.meta["val"] = torch.empty(zp.secondary_numel, dtype=zp.secondary_dtype, device=pctx.dist.device)
            pctx.own_placeholders.add(ph.name)
