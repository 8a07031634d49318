"""What a pass knows about the graph it transforms."""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from zcompile.config import Config
from zcompile.dist_context import DistContext
from zcompile.shard_store import ShardedParam


@dataclasses.dataclass
class PassContext:
    cfg: Config
    dist: DistContext
    kind: str                               # "dynamo", "joint", "forward", "backward" or "inference"
    params: dict[int, ShardedParam]         # graph-argument index -> its sharded parameter
    num_args: int                           # arguments of the dynamo graph
    side_inputs: list[ShardedParam] = dataclasses.field(default_factory=list)  # full params appended as inputs
    own_placeholders: set[str] = dataclasses.field(default_factory=set)  # placeholders whose values we set

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
