"""Placing nodes in an FX graph: moving them earlier together with what they depend on (to issue collectives
early), and putting a node that transforms a value right before that value's first use."""
from __future__ import annotations

import torch.fx as fx


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of `graph` (nodes and their meta) to transform while keeping the original."""
    new = fx.Graph()
    new.output(new.graph_copy(graph, {}))
    return new


def hoist(graph: fx.Graph, node: fx.Node, before: fx.Node, moved: list | None = None) -> None:
    """Move `node`, and recursively those of its inputs that come after `before`, before `before`. Nodes compare by
    position in their graph (fx keeps a sort key per node), so a hoist costs what it moves, not the graph's size.
    `moved`: each move is appended as (node, the node it followed), for `undo`."""
    if not before < node:
        return
    for inp in node.all_input_nodes:
        if inp.op != "placeholder" and before < inp:
            hoist(graph, inp, before, moved)
    latest = max(node.all_input_nodes, default=None)
    if latest is not None and not latest < before:  # `before` is itself an input (e.g. a shard cast)
        before = latest.next
    if before is not node:
        if moved is not None:
            moved.append((node, node.prev))
        before.prepend(node)


def undo(moved: list) -> None:
    """Put the nodes `hoist` moved (its `moved` list) back where they were, last move first."""
    for node, after in reversed(moved):
        after.append(node)
    moved.clear()


def at_first_use(graph: fx.Graph, node: fx.Node, users: list[fx.Node], order: dict, make) -> fx.Node:
    """Insert `make()` (a node computed from `node`: a cast, a reload) right before the first of `users` in
    `order`, and make every one of `users` read it instead of `node`."""
    with graph.inserting_before(min(users, key=order.get)):
        new = make()
    for u in users:
        u.replace_input_with(node, new)
    return new
