"""Which ranks share a node: K nodes x G ranks per node, rank r on node r // G (torchrun's layout).

Used to account every collective as intra- or cross-node (the bytes ZeRO++ is about) and to lay out the
intra-node groups hpZ and qgZ communicate in (zcompile.runtime.groups).
"""
from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Topology:
    world: int
    ranks_per_node: int

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    def cross_fraction(self, ranks) -> float:
        """Of the bytes one member of a collective over `ranks` moves (all-gather output, reduce-scatter or
        all-to-all input), the share that must cross a node boundary, per member, with a topology-aware algorithm:
        a node imports or exports (K-1)/K of the data, split over its G members of the group. Summed over a
        node's ranks this is the per-node volume of the ZeRO++ paper (3M for ZeRO-3, 0.75M with qwZ+hpZ+qgZ),
        times (K-1)/K."""
        ranks = list(ranks)
        k = len({r // self.ranks_per_node for r in ranks})
        return (k - 1) / len(ranks)  # (K-1)/K of the bytes, over the K*G members

    @staticmethod
    def resolve(world: int, ranks_per_node: int | None, where: str = "<config>") -> "Topology":
        """`ranks_per_node` from the config, else torchrun's LOCAL_WORLD_SIZE, else every rank on one node."""
        from zcompile.config import ConfigError
        g = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
        if g < 1 or world % g:
            raise ConfigError(f"{where}: key 'ranks_per_node' is {g} but the world has {world} ranks: nodes must "
                              "hold the same number of ranks")
        return Topology(world, g)
