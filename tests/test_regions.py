"""Regional compile (zcompile/compiler/codegen/regions.py), single process: the cut points, that repeated blocks
share one compiled region whatever the depth, that the program matches the model and drops each value after its
last reader. (The 2-rank inductor runs in test_parity, test_zeropp and test_offload go through it with collectives.)"""
import re

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from zcompile.compiler.graph import collectives
from zcompile.runtime import dtensor_params
from zcompile.compiler.codegen import regions
from zcompile.compiler.planning import region_cuts


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.relu(self.fc(self.ln(x)))


class PairBlock(Block):
    """Mixes pairs of features through a view whose size is computed from the batch size (a SymInt node in a
    dynamic graph, alive from the first block to the last)."""

    def forward(self, x):
        pairs = x.view(x.shape[0] * 2, -1)
        return super().forward(pairs.flip(0).view(x.shape))


class Net(nn.Module):
    def __init__(self, depth: int, d: int = 16, block=Block):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(block(d) for _ in range(depth))
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x).sum()


def compile_net(depth: int, dynamic: bool | None = None, block=Block, net=None, decompositions=None,
                compiled: list | None = None):
    """Net(depth) (or `net`) through dynamo and AOTAutograd, each graph run as a RegionProgram of eagerly run
    regions; `compiled` collects (kind, region graph) of each region compiled."""
    torch.manual_seed(0)
    net = net if net is not None else Net(depth, block=block)
    programs, compiled = {}, compiled if compiled is not None else []

    def compiler(kind):
        def compile_graph(gm, example_inputs):
            def compile_one(sub, fakes):
                compiled.append((kind, sub))
                return make_boxed_func(sub.forward)
            programs[kind] = regions.compile_regions(gm, example_inputs, compile_one)
            return programs[kind]
        return compile_graph

    extra = {"decompositions": decompositions} if decompositions is not None else {}
    run = torch.compile(net, backend=aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                                                  **extra), dynamic=dynamic)
    return net, run, programs


def assert_matches_the_model(net, run, x, atol):
    """The compiled program's loss and gradients are the module's own (eager) ones for input `x`."""
    loss = run(x)
    loss.backward()
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    ref = net(x)
    ref.backward()
    assert torch.allclose(loss, ref, atol=atol), tuple(x.shape)
    for g, p in zip(grads, net.parameters()):
        assert torch.allclose(g, p.grad, atol=atol), tuple(x.shape)
    net.zero_grad()


def test_repeated_blocks_compile_once_at_any_depth_and_match_the_model():
    x = torch.randn(4, 16)
    counts = {}
    for depth in (4, 8):
        torch._dynamo.reset()
        net, run, programs = compile_net(depth)
        assert_matches_the_model(net, run, x, atol=1e-6)
        counts[depth] = {k: (p.regions, p.compiled) for k, p in programs.items()}
        for kind, p in programs.items():
            assert p.compiled_regions == depth, (kind, p.compiled_regions)  # one compiled region per block
            assert p.regions == depth + 2, (kind, p.regions)  # and the modules before and after, run eagerly
            assert p.compiled <= 3, (kind, p.regions, p.compiled)  # first block, the others, last block
    # twice the blocks, the same distinct regions: compile cost does not grow with depth
    assert {k: c for k, (_, c) in counts[4].items()} == {k: c for k, (_, c) in counts[8].items()}, counts


class VocabNet(Net):
    """Net with a language model's ending: a wide head and a cross-entropy over its logits."""

    def __init__(self, depth: int, vocab: int, d: int = 16):
        super().__init__(depth, d)
        self.out = nn.Linear(d, vocab)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        logits = self.out(x)
        return nn.functional.cross_entropy(logits, torch.zeros(x.shape[0], dtype=torch.long))


@pytest.mark.parametrize("vocab", [8, 4096])
def test_the_loss_over_a_wide_head_is_compiled_and_small_ends_run_eagerly(vocab):
    """Outside the blocks, a region is compiled when its elementwise temporaries outweigh EAGER_MAX_BLOCKS block
    regions: the log-softmax over 4096 logits (each eager op a logits-sized temporary), forward and backward; a
    narrow head, the input linear and its gradient run eagerly."""
    from torch._inductor.decomposition import select_decomp_table  # as zcompile's inductor path decomposes
    torch._dynamo.reset()
    torch.manual_seed(0)
    compiled = []
    net, run, programs = compile_net(4, net=VocabNet(4, vocab), decompositions=select_decomp_table(),
                                     compiled=compiled)
    assert_matches_the_model(net, run, torch.randn(4, 16), atol=1e-6)
    wide = vocab == 4096
    for kind, p in programs.items():
        assert p.compiled_regions == 4 + wide, (kind, p.compiled_regions)
    exps = [kind for kind, sub in compiled if any(n.target is torch.ops.aten.exp.default for n in sub.graph.nodes)]
    assert sorted(exps) == (["backward", "forward"] if wide else []), exps


def test_a_dynamic_batch_compiles_the_same_regions_once_for_every_size():
    """A graph with a symbolic batch size (dynamo's automatic dynamic shapes after a size changes, or
    mark_dynamic) is cut and deduplicated as a static one, the size symbols crossing cuts like tensors; its
    regions are compiled once and serve every batch size."""
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    net, run, programs = compile_net(4, dynamic=True, block=PairBlock)
    for n in (3, 5, 8):
        assert_matches_the_model(net, run, torch.randn(n, 16), atol=1e-5)
    for kind, p in programs.items():
        assert p.compiled_regions == 4 and p.compiled <= 3, (kind, p.compiled_regions, p.compiled)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1


