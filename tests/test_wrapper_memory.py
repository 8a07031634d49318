"""wrapper_memory: the memory inductor's generated code allocates, against the CPU allocator and by hand."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.multiprocessing.reductions import StorageWeakRef

from zcompile.compiler import codegen
from zcompile.compiler.planning import liveness, wrapper_memory
from zcompile.compiler.planning.wrapper_memory import Input, simulate
from zcompile.runtime.allocator_peak import allocator_events, highest_rise


def _swiglu_backward(x, w_gate, w_up, w_down, dout):
    """SwiGLU's backward with its gate and up projections recomputed, as a memory plan that recomputes them runs it:
    inductor fuses the elementwise work that reads gate and up into one kernel after every matmul it needs."""
    gate, up = x @ w_gate, x @ w_up
    h = torch.nn.functional.silu(gate) * up
    dh = dout @ w_down.t()
    d_down = h.t() @ dout
    sig = torch.sigmoid(gate)
    d_up = dh * gate * sig
    d_gate = dh * up * sig * (1 + gate * (1 - sig))
    return x.t() @ d_gate, x.t() @ d_up, d_down, d_gate @ w_gate.t() + d_up @ w_up.t()


def _compiled(f, inputs, blocks=None):
    """`f` traced as AOTAutograd hands a graph to inductor and compiled: as one graph, or with `blocks` (which tags
    the traced graph's nodes with the module each computes for) in regions."""
    from torch._inductor.decomposition import select_decomp_table
    gm = make_fx(f, select_decomp_table(), tracing_mode="fake")(*inputs)
    if blocks is not None:
        blocks(gm)
    liveness.compiled_by_inductor(gm, blocks is not None)
    program = codegen.compile_graph("inductor", gm, list(inputs), "forward", blocks is not None)
    return gm, program


def _held(gm, region, inputs) -> list[Input]:
    """The one region's inputs as the simulation takes them: `inputs` (the graph's, in placeholder order), each held
    by the caller (not freeable)."""
    by_name = dict(zip((p.name for p in gm.graph.find_nodes(op="placeholder")), inputs))
    return [Input(("storage", StorageWeakRef(x.untyped_storage())), x.untyped_storage().nbytes(), x.dtype, False,
                  tuple(x.shape)) for x in (by_name[n.name] for n in region.inputs)]


def test_the_simulated_code_allocates_what_the_allocator_sees():
    """The most bytes the compiled SwiGLU backward allocates above its inputs, simulated from its wrapper code,
    equals the CPU allocator's highest rise while it runs (its inputs stay referenced by the caller here), and is
    above the FX plan's, which frees one op's values at a time."""
    torch.manual_seed(0)
    inputs = [torch.randn(512, 64), torch.randn(64, 192), torch.randn(64, 192), torch.randn(192, 64),
              torch.randn(512, 64)]
    gm, program = _compiled(_swiglu_backward, inputs)
    (region,) = program.layout
    assert region.code is not None and "def call" in region.code
    code = simulate(region.code, _held(gm, region, inputs))
    program(list(inputs))  # warm: the first call loads the kernels
    measured = min(highest_rise(allocator_events(lambda: program(list(inputs)))) for _ in range(3))
    assert abs(code.delta - measured) <= 1024, (code.delta, measured, code.line)
    fx_plan = liveness.analyze(gm)
    assert code.delta > fx_plan.peak_bytes, (code.delta, fx_plan.peak_bytes)
    planned = wrapper_memory.graph_liveness(gm, fx_plan, program.layout)
    assert planned.peak_bytes == code.delta and planned.fx_peak_bytes == fx_plan.peak_bytes
    assert "inductor's code" in planned.peak_node


MiB = 2**20
_CODE = '''
class Runner:
    def call(self, args):
        in0, in1, in2 = args
        args.clear()
        assert_size_stride(in0, (256, 1024), (1024, 1), 'input')
        buf0 = empty_strided_cpu((256, 1024), (1024, 1), torch.float32)
        cpp_fused_0(in0, buf0)
        del in0
        buf1 = reinterpret_tensor(buf0, (1024, 256), (256, 1), 0); del buf0  # reuse
        buf2 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(in1, in1, in1, 0.0, True)
        buf3 = buf2[0]
        assert_size_stride(buf3, (1, 1, 512, 512), (262144, 262144, 512, 1), 'op')
        buf4 = buf2[1]
        assert_size_stride(buf4, (1, 1, 512), (512, 512, 1), 'op')
        del buf2
        buf5 = torch.ops._c10d_functional.reduce_scatter_tensor.default(reinterpret_tensor(buf1, (262144, ), (1, ), 0), 'sum', 2, '0')
        assert_size_stride(buf5, (131072, ), (1, ), 'op')
        del buf1
        torch.ops._c10d_functional.wait_tensor.default(buf5)
        buf6 = empty_strided_cpu((ks0, 2), (2, 1), torch.float32)
        return (buf3, buf4, buf5, buf6, )
'''


def _inputs(in0_freeable: bool, x: torch.Tensor, q: torch.Tensor):
    """Storage keys as graph_liveness makes them, beside a size argument's (keys of two kinds in one dict)."""
    return [Input(("storage", StorageWeakRef(x.untyped_storage())), MiB, torch.float32, in0_freeable, (256, 1024)),
            Input(("storage", StorageWeakRef(q.untyped_storage())), MiB, torch.float32, False, (1, 1, 512, 512)),
            Input(("size", "s"), 0, torch.int64, False, value=3)]


def test_the_simulation_follows_reuse_fallback_results_and_frees():
    """By hand: buf0 (1 MiB) reuses nothing; its reuse as buf1 allocates nothing; SDPA's two results are sized by
    their asserts (1 MiB + 2 KiB); the reduce-scatter's result (0.5 MiB) and gloo's copy of its input (1 MiB) are
    alive until the wait. in0 freed at its `del` when the code holds the only reference."""
    x, q = torch.empty(256, 1024), torch.empty(1, 1, 512, 512)  # local: a module-level tensor stays on the heap
    held = simulate(_CODE.replace("ks0", "in2"), _inputs(False, x, q))
    assert held.delta == MiB + MiB + 2048 + MiB // 2 + MiB, held
    assert held.line.startswith("assert_size_stride(buf5"), held.line
    freed = simulate(_CODE.replace("ks0", "in2"), _inputs(True, x, q))
    assert freed.delta == held.delta - MiB, freed


def test_code_it_cannot_follow_gives_no_peak():
    """A size from a symbol the code never defines, or an allocation of a form not known, gives None: the FX plan
    stands."""
    x, q = torch.empty(256, 1024), torch.empty(1, 1, 512, 512)
    assert simulate(_CODE, _inputs(False, x, q)) is None  # ks0
    odd = _CODE.replace("buf0 = empty_strided_cpu", "buf0 = torch.empty_like(in0); _ = empty_strided_cpu")
    assert simulate(odd.replace("ks0", "in2"), _inputs(False, x, q)) is None
    assert simulate("def f():\n    pass\n", []) is None


def _two_blocks(x, w1, w2, w3):
    """Two blocks and a head: the first block's result is read last by the second (whose code
    frees it), a small value of the first block's crosses the second's region to the head."""
    a = (torch.relu(x @ w1) * 2) @ w1.t()
    s = a.mean(0)
    b = (torch.relu(a @ w2) * 2) @ w2.t()
    return ((b @ w3).sum() + s.sum(),)


@pytest.mark.parametrize("wide", [512, 1024])
def test_the_plan_of_a_regional_program_is_what_the_allocator_sees(wide):
    """graph_liveness over regions compiled apart: the bytes alive as each region starts (values earlier regions
    computed, until the region reading them last; not the transpose of a weight, a view of a caller-held input)
    plus the most that region's code holds above them, against the CPU allocator's highest rise over the whole
    program (its inputs held by the caller). The peak is in the first block's region, or with the second block
    wider, in the second's."""
    torch.manual_seed(0)
    inputs = [torch.randn(256, 128), torch.randn(128, 512), torch.randn(128, wide), torch.randn(128, 8)]

    def blocks(gm):  # as dynamo records them: blocks.0 and blocks.1, then the head (no block)
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        mms = [k for k, n in enumerate(calls) if n.target is torch.ops.aten.mm.default]
        for k, n in enumerate(calls):
            path = "blocks.0" if k < mms[2] else "blocks.1" if k < mms[4] else "head"
            n.meta["nn_module_stack"] = {path: (path, torch.nn.Module)}
    gm, program = _compiled(_two_blocks, inputs, blocks)
    assert len(program.layout) >= 3 and sum(r.code is not None for r in program.layout) >= 2, program.layout
    program(list(inputs))  # warm: the first call loads the kernels
    measured = min(highest_rise(allocator_events(lambda: program(list(inputs)))) for _ in range(3))
    planned = wrapper_memory.graph_liveness(gm, liveness.analyze(gm), program.layout)
    assert "inductor's code" in planned.peak_node, planned.peak_node
    assert abs(planned.peak_bytes - measured) <= 1024, (planned.peak_bytes, measured, planned.peak_node)


def test_a_trial_compile_generates_the_code_and_builds_kernels_only_when_run(monkeypatch, tmp_path):
    """codegen.inductor.code_only (the memory planner's trials): inductor's code is generated, stored in its FX graph
    cache and readable, but no C++ kernel is built; a later compile of the same graph (the commit's) loads that code
    from the cache and builds its kernels then. A trial's kernel that something does run is built on first use and
    computes what the graph does."""
    from torch._guards import TracingContext, tracing
    from torch._inductor import codecache
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from zcompile.compiler.codegen import inductor
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the trial misses even in a cache kept by the user
    built = []
    load = codecache.CppPythonBindingsCodeCache.load_pybinding_async.__func__  # load_pybinding calls it
    monkeypatch.setattr(codecache.CppPythonBindingsCodeCache, "load_pybinding_async",
                        classmethod(lambda cls, *a, **k: built.append(1) or load(cls, *a, **k)))
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    inputs = [torch.randn(64, 16), torch.randn(16, 24), torch.randn(16, 24), torch.randn(24, 16), torch.randn(64, 16)]
    with tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv()))):  # as AOTAutograd compiles: cacheable
        with inductor.code_only():
            gm, trial = _compiled(_swiglu_backward, inputs)
        (region,) = trial.layout
        counters = dict(torch._dynamo.utils.counters["inductor"])
        assert "def call" in region.code and built == [] and counters["fxgraph_cache_miss"] == 1, (built, counters)
        gm, program = _compiled(_swiglu_backward, inputs)
    counters = torch._dynamo.utils.counters["inductor"]
    assert counters["fxgraph_cache_hit"] == 1 and len(built) > 0, (built, counters)
    assert program.layout[0].code == region.code
    expected = _swiglu_backward(*inputs)
    torch.testing.assert_close(list(program(list(inputs))), list(expected))
    torch.testing.assert_close(list(trial(list(inputs))), list(expected))  # a trial's kernels, built as they run


