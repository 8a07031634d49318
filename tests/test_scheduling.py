"""Bucketing, prefetch and the liveness analysis they rely on."""
import os
import re

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.fake_tensor import FakeTensorMode

from tests import workers
from tests.harness import run_world
from tests.test_parity import TOL, max_diff
from tests.test_passes import _in_block
from zcompile.compiler.planning import liveness


@pytest.mark.parametrize("bounded", [True, False])
def test_liveness_plans_a_dynamic_size_at_its_declared_maximum(bounded):
    """A dim marked dynamic with a maximum is planned at that maximum (memory_budget then checks the worst batch);
    unbounded, at the size the graph was compiled for."""
    from torch._dynamo.backends.common import aot_autograd
    peaks, unbounded = [], []

    def fw(gm, example_inputs):
        peaks.append(liveness.analyze(gm).peak_bytes)
        unbounded.append(list(liveness.unbounded_sizes(gm).values()))
        return gm.forward
    torch._dynamo.reset()
    run = torch.compile(lambda x: (x * 2 + 1).sum(), backend=aot_autograd(fw_compiler=fw))
    x = torch.randn(4, 100)
    torch._dynamo.mark_dynamic(x, 1, **({"min": 2, "max": 512} if bounded else {}))
    run(x)
    assert peaks == [2 * 4 * (512 if bounded else 100) * 4], peaks  # x * 2 and its + 1: two 4 x T fp32 tensors
    assert unbounded == [[] if bounded else [100]], unbounded  # what memory_budget warns about (backend)


def _fake_graph(f, *shapes):
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    with FakeTensorMode() as mode:
        xs = [torch.empty(*s) for s in shapes]
        gm = make_fx(f, tracing_mode="fake")(*xs)
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*xs)
    return gm


def test_liveness_is_alias_aware():
    def f(x):
        y = x * 2            # 4 KiB
        z = y.view(-1)       # alias of y: free
        w = z + 1            # 4 KiB; y dies after this
        return (w * 3).sum()  # 4 KiB while w is alive
    gm = _fake_graph(f, (32, 32))
    live = liveness.analyze(gm)
    assert live.input_bytes == 4096
    assert live.peak_bytes == 2 * 4096
    assert live.live_after[-1][1] == 4  # only the scalar output survives


def test_liveness_counts_what_inductor_writes():
    """Compiled by inductor, an elementwise value read only by elementwise ops is computed inside their kernel (no
    buffer), its inputs live until that kernel reads them, and a kernel's output takes the buffer of a same-size
    input of its graph that dies there."""
    def f(a, w):
        h = a @ w                       # 64 KiB, extern (a matmul)
        g = h * 0.5 * (1 + torch.tanh(h))  # three elementwise steps: one kernel, one 64 KiB output
        return (g @ w.t()).sum()        # g is read by a matmul: written
    gm = _fake_graph(f, (128, 128), (128, 128))
    eager = liveness.analyze(gm)
    liveness.compiled_by_inductor(gm, regional=False)
    fused = liveness.analyze(gm)
    kb = 64 * 1024
    assert eager.peak_bytes >= 3 * kb  # h, a temporary and another: every op's output is a buffer
    # h (matmul output) dies in the kernel writing g: g takes its buffer; then g @ w.t() adds its output
    assert fused.peak_bytes == 2 * kb, (eager.peak_bytes, fused.peak_bytes)
    mul = next(n for n in gm.graph.nodes if n.name.startswith("mul"))
    from zcompile.compiler.planning import inductor_buffers
    assert mul in inductor_buffers.kernels(gm, False).unwritten


def test_liveness_extends_inputs_to_the_kernel_that_reads_them():
    def f(a, b):
        x = a @ b                 # 64 KiB
        y = a @ b.t()             # 64 KiB
        t = x * 2                 # read only by the kernel of u: computed there, so x lives until u
        u = (t + y).relu()        # written (read by the matmul); takes x's or y's buffer
        return (u @ b).sum()
    gm = _fake_graph(f, (128, 128), (128, 128))
    liveness.compiled_by_inductor(gm, regional=False)
    live = liveness.analyze(gm)
    kb = 64 * 1024
    after = dict(live.live_after)
    assert after["mul"] == 2 * kb  # x is not freed at t (no buffer): the kernel of u reads it
    assert after["relu"] == kb  # u took the buffer of x or y, which both died there
    assert live.peak_bytes == 2 * kb


def test_a_kernel_output_never_takes_a_buffer_read_later():
    """Inductor's in-place reuse takes only an input that dies at the kernel: x below has the output's size and
    dtype and is read by the kernel, but also by the last one, so u gets a buffer of its own."""
    def f(a, b):
        x = a @ b                 # 64 KiB, read again at the end
        u = (x * 2).relu()        # one kernel (x * 2 is computed inside it); written: a matmul reads u
        v = u @ b                 # 64 KiB
        return (v + x).sum()      # one kernel reads v and x
    gm = _fake_graph(f, (128, 128), (128, 128))
    liveness.compiled_by_inductor(gm, regional=False)
    live = liveness.analyze(gm)
    kb = 64 * 1024
    assert dict(live.live_after)["relu"] == 2 * kb  # x and u
    assert live.peak_bytes == 3 * kb  # x, u and v at the second matmul


