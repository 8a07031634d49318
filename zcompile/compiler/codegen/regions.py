"""Regional inductor compile: a transformed graph is cut into one region per repeated module (a transformer block),
each distinct block region is compiled once, the head and loss over a real vocabulary are compiled once, and the
rest runs eagerly.

The passes schedule the whole model as one graph (prefetch and bucketing cross block boundaries), but inductor's code
generation grows with graph size. A transformer's graph repeats block after block: the same ops on the same shapes,
fed by other parameters, with the collectives the passes placed among them. Each region is rebuilt as a graph of its
own with canonical names, so identical regions print the same code; a block region is compiled the first time its
(code, input layouts) appears and reused for every other occurrence. What lies outside the blocks (embeddings, the
final norm, head and loss, the collectives' glue between blocks) runs as its FX code, once per step, unless running
it op by op would write many times a block's elementwise temporaries (planning/region_cuts.py, where the cut and
this choice are made): the cross-entropy over a 50k vocabulary, decomposed, is a chain of logits-sized kernels,
slower than all the blocks together on CPU and most of the step's memory on GPU; that region (and its backward) is compiled. Block regions doing the same work share one
compile whatever each hands on to later regions. Cold compile then costs one block's forward and one block's backward
at any depth (two backward where the blocks were inlined before AOTAutograd: its partitioner saves block 0's first
norm differently).

The regions run in order from a flat list of slots; a value is dropped after its last use, as in one graph.

`nest_blocks` (regional_compile 'nested') makes the same cut into one graph for inductor that calls each distinct
block region's body (invoke_subgraph): each body is compiled once, the rest is compiled with the graph, and nothing
runs eagerly.
"""
from __future__ import annotations

import contextlib
import dataclasses
import operator
from typing import Callable

import torch
import torch.fx as fx
from torch._guards import TracingContext
from torch.fx.experimental.symbolic_shapes import free_symbols

from zcompile.compiler.graph.blocks import block_of
from zcompile.compiler.graph.meta_keys import BLOCK
from zcompile.compiler.planning.region_cuts import block_regions, compiled_regions, constants, holds


def _copy_order(nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node],
                const: set[fx.Node]) -> list[fx.Node]:
    """The nodes a region's own graph holds after its `inputs`, in the order they are created: each node of the
    region, a constant computed in another region recomputed (and a get_attr read) where first needed, a constant
    computed here only if it is returned (else where read). One order for building a region and for keying it."""
    placed, order = set(inputs), []

    def need(a: fx.Node) -> None:
        if a in placed:
            return
        if a.op != "get_attr" and a not in const:
            raise KeyError(f"region reads {a.name} before it is computed")
        place(a)

    def place(n: fx.Node) -> None:
        for a in n.all_input_nodes:
            need(a)
        placed.add(n)
        order.append(n)

    wanted = set(outputs)
    for n in nodes:
        if n not in placed and (n not in const or n in wanted):
            place(n)
    for o in outputs:
        need(o)
    return order


