"""Process subgroups for hierarchical collectives (hpZ, qgZ): blocks of G consecutive ranks (a node, an hpZ
partition) and the strided groups across blocks (the same local rank on every node).

`torch.distributed.new_group` is collective over the whole world, so every rank creates every group of a layout,
in the same order, the first time any graph asks for it; later graphs reuse them.
"""
from __future__ import annotations

import dataclasses
import datetime

import torch.distributed as dist

from zcompile.dist_context import DistContext


@dataclasses.dataclass(frozen=True)
class Group:
    name: str               # the group name functional collectives take
    ranks: tuple[int, ...]  # global ranks, in group-rank order

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index(self, rank: int) -> int:
        return self.ranks.index(rank)


_MADE: dict = {}


def world(ctx: DistContext) -> Group:
    return Group(ctx.group_name, tuple(range(ctx.world)))


def blocks(ctx: DistContext, size: int, timeout_s: float) -> Group:
    """This rank's block of `size` consecutive ranks: [0..size-1], [size..2size-1], ..."""
    return _mine(ctx, [tuple(range(b, b + size)) for b in range(0, ctx.world, size)], timeout_s)


def strided(ctx: DistContext, size: int, timeout_s: float) -> Group:
    """The ranks with this rank's position inside its block of `size`: {l, l+size, l+2*size, ...}."""
    return _mine(ctx, [tuple(range(l, ctx.world, size)) for l in range(size)], timeout_s)


def _mine(ctx: DistContext, layout: list[tuple[int, ...]], timeout_s: float) -> Group:
    if ctx.world % len(layout[0]):
        raise ValueError(f"groups of {len(layout[0])} ranks do not divide a world of {ctx.world}")
    mine = next(g for g in layout if ctx.rank in g)
    if len(mine) == ctx.world:
        return world(ctx)
    if ctx.planning:  # nothing is communicated: a name that says which group it would be
        return Group(f"{ctx.group_name}:{','.join(map(str, mine))}", mine)
    key = (ctx.group_name, id(ctx.group), tuple(layout))
    if key not in _MADE:
        name = None
        for ranks in layout:
            pg = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout_s))
            if ctx.rank in ranks:
                name = pg.group_name
        _MADE[key] = Group(name, mine)
    return _MADE[key]