def _block_then_recompute(x1, x0, cos, w, v):
    """A backward's tail as a memory plan makes it: block 1's work (a wide intermediate), then block 0's recomputed
    input to its matmul, which reads the same rotary table as block 1's first op."""
    h1 = torch.relu((x1 * cos) @ w) @ w.t()
    return (h1 + (x0 * cos) @ v,)


def test_inductor_does_not_fuse_two_blocks_work_so_its_code_keeps_the_fx_order():
    """codegen.inductor.block_local_fusion: inductor fuses two elementwise ops that read one buffer (horizontal
    fusion) and runs the fused kernel where the first was, so block 0's recompute would be computed before block
    1's matmuls and held through them (the Llama-style model under a budget: inductor's code 38.8 MiB where the FX
    order plans 23.5). With the nodes' blocks known, the code's peak is the FX plan's; without them (the control:
    the graph does exercise the fusion) it is one recomputed value above it."""
    from torch._inductor import config
    from torch._inductor.decomposition import select_decomp_table
    torch.manual_seed(0)
    inputs = [torch.randn(1024, 256), torch.randn(1024, 256), torch.randn(1024, 256), torch.randn(256, 1024),
              torch.randn(256, 256)]
    peaks = {}
    for tagged in (True, False):
        gm = make_fx(_block_then_recompute, select_decomp_table(), tracing_mode="fake")(*inputs)
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        second_mm = [k for k, n in enumerate(calls) if n.target is torch.ops.aten.mm.default][1]
        for k, n in enumerate(calls):
            if tagged:
                path = "blocks.1" if k <= second_mm else "blocks.0"
                n.meta["nn_module_stack"] = {path: (path, torch.nn.Module)}
        liveness.compiled_by_inductor(gm, False)
        with config.patch(fx_graph_cache=False):
            program = codegen.compile_graph("inductor", gm, list(inputs), "forward", False)
        (region,) = program.layout
        peaks[tagged] = (simulate(region.code, _held(gm, region, inputs)).delta, liveness.analyze(gm).peak_bytes)
        torch.testing.assert_close(program(list(inputs))[0], _block_then_recompute(*inputs)[0])
    (code, planned), (untagged_code, _) = peaks[True], peaks[False]
    assert code == planned, peaks
    assert untagged_code == planned + 1024 * 256 * 4, peaks
