"""What a pass knows about the graph it transforms."""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from zcompile.config import Config
from zcompile.runtime.dist_context import DistContext
from zcompile.runtime.groups import Group
from zcompile.runtime.shard_store import ShardedParam
from zcompile.compiler.graph.topology import Topology


@dataclasses.dataclass(frozen=True)
class SideInput:
    """A tensor the runtime appends to a graph's arguments: a parameter's whole buffer ("full": stage 2 and
    persistent stage 3) or its hpZ secondary partition ("secondary", written by the forward, read by the backward)."""
    zp: ShardedParam
    kind: str

    def value(self):
        return self.zp.full_view() if self.kind == "full" else self.zp.secondary()


@dataclasses.dataclass
class PassContext:
    cfg: Config
    dist: DistContext
    kind: str                               # "dynamo", "joint", "forward", "backward" or "inference"
    params: dict[int, ShardedParam]         # graph-argument index -> its sharded parameter
    num_args: int                           # arguments of the dynamo graph
    topology: Topology | None = None        # which ranks share a node
    side_inputs: list[SideInput] = dataclasses.field(default_factory=list)  # appended to the graph's inputs
    own_placeholders: set[str] = dataclasses.field(default_factory=set)  # placeholders whose values we set
    num_fwd_outputs: int = 0                # forward graph: outputs before the saved-for-backward ones
    offloaded: dict[str, int] = dataclasses.field(default_factory=dict)  # saved activations on the host (shared)
    offload_saved: frozenset = frozenset()  # saved activations the planner sends to the host (by forward name)
    subgroups: list[Group] = dataclasses.field(default_factory=list)  # for the commit step to create
    bucket_bytes: float | None = None       # bucket_collectives' cap where the memory budget chose one (else bucket_mb)
    bucketed: bool = False                  # bucket_collectives merged two collectives or more

    def subgroup(self, group: Group) -> Group:
        """A subgroup this graph's collectives use, named by its ranks until the commit step creates it."""
        if group.layout and group not in self.subgroups:
            self.subgroups.append(group)
        return group

    def add_side_input(self, gm: fx.GraphModule, zp: ShardedParam, kind: str, note: str) -> fx.Node:
        """A new last placeholder that the runtime fills with SideInput(zp, kind)."""
        last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
        with gm.graph.inserting_after(last):
            node = gm.graph.placeholder(f"zc_{kind}_param_{len(self.side_inputs)}")
        node.meta["zc_note"] = note
        node.meta["zc_side"] = SideInput(zp, kind)
        self.side_inputs.append(node.meta["zc_side"])
        return node

    def param_placeholders(self, gm: fx.GraphModule) -> dict[int, fx.Node]:
        """Placeholders that carry parameters in this graph, by argument index.

        Forward and inference graphs take the arguments in order; a backward graph takes the saved parameters
        under their forward names (AOTAutograd's `primals_<i+1>`).
        """
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if self.kind == "backward":
            by_name = {n.name: n for n in phs}
            return {i: by_name[f"primals_{i + 1}"] for i in self.params if f"primals_{i + 1}" in by_name}
        if len(phs) < self.num_args:
            raise RuntimeError(f"{self.kind} graph has {len(phs)} inputs, expected at least {self.num_args}")
        return {i: phs[i] for i in self.params}
