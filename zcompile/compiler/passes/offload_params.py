"""offload_params (ZeRO-Infinity): parameter shards live off the device and come in right before their all-gather.

For each stage-3 parameter whose shard is in the "cpu" tier, the graph copies the host shard to the device
(`zcompile::to_device`) just before the first op that uses it (the gather's cast or the gather itself); an "nvme"
shard is read from its file (`zcompile::read_shard`; with `offload.overlap` the engine has been reading the graph's
files ahead, in this order, since the graph started). The placeholder is marked host-resident (`zc_tier`), so the
planner does not count it as device memory: the device copy lives from the reload to the gather's copy-in.
bucket_collectives and prefetch move the reload up together with its gather. The reduced gradients go back to the
host in pass offload_grads.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from zcompile.runtime import offload_engine  # noqa: F401  (registers the zcompile:: ops)
from zcompile.compiler.graph import placement
from zcompile.config import Tier


def run(gm: fx.GraphModule, pctx) -> fx.GraphModule:
    if pctx.kind not in ("forward", "backward", "inference"):
        return gm
    graph = gm.graph
    order = {n: k for k, n in enumerate(graph.nodes)}
    device = pctx.dist.device
    moved = {"cpu": 0, "nvme": 0}
    for i, ph in pctx.param_placeholders(gm).items():
        zp = pctx.params[i]
        if zp.param_tier == Tier.DEVICE or zp.keeps_full:
            continue
        ph.meta["zc_tier"] = zp.param_tier
        users = [u for u in ph.users if u.op != "output"]
        if not users:
            continue
        op, args = ((torch.ops.zcompile.to_device.default, (ph, device)) if zp.param_tier == Tier.CPU else
                    (torch.ops.zcompile.read_shard.default, (ph, zp.key, device)))
        reload = placement.at_first_use(graph, ph, users, order, lambda: graph.call_function(op, args))
        reload.meta["zc_note"] = (f"reload shard of param {list(zp.shape)} from {zp.param_tier} "
                                  f"({zp.shard_numel * zp.dtype.itemsize} B) for its all-gather")
        moved[zp.param_tier] += 1
    if any(moved.values()):
        gm.meta.setdefault("zc_notes", []).append(
            f"offload_params: {moved['cpu']} shard(s) reloaded from cpu, {moved['nvme']} read from nvme")
    return gm
