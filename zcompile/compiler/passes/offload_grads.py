"""offload_grads (ZeRO-Infinity): on a GPU, the reduced gradient shard of each host- or NVMe-resident parameter is
copied to the host (`zcompile::to_host`) as the backward's output, where autograd accumulates it into the shard's
`.grad` and the optimizer steps it.

It runs after the gradient reduction passes (reduce_grads, bucket_collectives, quantize_gradients), so it moves
the reduce-scatter's output, 1/world of the gradient, and the collective reads a device tensor (NCCL has no host
path). The copies are issued without blocking; the backward's run waits for them once, at its end.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from zcompile.runtime import offload_engine  # noqa: F401  (registers the zcompile:: ops)
from zcompile.config import Tier


def run(gm: fx.GraphModule, pctx) -> fx.GraphModule:
    if pctx.kind != "backward" or pctx.dist.device.type == "cpu":
        return gm
    out = gm.graph.output_node()
    grads = list(out.args[0])
    moved = 0
    for i, zp in pctx.params.items():
        if zp.param_tier == Tier.DEVICE or zp.keeps_full or i >= len(grads) or grads[i] is None:
            continue
        with gm.graph.inserting_before(out):
            host = gm.graph.call_function(torch.ops.zcompile.to_host.default, (grads[i],))
        host.meta["zc_tier"] = "cpu"
        host.meta["zc_note"] = f"gradient shard of param {list(zp.shape)} to the host, where it is stepped"
        grads[i] = host
        moved += 1
    out.args = (type(out.args[0])(grads),)
    if moved:
        gm.meta.setdefault("zc_notes", []).append(f"offload_grads: {moved} gradient shard(s) to the host")
    return gm
