"""graph/placement.hoist on small hand-built graphs (single process): moved nodes keep their inputs before them."""
import operator

import torch
import torch.fx as fx

from zcompile.compiler.graph import placement


def _graph():
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    a = g.call_function(torch.neg, (x,), name="a")          # compute
    b = g.call_function(torch.relu, (a,), name="b")         # compute
    c = g.call_function(torch.sin, (w,), name="c")          # a function of a placeholder only (a gather's input)
    d = g.call_function(operator.add, (c, w), name="d")     # the node to issue early
    e = g.call_function(operator.mul, (b, d), name="e")
    g.output(e)
    return g


def _names(g):
    return [n.name for n in g.nodes]


def test_hoist_moves_a_node_and_its_placeholder_only_inputs_before_the_target():
    g = _graph()
    nodes = {n.name: n for n in g.nodes}
    placement.hoist(g, nodes["d"], nodes["a"])
    assert _names(g) == ["x", "w", "c", "d", "a", "b", "e", "output"]
    g.lint()  # every input still defined before its use


def test_hoist_is_a_no_op_for_a_node_already_earlier():
    g = _graph()
    nodes = {n.name: n for n in g.nodes}
    placement.hoist(g, nodes["a"], nodes["e"])
    assert _names(g) == ["x", "w", "a", "b", "c", "d", "e", "output"]


def test_hoist_stops_right_after_an_input_that_is_the_target_itself():
    """`before` is an input of the hoisted node (a shard cast feeding its gather): the node's other inputs move
    before it, and the node lands right after it."""
    g = _graph()
    nodes = {n.name: n for n in g.nodes}
    placement.hoist(g, nodes["e"], nodes["b"])
    assert _names(g) == ["x", "w", "a", "c", "d", "b", "e", "output"]
    g.lint()


def test_undo_puts_every_hoisted_node_back_in_order():
    """The prefetch pass under a memory budget tries a shorter distance after undoing the longer one's hoists."""
    g = _graph()
    nodes = {n.name: n for n in g.nodes}
    moved = []
    placement.hoist(g, nodes["d"], nodes["a"], moved)
    placement.hoist(g, nodes["e"], nodes["b"], moved)
    assert _names(g) != ["x", "w", "a", "b", "c", "d", "e", "output"] and moved
    placement.undo(moved)
    assert _names(g) == ["x", "w", "a", "b", "c", "d", "e", "output"] and moved == []
    assert nodes["c"] < nodes["d"] < nodes["e"] and nodes["a"] < nodes["c"]  # the sort keys follow the order
    g.lint()
