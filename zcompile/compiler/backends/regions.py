"""Regional inductor compile: a transformed graph is cut into regions where it moves from one repeated module
(a transformer block) to the next, and each distinct region is compiled once.

The passes schedule the whole model as one graph (prefetch and bucketing cross block boundaries), but inductor's
code generation grows with graph size. A transformer's graph repeats block after block: the same ops on the same
shapes, fed by other parameters, with the collectives the passes placed among them. Each region is rebuilt as a
graph of its own with canonical names, so identical regions print the same code; a region is compiled the first time its (code, input layouts) appears and
reused for every other occurrence. Cold compile then costs about one block's forward and backward, at any depth.

The regions run in order from a flat list of slots; a value is dropped after its last use, as in one graph.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.fx as fx
from torch._guards import TracingContext

from zcompile.compiler import collectives
from zcompile.compiler.blocks import block_of
from zcompile.compiler.liveness import input_held_until_wait

_WAIT = torch.ops._c10d_functional.wait_tensor.default


def _issued_here(wait: fx.Node, region: list[fx.Node], pos: dict) -> bool:
    """`wait` waits for a collective issued in `region` with other work between the two, which reads its input
    meanwhile: inside one compiled graph inductor may reuse that input's buffer for the work in between (it treats
    the `_out` all-gather as an in-place op), so the wait goes to the next region and the input is held for it."""
    c = collectives.collective_of(wait)
    return (bool(region) and pos.get(c, -1) >= pos[region[0]] and pos[wait] - pos[c] > 1
            and input_held_until_wait(c))


def split(graph: fx.Graph, by_block: bool = True) -> list[list[fx.Node]]:
    """The graph's computing nodes in regions, in order: a new region starts where the nodes move to another
    repeated module (another transformer block; with `by_block`) and at the wait of a collective issued in the
    current region with work in between, unless a value that is not a tensor (a tuple of a multi-output op) would
    cross the cut."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    pos = {n: k for k, n in enumerate(nodes)}
    last = {n: max((pos.get(u, len(nodes)) for u in n.users), default=-1) for n in nodes}
    regions: list[list[fx.Node]] = [[]]
    live: set[fx.Node] = set()
    current = None
    for k, n in enumerate(nodes):
        live = {x for x in live if last[x] >= k}
        block = block_of(n) if by_block else None
        new_block = block is not None and block != current
        in_flight = n.target is _WAIT and _issued_here(n, regions[-1], pos)
        if (new_block or in_flight) and regions[-1] and all(isinstance(x.meta.get("val"), torch.Tensor)
                                                            for x in live):
            regions.append([])
        if new_block:
            current = block
        regions[-1].append(n)
        live.add(n)
    return [r for r in regions if r]


def _region_module(gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]
                   ) -> fx.GraphModule:
    """`nodes` as a graph of their own: `inputs` become placeholders, `outputs` the outputs; names are made fresh
    (from the ops), so two regions doing the same thing print the same code."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for k, x in enumerate(inputs):
        env[x] = g.placeholder(f"in{k}")
        env[x].meta["val"] = x.meta["val"]

    def arg(a: fx.Node) -> fx.Node:
        if a not in env and a.op == "get_attr":  # a constant of the graph: each region reads its own copy
            env[a] = g.get_attr(a.target)
            env[a].meta.update({k: v for k, v in a.meta.items() if k == "val"})
        return env[a]

    for n in nodes:
        args, kwargs = fx.map_arg((n.args, n.kwargs), arg)
        env[n] = g.create_node(n.op, n.target, args, kwargs)
        env[n].meta.update({k: v for k, v in n.meta.items() if k in ("val", "tensor_meta")})
    g.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(gm, g)


def _layout(v) -> tuple:
    return (tuple(v.shape), tuple(v.stride()), v.dtype, str(v.device)) if isinstance(v, torch.Tensor) else (repr(v),)


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
        for fn, ins, outs, frees, frees_after in self.steps:
            a = [env[i] for i in ins]
            for i in frees:
                env[i] = None
            for i, v in zip(outs, fn(a)):
                env[i] = v
            for i in frees_after:
                env[i] = None
        return [env[o] if isinstance(o, int) else o[0] for o in self.outputs]


def _in_flight(regions: list[list[fx.Node]], where: dict) -> dict[fx.Node, int]:
    """Inputs of a collective that is waited on in a later region than it starts in -> the waiting region. The
    collective reads them until then: one graph keeps them alive to its wait, so must the program (inside the
    issuing region inductor would reuse their buffers). The same rule as the planner's (liveness)."""
    pins: dict[fx.Node, int] = {}
    for r, nodes in enumerate(regions):
        for w in nodes:
            if w.target is not _WAIT:
                continue
            c = collectives.collective_of(w)
            if where.get(c, r) == r or not input_held_until_wait(c):
                continue
            for x in c.all_input_nodes:
                if x.op != "get_attr":
                    pins[x] = max(pins.get(x, r), r)
    return pins


