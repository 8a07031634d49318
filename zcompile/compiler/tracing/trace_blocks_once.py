"""Dynamo traces each repeated block once: dtensor_params.mark_blocks marks the blocks of a sharded model as nested
compile regions, so dynamo traces the first block's body and stamps it out for the others (an `invoke_subgraph`
call per block, checked against the traced one's guards), and the backend inlines those calls back into one flat
graph before anything else reads it. The passes, AOTAutograd and the regions see the graph they always saw; only
dynamo's work stops growing with depth (it inlined every block's Python code).

Each block's nodes keep a module stack of their own block (`blocks.3`, not the traced `blocks.0`): the regions and
the buckets find the blocks by it (compiler/graph/blocks.py).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx


def inline(gm: fx.GraphModule, recompile: bool = True) -> int:
    """Replace every `invoke_subgraph` call in `gm` (dynamo's graph) by the nodes of its subgraph, nested calls
    and calls inside other higher-order ops' bodies (an activation checkpoint) too; a node's module stack names
    the block of its call. Returns how many calls were inlined. `recompile` false: the caller regenerates `gm`'s
    code itself after more changes (on a deep model each regeneration costs a few tenths of a second)."""
    count = 0
    inlined: set = set()
    for call in calls(gm):
        sub = body_of(gm, call)
        if id(sub) not in inlined:  # one subgraph serves every block's call
            inlined.add(id(sub))
            count += inline(sub)
        rename = _stack_rename(sub, call)
        phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
        env = dict(zip(phs, call.args[2:]))
        out = None
        with gm.graph.inserting_before(call):
            for n in sub.graph.nodes:
                if n.op == "placeholder":
                    continue
                if n.op == "output":
                    out = n.args[0]
                    continue
                if n.op == "get_attr":  # a higher-order op's body inside the region: the caller holds it too
                    name = _free_name(gm, n.target)
                    setattr(gm, name, operator.attrgetter(n.target)(sub))
                    new = gm.graph.get_attr(name)
                    new.meta = dict(n.meta)
                else:
                    new = gm.graph.node_copy(n, lambda x: env[x])
                for key in _STACKS:
                    if n.meta.get(key):
                        new.meta[key] = rename(n.meta[key])
                env[n] = new
        results = [env[o] if isinstance(o, fx.Node) else o for o in out]
        for user in list(call.users):
            assert user.target is operator.getitem, user.format_node()
            user.replace_all_uses_with(results[user.args[1]])
            gm.graph.erase_node(user)
        getter = call.args[0]
        gm.graph.erase_node(call)
        if not getter.users:
            gm.graph.erase_node(getter)
            if not any(n.op == "get_attr" and n.target == getter.target for n in gm.graph.nodes):
                delattr(gm, getter.target)
        count += 1
    for body in gm.children():
        if isinstance(body, fx.GraphModule) and id(body) not in inlined:
            count += inline(body)
    if count:
        gm.graph.lint()
        if recompile:
            gm.recompile()
    return count


def calls(gm: fx.GraphModule) -> list[fx.Node]:
    """The `invoke_subgraph` calls of `gm` (not inside other bodies)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph]


def body_of(gm: fx.GraphModule, call: fx.Node) -> fx.GraphModule:
    return getattr(gm, call.args[0].target)


def forget_reuse() -> None:
    """Drop dynamo's record of the traced regions once the frame's graph is inlined (no invoke_subgraph is left
    for AOTAutograd): the record lives in the tracing context, which AOTAutograd keeps for the lazy backward
    compile as long as the compiled graph lives, and its guards hold weak references to the traced block's
    parameters (torch.utils.swap_tensors, in model.to(), refuses to swap them) and its variables the block."""
    from torch._guards import HopDispatchSetCache, TracingContext
    ctx = TracingContext.try_get()
    if ctx is not None:
        ctx.hop_dispatch_set_cache = HopDispatchSetCache()


# A forward node's module stack; a backward node (a region's partitioned backward: keep_block_regions) carries
# its forward node's under the second key (AOTAutograd's copy_fwd_metadata_to_bw_nodes).
_STACKS = ("nn_module_stack", "fwd_nn_module_stack")


def _stack(node: fx.Node) -> dict | None:
    return node.meta.get(_STACKS[0]) or node.meta.get(_STACKS[1])


def _free_name(gm: fx.GraphModule, base: str) -> str:
    base = base.replace(".", "_")
    for k in range(1 << 20):
        name = f"{base}_{k}"
        if not hasattr(gm, name):
            return name
    raise AssertionError(base)


def _stack_rename(sub: fx.GraphModule, call: fx.Node):
    """A region node's module stack -> the stack of that node in the calling block: the call's own stack (the
    modules around the block, the block last), then the region's entries below the block, renamed from the traced
    block's path to the calling one's."""
    calling = dict(_stack(call) or {})
    if not calling:
        return lambda stack: stack
    here, cls = list(calling.values())[-1]
    traced = next(filter(None, map(_stack, sub.graph.nodes)), {})
    there = next((p for p, c in traced.values() if c is cls), None)

    def rename(stack: dict) -> dict:
        if there is None:
            return stack
        out = dict(calling)
        paths = {p for p, _ in calling.values()}
        for key, (path, c) in stack.items():
            if path == there or not path.startswith(there + "."):
                continue  # the block itself (already last in the call's stack) or what is around it
            path = here + path[len(there):]
            if path not in paths:
                out[key] = (path, c)
        return out
    return rename
