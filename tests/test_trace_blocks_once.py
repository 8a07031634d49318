"""Dynamo traces each repeated block once (dtensor_params.mark_blocks, compiler/tracing/trace_blocks_once.py): the
inlined graph is the one dynamo traces without regions, node for node, with each block's module stack; the zero backend
marks a sharded model's blocks itself and trains like the reference; a graph break in a block fails as before."""
import pytest
import torch
import torch.nn as nn

from zcompile.compiler.graph import blocks
from zcompile.compiler.tracing import trace_blocks_once
from zcompile.runtime import dtensor_params
from tests.test_regions import Block, Net

pytestmark = pytest.mark.skipif(not dtensor_params.trace_once_supported(),
                                reason="torch < 2.13: blocks are traced inline")


class MarkedBlock(Block):
    forward = torch.compiler.nested_compile_region(Block.forward)


def _dynamo_graph(net: nn.Module, x: torch.Tensor):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(net, backend=capture)(x)
    (gm,) = graphs
    return gm


def _ops(gm) -> list:
    return [(n.op, n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def test_inlining_gives_the_graph_dynamo_traces_without_regions_with_each_blocks_module_stack():
    torch.manual_seed(0)
    plain = Net(3)
    marked = Net(3)
    marked.blocks = nn.ModuleList(MarkedBlock(16) for _ in range(3))
    marked.load_state_dict(plain.state_dict())
    x = torch.randn(4, 16)
    flat = _dynamo_graph(plain, x)
    gm = _dynamo_graph(marked, x)
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(calls) == 3 and len({getattr(gm, n.args[0].target) for n in calls}) == 1  # traced once
    assert trace_blocks_once.inline(gm) == 3
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert not [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert _ops(gm) == _ops(flat)
    assert [blocks.block_of(n) for n in gm.graph.nodes if n.op != "placeholder"] == \
        [blocks.block_of(n) for n in flat.graph.nodes if n.op != "placeholder"]
    assert {blocks.block_of(n) for n in gm.graph.nodes} >= {"L['self'].blocks.0", "L['self'].blocks.1",
                                                            "L['self'].blocks.2"}
    args = [x if n.name.endswith("x_") else dict(marked.named_parameters())[_param_name(n.name)]
            for n in gm.graph.nodes if n.op == "placeholder"]
    assert torch.equal(gm(*args)[0], marked(x))


def _param_name(ph: str) -> str:
    """Dynamo's placeholder name of a parameter -> its module path: l_self_modules_blocks_modules_0_modules_fc_
    parameters_weight_ -> blocks.0.fc.weight."""
    body = ph.removeprefix("l_self_").removesuffix("_")
    parts = body.replace("_modules_", ".").replace("modules_", "").replace("_parameters_", ".").split(".")
    return ".".join(parts)


def test_only_composite_blocks_that_repeat_are_marked():
    net = Net(3)
    net.extra = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))  # repeated Linears, not blocks
    found = dtensor_params.repeated_blocks(net)
    assert found == list(net.blocks)
    assert dtensor_params.repeated_blocks(Net(1)) == []


def _train_sharded(rank: int, world: int, depth: int, shard_first: bool, block: str = "plain", **extra) -> dict:
    """Stage 3 (eager graphs) on `Net(depth)` of `_BLOCKS[block]`; what dynamo handed the backend, losses and the
    final parameters."""
    import zcompile
    from zcompile.compiler.tracing import trace_blocks_once as tbo

    seen = []
    inline = tbo.inline

    def counting(gm, **kwargs):
        calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
        if calls:
            seen.append((len(calls), len({id(getattr(gm, n.args[0].target)) for n in calls})))
        return inline(gm, **kwargs)

    tbo.inline = counting
    try:
        torch.manual_seed(0)
        net = Net(depth, block=_BLOCKS[block])
        config = {"stage": 3, "backend": "eager", **extra}  # trace_blocks_once by default
        if shard_first:
            zcompile.shard_parameters(net, config)
        run = torch.compile(net, backend="zero", options={"config": config})
        opt = torch.optim.AdamW(run.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(rank)
        losses = []
        for _ in range(3):
            loss = run(torch.randn(4, 16, generator=g))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        with torch.no_grad():  # an eager forward of the sharded model gathers each block's parameters (its hooks)
            x = torch.randn(4, 16, generator=g)
            eager, compiled = net(x), run(x)
        from zcompile.compiler import backend
        jobs = [job for job in backend._COMPILED if "forward" in job.final]
        return {"seen": seen, "losses": losses, "eager": eager.item(), "compiled": compiled.item(),
                "params": {k: v.full_tensor() for k, v in net.named_parameters()},
                "kept": [job.regions_kept for job in backend._COMPILED],
                "saved gathered": sum(_saved_gathered(job.final["forward"], job.num_fwd_outputs) for job in jobs)}
    finally:
        tbo.inline = inline


# views and copies: a bucket's copy-out is slice -> clone -> view
_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.slice.Tensor, torch.ops.aten.permute.default,
          torch.ops.aten.t.default, torch.ops.aten.transpose.int, torch.ops.aten.expand.default,
          torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.alias.default,
          torch.ops.aten.clone.default}


def _saved_gathered(fw, num_fwd_outputs: int) -> int:
    """How many tensors the compiled forward saves for the backward that are (views or copies of) gathered
    parameters: each keeps a whole parameter alive from the forward to the backward."""
    def root(n):
        while isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target in _VIEWS:
            n = n.args[0]
        return n
    saved = fw.graph.output_node().args[0][num_fwd_outputs:]
    return sum(isinstance(s, torch.fx.Node) and root(s).target is torch.ops._c10d_functional.wait_tensor.default
               for s in saved)


class BreakingBlock(Block):
    def forward(self, x):
        y = super().forward(x)
        torch._dynamo.graph_break()
        return y


class CheckpointedBlock(Block):
    """Checkpoints its own body: the block traced once holds the activation checkpoint's body, which all blocks'
    calls then share."""

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=False)


