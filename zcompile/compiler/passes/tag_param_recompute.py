"""tag_param_recompute: mark forward nodes computed only from parameters as must-recompute.

Casts, transposes and views of a weight would otherwise be saved for backward, keeping a full (gathered) weight
alive from forward to backward. Tagged, the partitioner saves the parameter itself (its shard, after shard_params)
and the backward re-derives them from a re-gathered copy: ZeRO-3's release-after-forward, re-gather-in-backward.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from zcompile.config import Stage
from torch.utils.checkpoint import CheckpointPolicy


def run(gm: fx.GraphModule, pctx) -> fx.GraphModule:
    if pctx.cfg.stage < Stage.GRADIENTS:
        return gm
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    primals = [n for n in placeholders if n.name.startswith("primals")]
    param_derived = {primals[i] for i in pctx.params if i < len(primals)}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        val = node.meta.get("val")
        tensors = isinstance(val, torch.Tensor) or isinstance(val, (list, tuple)) and val and all(
            isinstance(v, torch.Tensor) for v in val)  # tile_linears' weight_tiles returns a list
        if inputs and all(a in param_derived for a in inputs) and tensors:
            param_derived.add(node)
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            # in no activation-checkpoint region: the partitioner saves a recomputable node whose user sits in a
            # later region (the region's input), which would keep the gathered weight alive
            node.meta.pop("ac_graph_id", None)
    return gm
