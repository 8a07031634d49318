"""Process subgroups for hierarchical collectives (hpZ, qgZ): blocks of G consecutive ranks (a node, an hpZ
partition) and the strided groups across blocks (the same local rank on every node).

Passes ask for a subgroup and get a `Group` named by its ranks ("<world group>:0,1"), which is what dumps show;
creating it is the commit step's job (`realize`): `torch.distributed.new_group` is collective over the whole
world, so every rank creates every group of a layout, in the same order, the first time a committed graph needs
it; the commit step then puts the process group's real name into the graph. Later graphs reuse the groups.
"""
from __future__ import annotations

import dataclasses
import datetime

import torch.distributed as dist

from zcompile.runtime.dist_context import DistContext


@dataclasses.dataclass(frozen=True)
class Group:
    name: str               # the group name functional collectives take (a spec's name until realized)
    ranks: tuple[int, ...]  # global ranks, in group-rank order
    layout: tuple[tuple[int, ...], ...] = ()  # every group of the partition this one belongs to (to create them)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index(self, rank: int) -> int:
        return self.ranks.index(rank)


def world(ctx: DistContext) -> Group:
    return Group(ctx.group_name, tuple(range(ctx.world)))


def blocks(ctx: DistContext, size: int) -> Group:
    """This rank's block of `size` consecutive ranks: [0..size-1], [size..2size-1], ..."""
    return _mine(ctx, [tuple(range(b, b + size)) for b in range(0, ctx.world, size)])


def strided(ctx: DistContext, size: int) -> Group:
    """The ranks with this rank's position inside its block of `size`: {l, l+size, l+2*size, ...}."""
    return _mine(ctx, [tuple(range(l, ctx.world, size)) for l in range(size)])


def _mine(ctx: DistContext, layout: list[tuple[int, ...]]) -> Group:
    if ctx.world % len(layout[0]):
        raise ValueError(f"groups of {len(layout[0])} ranks do not divide a world of {ctx.world}")
    mine = next(g for g in layout if ctx.rank in g)
    if len(mine) == ctx.world:
        return world(ctx)
    return Group(f"{ctx.group_name}:{','.join(map(str, mine))}", mine, tuple(layout))


_MADE: dict = {}  # cache: (world group, layout) -> this rank's realized Group (process groups live as long)


def realize(ctx: DistContext, spec: Group, timeout_s: float) -> Group:
    """Commit step: the process group `spec` stands for (and the rest of its layout), created once."""
    key = (ctx.group_name, id(ctx.group), spec.layout)
    if key not in _MADE:
        name = None
        for ranks in spec.layout:
            pg = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout_s))
            if ctx.rank in ranks:
                name = pg.group_name
        _MADE[key] = Group(name, spec.ranks, spec.layout)
    return _MADE[key]
