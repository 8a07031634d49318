"""Hugging Face models train under `mixed_precision` as under FSDP2's MixedPrecisionPolicy (bf16 compute, fp32
reduction and master weights): per family and stage, the losses of four AdamW steps at world 2 match FSDP2's on the
same init and data within bf16 rounding, the model's outputs come in the compute dtype, and the loss falls."""
import functools

import pytest
import torch

from tests import hf_workers
from tests.harness import WorkerFailed, run_world

REL = 2e-2  # a few bf16 steps (2^-8 relative) after four updates at lr 1e-2; eager kernels match FSDP2's to ~1e-4
LEARNS = 0.5  # the loss falls by more than this over four steps on a fixed batch (about 1.0-3.0 in these runs)


@functools.cache
def _fsdp2(family: str, dtype: str) -> tuple:
    """FSDP2's runs per rank, once per (family, dtype) for all the tests that compare against them."""
    return tuple(run_world(2, hf_workers.fsdp2_runs, family, dtype, timeout=300))


def _check(results: list, families, stages, dtype: torch.dtype) -> None:
    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    for rank, res in enumerate(results):
        for family in families:
            ref = _fsdp2(family, name)[rank]
            assert ref["losses"][0] - ref["losses"][-1] > LEARNS, (family, ref)
            for stage in stages:
                got = res[family][stage]
                where = f"{family} stage {stage} rank {rank}: {got['losses']} vs FSDP2 {ref['losses']}"
                assert got["logits"] == ref["logits"] == dtype, where
                assert got["losses"] == pytest.approx(ref["losses"], rel=REL), where
                assert got["losses"][0] - got["losses"][-1] > LEARNS, where
                assert got.get("pickled", stage != 0), where  # torch.save(model) at stage 0
                assert got["recompiled"] == 0, f"{where}: {got['recompiled']} graph(s) compiled after the first step"


@pytest.mark.parametrize("family", hf_workers.FAMILIES)
def test_bf16_trains_like_fsdp2_at_every_stage(family):
    _check(run_world(2, hf_workers.matrix, [family], "bf16", [0, 1, 2, 3], timeout=400), [family], range(4),
           torch.bfloat16)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_bf16_under_inductor_trains_like_fsdp2(family):
    _check(run_world(2, hf_workers.matrix, [family], "bf16", [3], "inductor", timeout=400), [family], [3],
           torch.bfloat16)


def test_mistral_trains_in_fp32_at_every_stage():
    """Mistral's sliding-window KV cache is written inside each block: an empty one is recorded inside the block's
    region and filled after it (dtensor_params._empty_cache_call)."""
    _check(run_world(2, hf_workers.matrix, ["mistral"], "fp32", [0, 1, 2, 3], timeout=400), ["mistral"], range(4),
           torch.float32)


@pytest.mark.parametrize("family", hf_workers.MOE_FAMILIES)
def test_mixture_of_experts_trains_like_fsdp2_at_every_stage(family):
    """3-D expert weights (a token would give dynamo's trace all-zero strides, which `_grouped_mm` refuses:
    dtensor_params.strided_at_trace), sharded like any parameter."""
    _check(run_world(2, hf_workers.matrix, [family], "bf16", [0, 1, 2, 3], timeout=400), [family], range(4),
           torch.bfloat16)


def test_mixture_of_experts_in_fp32_and_under_inductor():
    """fp32 (stage 0 traces the plain expert weights, 3 their DTensors) and bf16 under inductor at stage 3."""
    _check(run_world(2, hf_workers.matrix, ["qwen3_moe"], "fp32", [0, 3], timeout=400), ["qwen3_moe"], [0, 3],
           torch.float32)
    _check(run_world(2, hf_workers.matrix, ["mixtral"], "bf16", [3], "inductor", timeout=400), ["mixtral"], [3],
           torch.bfloat16)


