"""Fake values (node.meta["val"]) of a graph's nodes: re-propagated after a rewrite, which liveness, the
schedule dump and inductor read."""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp


def refresh(gm: fx.GraphModule, inputs: list | None = None) -> list:
    """Re-run fake propagation after the passes changed input shapes and added nodes; returns the fake inputs.

    `inputs` overrides the placeholders' own values (AOTAutograd re-strides saved activations to the layout the
    compiled forward really produces; the backward must be compiled for those strides).
    """
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if inputs is None:
        inputs = [n.meta["val"] for n in phs]
    fake_mode = detect_fake_mode(inputs)
    assert fake_mode is not None, "graph placeholders carry no fake values"
    for n, v in zip(phs, inputs):
        n.meta["val"] = v
    FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*inputs)
    return inputs


def hold_for(phs: list[fx.Node], inputs: list) -> bool:
    """Whether the graph's fake values already hold for `inputs`: the same fake mode and, input by input, the same
    shapes and strides (a dynamic size: the same expression in the same symbols), dtypes and devices (then
    re-propagating, seconds on a deep model and ~9x that with dynamic shapes, would change nothing)."""
    vals = [n.meta.get("val") for n in phs]
    if detect_fake_mode(vals) is not detect_fake_mode(inputs):
        return False
    for v, x in zip(vals, inputs):
        if isinstance(v, torch.SymInt) and isinstance(x, torch.SymInt):
            if _sizes((v,)) != _sizes((x,)):
                return False
            continue
        if not (isinstance(v, torch.Tensor) and isinstance(x, torch.Tensor)):
            return False
        if (_sizes(v.shape) != _sizes(x.shape) or _sizes(v.stride()) != _sizes(x.stride())
                or (v.dtype, v.device) != (x.dtype, x.device)):
            return False
    return True


def _sizes(dims) -> tuple:
    """Sizes to compare without guarding: ints, and a SymInt by its expression (== on SymInts would add a guard)."""
    return tuple(d.node.expr if isinstance(d, torch.SymInt) else d for d in dims)
