"""Compile the transformed graph with inductor: Triton kernels on GPU, C++ on CPU; collectives stay in the graph."""
from __future__ import annotations

import contextlib
import threading
from unittest import mock

import torch
import torch.fx as fx
from torch._inductor import inductor_prims
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

from zcompile.compiler.graph import collectives
from zcompile.compiler.graph.meta_keys import BLOCK
from zcompile.compiler.tracing import warmup
from zcompile.compiler.planning.liveness import input_held_until_wait


def held_until(held: torch.Tensor, done: torch.Tensor) -> None:
    """Nothing at run time. To inductor: `held` is in use (written) until `done` (a collective's waited result) is
    ready, so its buffer is neither freed nor reused before. Defined through torch.library.Library, not custom_op:
    inductor's code calls it once per held collective input every step, and custom_op's Python dispatch (autograd
    and mutation checks) costs ~40 Python calls a call against 4 (23 us against 1.7 us on the benchmark VM)."""


_LIB = torch.library.Library("zcompile", "FRAGMENT")
_LIB.define("held_until(Tensor(a!) held, Tensor done) -> ()")
_LIB.impl("held_until", held_until, "CompositeExplicitAutograd")
_LIB.impl("held_until", held_until, "Meta")


_code_only = threading.local()


@contextlib.contextmanager
def code_only():
    """Inside: inductor generates each graph's code (and stores it in its FX graph cache) but builds a kernel only
    if something runs it. For the memory planner's trials, which read only what the code allocates: the commit's
    compile of the plan chosen loads its code from that cache and builds the kernels then, once, instead of every
    trial building its own (a C++ kernel costs 1-2 s of g++ on a CPU; a Triton kernel's compile, more)."""
    before = getattr(_code_only, "on", False)
    _code_only.on = True
    try:
        yield
    finally:
        _code_only.on = before


class _Deferred:
    """A kernel inductor's code asked for, built on first use (an autotuning benchmark, say), not at load."""

    def __init__(self, build):
        self._build, self._built = build, None

    def _kernel(self):
        if self._built is None:
            self._built = self._build()
            if hasattr(self._built, "result"):  # a future: compile threads > 1
                self._built = self._built.result()
        return self._built

    def __call__(self, *args, **kwargs):
        return self._kernel()(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._kernel(), name)


_KERNEL_BUILDERS = ("cpp", "cpp_pybinding", "triton", "cuda", "xpu", "rocm", "halide", "cutedsl", "pallas")


@contextlib.contextmanager
def _kernels_deferred():
    from torch._inductor.async_compile import AsyncCompile
    with contextlib.ExitStack() as stack:
        for name in _KERNEL_BUILDERS:
            build = getattr(AsyncCompile, name, None)
            if build is not None:
                stack.enter_context(mock.patch.object(
                    AsyncCompile, name,
                    lambda self, *a, _build=build, **k: _Deferred(lambda: _build(self, *a, **k))))
        yield


def compile_inductor(gm: fx.GraphModule, example_inputs: list, kind: str):
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner

    warmup.wait()
    # The order is the passes' (prefetch, release, the planner's budget): inductor's peak-memory reordering would
    # move a prefetched gather's wait up to the first moment its buffers can be reused, ending the overlap.
    with config.patch(reorder_for_peak_memory=False), block_local_fusion(), unchecked_body_inputs(), \
            (_kernels_deferred() if getattr(_code_only, "on", False) else contextlib.nullcontext()):
        return compile_fx_inner(gm, example_inputs, is_backward=(kind == "backward"),
                                is_inference=(kind == "inference"))


@contextlib.contextmanager
def unchecked_body_inputs():
    """Inside: the body of a subgraph call (`regional_compile: nested`: one per distinct block, called once per
    block) does not assert its inputs' sizes and strides at every call, as the outer graph's code does for the
    graph's own inputs. Its callers are in the same compile, and inductor gives each call's operands the strides
    of the fake inputs the body was lowered for (ir.InvokeSubgraph.create); at 24 layers the checks were 504 of a
    step's Python calls. The outer graph's inputs, and the outputs of extern kernels, stay checked. A torch whose
    wrapper has no such method checks them as it does."""
    from torch._inductor import config
    from torch._inductor.codegen import wrapper
    body = getattr(wrapper, "SubgraphPythonWrapperCodegen", None)
    if body is None or not hasattr(body, "codegen_input_size_and_nan_asserts"):
        yield
        return

    def nan_asserts_only(self):
        if config.nan_asserts:
            self.codegen_input_nan_asserts()
    with mock.patch.object(body, "codegen_input_size_and_nan_asserts", nan_asserts_only):
        yield


