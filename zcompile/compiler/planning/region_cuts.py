"""Where a graph is cut into regions for inductor (one per repeated block, the head and loss, the glue between), and
which regions are compiled: read by the code generator (codegen/regions.py), which compiles the regions, and by
liveness (inductor_buffers.py), which counts what each compiled region keeps in memory."""
from __future__ import annotations

import torch
import torch.fx as fx

from zcompile.compiler.graph.blocks import block_of
from zcompile.compiler.graph.collectives import KEY, c10d
from zcompile.compiler.graph.meta_keys import RELEASED
from zcompile.compiler.graph.tangents import is_tangent


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
                                                                    and not is_tangent(a))
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
    return KEY in n.meta or holds(n) or (isinstance(n.target, torch._ops.OpOverload)
                                          and n.target.namespace == "_c10d_functional")


def holds(n: fx.Node) -> bool:
    """hold_collective_inputs' `zcompile::held_until` (by name: codegen/inductor.py, which defines it, imports
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
