"""mixed_precision: cast parameters and floating user inputs to the compute dtype (and, if asked, outputs back).

Inserts `.to(param_dtype)` after each parameter and floating user-input placeholder of the dynamo graph, so
AOTAutograd traces bf16 compute whose gradients flow back to the fp32 master parameters through the casts. Dynamo
traced the model's code over the parameters' tokens, which are in the compute dtype already (docs/architecture.md,
"Mixed precision"): what the code derived from their dtype is bf16, and these casts make the placeholders, now the
fp32 parameters, match that; a block kept as a region (`keep_block_regions`) casts its parameter operands inside
its body, once per distinct block. Buffers are left in their own dtype (as FSDP does). The outputs stay in the
compute dtype, as with FSDP2's `MixedPrecisionPolicy` (its `output_dtype` None): a cast back of a language model's
logits is a full fp32 copy of them, with an fp32 gradient in the backward (3.3 GB each for GPT-2 124M at 16 x 1024
tokens).
`mixed_precision.output_dtype: fp32` inserts `.to(original dtype)` before each floating output, the same policy as
running the model after `.to(bf16)` with fp32 master weights.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from zcompile.compiler.tracing import block_regions, trace_blocks_once
from zcompile.compiler.graph import placement


def _is_user_input(node: fx.Node) -> bool:
    arg = node.meta.get("grapharg")
    source = getattr(arg, "source", None)
    name = node.name if source is None else source.name
    if callable(name):  # a method up to torch 2.12, a property from 2.13
        name = name()
    return "_buffers" not in name and "_parameters" not in name


def run(gm: fx.GraphModule, pctx) -> fx.GraphModule:
    dtype = pctx.cfg.mixed_precision.param_dtype
    if dtype == torch.float32:
        return gm
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    cast_bodies: dict[tuple[int, int], fx.GraphModule] = {}  # (id(body), operand) cast inside the body
    order = {n: k for k, n in enumerate(graph.nodes)}  # users are original nodes: the casts added keep it valid
    for i, ph in enumerate(placeholders):
        val = ph.meta.get("example_value", ph.meta.get("val"))
        if not isinstance(val, torch.Tensor) or not val.is_floating_point() or val.dtype == dtype:
            continue
        if i not in pctx.params and not _is_user_input(ph):
            continue
        users = list(ph.users)
        if i in pctx.params:
            users = [u for u in users if not _cast_in_regions(gm, ph, u, dtype, cast_bodies)]
        if not users:
            continue
        # at the first use, not at the top: shard_params gathers a parameter where its cast is, and every cast at
        # the top would gather the whole model before the first layer runs
        cast = placement.at_first_use(graph, ph, users, order, lambda: graph.call_method("to", (ph, dtype)))
        cast.meta["zc_note"] = f"mixed_precision: compute in {dtype}"
    for body in {id(b): b for b in cast_bodies.values()}.values():
        body.recompile()
    if pctx.cfg.mixed_precision.output_dtype is None:
        return gm
    out = graph.output_node()
    outs = out.args[0]
    new_outs = []
    for o in (outs if isinstance(outs, (tuple, list)) else (outs,)):
        val = o.meta.get("example_value") if isinstance(o, fx.Node) else None
        if isinstance(val, torch.Tensor) and val.is_floating_point() and o.op != "placeholder":
            with graph.inserting_before(out):
                o = graph.call_method("to", (o, val.dtype))
        new_outs.append(o)
    out.args = (type(outs)(new_outs) if isinstance(outs, (tuple, list)) else new_outs[0],)
    return gm


def _cast_in_regions(gm: fx.GraphModule, ph: fx.Node, user: fx.Node, dtype: torch.dtype, done: dict) -> bool:
    """A parameter handed to a block kept as a region (block_regions) is cast inside the region's body, at its
    first use there, so every block region still takes its parameters as operands (the region's partitioner and,
    once inlined, shard_params see them) and each distinct body is cast once for all its calls. True when `user`
    is such a call and reads `ph` only as parameter operands; `done` collects the bodies changed, by (id(body),
    operand), for the caller to regenerate their code once."""
    if user.target is not torch.ops.higher_order.invoke_subgraph or ph in (user.args[0], user.args[1]):
        return False
    body = trace_blocks_once.body_of(gm, user)
    phs = block_regions.placeholders(body)
    for k, a in enumerate(block_regions.operands(user)):
        if a is not ph or (id(body), k) in done:
            continue
        done[id(body), k] = body
        inner = phs[k]
        uses = list(inner.users)
        if uses:
            order = {n: j for j, n in enumerate(body.graph.nodes)}
            cast = placement.at_first_use(body.graph, inner, uses, order,
                                          lambda: body.graph.call_method("to", (inner, dtype)))
            cast.meta["zc_note"] = f"mixed_precision: compute in {dtype}"
    return True
