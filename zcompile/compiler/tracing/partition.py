"""From AOTAutograd's joint forward+backward graph to a forward and a backward: inductor's joint-graph passes, then
the min-cut partitioner, whose partitions a memory budget's search asks for again at other knapsack fractions."""
from __future__ import annotations

import contextlib
import inspect

import torch
import torch.fx as fx
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._guards import detect_fake_mode
from torch.fx._lazy_graph_module import _use_lazy_graph_module

from zcompile.compiler.graph import graph_copies
from zcompile.compiler.graph.placement import copy_graph


def joint_graph_passes(gm: fx.GraphModule) -> fx.GraphModule:
    """Inductor's joint-graph passes, which torch.compile runs in its own partition function and zcompile, which
    partitions itself, runs here (backend inductor; off with torch._inductor.config.use_joint_graph_passes):
    among them the seeding of random ops (dropout's `rand` becomes seeded `inductor_random`, the seeds kept for
    the backward) and scatter_upon_const_tensor, without which the NLL loss's backward writes a logits-size
    fp32 buffer of zeros before scattering into it. Not constant_fold_uniform_value: it makes one node of the
    uniform constants every block computes (Hugging Face Llama's), which the regional cut then reads from
    another block's region, before it is computed (a nested body) or after it was freed (regions)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import _recursive_joint_graph_passes
    from torch._inductor.virtualized import V
    fake_mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")])
    with V.set_fake_mode(fake_mode), inductor_config.patch(joint_graph_constant_folding=False):
        if "skip_invoke_subgraph" in inspect.signature(_recursive_joint_graph_passes).parameters:
            return _recursive_joint_graph_passes(gm, skip_invoke_subgraph=True)  # regions: partition_region
        return _recursive_joint_graph_passes(gm)  # an older torch


class MinCut:
    """The partitioner over one joint graph: `(fraction)` -> (forward, backward). The knapsack keeps `fraction` of the
    activation memory it can choose to save (None: as torch is configured). Lazy graph modules: the passes change
    both graphs, and what runs them (regions, inductor) reads the graph, so their Python code is generated only if
    something calls or prints them."""

    def __init__(self, joint: fx.GraphModule, joint_inputs, num_fwd_outputs: int, timed, **kwargs):
        self.joint, self.joint_inputs, self.num_fwd_outputs = joint, joint_inputs, num_fwd_outputs
        self.timed, self.kwargs = timed, kwargs
        self.cuts: dict = {}  # fraction -> its partition: each round of the budget's search asks for the same ones

    def __call__(self, fraction: float | None = None) -> tuple[fx.GraphModule, fx.GraphModule]:
        if fraction in self.cuts:  # on a copy: the budget's search rewrites what it is handed
            return tuple(graph_copies.copy(gm) for gm in self.cuts[fraction])
        knapsack = contextlib.nullcontext() if fraction is None else \
            torch._functorch.config.patch(activation_memory_budget=fraction)
        with self.timed("partition"), _use_lazy_graph_module(True), knapsack:
            fw, bw = min_cut_rematerialization_partition(
                fx.GraphModule(self.joint, copy_graph(self.joint.graph)), self.joint_inputs,
                num_fwd_outputs=self.num_fwd_outputs, **self.kwargs)
            bw = graph_copies.lazy(bw)  # the partitioner rebuilds the backward as a plain GraphModule when it reorders
        if fraction is None:
            return fw, bw
        self.cuts[fraction] = fw, bw
        return graph_copies.copy(fw), graph_copies.copy(bw)
