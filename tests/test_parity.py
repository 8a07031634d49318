"""Stages 0-3 on real gloo process groups match a single-process reference after 5 AdamW steps (fp32)."""
import pytest
import torch

from tests import workers
from tests.harness import run_world
from zcompile.runtime import dtensor_params

TOL = 1e-5


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("world", [2, 4])
def test_stages_match_reference(name, world):
    ref_params, ref_losses = workers.reference(name, world, steps=5)
    results = run_world(world, workers.parity, name, [0, 1, 2, 3])
    for stage in range(4):
        for rank, res in enumerate(results):
            got = res[stage]
            assert max_diff(got["params"], ref_params) < TOL, f"stage {stage} rank {rank}"
            assert got["losses"] == pytest.approx([l[rank] for l in ref_losses], abs=1e-4)
            # the per-rank model-state bytes are the ZeRO formula, up to padding
            report = got["report"]
            assert report.stage == stage and report.world == world
            assert 1.0 <= report.ratio < 1.01, str(report)
            if stage == 3:  # each rank holds 1/N of every parameter, gradient and moment (16P/N bytes)
                assert report.total == pytest.approx(16 * report.num_params / world, rel=0.01), str(report)
                assert report.param_bytes == pytest.approx(4 * report.num_params / world, rel=0.01), str(report)


def test_a_0d_parameter_trains_at_every_stage():
    """A 0-d parameter (a learned logit scale) is never a DTensor: at stage 1 the optimizer steps this rank's slice
    of it (ShardedParam.enter_step), at stages 2/3 its shard; each stage matches the reference."""
    ref_params, ref_losses = workers.reference("gpt_scaled", 2, steps=4)
    assert ref_params["logit_scale"].dim() == 0 and ref_params["logit_scale"] != 1.5
    for rank, res in enumerate(run_world(2, workers.parity, "gpt_scaled", [0, 1, 2, 3], steps=4)):
        for stage in range(4):
            assert max_diff(res[stage]["params"], ref_params) < TOL, f"stage {stage} rank {rank}"
            assert res[stage]["losses"] == pytest.approx([l[rank] for l in ref_losses], abs=1e-4)


def test_inductor_stage3_and_stage1():
    """The same parity through inductor's C++ codegen with the collectives kept in the compiled graph."""
    ref_params, _ = workers.reference("gpt", 2, steps=5)
    results = run_world(2, workers.parity, "gpt", [1, 3], "inductor")
    for res in results:
        for stage in (1, 3):
            assert max_diff(res[stage]["params"], ref_params) < TOL, f"stage {stage}"


@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_accumulation(stage):
    ref_params, _ = workers.reference("gpt", 2, steps=3, accum=2)
    results = run_world(2, workers.parity, "gpt", [stage], steps=3, accum=2)
    for res in results:
        assert max_diff(res[stage]["params"], ref_params) < TOL


@pytest.mark.parametrize("stage", [0, 3])
def test_global_norm_clipping(stage):
    ref_params, _ = workers.reference("gpt", 2, steps=3, clip=0.05)
    unclipped, _ = workers.reference("gpt", 2, steps=3)
    assert max_diff(ref_params, unclipped) > 1e-4  # the clip is active
    results = run_world(2, workers.parity, "gpt", [stage], steps=3, clip=0.05)
    for res in results:
        assert max_diff(res[stage]["params"], ref_params) < TOL


def test_new_batch_size_recompiles_and_stays_correct():
    sizes = [2, 2, 3, 1, 2]
    ref_params, _ = workers.reference("gpt", 2, steps=5, batch_sizes=sizes)
    results = run_world(2, workers.parity, "gpt", [3], steps=5, batch_sizes=sizes)
    for res in results:
        assert max_diff(res[3]["params"], ref_params) < TOL


