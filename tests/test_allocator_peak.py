"""zcompile.step_tensor_peak: the CPU allocator's view of a step's peak tensor bytes, held against exact storage
tracking where that is possible (eager code) and against the planner where it is not (inductor's C++ kernels)."""
import pytest
import torch

import zcompile
from tests import workers
from tests.harness import run_world
from zcompile.runtime.allocator_peak import highest_rise
from zcompile.runtime.memory_trace import LiveStorageTracker


def test_eager_step_peak_equals_storage_tracking():
    model = workers.build_model("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=workers.LR)
    x = workers.global_batch(0, 1, micro=8)

    def step():
        workers.loss_of(model, "gpt", x).backward()
        opt.step()
        opt.zero_grad()
    step()  # optimizer state exists from here on
    measured = zcompile.step_tensor_peak(step)
    tracker = LiveStorageTracker()
    tracker.track(list(model.parameters()) + list(model.buffers()) + [x]
                  + [v for s in opt.state.values() for v in s.values()])
    with tracker:
        step()
    assert measured["start"] >= tracker.bytes  # the heap scan finds every tracked storage, and the step's scalars
    assert abs(measured["peak"] - tracker.peak) <= 4096, (measured, tracker.peak)
    assert measured["rise"] > 2 * sum(p.numel() * 4 for p in model.parameters())  # activations and gradients


def test_a_free_on_another_thread_counts_when_the_address_is_reused():
    # (time, address, bytes): A allocated, freed unseen, its address reused by B; C allocated and freed normally
    events = [(0, 0xA, 100), (1, 0xC, 50), (2, 0xC, -50), (3, 0xA, 70), (4, 0xD, 10)]
    assert highest_rise(events) == 150  # A + C at t=1; later B(70) + D(10) = 80
    assert highest_rise([(0, 1, 8), (1, 2, -999)]) == 8  # a free of a block from before the step is not counted


def test_planner_meets_the_measured_inductor_peak_and_smaller_buckets_lower_it():
    """The planned peak, from inductor's code, is at most 5% below the measured one and at most 20% above: the
    gradients count as resident through the step (accumulate_grads, the default), 17% of this small model's peak,
    which a step starting without them is not (without them the plan read 1.4% below at one gather per parameter
    and 0.8% above at 25 MiB buckets, 2026-11-29). Lowest of 5 steps: a 20 KiB block freed off the main thread
    went unseen in 6 of 20 steps here."""
    base = {"stage": 3, "backend": "inductor", "prefetch": 0, "regional_compile": False}
    peaks = {}
    for mb in (25, 0):
        peaks[mb] = run_world(2, workers.allocator_peaks, "gpt", dict(base, bucket_mb=mb), repeats=5)
        for r in peaks[mb]:
            assert 0.95 * r["measured"]["peak"] <= r["planned"] <= 1.2 * r["measured"]["peak"], (mb, r)
    # one gather per parameter holds fewer gathered bytes at once than one bucket per block
    assert max(r["measured"]["peak"] for r in peaks[0]) < min(r["measured"]["peak"] for r in peaks[25])


@pytest.mark.parametrize("regional", [True, "nested"])
def test_regional_compile_stays_within_the_plan(regional):
    """The default regional compile (one inductor graph per block): a collective in flight across two regions keeps
    its input alive only where the library reads it until the wait (not gloo's reduce-scatter, which reads a copy;
    holding its input too measured 4% above the plan). Lowest of 5 steps: a block gloo's thread frees counts as
    freed only when its address is reused. Regions: 1.5% below (2026-11-29; 14% below without the gradients
    counted, accumulate_grads false). 'nested': the blocks' bodies called from one graph, planned in FX order
    (wrapper_memory does not follow subgraph calls): 13% above."""
    config = {"stage": 3, "backend": "inductor", "prefetch": 0, "bucket_mb": 25, "regional_compile": regional}
    for r in run_world(2, workers.allocator_peaks, "gpt", config, repeats=5):
        assert 0.95 * r["measured"]["peak"] <= r["planned"] <= 1.15 * r["measured"]["peak"], r


def test_the_plan_follows_what_inductor_writes():
    """Saved activations dominate (32 sequences per rank): the plan counts what inductor's code allocates, the
    backward freeing each saved activation after its last use, within 15% above the measured peak (7% above,
    2026-11-29; counting every FX value, and the saved activations as held to the backward's end, it planned 36%
    above)."""
    config = {"stage": 3, "backend": "inductor"}
    for r in run_world(2, workers.allocator_peaks, "gpt", config, micro=32):
        assert 0.95 * r["measured"]["peak"] <= r["planned"] <= 1.15 * r["measured"]["peak"], r


def test_storages_over_one_block_count_once():
    """Two storage objects over one block of memory (a stage-2 shard's, over its slice of the whole parameter's:
    it counted twice, 1.61 MiB per rank on bench/activation_budget.py's Llama) are its bytes once."""
    from zcompile.runtime.allocator_peak import live_tensor_bytes
    before = live_tensor_bytes()
    whole = torch.zeros(1 << 18)
    half = torch.from_numpy(whole.numpy()[1 << 17:])  # a storage of its own, over the second half
    assert half.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
    assert live_tensor_bytes() - before == whole.untyped_storage().nbytes()
    del half
