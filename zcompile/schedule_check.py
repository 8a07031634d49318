"""Collective-schedule agreement: ranks compare a hash of their compiled collective sequence before running it.

Ranks that compiled different schedules (different graphs, configs or world sizes) would otherwise deadlock or
exchange mismatched buffers at the first differing collective; here they all fail with a message naming the
difference.
"""
from __future__ import annotations

import hashlib
import json

import torch
from torch.utils._python_dispatch import _disable_current_modes
import torch.fx as fx

from zcompile import collectives
from zcompile.dist_context import DistContext, all_gather_flat


class ScheduleMismatch(RuntimeError):
    pass


def fingerprint(graphs: dict[str, fx.GraphModule]) -> tuple[str, str]:
    """(short hash, readable summary) of the collectives of the given graphs, in issue order."""
    desc = {kind: [(c["op"], c["bytes"], _group(c)) for c in collectives.schedule(gm)] for kind, gm in graphs.items()}
    text = json.dumps(desc, sort_keys=True)
    summary = ", ".join(f"{k}: {len(v)} collectives / {sum(b for _, b, _ in v)} bytes" for k, v in desc.items())
    return hashlib.sha256(text.encode()).hexdigest()[:16], summary


def _group(c: dict) -> str:
    """The same on every rank: a subgroup's name differs between the ranks of different subgroups."""
    return f"subgroup of {len(c['ranks'])}" if c.get("ranks") else c["group"]


def agree(ctx: DistContext, graph_id: int, graphs: dict[str, fx.GraphModule]) -> None:
    if ctx.world == 1 or ctx.planning:
        return
    digest, summary = fingerprint(graphs)
    # one fixed-size all-gather of (graph id, hash): a single collective, nothing to pickle
    with _disable_current_modes():  # called while AOTAutograd traces under a fake mode
        mine = torch.tensor([graph_id, int(digest[:15], 16)], dtype=torch.int64, device=ctx.device)
        everyone = torch.empty(ctx.world * 2, dtype=torch.int64, device=ctx.device)
        all_gather_flat(everyone, mine, ctx.group)
        rows = everyone.view(ctx.world, 2).tolist()
    if any(r != rows[ctx.rank] for r in rows):
        lines = "\n".join(f"  rank {r}: graph {g} schedule {h:015x}" for r, (g, h) in enumerate(rows))
        raise ScheduleMismatch(
            "ranks compiled different collective schedules; running them would deadlock or corrupt data.\n"
            f"{lines}\nthis rank ({ctx.rank}): {summary}\n"
            "Check that every rank runs the same model, config, batch shapes and world size.")