def _blocks(snode) -> frozenset:
    """The blocks (meta_keys.BLOCK) whose FX nodes an inductor scheduler node computes."""
    out = set()
    for sn in snode.get_nodes():
        ir_node = getattr(sn, "node", None)
        for origin in (ir_node.get_origins() if ir_node is not None else ()):
            if block := origin.meta.get(BLOCK):
                out.add(block)
    return frozenset(out)


def _block_local(base: type) -> type:
    """`base` (inductor's choices) refusing to fuse two blocks' work horizontally. Inductor places a fused kernel
    at its earliest member and pulls the others' dependencies up before it: in the backward a recomputed norm of
    the next block fused with this block's rotary backward (they read the same cos/sin table) brought the next
    block's recompute, its gathered weights and their wait ahead of this block's attention backward, so the code
    held both blocks' activations at once (the Llama-style model under a memory budget: 38.8 MiB where the FX
    order plans 23.5). Inductor's own guard (`are_long_distant_nodes`: 64 scheduler nodes apart) misses blocks
    that small."""
    def can_fuse_horizontal(scheduler, node1, node2, *rest):  # (shared_data_score in torch 2.13)
        a, b = _blocks(node1), _blocks(node2)
        if a and b and a != b:
            from torch._inductor.scheduler import WhyNoFuse
            WhyNoFuse(node1, node2)("zcompile: the work of different blocks")
            return False
        return base.can_fuse_horizontal(scheduler, node1, node2, *rest)

    def uuid(self):  # inductor's FX graph cache keys on it (config._cache_config_factory_keys)
        inner = base.uuid(self) if hasattr(base, "uuid") else base.__qualname__
        return f"zcompile.block_local_fusion.1:{inner}"

    return type(f"BlockLocal{base.__name__}", (base,),
                {"can_fuse_horizontal": staticmethod(can_fuse_horizontal), "uuid": uuid})


@contextlib.contextmanager
def block_local_fusion():
    """Inside: inductor does not fuse two blocks' work horizontally (_block_local; a user's own
    `inductor_choices_class` is the base), and its FX graph cache keys say so where torch keys on the choices
    class (2.13). A torch whose choices class has no `can_fuse_horizontal` fuses as it does."""
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V
    user = getattr(config, "inductor_choices_class", None)
    base = user if isinstance(user, type) else type(user()) if callable(user) else InductorChoices  # (a factory)
    if not hasattr(base, "can_fuse_horizontal"):  # a torch whose choices do not decide fusions: as it is
        yield
        return
    cls = _block_local(base)
    keyed = "inductor_choices_class" in getattr(config, "_cache_config_factory_keys", ())
    with (config.patch(inductor_choices_class=cls) if keyed else contextlib.nullcontext()), \
            V.set_choices_handler(cls()):
        yield


def hold_collective_inputs(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` in which the input of every collective that the library reads until completion
    (liveness.input_held_until_wait: all-gathers, all-to-alls, NCCL's reduce-scatter) is one realized buffer,
    held (`zcompile::held_until`) until the collective's waited result is ready.

    Inductor lowers the `_out` all-gather (collectives.all_gather) as an in-place op whose wait does not read the
    input, so it would reuse the input's buffer for work between the issue and the wait: the gathered parameters
    came back wrong (bench/compare.py's loss check, test_parity). `held_until` reads the waited result, so inductor
    orders it after the wait, and writes the input, so the buffer lives until then, in one graph or, across
    regions, by handing it to the region that waits (a `wait_tensor` of the input instead was ordered before the
    collective's wait by inductor's scheduler). `inductor_force_stride_order` realizes the input once: without it
    the collective and the hold would each get their own copy of an unrealized input (layout constraints copy)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    order = {n: k for k, n in enumerate(graph.nodes)}
    for c in list(graph.nodes):
        x = c.args[0] if c.op == "call_function" and c.args else None
        waits = collectives.waits_of(c) if isinstance(x, fx.Node) and input_held_until_wait(c) else []
        if not waits or not isinstance(x.meta.get("val"), torch.Tensor):
            continue
        with graph.inserting_before(c):
            held = graph.call_function(inductor_prims.force_stride_order, (x, list(x.meta["val"].stride())))
        held.meta["val"] = x.meta["val"]
        c.args = (held, *c.args[1:])
        last_wait = max(waits, key=order.__getitem__)
        with graph.inserting_after(last_wait):
            graph.call_function(torch.ops.zcompile.held_until.default, (held, last_wait)).meta["val"] = None
    with _use_lazy_graph_module(True):  # its code is generated only if run: compile_regions reads the graph
        return _make_graph_module(gm, graph)