def test_a_kernel_output_takes_no_buffer_of_another_compiled_region():
    """Regional compile: a block's region receives what an earlier region computed as an input, which its kernels
    never write over (inductor reuses only its own buffers), even where the input dies there."""
    def f(a, b, v):
        w = a @ b.t()             # block 0, 64 KiB, alive to the end
        x = a @ b                 # block 0, 64 KiB, dies in block 1's kernel below
        y = (x * 2).relu()        # block 1: one kernel reading x; written (a matmul reads it)
        z = y @ v                 # block 1, 512 bytes
        return z.sum() + w.sum()
    gm = _fake_graph(f, (128, 128), (128, 128), (128, 1))
    blocks = {"mm": "blocks.0", "mm_1": "blocks.0", "mul": "blocks.1", "relu": "blocks.1", "mm_2": "blocks.1"}
    _in_block(gm, {n.name: blocks.get(n.name, "head") for n in gm.graph.nodes if n.op == "call_function"})
    liveness.compiled_by_inductor(gm, regional=True)
    live = liveness.analyze(gm)
    kb = 64 * 1024
    assert live.peak_bytes == 3 * kb, live.live_after  # w, x and y at the kernel of y


def test_saved_activations_the_backward_releases_count_as_transients():
    def f(saved, w):
        g = saved @ w             # the saved activation dies here
        return (g @ w).sum()
    gm = _fake_graph(f, (128, 128), (128, 128))
    kb = 64 * 1024
    held = liveness.analyze(gm)
    assert (held.input_bytes, held.peak_bytes) == (2 * kb, 2 * kb)  # g and g @ w
    saved = next(iter(gm.graph.find_nodes(op="placeholder")))
    liveness.mark_released(gm, {saved.name})
    released = liveness.analyze(gm)
    assert (released.input_bytes, released.saved_bytes) == (kb, kb)
    assert released.peak_bytes == 2 * kb  # saved + g, then g + g @ w: the saved tensor is gone by then


@pytest.mark.parametrize("bucket_mb, prefetch", [(0, 0), (0, 2), (0.05, 1), (25, 1), (25, 0)])
def test_bucketing_and_prefetch_keep_parity(bucket_mb, prefetch, tmp_path):
    ref_params, _ = workers.reference("gpt", 2, steps=5)
    config = {"stage": 3, "backend": "eager", "bucket_mb": bucket_mb, "prefetch": prefetch, "dump": str(tmp_path)}
    results = run_world(2, workers.parity_with_config, "gpt", config)
    for res in results:
        assert max_diff(res["params"], ref_params) < TOL
    sched = open(os.path.join(tmp_path, "rank0", "graph0_schedule.txt")).read()
    n_fw = int(re.search(r"== forward: (\d+) collectives", sched).group(1))
    if bucket_mb == 0:
        assert n_fw > 10  # one gather per parameter
    elif bucket_mb == 25:  # one bucket per block (2) and per run of other parameters: embeddings, final norm
        assert n_fw == 4 and "bucket 3 of" in sched
    else:
        assert 1 < n_fw < 20  # 26 parameters, fewer collectives
    if prefetch:
        assert f"prefetched {prefetch} gather(s) ahead" in sched


def test_memory_budget_limits_prefetch(tmp_path):
    config = {"stage": 3, "backend": "eager", "bucket_mb": 0, "prefetch": 8, "memory_budget": 1,
              "over_budget": "warn", "dump": str(tmp_path)}
    run_world(2, workers.parity_with_config, "gpt", config, steps=1)
    fw = [f for f in os.listdir(tmp_path / "rank0") if "_forward_" in f and f.endswith("_prefetch.py")][0]
    text = open(tmp_path / "rank0" / fw).read()
    assert "prefetch distance 0" in text and "budget 1 B" in text


def test_stage0_all_reduces_are_bucketed(tmp_path):
    ref_params, _ = workers.reference("gpt", 2, steps=5)
    config = {"stage": 0, "backend": "eager", "dump": str(tmp_path)}
    for res in run_world(2, workers.parity_with_config, "gpt", config):
        assert max_diff(res["params"], ref_params) < TOL
    sched = open(os.path.join(tmp_path, "rank0", "graph0_schedule.txt")).read()
    # one coalesced all-reduce per block (2) and per run of other parameters (final norm; embeddings)
    assert re.search(r"== backward: 4 collectives", sched) and "all_reduce_coalesced" in sched
    assert "bucket 1 of 11 grads" in sched and "bucket 2 of 11 grads" in sched  # a block's 11 parameters


@pytest.mark.parametrize("backend, bucket_mb, distance", [("eager", 0, 2), ("inductor", 0.02, 1)])
def test_the_run_issues_each_gather_prefetch_ahead_of_its_wait(backend, bucket_mb, distance):
    """The forward's real order of issues and waits (torch.profiler, compiled run): before the wait of gather k,
    gathers up to k + prefetch are on the wire; with prefetch 0, exactly up to k. Values alone cannot show a late
    issue (test_bucketing_and_prefetch_keep_parity)."""
    for prefetch in (0, distance):
        config = {"stage": 3, "backend": backend, "bucket_mb": bucket_mb, "prefetch": prefetch}
        for order in run_world(2, workers.gather_issue_order, config):
            issues = order.count("issue")
            assert issues == order.count("wait") >= 4, order
            issued, waited = 0, 0
            for event in order:
                if event == "issue":
                    issued += 1
                    continue
                expected = min(waited + 1 + prefetch, issues)
                assert issued >= expected if prefetch else issued == expected, (prefetch, waited, issued, order)
                waited += 1
