"""keep_block_regions (compiler/block_regions.py): the blocks dynamo traced once go through AOTAutograd as regions
(one joint trace and partition per distinct block), then are inlined for the split passes. Trained on gloo against
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
from zcompile.compiler import block_regions
from zcompile.runtime import dtensor_params

pytestmark = pytest.mark.skipif(not dtensor_params.trace_once_supported(),
                                reason="torch < 2.13: blocks are traced inline")


def _train(rank: int, world: int, name: str, config: dict, steps: int) -> dict:
    import zcompile
    from zcompile.compiler import backend, blocks
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
                                  if "forward" in job.final)}


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


def test_why_regions_are_inlined_first():
    marked = Net(3)
    marked.blocks = torch.nn.ModuleList(MarkedBlock(16) for _ in range(3))
    gm = _dynamo_graph(marked, torch.randn(4, 16))
    keep = {"stage": 3, "keep_block_regions": True}
    assert block_regions.why_not(gm, zconfig.from_dict(keep)) is None
    assert block_regions.why_not(gm, zconfig.from_dict({"stage": 3})) == "off"
    bf16 = zconfig.from_dict({**keep, "mixed_precision": {"param_dtype": "bf16"}})
    assert block_regions.why_not(gm, bf16) == "a dynamo-phase pass rewrites parameter uses"
    tiled = zconfig.from_dict({**keep, "tiling": {}})
    assert block_regions.why_not(gm, tiled) == "a dynamo-phase pass rewrites parameter uses"
    assert block_regions.why_not(_dynamo_graph(Net(3), torch.randn(4, 16)), zconfig.from_dict(keep)) == "no regions"
