"""keep_block_regions (compiler/tracing/block_regions.py): the blocks dynamo traced once go through AOTAutograd as
regions (one joint trace and partition per distinct block), then are inlined for the split passes. Trained on gloo against
the single-process reference; the forward saves no gathered weight for the backward (what the region's own
partition did before it ran tag_param_recompute); where a region cannot stay one, the blocks are inlined first."""
import pytest
import torch

from tests import workers
from tests.harness import run_world
from tests.test_parity import TOL, max_diff
from tests.test_trace_blocks_once import MarkedBlock, _dynamo_graph, _saved_gathered
from tests.test_regions import Net
from zcompile import config as zconfig
from zcompile.compiler.tracing import block_regions
from zcompile.runtime import dtensor_params

pytestmark = pytest.mark.skipif(not dtensor_params.trace_once_supported(),
                                reason="torch < 2.13: blocks are traced inline")


def _train(rank: int, world: int, name: str, config: dict, steps: int) -> dict:
    import zcompile
    from zcompile.compiler import backend
    from zcompile.compiler.graph import blocks
    before = set(backend._COMPILED)
    model, _, losses = workers.train(rank, world, name, config, steps)
    jobs = set(backend._COMPILED) - before

    def order(gm) -> list:  # the blocks a graph computes for, in order of first appearance
        found = []
        for node in (n for n in gm.graph.nodes if n.op == "call_function"):
            block = blocks.block_of(node)
            if block and block not in found:
                found.append(block)
        return found
    return {"params": {k: v.cpu() for k, v in zcompile.full_state_dict(model).items()}, "losses": losses,
            "blocks": [(order(job.final["forward"]), order(job.final["backward"])) for job in jobs
                       if "backward" in job.final],
            "kept": [job.regions_kept for job in jobs], "notes": [n for job in jobs for n in job.notes],
            "saved gathered": sum(_saved_gathered(job.final["forward"], job.num_fwd_outputs) for job in jobs
                                  if "forward" in job.final),
            "offloaded": sum(len(job.offloaded) for job in jobs),
            "reloaded": sum(len(job.final["backward"].graph.find_nodes(
                op="call_function", target=torch.ops.zcompile.to_device.default)) for job in jobs
                if "backward" in job.final)}


def _kept_and(rank: int, world: int, fn, *args):
    """fn(rank, world, *args), and whether each graph it compiled kept its regions (backend._keep_regions)."""
    from zcompile.compiler import backend
    kept, keep = [], backend._keep_regions
    backend._keep_regions = lambda *a: kept.append(keep(*a)) or kept[-1]
    return fn(rank, world, *args), kept


@pytest.mark.parametrize("name, stage, depth", [("gpt3", 3, 3), ("gpt3", 2, 3), ("llama", 3, 2)])
def test_kept_regions_train_like_the_reference_and_save_no_gathered_weight(name, stage, depth):
    """Also: each node of the inlined forward and backward names its own block (regional compile cuts the graphs
    by them; the backward's were all block 0 at first, which compiled the backward as one graph)."""
    if name == "llama":
        pytest.importorskip("transformers")
    ref_params, ref_losses = workers.reference(name, 2, steps=3)
    config = {"stage": stage, "backend": "eager", "keep_block_regions": True}
    for rank, res in enumerate(run_world(2, _train, name, config, 3)):
        assert res["kept"] and all(res["kept"]), res  # no silent fallback to inlining
        assert max_diff(res["params"], ref_params) < TOL, rank
        assert res["losses"] == pytest.approx([l[rank] for l in ref_losses], abs=1e-4)
        assert res["saved gathered"] == 0, res["saved gathered"]
        for fw, bw in res["blocks"]:
            assert len(fw) == depth and bw == fw[::-1], (fw, bw)


def test_blocks_with_dropout_are_inlined_first_and_say_why():
    """Random ops in a region would be seeded by inductor's joint passes inside its partition, apart from the
    seeds zcompile threads through the graph: such blocks are inlined before AOTAutograd, with a note in the
    dumps, and train as before."""
    (res,) = run_world(1, _train, "gpt_dropout", {"stage": 3, "backend": "eager", "keep_block_regions": True}, 2)
    assert res["kept"] and not any(res["kept"]), res["kept"]
    assert any("random ops (dropout) in a block" in n for n in res["notes"]), res["notes"]
    assert all(map(torch.isfinite, map(torch.tensor, res["losses"])))


def _marked(depth: int):
    marked = Net(depth)
    marked.blocks = torch.nn.ModuleList(MarkedBlock(16) for _ in range(depth))
    return _dynamo_graph(marked, torch.randn(4, 16))