def compile_regions(gm: fx.GraphModule, example_inputs: list, compile_one: Callable, min_reuse: float = 0.0,
                    by_block: bool = True) -> RegionProgram | None:
    """Cut `gm` into regions (split), compile each distinct one with compile_one(region_gm, fake_inputs) and return
    the program that runs them. Reports the whole graph's output strides to AOTAutograd, as one compile would.
    None, compiling nothing, when the regions do not repeat enough: fewer than `min_reuse` regions per distinct one
    (each compile has a fixed cost; on a shallow model one graph compiles faster)."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    slot = {n: k for k, n in enumerate(phs)}
    regions = split(gm.graph, by_block)
    where = {n: r for r, nodes in enumerate(regions) for n in nodes}
    out_node = gm.graph.output_node()
    (graph_outs,) = out_node.args
    for nodes in regions:
        for n in nodes:
            slot[n] = len(slot)
    last_reader: dict[fx.Node, int] = {}  # value -> index of the last region reading it
    for r, nodes in enumerate(regions):
        for n in nodes:
            for a in n.all_input_nodes:
                if a.op != "get_attr" and where.get(a) != r:
                    last_reader[a] = r
    pins = _in_flight(regions, where)
    kept = {o for o in graph_outs if isinstance(o, fx.Node)}  # the graph's outputs stay to the end
    frees_before: dict[int, list[int]] = {}  # region -> slots dropped as it starts (it reads them last)
    frees_after: dict[int, list[int]] = {}  # region -> slots dropped once it ran (a collective read them)
    for x in set(last_reader) | set(pins):
        if x in kept:
            continue
        if pins.get(x, -1) >= last_reader.get(x, -1):
            frees_after.setdefault(pins[x], []).append(slot[x])
        else:
            frees_before.setdefault(last_reader[x], []).append(slot[x])
    planned = []  # (region module, key, inputs, outputs) per region
    for nodes in regions:
        inside = set(nodes)
        inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes
                                    if a not in inside and a.op != "get_attr"))
        outputs = [n for n in nodes if n in pins or any(u not in inside for u in n.users)]
        sub = _region_module(gm, nodes, inputs, outputs)
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
            steps.append((cache[key], [slot[x] for x in inputs], [slot[o] for o in outputs],
                          frees_before.get(r, []), frees_after.get(r, [])))
    # placeholders nothing reads are dropped at once: no region frees them
    unread = [slot[p] for p in phs if p not in last_reader and p not in kept and p not in pins]
    if unread and steps:
        steps[0] = (*steps[0][:3], steps[0][3] + unread, steps[0][4])
    outputs = [slot[o] if isinstance(o, fx.Node) else (o,) for o in graph_outs]
    tc = TracingContext.try_get()
    if tc is not None and tc.output_strides is not None:
        tc.output_strides.extend(tuple(o.meta["val"].stride()) if isinstance(o, fx.Node)
                                 and isinstance(o.meta.get("val"), torch.Tensor) else None for o in graph_outs)
    return RegionProgram(steps, outputs, len(slot), len(regions), len(cache))
