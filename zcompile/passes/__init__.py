"""Graph passes, one per file. Each is `fn(gm, pctx) -> gm` and runs on one phase of the compile:

- "dynamo":  the torch-level graph dynamo hands the backend, before AOTAutograd (dtype policy);
- "joint":   the joint forward+backward graph, before partitioning (recompute policy);
- "split":   the partitioned forward and backward graphs (and the inference graph), where collectives go.

A pass declares what it provides and requires, so a YAML pipeline is checked before anything runs.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch.fx as fx

from zcompile.passes import (bucket_collectives, mixed_precision, offload_activations, offload_params, prefetch,
                             quantize_gradients, quantize_weights, reduce_grads, secondary_partition, shard_params,
                             tag_param_recompute, tile_linears)


@dataclasses.dataclass(frozen=True)
class PassSpec:
    fn: Callable
    phase: str
    provides: frozenset
    requires: frozenset = frozenset()
    min_stage: int = 0  # stages below this don't need the pass (it is a no-op there)


REGISTRY: dict[str, PassSpec] = {
    "mixed_precision": PassSpec(mixed_precision.run, "dynamo", frozenset({"compute_dtype"})),
    "tile_linears": PassSpec(tile_linears.run, "dynamo", frozenset({"tiles"})),
    "tag_param_recompute": PassSpec(tag_param_recompute.run, "joint", frozenset({"param_recompute"})),
    "shard_params": PassSpec(shard_params.run, "split", frozenset({"param_shards"})),
    "offload_params": PassSpec(offload_params.run, "split", frozenset({"param_offload"}), frozenset({"param_shards"})),
    "secondary_partition": PassSpec(secondary_partition.run, "split", frozenset({"secondary_partition"}),
                                    frozenset({"param_shards"})),
    "quantize_weights": PassSpec(quantize_weights.run, "split", frozenset({"quantized_gathers"}),
                                 frozenset({"param_shards"})),
    "reduce_grads": PassSpec(reduce_grads.run, "split", frozenset({"grad_reduction"})),
    "bucket_collectives": PassSpec(bucket_collectives.run, "split", frozenset({"buckets"}),
                                   frozenset({"grad_reduction"})),
    "quantize_gradients": PassSpec(quantize_gradients.run, "split", frozenset({"quantized_reductions"}),
                                   frozenset({"grad_reduction"})),
    "offload_activations": PassSpec(offload_activations.run, "split", frozenset({"activation_offload"})),
    "prefetch": PassSpec(prefetch.run, "split", frozenset({"prefetch"}), frozenset({"param_shards"})),
}

# What each stage cannot run without.
STAGE_NEEDS = {
    0: {"reduce_grads"},
    1: {"reduce_grads"},
    2: {"shard_params", "reduce_grads", "tag_param_recompute"},
    3: {"shard_params", "reduce_grads", "tag_param_recompute"},
}

PHASE_ORDER = {"dynamo": 0, "joint": 1, "split": 2}


def check_pipeline(names: tuple[str, ...], stage: int) -> None:
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown pass(es) {unknown}; available: {sorted(REGISTRY)}")
    if len(set(names)) != len(names):
        raise ValueError(f"a pass is listed twice in {list(names)}")
    missing = STAGE_NEEDS[stage] - set(names)
    if missing:
        raise ValueError(f"stage {stage} needs pass(es) {sorted(missing)}, missing from {list(names)}")
    phases = [PHASE_ORDER[REGISTRY[n].phase] for n in names]
    if phases != sorted(phases):
        raise ValueError(f"passes must be listed in phase order dynamo -> joint -> split, got {list(names)}")
    provided: set = set()
    for n in names:
        need = REGISTRY[n].requires - provided
        if need:
            raise ValueError(f"pass '{n}' requires {sorted(need)}, provided by no earlier pass")
        provided |= REGISTRY[n].provides


def run_phase(phase: str, gm: fx.GraphModule, pctx,
              on_pass: Callable[[str, fx.GraphModule], None] | None = None) -> fx.GraphModule:
    """Run the pipeline's passes of one phase in order; on_pass(name, gm) sees the graph after each (for dumps).
    The Python code is regenerated once at the end (after each pass only for on_pass): on a deep model each
    regeneration takes about a second."""
    for name in pctx.cfg.passes:
        spec = REGISTRY[name]
        if spec.phase == phase:
            gm = spec.fn(gm, pctx)
            gm.graph.lint()
            if on_pass is not None:
                gm.recompile()
                on_pass(name, gm)
    gm.recompile()
    return gm
