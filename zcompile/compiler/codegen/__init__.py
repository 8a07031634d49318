"""Code for the final forward/backward graphs and the commit: `compile_graph` with `eager` (the FX code as-is) or
`inductor` (one graph, or one region per block with each distinct region compiled once: regions.py), the commit
step that turns the job's decisions into runtime state and a function (commit.py), and the compile cache
(graph_cache.py)."""
from __future__ import annotations

from typing import Callable

import torch.fx as fx


AUTO_MIN_REUSE = 2.0  # regional_compile 'auto': at least this many regions per distinct region


def compile_graph(name: str, gm: fx.GraphModule, example_inputs: list, kind: str,
                  regional: bool | str = False) -> Callable:
    """Compile `gm`; the result takes a list of inputs (boxed calling convention) and returns a list/tuple.
    `regional` (inductor): True, False, "auto" (regions per block where they repeat) or "nested" (one graph calling
    each distinct block's body, regions.nest_blocks; regions as with True where it cannot)."""
    if name == "eager":
        from zcompile.compiler.codegen.eager import compile_eager
        return compile_eager(gm, example_inputs, kind)
    if name == "inductor":
        from zcompile.compiler.codegen.inductor import compile_inductor, hold_collective_inputs
        from zcompile.compiler.codegen.regions import compile_regions

        gm = hold_collective_inputs(gm)

        def one(sub, fakes):
            return compile_inductor(sub, fakes, kind)
        if regional == "nested":
            from zcompile.compiler.codegen.regions import nest_blocks
            nested = nest_blocks(gm)
            if nested is not None:
                from zcompile.compiler.codegen.regions import donated_inputs
                with donated_inputs():  # inductor would apply the whole graph's positions to each body's inputs
                    return compile_inductor(nested, example_inputs, kind)
        if regional:  # by block where blocks repeat ('auto': enough); else one graph
            program = compile_regions(gm, example_inputs, one, min_reuse=AUTO_MIN_REUSE if regional == "auto" else 0.0)
            if program is not None:
                return program
        return compile_regions(gm, example_inputs, one, by_block=False)
    raise ValueError(f"unknown graph backend {name!r}; expected 'eager' or 'inductor'")
