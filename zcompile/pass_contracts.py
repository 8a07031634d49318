"""What each pass needs and gives, as data: no pass code here, so the config checks a pipeline without importing
the passes (which import the runtime). `zcompile.compiler.passes` binds each contract to its pass's `run`.

A contract names
- `phase`: "dynamo" (the torch-level graph, before AOTAutograd), "joint" (forward+backward, before partitioning)
  or "split" (the partitioned forward, backward and inference graphs, where collectives go);
- `provides` / `requires`: facts about the graph; a pass runs only after passes providing what it requires;
- `writes` / `reads`: fields of the collective records (`collectives.Collective`) beyond the ones every
  collective has. A pass reading a field runs after any listed pass that writes it, and after each pass the
  pipeline checks that no record carries a field that no pass run so far declares writing;
- `enabled_by`: the config key that turns the pass on (listing it without the key makes it a no-op; setting the key
  with a custom `pipeline` that lacks the pass is an error).
"""
from __future__ import annotations

import dataclasses

PHASES = ("dynamo", "joint", "split")


@dataclasses.dataclass(frozen=True)
class Contract:
    phase: str
    provides: frozenset = frozenset()
    requires: frozenset = frozenset()
    writes: frozenset = frozenset()
    reads: frozenset = frozenset()
    enabled_by: str | None = None


def _c(phase, provides, requires=(), writes=(), reads=(), enabled_by=None) -> Contract:
    return Contract(phase, frozenset(provides), frozenset(requires), frozenset(writes), frozenset(reads), enabled_by)


CONTRACTS: dict[str, Contract] = {
    "mixed_precision": _c("dynamo", {"compute_dtype"}),
    "chunk_loss": _c("dynamo", {"chunked_loss"}),
    "tile_linears": _c("dynamo", {"tiles"}, enabled_by="tiling"),
    "tag_param_recompute": _c("joint", {"param_recompute"}),
    "shard_params": _c("split", {"param_shards"}, writes={"param", "tile"}),
    "offload_params": _c("split", {"param_offload"}, {"param_shards"}, enabled_by="offload.params"),
    "secondary_partition": _c("split", {"secondary_partition"}, {"param_shards"}, reads={"param"},
                              enabled_by="hpz_partition_size"),
    "quantize_weights": _c("split", {"quantized_gathers"}, {"param_shards"},
                           enabled_by="quantize_weights"),
    "reduce_grads": _c("split", {"grad_reduction"}, writes={"tile"}),
    "bucket_collectives": _c("split", {"buckets"}, {"grad_reduction"}, writes={"members"}, reads={"tile"}),
    "quantize_gradients": _c("split", {"quantized_reductions"}, {"grad_reduction"}, reads={"members"},
                             enabled_by="quantize_gradients"),
    "offload_grads": _c("split", {"grad_offload"}, {"grad_reduction"}, enabled_by="offload.params"),
    "update_in_backward": _c("split", {"updates_in_backward"}, {"grad_reduction"},
                             enabled_by="offload.update_in_backward"),
    "offload_activations": _c("split", {"activation_offload"}, enabled_by="offload.activations"),
    "prefetch": _c("split", {"prefetch"}, {"param_shards"}),
}

DEFAULT_PIPELINE = tuple(CONTRACTS)

# What each stage cannot run without.
STAGE_NEEDS = {
    0: {"reduce_grads"},
    1: {"reduce_grads"},
    2: {"shard_params", "reduce_grads", "tag_param_recompute"},
    3: {"shard_params", "reduce_grads", "tag_param_recompute"},
}


def check_pipeline(names: tuple[str, ...], stage: int) -> None:
    """ValueError naming the problem when `names` is not a runnable pipeline for `stage`."""
    unknown = [n for n in names if n not in CONTRACTS]
    if unknown:
        raise ValueError(f"unknown pass(es) {unknown}; available: {sorted(CONTRACTS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"a pass is listed twice in {list(names)}")
    missing = STAGE_NEEDS[stage] - set(names)
    if missing:
        raise ValueError(f"stage {stage} needs pass(es) {sorted(missing)}, missing from {list(names)}")
    phases = [PHASES.index(CONTRACTS[n].phase) for n in names]
    if phases != sorted(phases):
        raise ValueError(f"passes must be listed in phase order dynamo -> joint -> split, got {list(names)}")
    provided: set = set()
    for k, n in enumerate(names):
        need = CONTRACTS[n].requires - provided
        if need:
            raise ValueError(f"pass '{n}' requires {sorted(need)}, provided by no earlier pass")
        provided |= CONTRACTS[n].provides
        for later in names[k + 1:]:
            early_read = CONTRACTS[n].reads & CONTRACTS[later].writes
            if early_read:
                raise ValueError(f"pass '{n}' reads collective field(s) {sorted(early_read)} that '{later}' writes: "
                                 f"list '{later}' first")


def written_fields(names) -> frozenset:
    """The collective record fields the passes `names` may set."""
    return frozenset().union(*(CONTRACTS[n].writes for n in names))
