"""Inductor's joint-graph passes run on zcompile's joint graphs (tracing/partition.py, from job.py), as torch.compile
runs them in its own partition function: scatter_upon_const_tensor turns the NLL loss's backward (a logits-size fp32
`full` of zeros scattered into) into one pointwise `where`, which inductor fuses into the softmax's gradient. One
process (world 1), the GPT at stage 3 under inductor with its blocks kept as regions (torch >= 2.13) and inlined;
against the same compile with inductor's joint passes turned off. (The chunked head and loss, on by default,
would leave no NLL backward to look at: test_chunk_loss.py.)"""
import pytest
import torch

from tests import workers
from tests.harness import run_world
from zcompile.runtime import dtensor_params


def _train(rank: int, world: int, joint_passes: bool, keep: bool) -> dict:
    import torch._inductor.config as inductor_config
    import zcompile
    from zcompile.compiler import backend
    inductor_config.use_joint_graph_passes = joint_passes
    before = set(backend._COMPILED)
    model, _, losses = workers.train(rank, world, "gpt", {"stage": 3, "backend": "inductor",
                                                          "keep_block_regions": keep,
                                                          "chunked_loss": {"enabled": False}}, 2)
    jobs = [job for job in set(backend._COMPILED) - before if "backward" in job.final]
    logits = workers.MICRO * workers.SEQ * workers.VOCAB
    filled = [(str(n.target), tuple(n.meta["val"].shape)) for job in jobs
              for n in job.final["backward"].graph.nodes
              if n.target in (torch.ops.aten.full.default, torch.ops.aten.scatter.value)
              and n.meta["val"].numel() == logits]
    return {"filled": filled, "losses": losses, "kept": [job.regions_kept for job in jobs],
            "params": {k: v.cpu() for k, v in zcompile.full_state_dict(model).items()}}


@pytest.mark.parametrize("keep", [True, False])
def test_the_nll_backward_holds_no_logits_size_buffer_of_zeros(keep):
    if keep and not dtensor_params.trace_once_supported():
        pytest.skip("torch < 2.13: blocks are traced inline")
    (on,) = run_world(1, _train, True, keep)
    (off,) = run_world(1, _train, False, keep)
    assert on["kept"] == off["kept"] == [keep]
    assert off["filled"], "the reference without the joint passes should fill and scatter logits-size zeros"
    assert on["filled"] == [], on["filled"]
    assert max(abs(a - b) for a, b in zip(on["losses"], off["losses"])) < 1e-5
    assert max((on["params"][k] - off["params"][k]).abs().max().item() for k in on["params"]) < 1e-5