def test_why_regions_are_inlined_first():
    gm = _marked(3)
    keep = {"stage": 3, "keep_block_regions": True}
    assert block_regions.why_not(gm, zconfig.from_dict(keep)) is None
    assert block_regions.why_not(gm, zconfig.from_dict({"stage": 3, "keep_block_regions": False})) == "off"
    bf16 = zconfig.from_dict({**keep, "mixed_precision": {"param_dtype": "bf16"}})
    assert block_regions.why_not(gm, bf16) is None  # the casts go inside the bodies
    tiled = zconfig.from_dict({**keep, "tiling": {}})
    assert block_regions.why_not(gm, tiled) == "tile_linears rewrites parameter uses"
    assert block_regions.why_not(_dynamo_graph(Net(3), torch.randn(4, 16)), zconfig.from_dict(keep)) == "no regions"


def test_auto_keeps_the_regions_of_deep_models_only():
    """The default, 'auto': a shallow model's blocks are inlined first (kept costs more than it saves there), a
    block that repeats AUTO_MIN_CALLS times or more stays a region."""
    auto = zconfig.from_dict({"stage": 3})
    assert auto.keep_block_regions == "auto"
    assert f"at least {block_regions.AUTO_MIN_CALLS} times" in zconfig.SCHEMA["keep_block_regions"].doc
    few = block_regions.AUTO_MIN_CALLS - 1
    assert block_regions.why_not(_marked(few), auto) == (
        f"auto: a block repeats {few} times, fewer than {block_regions.AUTO_MIN_CALLS}")
    assert block_regions.why_not(_marked(block_regions.AUTO_MIN_CALLS), auto) is None


def test_kept_regions_with_activation_offload_reload_every_saved_activation():
    """The inlined forward and backward name each saved activation alike (as AOTAutograd's own partition does):
    offload_activations pairs the forward's copy to the host with the backward's reload by that name. Before, the
    backward's inputs kept the region outputs' names, so the backward read the host copies as they were (on a GPU:
    host tensors in device ops); on this CPU machine only the count of reloads shows it."""
    ref_params, ref_losses = workers.reference("gpt", 2, steps=3)
    config = {"stage": 3, "backend": "eager", "keep_block_regions": True,
              "offload": {"activations": "cpu", "activation_min_bytes": 0}}
    for rank, res in enumerate(run_world(2, _train, "gpt", config, 3)):
        assert res["kept"] and all(res["kept"]), res["kept"]
        assert res["offloaded"] > 10 and res["reloaded"] == res["offloaded"], (res["offloaded"], res["reloaded"])
        assert max_diff(res["params"], ref_params) < TOL, rank
        assert res["losses"] == pytest.approx([l[rank] for l in ref_losses], abs=1e-4)


def test_kept_regions_plan_each_blocks_activations_apart():
    """The fake values of every call of one region are the same objects (torch's fake invoke_subgraph), so block
    0's and block 1's saved activations shared one fake storage and the liveness plan counted them once (9% under
    the measured backward peak): the inlined forward is propagated afresh and hands its values to the backward."""
    config = {"stage": 2, "backend": "eager", "bucket_mb": 25, "keep_block_regions": True}
    runs, kept = run_world(2, _kept_and, workers.planned_vs_measured, "gpt", config)[0]
    assert kept and all(kept), kept
    assert {r.kind for r in runs} == {"forward", "backward"}
    for r in runs:
        err = abs(r.planned_peak - r.measured_peak) / r.measured_peak
        assert err < 0.05, f"{r.kind}: planned {r.planned_peak} B, measured {r.measured_peak} B ({err:.1%} off)"


def test_kept_regions_with_dynamic_dims_that_differ_between_ranks():
    """Dims marked dynamic reach the region bodies as symbolic sizes: each body is checked in dynamo's fake mode
    (with the inputs' real tensors it failed: 'SymIntArrayRef expected to contain only concrete integers'). One
    graph serves every length, rank 1's sequences 8 tokens longer."""
    seq_lens, sizes = [16, 12, 20], [2, 2, 2]
    ref_params, ref_losses = workers.reference("gpt", 2, steps=3, batch_sizes=sizes, seq_lens=seq_lens,
                                               rank_seq_offset=8)
    config = {"stage": 3, "backend": "eager", "keep_block_regions": True}
    results = run_world(2, _kept_and, workers.new_shapes, config, seq_lens, sizes, True, 8)
    for rank, (res, kept) in enumerate(results):
        assert kept == [True], kept
        assert res["graphs"] == 1, res["graphs"]
        assert max_diff(res["params"], ref_params) < TOL, f"rank {rank}"
        assert res["losses"] == pytest.approx([l[rank] for l in ref_losses], abs=1e-4)


