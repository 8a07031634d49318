"""The backward's tangents: AOTAutograd names the placeholders of the forward outputs' gradients `tangents_<k>`."""
from __future__ import annotations

import torch.fx as fx


def is_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and node.name.startswith("tangents")


def tangents(gm: fx.GraphModule) -> list[fx.Node]:
    """The backward `gm`'s tangent placeholders, in order."""
    return [n for n in gm.graph.find_nodes(op="placeholder") if is_tangent(n)]
