"""Regional inductor compile: a transformed graph is cut into regions where it reaches the next repeated module
(a transformer block), and each distinct region is compiled once.

The passes schedule the whole model as one graph (prefetch and bucketing cross block boundaries), but inductor's
code generation grows with graph size. A transformer's graph repeats block after block: the same ops on the same
shapes, fed by other parameters, with the collectives the passes placed among them. Each region is rebuilt as a
graph of its own with canonical names, so identical regions print the same code; a region is compiled the first
time its (code, input layouts) appears and reused for every other occurrence. Cold compile then costs the first,
a middle and the last block's forward and backward, at any depth.

The regions run in order from a flat list of slots; a value is dropped after its last use, as in one graph.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.fx as fx
from torch._guards import TracingContext
from torch.fx.experimental.symbolic_shapes import free_symbols

from zcompile.compiler.blocks import block_of
from zcompile.compiler.collectives import KEY


def split(graph: fx.Graph, by_block: bool = True) -> list[list[fx.Node]]:
    """The graph's computing nodes in regions, in order: with `by_block`, a new region starts at each repeated module
    (a transformer block) the nodes reach for the first time, after the first. Everything else stays in the current
    region: the passes' collectives and copies, other modules (embeddings join the first block, the head and loss
    the last), and nodes of a block seen before (a saved activation's transpose at the end of the forward). No cut
    where a value that is neither a tensor nor a size (a dynamic dim's SymInt) would cross: a tuple of a
    multi-output op. Without `by_block`, one region."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    last = {n: -1 for n in nodes}
    for k, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[a] = k
    for a in graph.output_node().all_input_nodes:
        last[a] = len(nodes)
    regions: list[list[fx.Node]] = [[]]
    live: set[fx.Node] = set()
    seen: set[str] = set()
    for k, n in enumerate(nodes):
        live = {x for x in live if last[x] >= k}
        block = block_of(n) if by_block else None
        if block and block not in seen:
            if seen and all(isinstance(x.meta.get("val"), (torch.Tensor, torch.SymInt)) for x in live):
                regions.append([])
            seen.add(block)
        regions[-1].append(n)
        live.add(n)
    return [r for r in regions if r]


def constants(graph: fx.Graph) -> set[fx.Node]:
    """Pure nodes computed from no graph input (a causal mask, an arange, a -inf scalar): each region computes the
    ones it reads itself rather than taking them from the region that first needed them, so that region's code
    stays the same as the next block's (and inductor can fuse them into their readers). Also when the graph
    returns one (the forward saves the positions' arange for the embedding's backward): the output node counts as
    impure, but it does not write into it."""
    const: set[fx.Node] = set()
    for n in graph.nodes:
        if (n.op == "call_function" and not n.is_impure() and KEY not in n.meta
                and all(a in const or a.op == "get_attr" for a in n.all_input_nodes)
                and not any(u.op != "output" and u.is_impure() for u in n.users)):  # no op writes into it
            const.add(n)
    return const


def _region_module(gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node],
                   const: set[fx.Node]) -> fx.GraphModule:
    """`nodes` as a graph of their own: `inputs` become placeholders, `outputs` the outputs, constants of other
    regions are recomputed; names are made fresh (from the ops), so two regions doing the same thing print the
    same code."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for k, x in enumerate(inputs):
        env[x] = g.placeholder(f"in{k}")
        env[x].meta["val"] = x.meta["val"]

    def copy(n: fx.Node) -> fx.Node:
        args, kwargs = fx.map_arg((n.args, n.kwargs), arg)
        new = g.create_node(n.op, n.target, args, kwargs)
        new.meta.update({k: v for k, v in n.meta.items() if k in ("val", "tensor_meta")})
        return new

    def arg(a: fx.Node) -> fx.Node:
        if a not in env and a.op == "get_attr":  # a constant of the graph: each region reads its own copy
            env[a] = g.get_attr(a.target)
            env[a].meta.update({k: v for k, v in a.meta.items() if k == "val"})
        elif a not in env and a in const:  # computed in another region: recompute it here
            env[a] = copy(a)
        return env[a]

    wanted = set(outputs)
    for n in nodes:
        if n not in env and (n not in const or n in wanted):  # a constant is computed where first read, as above
            env[n] = copy(n)
    g.output(tuple(arg(o) for o in outputs))
    return fx.GraphModule(gm, g)


def _inputs(nodes: list[fx.Node], const: set[fx.Node], size_of: dict) -> list[fx.Node]:
    """What a region reads from outside it, plus the graph's size inputs (SymInt placeholders) of every dynamic
    dim in those values' shapes: inductor binds a size symbol from a SymInt argument, and its FX graph cache
    evaluates a cached graph's shape guards over the SymInt arguments only."""
    inside = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes
                                if a not in inside and a.op != "get_attr" and a not in const))
    symbols = set().union(*(free_symbols(a.meta.get("val")) for a in inputs)) if size_of else set()
    inputs += [size_of[s] for s in sorted(symbols, key=str) if s in size_of and size_of[s] not in inputs]
    return inputs


