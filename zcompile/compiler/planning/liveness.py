"""Alias-aware liveness over an FX graph: the bytes of intermediate tensors alive after every node, and the peak.

Tensors are tracked by storage (views share their base's storage, so they cost nothing extra); a storage is
allocated by the first node that produces it and freed after the last node that reads any tensor on it, or, for a
collective's input, after the collective's wait. Graph inputs are counted apart (they are held by the caller),
except the backward's saved activations marked `zc_released` (mark_released): autograd hands them over and drops its
own references, so they are freed after their last use like any intermediate. Graph outputs live past the end.
Tensors in host memory (offload: nodes and placeholders marked `zc_tier`) are not device memory and are not counted,
nor, in a graph inductor compiles, the values its kernels never write to memory (inductor_buffers).
"""
from __future__ import annotations

import dataclasses
import functools

import sympy
import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from zcompile.compiler.graph import collectives
from zcompile.compiler.planning import inductor_buffers
from zcompile.compiler.graph.meta_keys import INDUCTOR, PARAMETER, RELEASED  # noqa: F401 (read as liveness.*)
from zcompile.kernels import linear_cross_entropy


def mark_released(bw: fx.GraphModule, names) -> None:
    """Mark the backward's placeholders `names` (saved activations nothing but autograd holds) as freed after their
    last use: every zcompile graph runner takes its inputs boxed and clears the list (inductor, regions, eager's
    boxed FX code), and AOTAutograd clears the saved tensors before the call (not under retain_graph=True)."""
    for ph in bw.graph.find_nodes(op="placeholder"):
        if ph.name in names:
            ph.meta[RELEASED] = True


def fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


@dataclasses.dataclass
class Liveness:
    live_after: list[tuple[str, int]]   # (node name, transient bytes alive after it)
    peak_bytes: int
    peak_node: str
    input_bytes: int
    saved_bytes: int = 0  # of the transients, the saved activations the graph receives and frees (mark_released)
    live_at: list[int] = dataclasses.field(default_factory=list)  # per node: alive as it runs (outputs allocated)
    fx_peak_bytes: int | None = None  # where the peak comes from inductor's code (wrapper_memory): the FX plan's
    param_bytes: int = 0  # of the inputs, parameters' shards and whole buffers


def _tensors(val) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _tensors(v)]
    return []


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of `t`'s storage, a dynamic size as the plan counts it (planned_size)."""
    n = t.untyped_storage().nbytes()
    return planned_size(n) if isinstance(n, torch.SymInt) else int(n)


def sizes(t: torch.Tensor) -> list[int]:
    """`t`'s shape, a dynamic size as the plan counts it (planned_size)."""
    return [planned_size(d) if isinstance(d, torch.SymInt) else int(d) for d in t.shape]


def _declared_max(env, expr) -> int | None:
    """The largest value of a dynamic size the user's bounds allow (`mark_dynamic(x, dim, min=..., max=...)`), or
    None when nothing bounds it (torch's int_oo, not an Integer)."""
    upper = env.bound_sympy(expr).upper
    return int(upper) if upper.is_Integer else None


def planned_size(n: torch.SymInt) -> int:
    """A dynamic size as the plan counts it: at its largest if the user bounded its dims
    (`torch._dynamo.mark_dynamic(x, dim, min=..., max=...)`), else at its value when the graph was compiled."""
    upper = _declared_max(n.node.shape_env, n.node.expr)
    if upper is not None:
        return upper
    return int(n.node.hint) if n.node.has_hint() else 0


def unbounded_sizes(gm: fx.GraphModule) -> dict[str, int]:
    """The graph's dynamic sizes that have no declared maximum, by the input they come from (dynamo's source, e.g.
    `L['idx'].size()[1]`), with their compile-time values: the plan counts them at those values (planned_size), so a
    later, larger input is not covered by it."""
    out: dict[str, int] = {}
    for ph in gm.graph.find_nodes(op="placeholder"):
        val = ph.meta.get("val")
        dims = val.shape if isinstance(val, torch.Tensor) else (val,) if isinstance(val, torch.SymInt) else ()
        for d in dims:
            if not isinstance(d, torch.SymInt):
                continue
            env = d.node.shape_env
            for sym in d.node.expr.free_symbols:
                if _declared_max(env, sym) is not None:
                    continue
                sources = env.var_to_sources.get(sym) or []
                name = sources[0].name if sources else str(sym)
                hints = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val  # renamed
                out[name() if callable(name) else name] = int(hints.get(sym, 0))  # method or property
    return out


