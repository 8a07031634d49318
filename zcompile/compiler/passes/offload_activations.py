"""offload_activations (ZeRO-Infinity): big saved activations wait for the backward in host memory.

Forward: every tensor the graph saves for the backward (an output past the first `num_fwd_outputs`) of at least
`offload.activation_min_bytes` is copied to the host right after it is produced (`zcompile::to_host`) and the host
copy is what the graph returns, so the device copy dies at its last forward use instead of living until the
backward; so is every one the planner chose to offload under a `memory_budget` (`pctx.offload_saved`).
Backward: the matching input (same name) is marked host-resident and copied back to the device
(`zcompile::to_device`) right before its first use. Parameter shards and graph inputs are never moved here.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from zcompile.runtime import offload_engine  # noqa: F401  (registers the zcompile:: ops)
from zcompile.compiler.graph import placement
from zcompile.config import Tier


def _offload_saved(gm: fx.GraphModule, pctx) -> None:
    graph = gm.graph
    out = graph.output_node()
    values = list(out.args[0])
    min_bytes = pctx.cfg.offload.activation_min_bytes
    for k in range(pctx.num_fwd_outputs, len(values)):
        n = values[k]
        val = n.meta.get("val") if isinstance(n, fx.Node) else None
        if n is None or n.op == "placeholder" or not isinstance(val, torch.Tensor):
            continue
        nbytes = val.numel() * val.element_size()
        by_config = pctx.cfg.offload.activations != Tier.NONE and nbytes >= min_bytes
        if not (by_config or n.name in pctx.offload_saved) or n.name in pctx.offloaded:
            continue
        with graph.inserting_after(n):
            host = graph.call_function(torch.ops.zcompile.to_host.default, (n,))
        host.meta["zc_tier"] = "cpu"
        host.meta["zc_note"] = f"offload saved activation {n.name} {list(val.shape)} ({nbytes} B) to the host"
        values[k] = host
        pctx.offloaded[n.name] = nbytes
    out.args = (type(out.args[0])(values),)


def _reload_saved(gm: fx.GraphModule, pctx) -> None:
    graph = gm.graph
    order = {n: k for k, n in enumerate(graph.nodes)}
    for ph in [n for n in graph.nodes if n.op == "placeholder" and n.name in pctx.offloaded]:
        ph.meta["zc_tier"] = "cpu"
        users = [u for u in ph.users if u.op != "output"]
        if not users:
            continue
        reload = placement.at_first_use(graph, ph, users, order, lambda: graph.call_function(
            torch.ops.zcompile.to_device.default, (ph, pctx.dist.device)))
        reload.meta["zc_note"] = f"reload saved activation {ph.name} ({pctx.offloaded[ph.name]} B) from the host"


def run(gm: fx.GraphModule, pctx) -> fx.GraphModule:
    if (pctx.cfg.offload.activations == Tier.NONE and not pctx.offload_saved) or pctx.kind not in ("forward",
                                                                                                  "backward"):
        return gm
    if pctx.kind == "forward":
        _offload_saved(gm, pctx)
        what = f"{len(pctx.offloaded)} saved activation(s), {sum(pctx.offloaded.values())} B, go to the host"
    else:
        _reload_saved(gm, pctx)
        what = f"{len(pctx.offloaded)} saved activation(s) reloaded from the host before first use"
    gm.meta.setdefault("zc_notes", []).append(f"offload_activations: {what}")
    return gm