def _layout(v) -> tuple:
    """What a compiled region depends on in one input: sizes and strides, dtype, device; a dynamic size (a SymInt,
    also as an input of its own) by its expression in the graph's size symbols, which one compile serves for every
    value."""
    if isinstance(v, torch.Tensor):
        return (tuple(map(str, v.shape)), tuple(map(str, v.stride())), v.dtype, str(v.device))
    return ("SymInt", str(v)) if isinstance(v, torch.SymInt) else (repr(v),)


@contextlib.contextmanager
def _no_output_strides():
    """Each region's compile would report its output strides to AOTAutograd, which expects one report per graph."""
    tc = TracingContext.try_get()
    old = tc.output_strides if tc is not None else None
    if tc is not None:
        tc.output_strides = None
    try:
        yield
    finally:
        if tc is not None:
            tc.output_strides = old


class RegionProgram:
    """Runs the compiled regions in order over a list of slots: the graph's inputs first, then every value a region
    hands to a later one. Boxed calling convention (takes a list, clears it)."""

    def __init__(self, steps: list, outputs: list, num_slots: int, regions: int, compiled: int):
        self._boxed_call = True  # an instance attribute: wrappers copy __dict__ (functools.wraps)
        self.steps, self.outputs, self.num_slots = steps, outputs, num_slots
        self.regions, self.compiled = regions, compiled  # how many regions, how many distinct ones were compiled

    def __call__(self, args: list):
        env = list(args) + [None] * (self.num_slots - len(args))
        args.clear()
        for fn, ins, outs, frees in self.steps:
            a = [env[i] for i in ins]
            for i in frees:
                env[i] = None
            for i, v in zip(outs, fn(a)):
                env[i] = v
        return [env[o] if isinstance(o, int) else o[0] for o in self.outputs]


def compile_regions(gm: fx.GraphModule, example_inputs: list, compile_one: Callable, min_reuse: float = 0.0,
                    by_block: bool = True) -> RegionProgram | None:
    """Cut `gm` into regions (split), compile each distinct one with compile_one(region_gm, fake_inputs) and return
    the program that runs them. Reports the whole graph's output strides to AOTAutograd, as one compile would.
    None, compiling nothing, when the regions do not repeat enough: fewer than `min_reuse` regions per distinct one
    (each compile has a fixed cost; on a shallow model one graph compiles faster)."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    slot = {n: k for k, n in enumerate(phs)}
    regions = split(gm.graph, by_block)
    const = constants(gm.graph)
    out_node = gm.graph.output_node()
    (graph_outs,) = out_node.args
    for nodes in regions:
        for n in nodes:
            slot[n] = len(slot)
    size_of = {n.meta["val"].node.expr: n for n in phs if isinstance(n.meta.get("val"), torch.SymInt)}
    region_inputs = [_inputs(nodes, const, size_of) for nodes in regions]
    last_reader: dict[fx.Node, int] = {}  # value read by a later region -> the last region reading it
    for r, inputs in enumerate(region_inputs):
        for a in inputs:
            last_reader[a] = r
    kept = {o for o in graph_outs if isinstance(o, fx.Node)}  # the graph's outputs stay to the end
    frees: dict[int, list[int]] = {}  # region -> slots dropped as it starts (it reads them last)
    for x, r in last_reader.items():
        if x not in kept:
            frees.setdefault(r, []).append(slot[x])
    planned = []  # (region module, key, inputs, outputs) per region
    for nodes, inputs in zip(regions, region_inputs):
        outputs = [n for n in nodes if n in last_reader or n in kept]
        sub = _region_module(gm, nodes, inputs, outputs, const)
        consts = tuple(id(getattr(gm, n.target)) for n in sub.graph.nodes if n.op == "get_attr")
        planned.append((sub, (sub.code, tuple(_layout(x.meta["val"]) for x in inputs), consts), inputs, outputs))
    if len(regions) < min_reuse * len({key for _, key, _, _ in planned}):
        return None
    cache: dict[tuple, Callable] = {}
    steps = []
    with _no_output_strides():
        for r, (sub, key, inputs, outputs) in enumerate(planned):
            if key not in cache:
                cache[key] = compile_one(sub, [x.meta["val"] for x in inputs])
            steps.append((cache[key], [slot[x] for x in inputs], [slot[o] for o in outputs], frees.get(r, [])))
    # placeholders nothing reads are dropped at once: no region frees them
    unread = [slot[p] for p in phs if p not in last_reader and p not in kept]
    if unread and steps:
        steps[0] = (*steps[0][:3], steps[0][3] + unread)
    outputs = [slot[o] if isinstance(o, fx.Node) else (o,) for o in graph_outs]
    tc = TracingContext.try_get()
    if tc is not None and tc.output_strides is not None:
        tc.output_strides.extend(tuple(o.meta["val"].stride()) if isinstance(o, fx.Node)
                                 and isinstance(o.meta.get("val"), torch.Tensor) else None for o in graph_outs)
    return RegionProgram(steps, outputs, len(slot), len(regions), len(cache))