_BLOCKS = {"plain": Block, "graph_break": BreakingBlock, "checkpointed": CheckpointedBlock}


def _reference(world: int, depth: int) -> dict:
    """The same steps in one process without sharding: each rank's batch, gradients averaged."""
    torch.manual_seed(0)
    net = Net(depth)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    for _ in range(3):
        total = sum(net(torch.randn(4, 16, generator=g)) for g in gens) / world
        total.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in net.named_parameters()}


@pytest.mark.parametrize("shard_first, block, keep", [
    (False, "plain", False), (True, "plain", False), (False, "checkpointed", False),
    (False, "plain", True), (False, "checkpointed", True)],
    ids=["sharded_at_first_compile", "shard_parameters", "checkpoint_inside_the_block",
         "kept_through_aot", "kept_through_aot_checkpoint_inside"])
def test_the_zero_backend_traces_each_block_once_and_trains_like_the_reference(shard_first, block, keep):
    """Also with an activation checkpoint inside the block: its body, shared by every block's call once inlined,
    loses the meshes it no longer reads at each call (it failed with a layer_norm given a FakeScriptObject).
    keep_block_regions: AOTAutograd traces and partitions the block once (the forward and the backward then
    inline 4 calls of one region each); the forward saves no gathered weight for the backward either way (the
    region's partition tags the weights' transposes for recompute, else it saved one per linear)."""
    from tests.harness import run_world
    ref = _reference(2, 4)
    for res in run_world(2, _train_sharded, 4, shard_first, block, keep_block_regions=keep):
        assert res["seen"] and all(s == (4, 1) for s in res["seen"]), res["seen"]  # 4 calls of one subgraph
        assert all(res["kept"]) if keep else not any(res["kept"]), res["kept"]
        assert res["saved gathered"] == 0, res["saved gathered"]
        assert abs(res["eager"] - res["compiled"]) < 1e-5
        for k, v in ref.items():
            assert torch.allclose(res["params"][k], v, atol=1e-5), k


def test_a_block_with_a_graph_break_fails_traced_once_and_runs_eagerly_inline():
    """A graph break inside a block: traced once, the block is a nested compile region, which dynamo refuses to
    split: its error, on every rank, carries zcompile's note on what to do. Traced inline, the break inside the
    loop over blocks leaves the frame to eager code, which reads the DTensor parameters (sharded when dynamo
    started the frame) and trains like the reference."""
    from tests.harness import run_world
    from zcompile.tools.launch import WorkerFailed
    with pytest.raises(WorkerFailed) as e:
        run_world(2, _train_sharded, 3, False, "graph_break", trace_blocks_once=True)
    assert len(e.value.errors) == 2, e.value.errors
    for text in e.value.errors.values():
        assert "UncapturedHigherOrderOpError" in text and "graph_break" in text, text
        assert "a region cannot hold a graph break" in text and "trace_blocks_once: false" in text, text
    ref = _reference(2, 3)
    for res in run_world(2, _train_sharded, 3, False, "graph_break", trace_blocks_once=False):
        assert abs(res["eager"] - res["compiled"]) < 1e-5
        for k, v in ref.items():
            assert torch.allclose(res["params"][k], v, atol=1e-5), k


def test_a_user_marked_region_is_inlined_and_its_parameters_sharded():
    from tests.harness import run_world
    from tests.test_regions import _compile_marked_blocks
    (message,) = run_world(1, _compile_marked_blocks)
    assert message == "compiled", message



def test_an_empty_kv_cache_is_recorded_only_for_a_block_with_one_layer_index():
    """dtensor_params._empty_cache_call: a block's region records one layer's keys and values, so a block whose
    attentions write two layers of the cache (LongcatFlash's two per block) is traced inline; an empty
    EncoderDecoderCache is recorded until its layer is marked updated (a later decoding step reuses it)."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    class Attention(torch.nn.Module):
        def __init__(self, layer_idx):
            super().__init__()
            self.layer_idx = layer_idx

    one, two = torch.nn.ModuleList([Attention(3)]), torch.nn.ModuleList([Attention(2), Attention(3)])
    x = torch.zeros(1)
    cache = DynamicCache()
    assert dtensor_params._empty_cache_call(one, (x,), {"cache": cache}) == ("cache", cache, 3)
    assert dtensor_params._empty_cache_call(two, (x,), {"cache": cache}) is None
    dtensor_params._define_encoder_decoder_recorder()
    pair = EncoderDecoderCache(DynamicCache(), DynamicCache())
    assert dtensor_params._empty_cache_call(one, (x,), {"cache": pair}) == ("cache", pair, 3)
    pair.is_updated[3] = True
    assert dtensor_params._empty_cache_call(one, (x,), {"cache": pair}) is None