def test_auto_compiles_regions_only_where_they_repeat():
    """min_reuse (regional_compile 'auto'): a shallow graph compiles as one graph (None), a deep one by regions."""
    seen = {}
    for depth in (1, 12):
        torch._dynamo.reset()
        torch.manual_seed(0)

        def fw_compiler(gm, example_inputs, depth=depth):
            seen[depth] = regions.compile_regions(gm, example_inputs, lambda sub, fakes: make_boxed_func(sub.forward),
                                                  min_reuse=2.0)
            return seen[depth] if seen[depth] is not None else make_boxed_func(gm.forward)
        run = torch.compile(Net(depth), backend=aot_autograd(fw_compiler=fw_compiler))
        run(torch.randn(4, 16)).backward()
    assert seen[1] is None  # one block: nothing repeats
    deep = seen[12]
    assert deep is not None and deep.compiled_regions >= 2 * deep.compiled, (deep.compiled_regions, deep.compiled)


@pytest.mark.parametrize("depth", [0, 3])
def test_a_backward_region_donates_only_the_inputs_aotautograd_donated_to_it(depth):
    """Inductor reuses in place the backward inputs AOTAutograd lists as donated, by position in the whole backward.
    Block regions have positions of their own and hand values on to later regions: they donate none (before, each
    inherited the whole list, e.g. an 18-input block region of nanoGPT had inputs 4-17 marked). A graph compiled as
    one region donates AOTAutograd's inputs at the positions they have in the region (first use, not placeholder
    order)."""
    from torch._inductor.utils import get_donated_idxs
    seen = []

    def compiler(kind):
        def compile_graph(gm, example_inputs):
            phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
            name_of = {id(n.meta["val"]): n.name for n in phs}  # a region's inputs come with the graph's values
            whole = [phs[k].name for k in get_donated_idxs() or ()] if kind == "backward" else []

            def compile_one(sub, fakes):
                seen.append((kind, whole, [name_of.get(id(fakes[k]), k) for k in get_donated_idxs() or ()]))
                return make_boxed_func(sub.forward)
            return regions.compile_regions(gm, example_inputs, compile_one)
        return compile_graph

    torch.manual_seed(0)
    net = Net(depth)
    run = torch.compile(net, backend=aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward")))
    run(torch.randn(4, 16)).backward()
    backward = [(whole, mine) for kind, whole, mine in seen if kind == "backward"]
    assert backward and all(whole for whole, _ in backward), seen  # AOTAutograd donates saved activations here
    if depth:
        assert all(mine == [] for _, mine in backward), backward  # the block region, compiled once
    else:
        assert len(backward) == 1 and sorted(backward[0][1]) == sorted(backward[0][0]), backward


def test_each_value_is_dropped_after_its_last_reader():
    torch._dynamo.reset()
    _, run, programs = compile_net(4)
    run(torch.randn(4, 16)).backward()
    for kind, p in programs.items():
        kept = {o for o in p.outputs if isinstance(o, int)}
        freed = [i for _, _, _, frees in p.steps for i in frees]
        assert len(freed) == len(set(freed)), f"{kind}: a slot freed twice"
        last_read = {}
        for k, (_, ins, _, _) in enumerate(p.steps):
            for i in ins:
                last_read[i] = k
        for i, k in last_read.items():
            if i not in kept:
                assert i in p.steps[k][3], f"{kind}: slot {i} is kept after its last reader (step {k})"
        assert p._boxed_call  # AOTAutograd hands it the argument list, which it clears (inputs die early)


def _input_graph() -> tuple[fx.Graph, fx.Node]:
    """A new graph with one 4x4 input `x` (its value real: the regions run eagerly on it)."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.randn(4, 4)
    return g, x


def _node(g: fx.Graph, target, args, block: str) -> fx.Node:
    n = g.call_function(target, args)
    n.meta["nn_module_stack"] = {block: (block, Block)}
    return n


def test_no_cut_separates_a_tuple_from_its_items():
    """var_mean of block 0 returns a tuple that block 1 reads: the region boundary moves past it."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.randn(4, 16)
    vm = _node(g, torch.ops.aten.var_mean.correction, (x, [1]), "L['self'].blocks.0")
    vm.meta["val"] = torch.var_mean(x.meta["val"], [1])
    relu = _node(g, torch.ops.aten.relu.default, (x,), "L['self'].blocks.1")
    relu.meta["val"] = x.meta["val"]
    mean = _node(g, lambda t, i: t[i], (vm, 1), "L['self'].blocks.1")
    mean.meta["val"] = vm.meta["val"][1]
    add = _node(g, torch.ops.aten.add.Tensor, (relu, mean), "L['self'].blocks.2")
    add.meta["val"] = x.meta["val"]
    g.output((add,))
    cut, _ = region_cuts.block_regions(g)
    where = {n: k for k, r in enumerate(cut) for n in r}
    assert where[vm] == where[mean], cut  # the tuple never crosses a cut
    assert where[add] != where[vm], cut  # block 2 still starts a region


def test_constants_are_recomputed_in_each_region_that_reads_them_unless_written():
    """A causal-mask-like constant made in block 0 and read by block 1 is recomputed in block 1's region (so block 0
    does not hand it on and both regions print the same code), also when the graph returns it (a saved
    activation: it was handed on to every later region); one that an op writes into stays a handed-on value."""
    aten = torch.ops.aten
    for written, saved in ((False, False), (True, False), (False, True)):
        g = fx.Graph()
        x = g.placeholder("x")
        x.meta["val"] = torch.randn(4, 4)
        mask = _node(g, aten.full.default, ([4, 4], 1.0), "L['self'].blocks.0")
        mask.meta["val"] = torch.ones(4, 4)
        if written:
            fill = _node(g, aten.fill_.Scalar, (mask, 2.0), "L['self'].blocks.0")
            fill.meta["val"] = mask.meta["val"]
        outs = []
        prev = x
        for b in (0, 1):
            m = _node(g, aten.mul.Tensor, (prev, mask), f"L['self'].blocks.{b}")
            m.meta["val"] = x.meta["val"]
            outs.append(m)
            prev = m
        g.output((outs[-1], mask) if saved else (outs[-1],))
        gm = fx.GraphModule(torch.nn.Module(), g)
        compiled = []
        program = regions.compile_regions(gm, [x.meta["val"]],
                                          lambda sub, fakes: compiled.append(sub) or make_boxed_func(sub.forward))
        assert program.regions == 2
        second_inputs = [n for n in compiled[-1].graph.nodes if n.op == "placeholder"]
        if written:
            assert len(compiled) == 2 and len(second_inputs) == 2, compiled[-1].code  # the mask is handed on
        elif saved:  # the first region also returns the mask: two codes, but the second makes its own
            assert len(compiled) == 2 and len(second_inputs) == 1, compiled[-1].code
        else:
            assert len(compiled) == 1 and program.compiled == 1  # one code for both blocks: the mask made in each
        ref = x.meta["val"] * (2.0 if written else 1.0) ** 2
        out = program([x.meta["val"]])
        assert torch.equal(out[0], ref)
        if saved:
            assert torch.equal(out[1], torch.ones(4, 4))


def _gather_in_flight_graph(wait_block: str, group: str = "0") -> fx.GraphModule:
    """An all-gather (world 1) of a temporary started in block 0 and waited on in `wait_block`, with a matmul in
    between that needs a buffer of the same size."""
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.randn(8, 8)
    flat = _node(g, aten.mul.Tensor, (x, 2.0), "L['self'].blocks.0")
    out = g.call_function(aten.new_empty.default, (flat, [8, 8]))
    ag = g.call_function(c10d.all_gather_into_tensor_out.default, (flat, 1, group), {"out": out})
    collectives.annotate(ag, "all_gather", 256, group, "test: prefetch", 64, torch.float32, (0,))
    sin = _node(g, aten.sin.default, (x,), wait_block)
    work = _node(g, aten.mm.default, (sin, x), wait_block)
    wait = g.call_function(c10d.wait_tensor.default, (ag,))
    after = _node(g, aten.mul.Tensor, (wait, 3.0), wait_block)
    for n in (flat, out, ag, sin, work, wait, after):
        n.meta["val"] = torch.randn(8, 8)
    g.output((work, after))
    return fx.GraphModule(torch.nn.Module(), g)


def test_a_held_collective_input_is_held_until_the_wait_and_crosses_a_cut_to_it():
    """hold_collective_inputs: the gather reads its input through one realized node, which `held_until` holds until
    the gather's waited result is ready; regional compile hands that node to the waiting region, which drops it as
    it starts (the compiled region keeps it to the hold)."""
    from zcompile.compiler.codegen.inductor import hold_collective_inputs
    wait_op, hold_op = torch.ops._c10d_functional.wait_tensor.default, torch.ops.zcompile.held_until.default
    gm = hold_collective_inputs(_gather_in_flight_graph("L['self'].blocks.1"))
    nodes = list(gm.graph.nodes)
    (ag,) = [n for n in nodes if collectives.is_op(n, "all_gather")]
    held = ag.args[0]
    assert "force_stride_order" in str(held.target)
    (wait,) = [n for n in nodes if n.target is wait_op]
    (hold,) = [n for n in nodes if n.target is hold_op]
    assert hold.args == (held, wait) and nodes.index(hold) == nodes.index(wait) + 1
    compiled = []
    program = regions.compile_regions(gm, [nodes[0].meta["val"]], lambda sub, fakes: compiled.append(sub) or sub)
    assert program.regions == 2
    (first_outputs,) = [list(n.args[0]) for n in compiled[0].graph.nodes if n.op == "output"]
    assert len(first_outputs) == 2  # the gather and its held input, which the waiting region reads
    held_slot = program.steps[0][2][0]
    assert held_slot not in program.steps[0][3] and held_slot in program.steps[1][1] + program.steps[1][3]
    (hold,) = [n for n in compiled[1].graph.nodes if n.target is hold_op]
    assert hold.args[0].op == "placeholder"


def _prefetching_blocks(depth: int, issue_after_wait: bool, group: str = "0") -> fx.GraphModule:
    """Blocks as the passes schedule them (world 1): block k waits for its bucket, gathered from a shard input, and
    issues the next bucket's gather before that wait (prefetch), or after it (`issue_after_wait`: a block of two
    buckets); the last block prefetches the head's bucket, of another size; the head reads it."""
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.randn(8, 8)
    shards = []
    for k in range(depth + 1):
        shards.append(g.placeholder(f"shard{k}"))
        shards[-1].meta["val"] = torch.randn(64 if k < depth else 8)

    def issue(k: int) -> fx.Node:
        cat = g.call_function(aten.cat.default, ([shards[k]],))
        out = g.call_function(aten.new_empty.default, (cat, [shards[k].meta["val"].numel()]))
        ag = g.call_function(c10d.all_gather_into_tensor_out.default, (cat, 1, group), {"out": out})
        for n in (cat, out, ag):
            n.meta["val"] = shards[k].meta["val"].clone()
        collectives.annotate(ag, "all_gather", 4 * cat.meta["val"].numel(), group, "test", cat.meta["val"].numel(),
                             torch.float32, (0,))
        return ag

    def wait(ag: fx.Node, shape: list[int]) -> fx.Node:
        w = g.call_function(c10d.wait_tensor.default, (ag,))
        w.meta["val"] = ag.meta["val"]
        v = g.call_function(aten.view.default, (w, shape))
        v.meta["val"] = w.meta["val"].view(shape)
        return v

    gather, h = issue(0), x
    for k in range(depth):
        block = f"L['self'].blocks.{k}"
        h = _node(g, aten.sin.default, (h,), block)  # work that reads no parameter
        if not issue_after_wait:
            following = issue(k + 1)
        weight = wait(gather, [8, 8])
        if issue_after_wait:
            following = issue(k + 1)
        h = _node(g, aten.mm.default, (h, weight), block)
        h.meta["val"] = torch.randn(8, 8)
        gather = following
    head = _node(g, aten.mul.Tensor, (h, wait(gather, [8])), "L['self'].head")
    head.meta["val"] = h.meta["val"]
    g.output((head,))
    return fx.GraphModule(torch.nn.Module(), g)


def _run_prefetching_blocks(rank: int, world: int, issue_after_wait: bool) -> dict:
    import torch.distributed as dist
    gm = _prefetching_blocks(4, issue_after_wait, dist.group.WORLD.group_name)
    inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    compiled = []
    program = regions.compile_regions(gm, inputs, lambda sub, fakes: compiled.append(sub) or make_boxed_func(
        sub.forward))
    gather = torch.ops._c10d_functional.all_gather_into_tensor_out.default
    gathers_in_compiled = [sum(n.target is gather for n in sub.graph.nodes) for sub in compiled]
    (out,) = program(list(inputs))
    return {"regions": program.regions, "compiled regions": program.compiled_regions, "compiled": program.compiled,
            "gathers in compiled regions": gathers_in_compiled, "right": torch.allclose(out, gm(*inputs)[0])}


def test_prefetch_issues_leave_the_block_regions_and_only_blocks_are_compiled():
    """A gather fed by shard inputs and issued before its block's first wait moves into an eager region before the
    block, so the last block (prefetching the head's bucket, of another size) shares the middle blocks' compiled
    region; the head and the first issue run eagerly. A gather issued after a wait stays where the schedule put
    it (moving it up would gather two buckets at once): then the last block is a region of its own."""
    from tests.harness import run_world
    (hoisted,), (kept,) = (run_world(1, _run_prefetching_blocks, flag) for flag in (False, True))
    assert hoisted["right"] and kept["right"], (hoisted, kept)
    # the first issue with block 0's prefetch, then an issue region before each later block, 4 blocks, the head
    assert (hoisted["regions"], hoisted["compiled regions"], hoisted["compiled"]) == (9, 4, 1), hoisted
    assert hoisted["gathers in compiled regions"] == [0], hoisted
    # the first issue, 4 blocks, the head; compiled: the first three blocks, the last one
    assert (kept["regions"], kept["compiled regions"], kept["compiled"]) == (6, 4, 2), kept
    assert kept["gathers in compiled regions"] == [1, 1], kept


def test_a_block_seen_again_after_the_blocks_runs_eagerly_with_the_head():
    """The partitioner puts some saved activations' transposes (nodes of an earlier block) after the head: they stay
    in the head's region, which still runs eagerly (ZeRO++ and stage 2 compiled one more region before)."""
    aten = torch.ops.aten
    g, x = _input_graph()
    h = x
    for b in range(4):
        h = _node(g, aten.sin.default, (h,), f"L['self'].blocks.{b}")
        h.meta["val"] = x.meta["val"]
    head = _node(g, aten.cos.default, (h,), "L['self'].head")
    saved = _node(g, aten.t.default, (x,), "L['self'].blocks.0")
    head.meta["val"], saved.meta["val"] = x.meta["val"], x.meta["val"].t()
    g.output((head, saved))
    compiled = []
    program = regions.compile_regions(fx.GraphModule(torch.nn.Module(), g), [x.meta["val"]],
                                      lambda sub, fakes: compiled.append(sub) or make_boxed_func(sub.forward))
    assert (program.regions, program.compiled_regions, program.compiled) == (5, 4, 1), program.__dict__
    out = program([x.meta["val"]])
    assert torch.equal(out[0], x.meta["val"].sin().sin().sin().sin().cos()) and torch.equal(out[1], x.meta["val"].t())


def test_blocks_that_differ_only_in_what_they_hand_on_share_one_compile():
    """Block 0 hands on one intermediate (as the partitioner saves block 0's first norm differently), block 1
    another, block 2 neither: the same work, so one compiled region returns all of them and each occurrence keeps
    what it hands on."""
    aten = torch.ops.aten
    g, x = _input_graph()
    h, kept = x, []
    for b in range(3):
        a = _node(g, aten.sin.default, (h,), f"L['self'].blocks.{b}")
        c = _node(g, aten.cos.default, (a,), f"L['self'].blocks.{b}")
        h = _node(g, aten.mul.Tensor, (c, 2.0), f"L['self'].blocks.{b}")
        for n in (a, c, h):
            n.meta["val"] = x.meta["val"]
        kept += [a] if b == 0 else [c] if b == 1 else []
    g.output((h, *kept))
    gm = fx.GraphModule(torch.nn.Module(), g)
    compiled = []
    program = regions.compile_regions(gm, [x.meta["val"]],
                                      lambda sub, fakes: compiled.append(sub) or make_boxed_func(sub.forward))
    assert (program.regions, program.compiled) == (3, 1), program.__dict__
    for got, want in zip(program([x.meta["val"]]), gm(x.meta["val"])):
        assert torch.equal(got, want)


def test_regions_are_told_apart_by_their_work_and_built_once_per_distinct_one(monkeypatch):
    """Blocks 0-2 do the same work, block 3 the same ops with another constant: two compiles. Regions are keyed
    by their ops and arguments without building a module each (that cost seconds on a deep model): one module is
    built per distinct region."""
    aten = torch.ops.aten
    g, x = _input_graph()
    h = x
    for b in range(4):
        a = _node(g, aten.sin.default, (h,), f"L['self'].blocks.{b}")
        h = _node(g, aten.mul.Tensor, (a, 2.0 if b < 3 else 3.0), f"L['self'].blocks.{b}")
        a.meta["val"] = h.meta["val"] = x.meta["val"]
    g.output((h,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    built, build = [], regions._region_module
    monkeypatch.setattr(regions, "_region_module", lambda *a: built.append(a) or build(*a))
    compiled = []
    program = regions.compile_regions(gm, [x.meta["val"]],
                                      lambda sub, fakes: compiled.append(sub) or make_boxed_func(sub.forward))
    assert (program.regions, program.compiled) == (4, 2), program.__dict__
    assert len(built) == 2 and "3.0" in compiled[1].code and "3.0" not in compiled[0].code
    assert torch.equal(program([x.meta["val"]])[0], gm(x.meta["val"])[0])


def test_a_graph_without_blocks_is_compiled_as_one_region():
    g, x = _input_graph()
    y = _node(g, torch.ops.aten.sin.default, (x,), "L['self'].inp")
    y.meta["val"] = x.meta["val"]
    g.output((y,))
    compiled = []
    program = regions.compile_regions(fx.GraphModule(torch.nn.Module(), g), [x.meta["val"]],
                                      lambda sub, fakes: compiled.append(sub) or make_boxed_func(sub.forward))
    assert (program.regions, program.compiled_regions, program.compiled, len(compiled)) == (1, 1, 1, 1)


def _inductor_code_of_a_gather_in_flight(rank: int, world: int, hold: bool) -> tuple[str, bool]:
    import torch.distributed as dist
    from torch._inductor.utils import run_and_get_code
    from zcompile.compiler.codegen.inductor import compile_inductor, hold_collective_inputs
    gm = _gather_in_flight_graph("L['self'].blocks.0", dist.group.WORLD.group_name)
    if hold:
        gm = hold_collective_inputs(gm)
    x = next(iter(gm.graph.nodes)).meta["val"]
    compiled, (code,) = run_and_get_code(lambda: compile_inductor(gm, [x], "forward"))
    right = torch.allclose(compiled([x.clone()])[1], x * 6)
    return code[code.index("def call"):], right


def test_inductor_keeps_a_gathered_input_until_the_wait():
    """The bug hold_collective_inputs fixes, shown in inductor's own output: without it, the buffer the `_out`
    all-gather reads is freed or reused for the work issued before the gather's wait; with it, not."""
    import re
    from tests.harness import run_world

    def freed_before_wait(code: str) -> bool:
        ag = re.search(r"all_gather_into_tensor_out\.default\((buf\d+), .*out=(buf\d+)\)", code)
        gather_in, gather_out = ag.group(1), ag.group(2)
        wait = code.index(f"wait_tensor.default({gather_out})")
        return bool(re.search(rf"del {gather_in}\b", code[ag.end():wait]))

    ((without, _),) = run_world(1, _inductor_code_of_a_gather_in_flight, False)  # its result may be right or not
    ((with_hold, right),) = run_world(1, _inductor_code_of_a_gather_in_flight, True)
    assert freed_before_wait(without), without  # inductor's in-place lowering of the `_out` gather (torch 2.11-2.13)
    assert not freed_before_wait(with_hold) and right, with_hold
    assert "held_until" in with_hold, with_hold
    # the passes' order stands: the matmul still runs while the gather is in flight (inductor's peak-memory
    # reordering, off in compile_inductor, would move the wait above it to reuse the held buffer)
    gather_out = re.search(r"out=(buf\d+)\)", with_hold).group(1)
    assert with_hold.index("extern_kernels.mm(") < with_hold.index(f"wait_tensor.default({gather_out})"), with_hold


class MarkedBlock(Block):
    forward = torch.compiler.nested_compile_region(Block.forward)


def _compile_marked_blocks(rank: int, world: int) -> str:
    from zcompile.errors import ZCompileError
    net = Net(2)
    net.blocks = nn.ModuleList(MarkedBlock(16) for _ in range(2))
    run = torch.compile(net, backend="zero", options={"config": {"stage": 3, "backend": "eager"}})
    try:
        run(torch.randn(4, 16))
    except ZCompileError as e:
        return str(e)
    return "compiled"


@pytest.mark.skipif(dtensor_params.trace_once_supported(),
                    reason="torch >= 2.13 inlines the region (test_trace_blocks_once)")
def test_a_user_marked_nested_compile_region_is_refused_with_the_reason():
    from tests.harness import run_world
    (message,) = run_world(1, _compile_marked_blocks)
    assert "nested_compile_region" in message and "Remove the decorator" in message, message


@pytest.mark.parametrize("regional", [True, "nested"])
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_regional_inductor_stage3_matches_the_reference(name, regional):
    """Forced on (the small model is below 'auto''s threshold): regions, collectives in flight across cuts, the
    eager regions around the blocks (HF Llama: the rotary embedding made before the blocks and read by each) and the
    program's frees on 2 gloo ranks, against the single-process reference (this caught the in-flight input bug);
    'nested': the same cut as calls of block bodies inside one inductor graph."""
    from tests import workers
    from tests.harness import run_world
    from tests.test_parity import TOL, max_diff
    ref_params, ref_losses = workers.reference(name, 2, steps=5)
    config = {"stage": 3, "backend": "inductor", "regional_compile": regional}
    for rank, res in enumerate(run_world(2, workers.parity_with_config, name, config)):
        assert max_diff(res["params"], ref_params) < TOL


def _isa_probe_calls(rank: int, world: int, flags: list | None = None) -> dict:
    """A stage-3 inductor compile in a fresh process, recording in order which threads called inductor's CPU ISA
    probe, whether it had a result already (the probe is functools-cached), where the first inductor compile
    began, and which ISAs were built with ATen's vector headers and loaded to check them (thread, ISA). `flags`:
    the x86 ISA flags the CPU reports (None: this CPU's), e.g. ["avx2"] for a CPU with one candidate."""
    import threading

    from torch._inductor import cpu_vec_isa

    from zcompile.compiler.codegen import inductor as zinductor
    from zcompile.compiler.tracing import warmup
    if flags is not None:
        cpu_vec_isa.x86_isa_checker = lambda: list(flags)

    calls, probe, compile_inductor = [], cpu_vec_isa.valid_vec_isa_list, zinductor.compile_inductor
    assert probe.cache_info().currsize == 0, "this process has probed already: the test needs a fresh one"
    builds, check_build = [], cpu_vec_isa.VecISA.check_build

    def recorded_probe():
        calls.append((threading.current_thread().name, probe.cache_info().currsize > 0))
        return probe()

    def recorded_build(isa, code):  # the check of an ISA as a whole: ATen's vector headers (others: one intrinsic)
        if code == cpu_vec_isa.VecISA._avx_code:
            builds.append((threading.current_thread().name, str(isa)))
        return check_build(isa, code)

    def recorded_compile(*args):
        calls.append("compile_inductor")
        return compile_inductor(*args)
    cpu_vec_isa.valid_vec_isa_list, zinductor.compile_inductor = recorded_probe, recorded_compile
    cpu_vec_isa.VecISA.check_build = recorded_build
    net = Net(2)
    run = torch.compile(net, backend="zero", options={"config": {"stage": 3, "backend": "inductor",
                                                                 "regional_compile": False}})
    run(torch.randn(4, 16)).backward()
    return {"calls": calls, "probed": probe.cache_info().currsize, "builds": builds,
            "picked": str(cpu_vec_isa.pick_vec_isa()), "valid": [str(isa) for isa in probe()],
            "candidates": len(warmup._candidates(cpu_vec_isa))}


@pytest.mark.parametrize("flags", [None, ["avx2"]], ids=["this-cpu", "avx2-only"])
def test_inductor_probes_the_cpu_isa_in_the_background_before_its_first_compile(flags, tmp_path):
    """zcompile/compiler/tracing/warmup.py: the zero backend starts inductor's one-time ISA check (a g++ build of
    ATen's vector headers and a child process, seconds) when first entered, beside dynamo's trace and the passes,
    for the one ISA inductor will use; the first inductor compile waits for it and fills inductor's list from the
    CPU's flags instead of building every candidate (on x86: one build where inductor makes up to four). What
    decides the path is how many x86 candidates the CPU's flags allow, not how many inductor then lists: with one
    (an AVX2-only CPU) the warmup still builds it, and the main thread makes the list. Both are run here, whatever
    this CPU has."""
    import platform

    from tests.harness import run_world
    if flags is not None and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 flags on another platform")
    # a cache of its own: inductor's caches would hand the AVX2-only process this CPU's kernels (built for AVX-512)
    (res,) = run_world(1, _isa_probe_calls, flags, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
    calls = res["calls"]
    assert res["probed"] == 1 and "compile_inductor" in calls, calls
    probes = [c for c in calls if c != "compile_inductor"]
    if res["candidates"]:  # x86: the ISA inductor will use is built in the background, once
        assert res["builds"] == [("zcompile-inductor-warmup", res["picked"])], res  # the one used, built once
        assert calls.index("compile_inductor") < calls.index(("MainThread", False)), calls  # made in wait()
        assert res["picked"] == res["valid"][0], res
    else:  # no x86 candidate (another platform): the warmup computes inductor's list itself
        assert probes[0] == ("zcompile-inductor-warmup", False), calls
    assert all(cached for name, cached in probes if name not in ("zcompile-inductor-warmup", "MainThread")), calls


def _fake_isas(results: dict, checked: list, barrier=None):
    """A cpu_vec_isa stand-in: x86 candidates (AMX first, as inductor lists them; this CPU lacks AMX) whose check
    records itself and returns `results[flags]` (raising it if it is an exception); with a barrier, each check made
    in a thread waits for the others."""
    import threading
    import types

    class Isa:
        def __init__(self, flags):
            self.flags = flags

        def __str__(self):
            return self.flags

        def bit_width(self):
            return 256 if self.flags == "avx2" else 512

        def __bool__(self):
            checked.append(self.flags)
            if barrier is not None and threading.current_thread() is not threading.main_thread():
                barrier.wait()  # raises in the thread (broken barrier) unless all the checks run together
                checked.append("met")
            result = results.get(self.flags, True)
            if isinstance(result, Exception):
                raise result
            return result

    made = []
    return types.SimpleNamespace(
        x86_isa_checker=lambda: ["avx2", "avx512", "avx512_vnni"], made=made, invalid_vec_isa=None,
        supported_vec_isa_list=[Isa("avx512 avx512_vnni amx_tile"), Isa("avx512 avx512_vnni"), Isa("avx512"),
                                Isa("avx2")],
        valid_vec_isa_list=lambda: made.append(1),
        get_isa_from_cpu_capability=lambda cap, found, invalid: next((i for i in found if cap in str(i)), invalid))


def test_the_warmup_builds_only_the_isa_inductor_will_use(monkeypatch):
    import platform
    import types

    from zcompile.compiler.tracing import warmup
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    config = types.SimpleNamespace(cpp=types.SimpleNamespace(vec_isa_ok=None, simdlen=None))
    checked = []
    isas = _fake_isas({}, checked)
    assert str(warmup._verify(isas, config)) == "avx512 avx512_vnni" and checked == ["avx512 avx512_vnni"]
    assert isas.made == []  # inductor's list is made by wait(), from the flags
    checked.clear()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # inductor then picks AVX2: that one is checked
    assert str(warmup._verify(isas, config)) == "avx2" and checked == ["avx2"]
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    checked.clear()
    config.cpp.simdlen = 256
    assert str(warmup._verify(isas, config)) == "avx2" and checked == ["avx2"]
    config.cpp.simdlen, config.cpp.vec_isa_ok = None, False  # the user's own answer: nothing built here
    checked.clear()
    assert warmup._verify(isas, config) is None and checked == [] and isas.made == []


def test_the_warmup_checks_the_candidate_isas_at_once_when_the_chosen_one_fails(monkeypatch):
    """Inductor checks each candidate ISA in turn (a g++ build and a child process each); should the one it will
    use fail, the warmup checks the ones this CPU's flags allow at once, so each check meets the others (a barrier:
    in turn, the first would time out), and never one the CPU lacks; a check that raises is left to inductor's own
    list, without a thread's traceback."""
    import platform
    import threading
    import types

    from zcompile.compiler.tracing import warmup
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    config = types.SimpleNamespace(cpp=types.SimpleNamespace(vec_isa_ok=None, simdlen=None))
    checked = []
    isas = _fake_isas({"avx512 avx512_vnni": False, "avx2": OSError("a check that fails")}, checked,
                      threading.Barrier(3, timeout=20))
    thread_errors = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)
    assert warmup._verify(isas, config) is None
    assert thread_errors == [], thread_errors
    assert checked[0] == "avx512 avx512_vnni"  # the chosen one, first and alone (inductor caches its result)
    assert sorted(checked[1:]) == sorted(["avx512 avx512_vnni", "avx512", "avx2"] + ["met"] * 3), checked
    assert isas.made == [1]  # inductor's list, made from those checks


def test_an_eager_region_drops_what_inductor_needed_to_hold_collective_inputs():
    """hold_collective_inputs' force_stride_order and held_until are for inductor's buffer reuse; run eagerly the
    first copied its input on every call (a copy of each gathered bucket per step)."""
    from torch._inductor import inductor_prims

    from zcompile.compiler.codegen import inductor  # noqa: F401  (zcompile::held_until)
    graph = fx.Graph()
    x = graph.placeholder("x")
    held = graph.call_function(inductor_prims.force_stride_order, (x, [1]))
    out = graph.call_function(torch.ops.aten.mul.Tensor, (held, 2.0))
    graph.call_function(torch.ops.zcompile.held_until.default, (held, out))
    graph.output((held, out))
    sub = fx.GraphModule(nn.Module(), graph)
    t = torch.arange(4.0)
    first, doubled = regions._run_eagerly(sub)([t])
    assert first is t and torch.equal(doubled, 2 * t)  # no copy
    assert not any(n.op == "call_function" and n.target is not torch.ops.aten.mul.Tensor for n in sub.graph.nodes)


def test_nested_blocks_call_one_body_per_distinct_block_and_match_the_model():
    """regional_compile 'nested' (regions.nest_blocks): each graph becomes one graph whose block regions are
    invoke_subgraph calls of one body per distinct region, as many bodies at 8 blocks as at 4; run as FX code and
    compiled by inductor (which lowers each body once), it computes the model's loss and gradients."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    x = torch.randn(4, 16)
    bodies = {}
    for depth in (4, 8):
        for backend in ("fx", "inductor"):
            torch._dynamo.reset()
            torch.manual_seed(0)
            net, nested = Net(depth), {}

            def compiler(kind, backend=backend):
                def compile_graph(gm, example_inputs):
                    out = nested[kind] = regions.nest_blocks(gm)
                    if backend == "inductor":
                        return compile_fx_inner(out, example_inputs, is_backward=kind == "backward")
                    return make_boxed_func(out.forward)
                return compile_graph
            run = torch.compile(net, backend=aot_autograd(fw_compiler=compiler("forward"),
                                                          bw_compiler=compiler("backward"),
                                                          decompositions=select_decomp_table()))
            assert_matches_the_model(net, run, x, atol=1e-5)
            for kind, gm in nested.items():
                calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
                assert len(calls) == depth, (kind, depth, len(calls))
                used = {n.args[0] for n in calls}
                assert all(b.op == "get_attr" for b in used)
                bodies[kind, depth] = len(used)
                assert len(used) <= 3, (kind, depth, len(used))  # first block, the others, last block
    assert {k: n for (k, d), n in bodies.items() if d == 4} == {k: n for (k, d), n in bodies.items() if d == 8}


def test_nested_bodies_leave_their_input_checks_to_the_caller():
    """zcompile's inductor compile of a nested graph (codegen.inductor.unchecked_body_inputs): a block body's code
    asserts no input's size and stride at each of its calls (inductor gives each call's operands the body's
    layouts: issue 69's host work), while the outer graph's code still checks its own inputs; the loss and the
    gradients are the model's."""
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.utils import fresh_inductor_cache, run_and_get_code
    from zcompile.compiler.codegen import inductor

    def compiler(kind):
        return lambda gm, example_inputs: inductor.compile_inductor(regions.nest_blocks(gm), example_inputs, kind)
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = Net(4)
    run = torch.compile(net, backend=aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                                                  decompositions=select_decomp_table()))
    with fresh_inductor_cache():
        _, codes = run_and_get_code(lambda: assert_matches_the_model(net, run, torch.randn(4, 16), atol=1e-5))
    assert len(codes) == 2, len(codes)  # forward, backward
    for code in codes:
        bodies = [_top_level_def(code, at.start()) for at in re.finditer(r"^def zc_block_", code, re.M)]
        outer = code.count("'input')") - sum(b.count("'input')") for b in bodies)
        assert bodies and outer > 0 and all("assert_size_stride" not in b for b in bodies), code


def _top_level_def(code: str, start: int) -> str:
    """The text of the function defined at `start` in generated code: up to the next unindented line."""
    end = re.compile(r"^\S", re.M).search(code, code.index("\n", start) + 1)
    return code[start:end.start() if end else len(code)]


def test_the_backward_runs_below_autograd():
    """With grad mode off, the compiled backward runs with autograd's dispatch keys excluded (codegen.commit): its
    functional collectives skip the Python autograd wrapper torch registers for them (`autograd_impl`, six Python
    calls a collective call; issue 69's host work), while the forward, whose outputs autograd must see, keeps it."""
    from tests import workers
    from tests.harness import run_world
    for seen in run_world(2, workers.collective_autograd_wrappers, {"stage": 3, "backend": "eager"}):
        assert seen["forward"] > 0 and seen["backward"] == 0, seen


def test_nesting_leaves_a_graph_without_blocks_or_with_sizes_between_blocks_alone():
    """No block regions: nothing to nest. A dynamic batch whose size a block region reads (PairBlock's view):
    inductor's subgraph calls take tensors only, so the graph is left to the regions."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)
    torch._dynamo.reset()
    torch.compile(nn.Linear(16, 1), backend=aot_autograd(fw_compiler=capture))(torch.randn(4, 16)).sum()
    torch._dynamo.reset()
    run = torch.compile(Net(4, block=PairBlock), backend=aot_autograd(fw_compiler=capture), dynamic=True)
    run(torch.randn(4, 16))
    assert regions.nest_blocks(graphs[0]) is None
    assert regions.nest_blocks(graphs[1]) is None


def test_a_hold_costs_next_to_nothing_at_run_time():
    """Inductor's code calls `zcompile::held_until` for every held collective input at every step: it dispatches
    to a Python no-op without custom_op's autograd and mutation checks (41 Python calls a call as a custom_op)."""
    import sys
    from zcompile.compiler.codegen import inductor  # noqa: F401  (zcompile::held_until)
    hold, x, done = torch.ops.zcompile.held_until.default, torch.zeros(4), torch.zeros(4)
    hold(x, done)
    seen = [0]

    def count(frame, event, arg):
        seen[0] += event in ("call", "c_call")
    sys.setprofile(count)
    try:
        hold(x, done)
    finally:
        sys.setprofile(None)
    assert seen[0] <= 6, seen[0]


@pytest.mark.parametrize("extra", [{"mixed_precision": {"param_dtype": "bf16"}},
                                   {"quantize_weights": {"block": 256}}], ids=["bf16", "qwz"])
def test_nested_blocks_train_like_the_regions(extra):
    """'nested' with bf16 compute (the GPU default) and with ZeRO++'s quantized gathers, at 2 gloo ranks: the losses
    and parameters of the default regions (bf16: the glue and the loss run compiled, not eagerly, which rounds
    differently: 1.0e-3 apart at most in the parameters, 2e-4 in the losses, on 2026-11-29)."""
    from tests import workers
    from tests.harness import run_world
    from tests.test_parity import max_diff
    base = {"stage": 3, "backend": "inductor", **extra}
    nested = run_world(2, workers.parity_with_config, "gpt", dict(base, regional_compile="nested"))
    regional = run_world(2, workers.parity_with_config, "gpt", dict(base, regional_compile=True))
    bf16 = "mixed_precision" in extra
    for a, b in zip(nested, regional):
        assert max_diff(a["params"], b["params"]) < (5e-3 if bf16 else 1e-5)
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-3 if bf16 else 1e-6)