@pytest.mark.parametrize("mark_dynamic", [False, True])
def test_new_sequence_lengths_and_batch_sizes_reuse_one_dynamic_graph_under_inductor(mark_dynamic):
    """Inductor, by regions, at stage 3: the first shape compiles a static graph and the first change a dynamic one
    (dynamo's automatic dynamic shapes) that serves every later length and batch size; inputs marked dynamic
    compile one graph for all. Parameters match the reference throughout (collective sizes do not depend on the
    activations' shapes)."""
    seq_lens, sizes = [16, 24, 12, 32, 20], [2, 3, 2, 4, 3]
    ref_params, ref_losses = workers.reference("gpt", 2, steps=5, batch_sizes=sizes, seq_lens=seq_lens)
    config = {"stage": 3, "backend": "inductor", "regional_compile": True}
    results = run_world(2, workers.new_shapes, config, seq_lens, sizes, mark_dynamic)
    for rank, res in enumerate(results):
        assert res["graphs"] == (1 if mark_dynamic else 2), res["graphs"]
        assert max_diff(res["params"], ref_params) < TOL, f"rank {rank}"
        assert res["losses"] == pytest.approx([l[rank] for l in ref_losses], abs=1e-4)


def test_ranks_may_differ_in_a_dim_marked_dynamic():
    """Rank 1's sequences are 8 tokens longer at every step, in one graph compiled with the sequence dim dynamic:
    no recompile, no schedule mismatch (collectives move parameters), and the averaged gradients match the
    reference's."""
    seq_lens, sizes = [16, 12, 20], [2, 2, 2]
    ref_params, ref_losses = workers.reference("gpt", 2, steps=3, batch_sizes=sizes, seq_lens=seq_lens,
                                               rank_seq_offset=8)
    results = run_world(2, workers.new_shapes, {"stage": 3, "backend": "eager"}, seq_lens, sizes, True, 8)
    for rank, res in enumerate(results):
        assert res["graphs"] == 1, res["graphs"]
        assert max_diff(res["params"], ref_params) < TOL, f"rank {rank}"
        assert res["losses"] == pytest.approx([l[rank] for l in ref_losses], abs=1e-4)


def test_graph_breaks_map_parameters_by_identity():
    """Three graphs; the tied embedding is an input of the first and the last one and gets both gradients."""
    ref_params, _ = workers.reference("gpt_break", 2, steps=5)
    results = run_world(2, workers.parity, "gpt_break", [0, 3])
    for res in results:
        for stage in (0, 3):
            assert max_diff(res[stage]["params"], ref_params) < TOL, f"stage {stage}"


@pytest.mark.skipif(not dtensor_params.trace_once_supported(),
                    reason="torch 2.11: zcompile shards after dynamo's first trace, not before it")
def test_blocks_left_to_eager_code_train_like_the_reference():
    """A graph break dynamo cannot resume from (inside the loop over blocks) leaves the blocks to eager code. The
    parameters were sharded when dynamo started the frame (compiler/tracing/before_trace.py), so the eager blocks gather
    and reduce through the DTensor parameters, as with FSDP2."""
    ref_params, ref_losses = workers.reference("gpt_loop_break", 2, steps=3)
    for rank, res in enumerate(run_world(2, workers.parity, "gpt_loop_break", [3], steps=3)):
        assert max_diff(res[3]["params"], ref_params) < TOL
        assert res[3]["losses"] == pytest.approx([l[rank] for l in ref_losses], abs=1e-4)


def test_parameters_left_plain_in_eager_code_are_an_error_not_silent_drift():
    """Where nothing shards them before dynamo gives the frame up (the first compile after a bare
    torch._dynamo.reset(), which drops zcompile's compile-start hook), the parameters stay plain: the first compile
    inside the model the hook sees says so on every rank, naming zcompile.shard_parameters
    (before_trace._refuse_skipped_root). With only a submodule compiled, the optimizer step refuses the gradients
    eager code left unreduced. Either way, instead of letting the ranks drift apart."""
    for rank, out in enumerate(run_world(2, workers.plain_in_eager_code)):
        where, message = out["after a bare reset"]
        assert where == "forward" and "inside LoopBreakGPT" in message, (rank, where, message)
        assert "zcompile.shard_parameters(model, config)" in message, message
        where, message = out["one block compiled"]
        assert where == "step" and "never an input of a graph compiled by the zero backend" in message, (rank, out)


@pytest.mark.parametrize("stage", [1, 2])
def test_gradients_from_eager_fallback_are_reduced_like_compiled(stage):
    for diff in run_world(2, workers.eager_step_after_compile, stage):
        assert diff < 1e-5