def _alias_source(node: fx.Node) -> fx.Node | None:
    """The input whose storage `node`'s output is, by the op's schema (`Tensor(a!) out -> Tensor(a!)`, views);
    fake propagation of out= collectives returns a fresh tensor, which would count the buffer twice."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    if node.target is torch.ops._c10d_functional.wait_tensor.default:
        return node.args[0]
    aliased = _aliased_argument(node.target)
    if aliased is None:
        return None
    i, name = aliased
    src = node.kwargs.get(name) if name in node.kwargs else (node.args[i] if i < len(node.args) else None)
    return src if isinstance(src, fx.Node) else None


@functools.cache
def _aliased_argument(op: torch._ops.OpOverload) -> tuple[int, str] | None:
    """(position, name) of the argument whose storage the op's single output is, by its schema; None if none."""
    returns = op._schema.returns
    if len(returns) != 1 or returns[0].alias_info is None:
        return None
    for i, arg in enumerate(op._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.before_set & returns[0].alias_info.before_set:
            return i, arg.name
    return None


def _on_host(node: fx.Node) -> bool:
    val = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    return val is not None and val.device.type == "cpu"


def input_held_until_wait(node: fx.Node) -> bool:
    """Whether the communication library reads a collective's input until its wait: all-gathers and all-to-alls do,
    and NCCL's reduce-scatter. Gloo's reduce-scatter copies its input at issue and reads the copy (see
    gloo_copy_bytes); a functional all-reduce works on its own copy, which is its output."""
    rec = collectives.record(node)
    if rec is None:
        return False
    return rec.op in ("all_gather", "all_to_all") or rec.op == "reduce_scatter" and not _on_host(node)


def gloo_copy_bytes(node: fx.Node) -> int:
    """Bytes of the copy of its input that gloo's reduce-scatter makes at issue, in C++, and holds until the work
    completes: alive from the collective to its wait (the allocator sees it, tests/test_allocator_peak.py)."""
    rec = collectives.record(node)
    if rec is None or rec.op != "reduce_scatter" or not _on_host(node):
        return 0
    return storage_bytes(node.args[0].meta["val"])


def workspace_bytes(node: fx.Node, symbolic: bool = False):
    """Bytes an opaque op of zcompile's allocates and frees inside its call (the chunked head and loss's chunks); with
    `symbolic` and a dynamic token count, as an expression in it (peak_exprs)."""
    if node.op != "call_function" or node.target not in linear_cross_entropy.BODIES:
        return 0
    x, weight, rows = linear_cross_entropy.call_operands(node.target, node.args)
    shape = _shape(weight)
    if shape is None or "val" not in x.meta:
        return 0
    vocab, dim = int(shape[0]), int(shape[1])

    def work(r):  # linear in the rows of a chunk
        return linear_cross_entropy.call_workspace(node.target, node.args, r, vocab, dim, x.meta["val"].dtype.itemsize)
    n = x.meta["val"].numel() // dim
    if isinstance(n, int):
        return work(min(rows, n))
    if symbolic:
        return (work(1) - work(0)) * sympy.Min(rows, n.node.expr) + work(0)
    return work(min(rows, planned_size(n)))  # a dynamic count: as the plan counts sizes


def _shape(node: fx.Node):
    """A value's shape, from its fake value or, for a view shard_params made (no fake value), its arguments."""
    if "val" in node.meta:
        return tuple(node.meta["val"].shape)
    if node.target in (torch.ops.aten.view.default, torch.ops.aten.reshape.default):
        return tuple(node.args[1])
    return None


def compiled_by_inductor(gm: fx.GraphModule, regional: bool | str) -> None:
    """Mark `gm` as compiled by inductor (in regions per block when `regional`): what inductor computes inside its
    kernels is then not counted (inductor_buffers)."""
    gm.meta[INDUCTOR] = regional


def _lifetimes(gm: fx.GraphModule, sizer) -> tuple[list, dict, dict, set, set, dict]:
    """(nodes, storages per node, size per storage by `sizer`, input storages, host storages, frees per node)."""
    nodes = list(gm.graph.nodes)
    kernels = inductor_buffers.kernels(gm, gm.meta[INDUCTOR]) if INDUCTOR in gm.meta else None
    unwritten = kernels.unwritten if kernels else set()
    storages_of: dict[fx.Node, list] = {}
    size: dict = {}
    inputs: set = set()
    host: set = set()
    for n in nodes:
        if n.op == "output" or n in unwritten:  # output: its value repeats its inputs' (as fresh fake tensors)
            storages_of[n] = []
            continue
        src = _alias_source(n)
        if src is not None and storages_of.get(src):
            storages_of[n] = storages_of[src]
            continue
        keys = []
        for t in _tensors(n.meta.get("val")):
            key = StorageWeakRef(t.untyped_storage())
            size.setdefault(key, sizer(t))
            keys.append(key)
            if n.meta.get("zc_tier") in ("cpu", "nvme"):
                host.add(key)
            elif n.op == "placeholder" and not n.meta.get(RELEASED):
                inputs.add(key)
        storages_of[n] = keys
    read_through: dict[fx.Node, list] = {}  # an unwritten value's kernel reads its inputs where it is read

    def reads(a: fx.Node) -> list:
        if a not in unwritten:
            return [a]
        if a not in read_through:
            read_through[a] = [b for x in a.all_input_nodes for b in reads(x)]
        return read_through[a]

    last_use: dict = {}
    for k, n in enumerate(nodes):
        for key in storages_of[n]:
            last_use[key] = max(last_use.get(key, k), k)
        for a in n.all_input_nodes:
            for b in reads(a):
                for key in storages_of.get(b, []):
                    last_use[key] = k
    position = {n: k for k, n in enumerate(nodes)}
    for n in nodes:
        if input_held_until_wait(n):
            waits = [position[w] for w in collectives.waits_of(n)]
            for a in n.all_input_nodes:
                for key in storages_of.get(a, []):
                    last_use[key] = max([last_use.get(key, 0)] + waits)
        copy = gloo_copy_bytes(n)
        if copy:
            key = ("gloo copy", n.name)
            size[key] = copy
            storages_of[n] = storages_of[n] + [key]
            last_use[key] = max([position[n]] + [position[w] for w in collectives.waits_of(n)])
        scratch = workspace_bytes(n, symbolic=sizer is not storage_bytes)
        if scratch:
            key = ("workspace", n.name)
            size[key] = scratch
            storages_of[n] = storages_of[n] + [key]
            last_use[key] = position[n]
    for a in gm.graph.output_node().all_input_nodes:
        for key in storages_of.get(a, []):
            last_use[key] = len(nodes)
    if kernels:
        _write_in_place(nodes, storages_of, size, inputs | host, last_use, reads, kernels)
    frees: dict[int, list] = {}
    for key, k in last_use.items():
        frees.setdefault(k, []).append(key)
    return nodes, storages_of, size, inputs, host, frees


def _write_in_place(nodes, storages_of, size, held, last_use, reads, kernels) -> None:
    """Inductor writes a kernel's output over an input buffer of its own graph that dies there, of the same size
    and dtype: the output takes that storage (its lifetime extended) instead of a new one."""
    taken: set = set()

    def dying_input(k: int, n: fx.Node):
        mine, dtype = storages_of[n][0], n.meta["val"].dtype
        for b in (b for a in n.all_input_nodes for b in reads(a)):
            val = b.meta.get("val")
            if not isinstance(val, torch.Tensor) or val.dtype != dtype or not kernels.same_compiled_region(b, n):
                continue
            for key in storages_of.get(b, []):
                if (key not in held and key not in taken and key != mine and last_use.get(key) == k
                        and size[key] == size[mine]):
                    return key
        return None

    for k, n in enumerate(nodes):
        if not kernels.loop_output(n) or len(storages_of[n]) != 1 or storages_of[n][0] not in last_use:
            continue  # (a storage two nodes claim, fake values shared by copies of one region: left as it is)
        key = dying_input(k, n)
        if key is not None:
            taken.add(key)
            last_use[key] = last_use.pop(storages_of[n][0])
            storages_of[n][0] = key  # in the list its views share


def _live(nodes, storages_of, size, inputs, host, frees) -> tuple[list, list]:
    """Bytes alive at each node (its outputs allocated, before its frees) and after it, in the sizes' type (int,
    or sympy for symbolic sizes)."""
    live, allocated, at, after = 0, set(), [], []
    for k, n in enumerate(nodes):
        for key in storages_of[n]:
            if key not in allocated and key not in inputs and key not in host:
                allocated.add(key)
                live += size[key]
        at.append(live)
        for key in frees.get(k, []):
            if key in allocated:
                live -= size[key]
                allocated.discard(key)
        after.append(live)
    return at, after


def analyze(gm: fx.GraphModule) -> Liveness:
    nodes, storages_of, size, inputs, host, frees = _lifetimes(gm, storage_bytes)
    at, after = _live(nodes, storages_of, size, inputs, host, frees)
    peak, peak_node = 0, ""
    for k, n in enumerate(nodes):
        if at[k] > peak:
            peak, peak_node = at[k], n.name
    saved = {k for n in nodes if n.op == "placeholder" and n.meta.get(RELEASED) for k in storages_of[n]} - host
    params = {k for n in nodes if n.op == "placeholder" and n.meta.get(PARAMETER) for k in storages_of[n]} & inputs
    return Liveness([(n.name, after[k]) for k, n in enumerate(nodes)], peak, peak_node,
                    sum(size[k] for k in inputs), sum(size[k] for k in saved), at,
                    param_bytes=sum(size[k] for k in params))


def _size_expr(t: torch.Tensor):
    n = t.untyped_storage().nbytes()
    return n.node.expr if isinstance(n, torch.SymInt) else sympy.Integer(int(n))


def peak_exprs(gm: fx.GraphModule) -> list:
    """The graph's planned peak as candidates over its dynamic sizes: sympy expressions in the sizes' symbols, the
    graph's inputs plus the bytes alive at one node each; the peak at given sizes is the largest of them there.
    Only the nodes where the live bytes stop rising are kept (a peak sits at one of them, at any sizes, as the bytes
    a node allocates are never negative)."""
    nodes, storages_of, size, inputs, host, frees = _lifetimes(gm, _size_expr)
    at, _ = _live(nodes, storages_of, size, inputs, host, frees)
    base = sum((size[k] for k in inputs), start=sympy.Integer(0))
    tops = [at[k] for k in range(len(at)) if k + 1 == len(at) or frees.get(k)]
    return list(dict.fromkeys(base + e for e in tops))
