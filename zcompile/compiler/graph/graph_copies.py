"""Copies of graph modules to transform, lazy code generation, and what a graph's compiled code depends on."""
from __future__ import annotations

import copy as _copy_module

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from zcompile.compiler.graph.blocks import block_of
from zcompile.compiler.graph.meta_keys import RELEASED
from zcompile.compiler.graph.placement import copy_graph


def copy(gm: fx.GraphModule, graph: fx.Graph | None = None) -> fx.GraphModule:
    """A copy of `gm` (of `graph`, if given) to transform, as a _LazyGraphModule: the budget's search copies and
    splits graphs dozens of times, and generating each copy's Python code took a fifth of its time."""
    new = _LazyGraphModule(gm, copy_graph(gm.graph if graph is None else graph))
    new.meta.update({k: _copy_module.copy(v) for k, v in gm.meta.items()})  # a new GraphModule starts with empty meta
    return new


def identity(gm: fx.GraphModule) -> int:
    """What inductor's code for `gm` depends on, hashed: per node its op, target and arguments (nodes by name), what
    regions cut by and wrapper_memory counts (block, released, tier) and each placeholder's layout. Two graphs with
    the same identity compile to the same code. (Not gm.code: generating it costs ten times as much.)"""
    def layout(v):
        return (tuple(map(str, v.shape)), tuple(map(str, v.stride())), v.dtype, v.device.type) \
            if isinstance(v, torch.Tensor) else str(v)
    return hash(tuple((n.name, n.op, str(n.target), repr(n.args), repr(n.kwargs), block_of(n),
                       n.meta.get(RELEASED), n.meta.get("zc_tier"),
                       layout(n.meta.get("val")) if n.op == "placeholder" else None) for n in gm.graph.nodes))


def lazy(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` as a _LazyGraphModule (same graph and meta): its recompile only marks, its code is generated when read."""
    module = _LazyGraphModule.from_graphmodule(gm)
    if module is not gm:
        module.meta.update(gm.meta)  # a new GraphModule starts with empty meta
    return module
