"""Placing nodes in an FX graph: moving them earlier together with what they depend on (to issue collectives
early), and putting a node that transforms a value right before that value's first use."""
from __future__ import annotations

import torch.fx as fx


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of `graph` (nodes and their meta) to transform while keeping the original."""
    new = fx.Graph()
    new.output(new.graph_copy(graph, {}))
    return new


def hoist(graph: fx.Graph, node: fx.Node, before: fx.Node) -> None:
    """Move `node` (and inputs of it that are pure functions of placeholders) before `before`."""
    order = {n: k for k, n in enumerate(graph.nodes)}
    if order[node] <= order[before]:
        return
    for inp in node.all_input_nodes:
        if inp.op != "placeholder" and order[inp] > order[before]:
            hoist(graph, inp, before)
    order = {n: k for k, n in enumerate(graph.nodes)}
    latest = max(node.all_input_nodes, key=order.get, default=None)
    if latest is not None and order[latest] >= order[before]:  # `before` is itself an input (e.g. a shard cast)
        before = latest.next
    if before is not node:
        before.prepend(node)


def at_first_use(graph: fx.Graph, node: fx.Node, users: list[fx.Node], order: dict, make) -> fx.Node:
    """Insert `make()` (a node computed from `node`: a cast, a reload) right before the first of `users` in
    `order`, and make every one of `users` read it instead of `node`."""
    with graph.inserting_before(min(users, key=order.get)):
        new = make()
    for u in users:
        u.replace_input_with(node, new)
    return new
