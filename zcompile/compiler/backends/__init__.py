"""Graph compilers for the transformed forward/backward graphs: `eager` (the FX code as-is) or `inductor` (one
graph, or one region per block with each distinct region compiled once: backends/regions.py)."""
from __future__ import annotations

from typing import Callable

import torch.fx as fx


AUTO_MIN_REUSE = 2.0  # regional_compile 'auto': at least this many regions per distinct region


def compile_graph(name: str, gm: fx.GraphModule, example_inputs: list, kind: str,
                  regional: bool | str = False) -> Callable:
    """Compile `gm`; the result takes a list of inputs (boxed calling convention) and returns a list/tuple.
    `regional` (inductor): True, False or "auto" (regions where they repeat, see regions.compile_regions)."""
    if name == "eager":
        from zcompile.compiler.backends.eager import compile_eager
        return compile_eager(gm, example_inputs, kind)
    if name == "inductor":
        from zcompile.compiler.backends.inductor import compile_inductor
        if regional:
            from zcompile.compiler.backends.regions import compile_regions
            program = compile_regions(gm, example_inputs, lambda sub, fakes: compile_inductor(sub, fakes, kind),
                                      min_reuse=AUTO_MIN_REUSE if regional == "auto" else 0.0)
            if program is not None:
                return program
        return compile_inductor(gm, example_inputs, kind)
    raise ValueError(f"unknown graph backend {name!r}; expected 'eager' or 'inductor'")
