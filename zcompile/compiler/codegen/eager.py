"""Run the transformed FX graph as the Python code FX generated: boxed (it takes the list of inputs and clears it)
and freeing each value after its last use, inputs included, as inductor's code does (liveness plans that way)."""
from __future__ import annotations

import torch.fx as fx
from torch.fx.graph import _BoxedCodeGen

from zcompile.compiler.graph.placement import copy_graph


def compile_eager(gm: fx.GraphModule, example_inputs: list, kind: str):
    boxed = fx.GraphModule(gm, copy_graph(gm.graph))  # the dumps and the graph cache keep gm's plain code
    boxed.graph.set_codegen(_BoxedCodeGen())
    boxed.recompile()

    def run(args: list):
        return boxed(args)
    run._boxed_call = True
    return run
