"""Regional inductor compile: a transformed graph is cut into one region per repeated module (a transformer block),
each distinct block region is compiled once, the head and loss over a real vocabulary are compiled once, and the
rest runs eagerly.

The passes schedule the whole model as one graph (prefetch and bucketing cross block boundaries), but inductor's code
generation grows with graph size. A transformer's graph repeats block after block: the same ops on the same shapes,
fed by other parameters, with the collectives the passes placed among them. Each region is rebuilt as a graph of its
own with canonical names, so identical regions print the same code; a block region is compiled the first time its
(code, input layouts) appears and reused for every other occurrence. What lies outside the blocks (embeddings, the
final norm, head and loss, the collectives' glue between blocks) runs as its FX code, once per step, unless running
it op by op would write many times a block's elementwise temporaries (`EAGER_MAX_BLOCKS`): the cross-entropy over a
50k vocabulary, decomposed, is a chain of logits-sized kernels, slower than all the blocks together on CPU and most
of the step's memory on GPU; that region (and its backward) is compiled. Block regions doing the same work share one
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

from zcompile.compiler.blocks import block_of
from zcompile.compiler.collectives import KEY, c10d
from zcompile.compiler.meta_keys import RELEASED


def block_regions(graph: fx.Graph, by_block: bool = True) -> tuple[list[list[fx.Node]], list[bool]]:
    """The graph's computing nodes in regions, in order, and for each whether it holds a block's work. With
    `by_block`, a new region starts at each repeated module (a transformer block) the nodes reach for the first
    time, and where they leave the blocks for another module (the final norm, head and loss; the embeddings'
    backward), so a block's region holds that block's work. The passes' collectives and copies stay in the current
    region, except what would make one block's region differ from the next: module-less nodes at the end of a region
    that read nothing it computed (the wait for the next module's bucket, its copy-out) go before the next region,
    and so does the issue of a gather fed by the graph's inputs alone (a prefetch: the bucket's shard concatenation
    and all-gather) placed before the region's first wait (the last block prefetches the final norm's bucket, of
    another size). Neither changes the order of collectives and waits; the gather moves only over work that reads
    no gathered parameter, so the overlap and the planned memory stay. Nodes of a block seen before (a saved
    activation's transpose at the end of the forward) stay in the current region; pure work on the graph's inputs
    alone that is no one block's own (`_shared_work`) goes before the block region that meets it. No cut where a
    value that is neither a tensor nor a size (a dynamic dim's SymInt) would cross: a tuple of a multi-output op.
    Without `by_block`, one region."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    if not by_block:
        return ([nodes], [False]) if nodes else ([], [])
    last = {n: -1 for n in nodes}
    for k, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[a] = k
    for a in graph.output_node().all_input_nodes:
        last[a] = len(nodes)
    issue = gather_issues(nodes)
    shared = _shared_work(nodes)
    regions: list[list[fx.Node]] = [[]]
    hoisted: dict[int, list[fx.Node]] = {}  # region -> the glue and gather issues moved before it
    in_block: list[bool] = [False]  # per region: it holds block work
    waited: list[bool] = [False]  # per region: it waited on a collective so far
    region_of: dict[fx.Node, int] = {}
    live: set[fx.Node] = set()
    seen: set[str] = set()

    def place(n: fx.Node) -> None:
        if n in issue and not waited[-1]:
            hoisted.setdefault(len(regions) - 1, []).append(n)
        else:
            regions[-1].append(n)
            region_of[n] = len(regions) - 1
        waited[-1] = waited[-1] or n.target is c10d.wait_tensor.default

    for k, n in enumerate(nodes):
        live = {x for x in live if last[x] >= k}
        block = block_of(n)
        if in_block[-1] and n in shared and all(region_of.get(a) != len(regions) - 1 for a in n.all_input_nodes):
            hoisted.setdefault(len(regions) - 1, []).append(n)
            live.add(n)
            continue
        into_block = bool(block) and block not in seen
        cut = into_block or (block == "" and in_block[-1])
        if cut and regions[-1] and all(isinstance(x.meta.get("val"), (torch.Tensor, torch.SymInt)) for x in live):
            carried = _trailing_glue(regions[-1], into_block)
            regions[-1] = [x for x in regions[-1] if x not in carried]
            regions.append([])
            in_block.append(False)
            waited.append(False)
            hoisted[len(regions) - 1] = carried
        if block and block not in seen:  # a block seen before (a saved activation's transpose) is not block work
            seen.add(block)
            in_block[-1] = True
        place(n)
        live.add(n)
    order = {n: k for k, n in enumerate(nodes)}
    out: list[tuple[list[fx.Node], bool]] = []
    for r, nodes_r in enumerate(regions):
        moved = sorted(hoisted.get(r, []), key=order.__getitem__)
        if in_block[r]:
            out.append((moved, False))  # reads nothing region r computes: it can run before it
        else:
            nodes_r = sorted(nodes_r + moved, key=order.__getitem__)
        out.append((nodes_r, in_block[r]))
    out = [(r, b) for r, b in out if r]
    return [r for r, _ in out], [b for _, b in out]


def _shared_work(nodes: list[fx.Node]) -> set[fx.Node]:
    """Pure work (no collective, no random draw) on the graph's inputs alone, saved activations and gradients
    excepted, that every block reads and that is no one block's own: the attention mask and the rotary unsqueezes
    AOTAutograd computes once, in block 0, or feeding only such work (the rotary cos and sin, which the partitioner
    recomputes in the backward where the last block first reads them). Left in the block region that meets it, it
    would make that one block compile apart from the others or cut its region in two. Values passed from one block
    to the next (a recomputed activation two blocks read) stay where they are: moved, they would live longer."""
    from_inputs: set[fx.Node] = set()
    for n in nodes:
        if (n.op == "call_function" and not n.is_impure() and not _communicates(n)
                and not (isinstance(n.target, torch._ops.OpOverload)
                         and torch.Tag.nondeterministic_seeded in n.target.tags)
                and all(a in from_inputs or a.op == "get_attr" or (a.op == "placeholder" and not a.meta.get(RELEASED)
                                                                    and not a.name.startswith("tangents"))
                        for a in n.all_input_nodes)):
            from_inputs.add(n)
    every = {b for b in map(block_of, nodes) if b}
    readers: dict[fx.Node, frozenset] = {}  # the blocks reading a node, directly or through non-block work
    shared: set[fx.Node] = set()
    for n in reversed(nodes):  # users first
        if n not in from_inputs:
            continue
        found: set[str] = set()
        for u in n.users:
            block = block_of(u)
            found |= {block} if block else readers.get(u, frozenset())
        readers[n] = frozenset(found)
        if (len(every) > 1 and found == every) or (n.users and all(u in shared for u in n.users)):
            shared.add(n)
    return shared


def _trailing_glue(region: list[fx.Node], into_block: bool) -> list[fx.Node]:
    """The module-less nodes at the end of `region` that go with the region that follows, so the block before does
    not differ from the others by them: those that read nothing else the region computed (the wait for the next
    module's bucket, its copy-out), and, where the blocks end (`into_block` false), work other than a collective
    that only the modules after the blocks read (in the backward, block 0's region ended with the position
    embedding's gradient, a sum over the block's input gradient, so block 0's backward compiled apart from the
    others' where their partitions are the same: keep_block_regions). A graph's output stays: every block computes
    its own (a weight gradient's transpose)."""
    inside, carried = set(region), []
    for n in reversed(region):
        if block_of(n) is not None:
            break
        carried.append(n)
    carried.reverse()
    moved: set[fx.Node] = set()
    for n in carried:
        if all(a not in inside or a in moved for a in n.all_input_nodes):
            moved.add(n)
    if not into_block:
        moved |= _read_after_the_blocks(inside, [n for n in carried if n not in moved and not _communicates(n)])
    return [n for n in carried if n in moved]


def _read_after_the_blocks(inside: set, candidates: list[fx.Node]) -> set[fx.Node]:
    """The largest set of `candidates` that only later regions read and that read only what the region hands on
    anyway (a value a later region reads) or each other: moving them adds no output to the region."""
    moved = set(candidates)
    changed = True
    while changed:
        changed = False
        for n in list(moved):
            users_ok = all(u.op != "output" and (u not in inside or u in moved) for u in n.users)
            inputs_ok = all(a not in inside or a in moved or any(u not in inside for u in a.users)
                            for a in n.all_input_nodes)
            if not (users_ok and inputs_ok):
                moved.discard(n)
                changed = True
    return moved


def _communicates(n: fx.Node) -> bool:
    """A collective, its wait (both _c10d_functional ops), or a hold of its input to the wait: they stay where the
    passes' schedule put them."""
    return KEY in n.meta or _holds(n) or (isinstance(n.target, torch._ops.OpOverload)
                                          and n.target.namespace == "_c10d_functional")


def _holds(n: fx.Node) -> bool:
    """hold_collective_inputs' `zcompile::held_until` (by name: backends.inductor, which defines it, imports
    inductor)."""
    return isinstance(n.target, torch._ops.OpOverload) and n.target.name() == "zcompile::held_until"


def gather_issues(nodes: list[fx.Node]) -> set[fx.Node]:
    """The collectives (not their waits) that the passes fed from the graph's inputs alone, with the module-less
    nodes computing their inputs (a bucket's shard concatenation, its output buffer): work that can run as early
    as the graph starts."""
    from_inputs: set[fx.Node] = set()
    for n in nodes:
        if (block_of(n) is None and n.op == "call_function" and n.target is not c10d.wait_tensor.default
                and all(a.op in ("placeholder", "get_attr") or a in from_inputs for a in n.all_input_nodes)):
            from_inputs.add(n)
    issue: set[fx.Node] = set()
    for n in reversed(nodes):
        if n in from_inputs and (KEY in n.meta or any(u in issue for u in n.users)):
            issue.add(n)
    return issue


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
    same code."""
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


# A region outside the blocks is compiled when running it op by op writes more than this many times the
# elementwise temporaries of the largest block region: the loss over a real vocabulary (a log-softmax as separate
# sub, exp, sum, log kernels, each a logits-sized temporary: 40x a block in GPT-2's shape) is, the embeddings and
# their gradient (1.4x) and the passes' glue are not, as each compile has a fixed cost (about 2 s of C++ on CPU).
EAGER_MAX_BLOCKS = 4.0


def compiled_regions(regions: list, holds_block: list, handed_on: dict, kept: set) -> list[bool]:
    """Which regions are compiled: every block region, and a region outside the blocks whose elementwise
    temporaries outweigh EAGER_MAX_BLOCKS block regions (the head and loss over a real vocabulary). Without blocks
    the graph is one region, compiled."""
    if not any(holds_block):
        return [True] * len(regions)
    work = [_elementwise_temporaries(nodes, handed_on, kept) for nodes in regions]
    block = max(w for w, b in zip(work, holds_block) if b)
    return [b or w > EAGER_MAX_BLOCKS * block for w, b in zip(work, holds_block)]


def _elementwise_temporaries(nodes: list[fx.Node], handed_on: dict, kept: set) -> int:
    """Bytes of the pointwise results a region computes and drops: what its eager run writes that a compiled one
    fuses away."""
    total = 0
    for n in nodes:
        v = n.meta.get("val")
        if (isinstance(v, torch.Tensor) and n not in handed_on and n not in kept
                and isinstance(n.target, torch._ops.OpOverload) and torch.Tag.pointwise in n.target.tags):
            numel = v.numel()
            if isinstance(numel, torch.SymInt):  # a dynamic size: its example value, without adding a guard
                numel = numel.node.hint or 0
            total += numel * v.element_size()
    return total


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
        elif _holds(n):
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
