"""update_in_backward (ZeRO-Offload's overlap): as soon as a bucket's reduce-scatter is done, the backward hands the
bucket's gradient shards of host-stepped parameters to the host optimizer (`zcompile::grads_ready`), which updates
them while the rest of the backward runs (zcompile.runtime.update_in_backward).

Each gradient a parameter's output takes is traced back through the single-input ops that cut it out of its
bucket (slices, views, casts) to the collective's wait; those ops move up to right after the wait, followed by one
grads_ready call for the bucket. A gradient made otherwise (a sum of two uses, a dequantization) is handed over
where it is made.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from zcompile.config import Tier
from zcompile.runtime import update_in_backward  # noqa: F401  (registers zcompile::grads_ready)

_WAIT = torch.ops._c10d_functional.wait_tensor.default


def run(gm: fx.GraphModule, pctx) -> fx.GraphModule:
    if pctx.kind != "backward" or not pctx.cfg.offload.update_in_backward:
        return gm
    graph = gm.graph
    grads = list(graph.output_node().args[0])
    buckets: dict[fx.Node, list] = {}  # the wait (or the gradient itself) -> [(gradient, its cut-out ops, zp)]
    for i, zp in pctx.params.items():
        if zp.optim_tier == Tier.DEVICE or zp.param_tier != Tier.DEVICE or i >= len(grads) or grads[i] is None:
            continue
        chain = _cut_out(grads[i])
        source = chain[0].all_input_nodes[0] if chain else grads[i]
        buckets.setdefault(source, []).append((grads[i], chain, zp))
    moved: set[fx.Node] = set()
    for source, members in buckets.items():
        last = source
        for _, chain, _ in members:
            for n in chain:  # each takes only the one before it (or the wait): valid right after it
                if n not in moved:
                    moved.add(n)
                    last.append(n)
                    last = n
        with graph.inserting_after(last):
            call = graph.call_function(torch.ops.zcompile.grads_ready.default,
                                       ([g for g, _, _ in members], [zp.key for _, _, zp in members]))
        call.meta["zc_note"] = f"update_in_backward: {len(members)} gradient shard(s) to the host optimizer"
    if buckets:
        gm.meta.setdefault("zc_notes", []).append(
            f"update_in_backward: {sum(map(len, buckets.values()))} gradient shard(s) in {len(buckets)} bucket(s) "
            "handed to the host optimizer during the backward")
    return gm


def _cut_out(grad: fx.Node) -> list[fx.Node]:
    """The ops between a bucket's wait and `grad` that take nothing else but constants, first to last (empty when
    there is no wait behind them)."""
    chain, n = [], grad
    while n.op == "call_function" and n.target is not _WAIT:
        inputs = n.all_input_nodes
        if len(inputs) != 1:
            return []
        chain.append(n)
        n = inputs[0]
    return chain[::-1] if n.target is _WAIT and chain else []