def _regions_compiled(rank: int, world: int, name: str, config: dict, steps: int):
    """_train, how many distinct regions each regional compile built (compile_one stubbed: the regions run eagerly,
    so the test pays no inductor compile), and per program how many regions it runs and how many run compiled."""
    from zcompile.compiler.codegen import regions
    counts, totals, cut = [], [], regions.compile_regions

    def compile_regions(gm, example_inputs, compile_one, *args, **kwargs):
        counts.append(0)

        def one(sub, fakes):
            counts[-1] += 1
            return regions._run_eagerly(sub)
        program = cut(gm, example_inputs, one, *args, **kwargs)
        if program is not None:
            totals.append((program.regions, program.compiled_regions))
        return program
    regions.compile_regions = compile_regions
    return _train(rank, world, name, config, steps), counts, totals


def test_kept_regions_compile_one_forward_and_one_backward_block():
    """Kept, every block is partitioned alike, so block 0's backward is the others' too: its region used to end with
    the position embedding's gradient (a sum over the block's input gradient, module-less), which now goes with the
    embeddings' backward; the forward and the backward each compile one block region (3 before)."""
    ref_params, ref_losses = workers.reference("gpt3", 2, steps=2)
    config = {"stage": 3, "backend": "inductor", "regional_compile": True, "keep_block_regions": True}
    for rank, (res, counts, totals) in enumerate(run_world(2, _regions_compiled, "gpt3", config, 2)):
        assert res["kept"] and all(res["kept"]), res["kept"]
        assert counts == [1, 1], counts  # forward, backward
        # 8 regions each, 3 running compiled code (one per block), 5 glue regions run eagerly around them
        assert totals == [(8, 3), (8, 3)], totals
        assert max_diff(res["params"], ref_params) < TOL, rank
        assert res["losses"] == pytest.approx([l[rank] for l in ref_losses], abs=1e-4)


@pytest.mark.parametrize("name", ["gpt3", "llama"])
def test_kept_regions_under_bf16_train_like_inlined_blocks(name):
    """mixed_precision casts a kept region's parameter operands inside its body, so bf16 keeps the regions (it
    inlined them before: the casts at the top made the regions' operands casts, not parameters). The same steps as
    the blocks inlined before AOTAutograd, and no gathered weight saved for the backward."""
    if name == "llama":
        pytest.importorskip("transformers")
    bf16 = {"stage": 3, "backend": "eager", "mixed_precision": {"param_dtype": "bf16"}}
    inlined = run_world(2, _train, name, {**bf16, "keep_block_regions": False}, 3)
    kept = run_world(2, _train, name, {**bf16, "keep_block_regions": True}, 3)
    for rank, (a, b) in enumerate(zip(inlined, kept)):
        assert b["kept"] and all(b["kept"]) and not any(a["kept"]), (a["kept"], b["kept"])
        assert max_diff(b["params"], a["params"]) == 0, rank
        assert b["losses"] == a["losses"], rank
        assert b["saved gathered"] == 0, b["saved gathered"]


@pytest.mark.parametrize("keep", [False, True])
def test_a_llama_compiles_one_forward_block_in_bf16(keep):
    """Blocks inlined before AOTAutograd (keep false): work on the graph's inputs alone that every block reads goes
    before the block region that meets it (regions._shared_work). The attention mask and the rotary cos/sin
    unsqueezes AOTAutograd computes once, in block 0, made block 0's forward compile apart from the others' (2
    forward compiles), and at 8 layers the rotary cos and sin the partitioner recomputes in the backward where the
    last block first reads them cut that block's backward in two (5 backward compiles, 4 with the fix). Kept
    regions (keep true, now also under bf16) partition each block alike. The last block's backward compiles apart
    either way: it waits on the head's gradient reduce-scatter, a bucket of another size, where the others wait on
    the block after them (reduce_grads keeps one reduce-scatter in flight)."""
    pytest.importorskip("transformers")
    config = {"stage": 3, "backend": "inductor", "regional_compile": True, "keep_block_regions": keep,
              "mixed_precision": {"param_dtype": "bf16"}}
    for res, counts, _ in run_world(2, _regions_compiled, "llama", config, 2):
        assert all(res["kept"]) == keep, res["kept"]
        assert counts == [1, 2], counts  # forward, backward