def _region_module(gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node],
                   const: set[fx.Node]) -> fx.GraphModule:
    """`nodes` as a graph of their own: `inputs` become placeholders, `outputs` the outputs, constants of other
    regions are recomputed; names are made fresh (from the ops), so two regions doing the same thing print the
    same code. Of the meta, values and each node's block (meta_keys.BLOCK) are kept."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for k, x in enumerate(inputs):
        env[x] = g.placeholder(f"in{k}")
        env[x].meta["val"] = x.meta["val"]
    for n in _copy_order(nodes, inputs, outputs, const):
        if n.op == "get_attr":  # a constant of the graph: each region reads its own copy
            env[n] = g.get_attr(n.target)
            env[n].meta.update({k: v for k, v in n.meta.items() if k == "val"})
        else:
            env[n] = g.create_node(n.op, n.target, *fx.map_arg((n.args, n.kwargs), env.__getitem__))
            env[n].meta.update({k: v for k, v in n.meta.items() if k in ("val", "tensor_meta")})
            if block := block_of(n):  # for inductor's fusion choices (inductor.block_local_fusion)
                env[n].meta[BLOCK] = block
    g.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(gm, g)


def _region_key(gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node],
                const: set[fx.Node]) -> tuple:
    """What _region_module(gm, nodes, inputs, outputs, const) builds, without building it: its nodes in the same
    order, each as (op, target, arguments by position in the region), and its outputs. Two regions with equal keys
    print the same code (and read the same constants); building a module per region to compare code cost seconds
    on a deep model (the code generation of each)."""
    at = {x: k for k, x in enumerate(inputs)}
    ops = []
    for n in _copy_order(nodes, inputs, outputs, const):
        ops.append(("get_attr", n.target, id(getattr(gm, n.target))) if n.op == "get_attr"
                   else (n.op, n.target, repr(fx.map_arg((n.args, n.kwargs), at.__getitem__))))
        at[n] = len(at)
    return len(inputs), tuple(ops), tuple(at[o] for o in outputs)


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
def _swapped(obj, attr: str, value):
    """`obj.attr` set to `value` for the block (nothing where `obj` is None)."""
    if obj is None:
        yield
        return
    old = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, old)


def no_output_strides():
    """Each region's compile would report its output strides to AOTAutograd, which expects one report per graph
    (and a trial compile, the memory planner's, none)."""
    return _swapped(TracingContext.try_get(), "output_strides", None)


def donated_inputs(positions: list[int] | None = None):
    """Inductor lets a backward graph reuse, in place, the inputs AOTAutograd lists as donated (saved activations
    nothing else holds), by their positions in the whole backward. A region or a block body has positions of its
    own, and an input it receives may still be read by a later region: it donates `positions` (default none). A
    region's code may serve other regions and other graphs (inductor's graph cache does not key on the list), so
    only a graph compiled as one region donates, AOTAutograd's inputs at its own positions."""
    meta = getattr(TracingContext.try_get(), "fw_metadata", None)
    return _swapped(meta, "bw_donated_idxs", list(positions or []))


@dataclasses.dataclass
class RegionLayout:
    nodes: list[fx.Node]       # the region's computing nodes, in order
    inputs: list[fx.Node]      # its inputs, in the order of its compiled code's arguments
    freed: set[fx.Node]        # the inputs it reads last: the program drops them as it starts
    code: str | None           # the wrapper code inductor generated (None: run eagerly)


class RegionProgram:
    """Runs the compiled regions in order over a list of slots: the graph's inputs first, then every value a region
    hands to a later one. Boxed calling convention (takes a list, clears it)."""

    def __init__(self, steps: list, outputs: list, num_slots: int, regions: int, compiled: int,
                 compiled_regions: int, layout: list | None = None):
        self._boxed_call = True  # an instance attribute: wrappers copy __dict__ (functools.wraps)
        self.steps, self.outputs, self.num_slots = steps, outputs, num_slots
        self.layout = layout or []  # per step: its RegionLayout (what wrapper_memory needs of it)
        self.regions, self.compiled = regions, compiled  # how many regions, how many distinct ones were compiled
        self.compiled_regions = compiled_regions  # how many regions run compiled code (the others run eagerly)

    def __call__(self, args: list):
        env = list(args) + [None] * (self.num_slots - len(args))
        args.clear()
        for fn, ins, outs, frees in self.steps:
            a = [env[i] for i in ins]
            for i in frees:
                env[i] = None
            for i, v in zip(outs, fn(a)):
                if i is not None:  # None: a value another occurrence of this region hands on, not this one
                    env[i] = v
        return [env[o] if isinstance(o, int) else o[0] for o in self.outputs]


def compile_regions(gm: fx.GraphModule, example_inputs: list, compile_one: Callable, min_reuse: float = 0.0,
                    by_block: bool = True) -> RegionProgram | None:
    """Cut `gm` into regions (block_regions), compile each distinct block region with compile_one(region_gm, fakes) and
    return the program that runs them. The regions outside the blocks (embeddings, the final norm, head and loss,
    gather issues) run eagerly, each once per step (compiling one costs as much as a block's region), except those
    heavy enough to compile (compiled_regions: the loss over a real vocabulary). Reports the whole graph's output
    strides to AOTAutograd, as one compile would. None, compiling nothing, when the block regions do not repeat
    enough: fewer than `min_reuse` per distinct one (each compile has a fixed cost; on a shallow model one graph
    compiles faster). Without blocks (or `by_block` false) the graph is one region, compiled."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    slot = {n: k for k, n in enumerate(phs)}
    regions, holds_block = block_regions(gm.graph, by_block)
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
    compiled_here = compiled_regions(regions, holds_block, last_reader, kept)
    wanted = [[n for n in nodes if n in last_reader or n in kept] for nodes in regions]
    returned = _union_outputs(gm, regions, region_inputs, wanted, compiled_here, const)
    planned = []  # (key, nodes, inputs, outputs returned, compiled) per region
    for nodes, inputs, outputs, compiled in zip(regions, region_inputs, returned, compiled_here):
        key = (_region_key(gm, nodes, inputs, outputs, const), tuple(_layout(x.meta["val"]) for x in inputs))
        planned.append((key, nodes, inputs, outputs, compiled))
    keys = [key for (key, _, _, _, compiled), block in zip(planned, holds_block) if compiled and block]
    if len(keys) < min_reuse * len(set(keys)):
        return None
    from torch._inductor.utils import get_donated_idxs  # (inductor's import is left to the compile)
    donated = set(get_donated_idxs() or ())  # AOTAutograd's, by placeholder position
    cache: dict[tuple, Callable] = {}  # compiled regions by key
    eager: dict[tuple, Callable] = {}  # regions run eagerly by key: one module serves every region doing the same
    steps, layout = [], []
    with no_output_strides():
        for r, (key, nodes, inputs, outputs, compiled) in enumerate(planned):
            found = cache if compiled else eager
            if key not in found:
                sub = _region_module(gm, nodes, inputs, outputs, const)
                with donated_inputs([k for k, x in enumerate(inputs) if x.op == "placeholder" and slot[x] in donated]
                                    if len(regions) == 1 else None):
                    found[key] = compile_one(sub, [x.meta["val"] for x in inputs]) if compiled else _run_eagerly(sub)
            fn = found[key]
            mine = set(wanted[r])
            steps.append((fn, [slot[x] for x in inputs], [slot[o] if o in mine else None for o in outputs],
                          frees.get(r, [])))
            layout.append(RegionLayout(nodes, inputs, {x for x in inputs if last_reader.get(x) == r and x not in kept},
                                       getattr(fn, "source_code", None) if compiled else None))
    # placeholders nothing reads are dropped at once: no region frees them
    unread = [slot[p] for p in phs if p not in last_reader and p not in kept]
    if unread and steps:
        steps[0] = (*steps[0][:3], steps[0][3] + unread)
    outputs = [slot[o] if isinstance(o, fx.Node) else (o,) for o in graph_outs]
    tc = TracingContext.try_get()
    if tc is not None and tc.output_strides is not None:
        tc.output_strides.extend(tuple(o.meta["val"].stride()) if isinstance(o, fx.Node)
                                 and isinstance(o.meta.get("val"), torch.Tensor) else None for o in graph_outs)
    return RegionProgram(steps, outputs, len(slot), len(regions), len(cache), sum(c for *_, c in planned), layout)


def _union_outputs(gm: fx.GraphModule, regions: list, region_inputs: list, wanted: list, compiled: list,
                   const: set) -> list[list[fx.Node]]:
    """The values each region returns: those later regions read (`wanted`), and for a compiled region also what any
    region doing the same work (the same code and input layouts whatever it returns) hands on, so that one compile
    serves them all. Block 0 differs from the others only in which of its first norm's values the partitioner
    saves."""
    position: dict[tuple, set[int]] = {}
    bodies = []
    for nodes, inputs, outputs, comp in zip(regions, region_inputs, wanted, compiled):
        body, returned_consts = None, [o for o in outputs if o in const]  # computed here only because returned
        computed = [n for n in nodes if n not in const or n in returned_consts]
        if comp:
            body = (_region_key(gm, nodes, inputs, returned_consts, const),
                    tuple(_layout(x.meta["val"]) for x in inputs))
            at = {n: k for k, n in enumerate(computed)}
            position.setdefault(body, set()).update(at[o] for o in outputs)
        bodies.append((body, computed))
    return [[computed[k] for k in sorted(position[body])] if body is not None else outputs
            for outputs, (body, computed) in zip(wanted, bodies)]


def _run_eagerly(sub: fx.GraphModule) -> Callable:
    """The region's graph run op by op, without what hold_collective_inputs added for inductor's buffer reuse:
    eagerly a tensor is realized and lives as long as it is referenced, and the eager `force_stride_order` copies
    its input every time (a copy of each gathered bucket per step: seen as +47% step time on an H200 and on CPU,
    2026-11-26)."""
    from torch._inductor import inductor_prims
    for n in list(sub.graph.nodes):
        if n.op != "call_function":
            continue
        if n.target is inductor_prims.force_stride_order:
            n.replace_all_uses_with(n.args[0])
            sub.graph.erase_node(n)
        elif holds(n):
            sub.graph.erase_node(n)
        elif n.target is torch.ops.prims.convert_element_type.default:  # aten's: one C++ op, not the prim's Python
            n.target, n.args, n.kwargs = torch.ops.aten._to_copy.default, n.args[:1], {"dtype": n.args[1]}
    sub.recompile()

    def run(args: list):
        return sub(*args)
    return run


def nest_blocks(gm: fx.GraphModule) -> fx.GraphModule | None:
    """`gm` as one graph for inductor in which each block region (block_regions) is a call of its body
    (invoke_subgraph), one body per distinct region (the same code and input layouts, as compile_regions keys
    them): inductor lowers each body once and calls it from one compiled graph, so a step makes one graph call per
    forward and backward and runs no glue eagerly. None where there are no block regions, or where a block region
    takes a size (a dynamic dim's SymInt: inductor's subgraph calls take tensors only)."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    regions, holds_block = block_regions(gm.graph)
    if not any(holds_block):
        return None
    const = constants(gm.graph)
    (graph_outs,) = gm.graph.output_node().args
    size_of = {n.meta["val"].node.expr: n for n in phs if isinstance(n.meta.get("val"), torch.SymInt)}
    region_inputs = [_inputs(nodes, const, size_of) for nodes in regions]
    if any(not isinstance(x.meta.get("val"), torch.Tensor)
           for inputs, block in zip(region_inputs, holds_block) if block for x in inputs):
        return None
    read_later = {a for inputs in region_inputs for a in inputs}
    kept = {o for o in graph_outs if isinstance(o, fx.Node)}
    wanted = [[n for n in nodes if n in read_later or n in kept] for nodes in regions]
    returned = _union_outputs(gm, regions, region_inputs, wanted, holds_block, const)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in phs:
        env[p] = g.node_copy(p, env.__getitem__)
    bodies: dict[tuple, fx.Node] = {}  # region key -> the get_attr of its body (one per body: inductor lowers a
    calls = []                          # body once per get_attr node)
    for nodes, inputs, outputs, block in zip(regions, region_inputs, returned, holds_block):
        body = None
        if block:
            key = (_region_key(gm, nodes, inputs, outputs, const), tuple(_layout(x.meta["val"]) for x in inputs))
            if key not in bodies:
                name = f"zc_block_{len(bodies)}"
                setattr(gm, name, _region_module(gm, nodes, inputs, outputs, const))
                bodies[key] = g.get_attr(name)
            body = bodies[key]
        calls.append((nodes, inputs, outputs, body))

    def need(a: fx.Node) -> fx.Node:
        """`a`'s node in the new graph; a constant (or get_attr) no region before computed is computed here."""
        if a not in env:
            if a.op != "get_attr" and a not in const:
                raise KeyError(f"the nested graph reads {a.name} before it is computed")
            for x in a.all_input_nodes:
                need(x)
            env[a] = g.node_copy(a, env.__getitem__)
        return env[a]

    for nodes, inputs, outputs, body in calls:
        if body is None:  # the work outside the blocks: embeddings, head and loss, the collectives' glue
            for n in nodes:
                for x in n.all_input_nodes:
                    need(x)
                env[n] = g.node_copy(n, env.__getitem__)
            continue
        call = g.call_function(torch.ops.higher_order.invoke_subgraph, (body, body.target, *map(need, inputs)))
        call.meta["val"] = tuple(o.meta["val"] for o in outputs)
        for k, o in enumerate(outputs):
            if o in read_later or o in kept:  # not what only another call of this body hands on
                env[o] = g.call_function(operator.getitem, (call, k))
                env[o].meta["val"] = o.meta["val"]
    g.output(tuple(need(o) if isinstance(o, fx.Node) else o for o in graph_outs))
    return fx.GraphModule(gm, g)
