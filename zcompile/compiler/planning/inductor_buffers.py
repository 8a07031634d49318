"""What inductor writes to memory of a graph it compiles, for liveness.

Inductor inlines an elementwise op into the kernels that read it and drops a buffer that only one fused kernel
reads, so an elementwise or reduction result read only by other such ops of the same compiled region (directly or
through views) never takes memory: the GELU backward's products over the MLP's hidden size are one kernel with one
output. Everything else gets a buffer: what a matmul, a collective or any other extern kernel reads, what another
region or the graph's caller reads, what a region run eagerly computes, and any op this module does not know. A
kernel's output may take the buffer of an input that dies there (liveness._write_in_place). Not modelled: inductor
reordering a whole graph's nodes (one graph, not regions, can peak above its FX order), and a costly value with
several readers realized once, then read by kernels that do not fuse (its buffer is not counted).
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.fx as fx

from zcompile.compiler.planning.region_cuts import block_regions, compiled_regions

aten = torch.ops.aten

# reductions inductor lowers to loops (a reduction's small output is counted either way)
_REDUCTIONS = {aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.amax.default,
               aten.amin.default, aten.var_mean.correction, aten.var.correction, aten.prod.dim_int,
               aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default, aten.any.dim, aten.all.dim}


@functools.cache
def _kind(op) -> str:
    """'loop' (an elementwise op or reduction inductor generates), 'view' (a view of its input), or 'extern'."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace not in ("aten", "prims"):
        return "extern"
    if op._schema.is_mutable:
        return "extern"
    returns = op._schema.returns
    if len(returns) == 1 and returns[0].alias_info is not None:
        return "view"
    if torch.Tag.pointwise in op.tags or op in _REDUCTIONS or op is aten.full.default:  # a fill: a loop too
        return "loop"
    return "extern"


def _readers(node: fx.Node) -> list[fx.Node]:
    """The nodes that read `node`'s values, through views."""
    out = []
    for u in node.users:
        if u.op == "call_function" and _kind(u.target) == "view":
            out += _readers(u) or [u]  # a view nothing reads: keep it (it counts as a reader that is no loop)
        else:
            out.append(u)
    return out


@dataclasses.dataclass
class Kernels:
    unwritten: set[fx.Node]          # values computed inside the kernels that read them, and views of them
    region_of: dict[fx.Node, int]    # node -> its region (codegen/regions.py)
    compiled: list[bool]             # per region: compiled by inductor (else run as FX code)

    def loop_output(self, node: fx.Node) -> bool:
        """Whether `node` is a written result of a kernel inductor generates (it may take a dying input's buffer)."""
        r = self.region_of.get(node)
        return (r is not None and self.compiled[r] and node not in self.unwritten and node.op == "call_function"
                and _kind(node.target) == "loop")

    def same_compiled_region(self, a: fx.Node, b: fx.Node) -> bool:
        r = self.region_of.get(a)
        return r is not None and r == self.region_of.get(b) and self.compiled[r]


def kernels(gm: fx.GraphModule, regional: bool | str) -> Kernels:
    """What inductor makes of `gm` (compiled in regions per block when `regional`: codegen/regions.py): which
    values it never writes to memory (and the views of them), by region."""
    regions, holds_block = block_regions(gm.graph, by_block=bool(regional))
    region_of = {n: r for r, nodes in enumerate(regions) for n in nodes}
    outputs = set(gm.graph.output_node().all_input_nodes)
    read_later: dict[fx.Node, int] = {}
    for r, nodes in enumerate(regions):
        for n in nodes:
            for a in n.all_input_nodes:
                if region_of.get(a) is not None and region_of[a] != r:
                    read_later[a] = r
    compiled = ([True] * len(regions) if regional == "nested"  # the glue too, in the graph that calls the blocks
                else compiled_regions(regions, holds_block, read_later, outputs))
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or _kind(n.target) != "loop" or n in outputs or n in read_later:
            continue
        r = region_of.get(n)
        if r is None or not compiled[r] or not isinstance(n.meta.get("val"), torch.Tensor):
            continue
        readers = _readers(n)
        if readers and all(u.op == "call_function" and _kind(u.target) == "loop" and region_of.get(u) == r
                           for u in readers):
            out.add(n)
    views = [n for n in gm.graph.nodes if n.op == "call_function" and _kind(n.target) == "view"]
    for v in views:  # in graph order: a view's input comes first
        src = v.args[0] if v.args and isinstance(v.args[0], fx.Node) else None
        if src in out:
            out.add(v)
    return Kernels(out, region_of, compiled)