def test_stage_0_compiled_without_the_compile_start_hook():
    """After a bare torch._dynamo.reset() (torch 2.11's path): the backend makes the tokens and restarts the trace
    once, which then reads them (before_trace.restarted_as_zero; traced plain in fp32 it failed on a bf16 matmul);
    Mixtral's plain expert weights (`cast_at_trace`) must not ask for another restart (which looped until dynamo gave
    up on the frame)."""
    families = ["llama", "mixtral"]
    _check(run_world(2, hf_workers.matrix, families, "bf16", [0], "eager", True, timeout=400), families, [0],
           torch.bfloat16)


def test_an_expert_that_gets_no_tokens_has_a_zero_gradient():
    """Every rank reduces every expert's gradient: one no token reached has zeros, not None."""
    for rank, grads in enumerate(run_world(2, hf_workers.unused_expert_grads, 3, timeout=300)):
        assert len(grads) == 2 * 2, grads  # gate_up_proj and down_proj of two layers
        for g in grads:
            assert g["zero"] == [False, False, False, True], (rank, g)


def test_experts_that_run_only_where_tokens_went_fail_naming_the_cause():
    """transformers' experts_implementation='eager' loops over the experts hit (`nonzero`), which differ per rank:
    inside the block's region that is a graph break, whose error on every rank carries zcompile's note naming that
    layer and the way out (traced inline, the ranks' schedules differ and the schedule check's error says the
    same), instead of hanging."""
    with pytest.raises(WorkerFailed) as e:
        run_world(2, hf_workers.matrix, ["mixtral_eager_experts"], "bf16", [3], timeout=300)
    ranks = str(e.value).split("--- rank ")[1:]
    assert len(ranks) == 2 and all("experts_implementation='eager'" in r and "'grouped_mm'" in r for r in ranks), \
        str(e.value)


def test_floating_inputs_are_cast_before_the_forward_as_fsdp2_casts_them():
    """`inputs_embeds` in fp32 under bf16 (mixed_precision.cast_forward_inputs, on by default): the first decoder
    layer gets bf16 hidden states from the first call on, and the losses are FSDP2's (eager kernels: to ~1e-6)."""
    for rank, res in enumerate(run_world(2, hf_workers.embeds_matrix, timeout=300)):
        ref, got = res["fsdp2"], res["zcompile"]
        assert ref["seen"] == got["seen"] == torch.bfloat16, (rank, res)
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), (rank, res)
        assert got["losses"][0] - got["losses"][-1] > LEARNS, (rank, res)


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_the_default_kv_cache_call_keeps_one_region_per_block_class(family):
    """`model(input_ids=, labels=)` with the config's `use_cache=True` hands every decoder layer a DynamicCache (T5:
    an EncoderDecoderCache of two); an empty one is recorded inside the block's region and filled after it
    (dtensor_params._empty_cache_call): Llama's 4 layers are 4 calls of one region, T5's 2 repeated blocks per
    stack 4 calls of two (its first blocks hold the relative position tables); the losses equal those of the
    blocks traced inline with the cache (trace_blocks_once: false), and so does the returned cache, every layer's
    keys and values (T5: self- and cross-attention, the cross-attention layers marked updated)."""
    for rank, out in enumerate(run_world(2, hf_workers.use_cache_run, family, timeout=300)):
        got, ref = out[True], out[False]
        want = (4, 1) if family == "llama" else (4, 2)  # (region calls, distinct bodies) per graph
        assert got["seen"] and all(s == want for s in got["seen"]) and not ref["seen"], (rank, got, ref)
        assert got["losses"] == ref["losses"], (rank, got["losses"], ref["losses"])
        assert got["cache"] == ref["cache"], (rank, got["cache"], ref["cache"])
        shape = (hf_workers.MICRO, 2 if family == "llama" else 4, hf_workers.SEQ, 16)
        layers = [got["cache"]] if family == "llama" else [got["cache"]["self"], got["cache"]["cross"]]
        assert all([s for s, _, _ in layer] == [shape] * (4 if family == "llama" else 3) for layer in layers), got
        if family == "t5":
            assert got["cache"]["updated"] == {i: True for i in range(3)}, got["cache"]["updated"]
