"""Bytes of every collective this process issued (compiled graphs and optimizer-step refreshes), by op; and the part
of them that crosses node boundaries. Counted when a graph runs, from its schedule (collectives.schedule)."""
from __future__ import annotations

import collections

# process-wide counters, reset by reset_traffic()
TRAFFIC: collections.Counter = collections.Counter()
CROSS_NODE: collections.Counter = collections.Counter()


def count(sched: list[dict]) -> None:
    for c in sched:
        TRAFFIC[c["op"]] += c["bytes"]
        if c.get("cross_bytes"):
            CROSS_NODE[c["op"]] += c["cross_bytes"]


def traffic(cross_node: bool = False) -> dict[str, int]:
    """Collective bytes issued by this process since the last reset_traffic(), by op. With cross_node=True, this
    rank's share of the bytes that cross node boundaries (see Topology.cross_fraction and `ranks_per_node`): for
    plain ZeRO-3 over K nodes of G ranks, (K-1)/(K*G) of all bytes."""
    return dict(CROSS_NODE if cross_node else TRAFFIC)


def reset_traffic() -> None:
    TRAFFIC.clear()
    CROSS_NODE.clear()
