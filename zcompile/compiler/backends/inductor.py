"""Compile the transformed graph with inductor: Triton kernels on GPU, C++ on CPU; collectives stay in the graph."""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._inductor import inductor_prims

from zcompile.compiler import collectives
from zcompile.compiler.liveness import input_held_until_wait

_WAIT = torch.ops._c10d_functional.wait_tensor.default


def compile_inductor(gm: fx.GraphModule, example_inputs: list, kind: str):
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, example_inputs, is_backward=(kind == "backward"), is_inference=(kind == "inference"))


def hold_collective_inputs(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` in which the input of every collective that the library reads until completion
    (liveness.input_held_until_wait: all-gathers, all-to-alls, NCCL's reduce-scatter) is one realized buffer,
    read again by a `wait_tensor` of it right after the collective's wait.

    Inductor lowers the `_out` all-gather (collectives.all_gather) as an in-place op whose wait does not read the
    input, so it would reuse the input's buffer for work between the issue and the wait: the gathered parameters
    came back wrong (bench/compare.py's loss check, test_parity). The second wait is a no-op at run time; to
    inductor it is a mutation of the input, which keeps the buffer until then, in one graph or, across regions,
    by handing it to the region that waits. `inductor_force_stride_order` realizes the input once: without it the
    collective and the wait would each get their own copy of an unrealized input (layout constraints copy)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    order = {n: k for k, n in enumerate(graph.nodes)}
    for c in list(graph.nodes):
        x = c.args[0] if c.op == "call_function" and c.args else None
        if not isinstance(x, fx.Node) or not input_held_until_wait(c) or not isinstance(x.meta.get("val"),
                                                                                          torch.Tensor):
            continue
        waits = collectives.waits_of(c)
        if not waits:
            continue
        with graph.inserting_before(c):
            held = graph.call_function(inductor_prims.force_stride_order, (x, list(x.meta["val"].stride())))
        held.meta["val"] = x.meta["val"]
        c.args = (held, *c.args[1:])
        with graph.inserting_after(max(waits, key=order.__getitem__)):
            graph.call_function(_WAIT, (held,)).meta["val"] = x.meta["val"]
    return fx.GraphModule(gm, graph)
