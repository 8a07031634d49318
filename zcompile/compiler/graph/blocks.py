"""Which repeated module (a transformer block) a graph node computes for, from the module stack dynamo records on
each node and AOTAutograd carries to the forward and backward graphs."""
from __future__ import annotations

import re

import torch.fx as fx

_ITEM = re.compile(r"(\.\d+|\[\d+\])$")  # a module path ending in a container index: blocks.3, layers[3]


def block_of(node: fx.Node) -> str | None:
    """The module path of the repeated module (an item of a ModuleList or Sequential) `node` computes for; "" for
    an op of another module; None when the node carries no module (collectives, copies and casts the passes
    inserted). Backward nodes carry their forward node's stack."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    for path, _ in stack.values():  # outermost first
        if _ITEM.search(path):
            return path
    return ""


def first_block(nodes) -> str | None:
    """block_of the first of `nodes` that has one."""
    return next((b for b in map(block_of, nodes) if b is not None), None)
