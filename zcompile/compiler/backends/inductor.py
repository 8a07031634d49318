"""Compile the transformed graph with inductor: Triton kernels on GPU, C++ on CPU; collectives stay in the graph."""
from __future__ import annotations

import torch.fx as fx


def compile_inductor(gm: fx.GraphModule, example_inputs: list, kind: str):
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, example_inputs, is_backward=(kind == "backward"), is_inference=(kind == "inference"))
