"""Small graphs and contexts for running one pass in a single process: parameters on the meta device, a
DistContext without a group (as zcompile plan's), graphs traced with make_fx or built by hand."""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

from zcompile import config as zconfig
from zcompile.compiler.graph import collectives
from zcompile.runtime import shard_store
from zcompile.runtime.dist_context import DistContext
from zcompile.compiler.graph.pass_context import PassContext
from zcompile.compiler.graph.topology import Topology


def trace(fn, *shapes, dtypes=None) -> fx.GraphModule:
    """fn traced on meta tensors of `shapes`; placeholders keep fn's argument names (make_fx appends '_1')."""
    dtypes = dtypes or [torch.float32] * len(shapes)
    traced = make_fx(fn)(*[torch.empty(s, dtype=d, device="meta") for s, d in zip(shapes, dtypes)])
    graph, env = fx.Graph(), {}
    for ph in [n for n in traced.graph.nodes if n.op == "placeholder"]:
        env[ph] = graph.placeholder(ph.target.removesuffix("_1"))
        env[ph].meta = dict(ph.meta)
    graph.output(graph.graph_copy(traced.graph, env))
    return fx.GraphModule(traced, graph)


def context(config: dict, kind: str, param_shapes: dict[int, tuple], num_args: int, world: int = 2, rank: int = 0,
            ranks_per_node: int | None = None) -> PassContext:
    """A PassContext of `kind` whose arguments `param_shapes` (index -> shape) are parameters of this config."""
    cfg = zconfig.from_dict(dict(config, ranks_per_node=ranks_per_node) if ranks_per_node else config)
    ctx = DistContext.without_group(world, rank)
    params = {}
    for i, shape in param_shapes.items():
        p = nn.Parameter(torch.empty(shape, device="meta"))
        params[i] = shard_store.register_for(cfg, ctx, p, attach=False)
    topology = Topology.resolve(world, cfg.ranks_per_node, cfg.source)
    return PassContext(cfg, ctx, kind, params, num_args, topology)


def _short(n: fx.Node) -> str | None:
    if n.op == "call_function":
        t = n.target
        return t._opname if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))
    return n.target if n.op == "call_method" else None


def ops(gm: fx.GraphModule) -> list[str]:
    """The graph's calls, briefly: 'mm' for aten.mm.default, the method name for call_method."""
    return [_short(n) for n in gm.graph.nodes if _short(n) is not None]


def call(gm: fx.GraphModule, op: str, k: int = 0) -> fx.Node:
    """The k-th call of `op` (a name as ops() gives it)."""
    return [n for n in gm.graph.nodes if _short(n) == op][k]


def records(gm: fx.GraphModule) -> list[collectives.Collective]:
    return [collectives.record(n) for n in gm.graph.nodes if collectives.record(n) is not None]


def node(gm: fx.GraphModule, name: str) -> fx.Node:
    """The node named `name` (placeholders keep their names)."""
    return next(n for n in gm.graph.nodes if n.name == name)
