"""Recompute saved activations in the backward instead of keeping them from the forward.

AOTAutograd's partition hands the backward the forward's outputs past the first `num_fwd_outputs` (the saved
values: tensors, then sizes), in the order of the backward's first placeholders. Recomputing a set of saved values
rewrites both graphs:
- the forward stops returning them; what they are computed from is returned instead where the backward does not
  receive it yet: a parameter primal, a value that cannot be computed twice (a random op's output), or a value of
  another block (a block's input: as checkpointing a block saves its input, a chain never leaves its block);
- the backward computes each again right before its first use, from the values it receives: the ops between, copied
  from the forward with their metadata (so regions and liveness treat them as the block's work), each op once
  however many recomputed values share it.
A parameter primal reaching the backward this way is gathered there again by the split passes, as ZeRO-3 does for
every parameter the backward uses.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import CheckpointPolicy

from zcompile.compiler.planning import liveness, timeline
from zcompile.compiler.tracing.block_regions import free_name
from zcompile.compiler.graph.blocks import block_of
from zcompile.compiler.graph.placement import hoist
from zcompile.compiler.graph.tangents import tangents

MAX_OPS = 64  # a longer chain is no candidate (a transformer block's forward is ~50 ops)


@dataclasses.dataclass
class Chain:
    ops: list[fx.Node]        # forward nodes to run again, in forward order
    leaves: list[fx.Node]     # forward values the backward must receive for them, not received yet


def saved_values(fw: fx.GraphModule, num_fwd_outputs: int) -> list:
    return list(fw.graph.output_node().args[0])[num_fwd_outputs:]


def saved_tensors(fw: fx.GraphModule, num_fwd_outputs: int) -> list[fx.Node]:
    """The forward's saved values that are computed tensors (not its inputs, not sizes), each once."""
    out = saved_values(fw, num_fwd_outputs)
    return list(dict.fromkeys(n for n in out if isinstance(n, fx.Node) and n.op == "call_function"
                              and isinstance(n.meta.get("val"), torch.Tensor)))


def mark_released(graphs: dict[str, fx.GraphModule], num_fwd_outputs: int) -> None:
    """The backward frees the saved activations only it holds after their last use (liveness.mark_released),
    and the gradients of the forward's outputs: AOTAutograd hands them over boxed (measured on
    bench/activation_budget.py's Llama: the zero-filled gradient of the logits beside the loss, 2 MiB, is gone
    by the backward's peak)."""
    if "forward" in graphs and "backward" in graphs:
        bw = graphs["backward"]
        liveness.mark_released(bw, released_saved(graphs["forward"], num_fwd_outputs) | {n.name for n in tangents(bw)})


def released_saved(fw: fx.GraphModule, num_fwd_outputs: int) -> set[str]:
    """The saved tensors only the backward holds: computed by the forward, not on the storage of a forward input
    (a parameter, the user's batch) nor of a value the forward returns to the user (which may keep it)."""
    outs = list(fw.graph.output_node().args[0])
    held = {storage_of(n) for n in fw.graph.find_nodes(op="placeholder")}
    held |= {storage_of(n) for n in outs[:num_fwd_outputs] if isinstance(n, fx.Node)}
    return {n.name for n in saved_tensors(fw, num_fwd_outputs) if storage_of(n) not in held}


def _recomputable(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or op.namespace not in ("aten", "prims"):
        return False  # collectives, zcompile's copies, higher-order ops
    if op._schema.is_mutable:
        return False
    return torch.Tag.nondeterministic_seeded not in op.tags or _dropout_p(node) == 0


def _dropout_p(node: fx.Node):
    """The `dropout_p` argument of a seeded op that has one (the SDPA kernels are tagged seeded for their dropout:
    at 0 they draw nothing and run the same twice, as checkpointing a block recomputes them); None otherwise."""
    for k, arg in enumerate(node.target._schema.arguments):
        if arg.name == "dropout_p":
            if arg.name in node.kwargs:
                return node.kwargs[arg.name]
            return node.args[k] if k < len(node.args) else arg.default_value
    return None


def nbytes(node: fx.Node) -> int:
    return sum(int(t.untyped_storage().nbytes()) for t in liveness._tensors(node.meta.get("val")))


def storage_of(node: fx.Node):
    val = node.meta.get("val")
    return StorageWeakRef(val.untyped_storage()) if isinstance(val, torch.Tensor) else None


def kept_storages(fw: fx.GraphModule, received: set[str]) -> set:
    """The storages the computed values in `received` keep alive (a saved view keeps its base's). Not the inputs':
    a parameter reaches the backward as a shard, whatever the forward's whole copy was."""
    return {storage_of(n) for n in fw.graph.nodes if n.name in received and n.op != "placeholder"} - {None}


def _must_recompute(node: fx.Node) -> bool:
    """tag_param_recompute's tag: computed from parameters alone (a gathered weight's transpose), never saved."""
    return node.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE


def chain(fw: fx.GraphModule, node: fx.Node, received: set[str], kept: set | None = None) -> Chain | None:
    """The ops that compute `node` again from values in `received` (names), or None where they cannot (an op that
    may not run twice, a size the backward does not receive, more than MAX_OPS ops). A value on a storage a
    received value keeps alive (`kept`, from kept_storages) is received too, at no cost: a saved transpose's base."""
    kept = kept_storages(fw, received) if kept is None else kept
    block = block_of(node)
    ops: set[fx.Node] = set()
    leaves: set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in ops:
            continue
        if not _recomputable(n) or len(ops) >= MAX_OPS:
            return None
        ops.add(n)
        for a in n.all_input_nodes:
            if a.name in received and a is not node:
                continue
            is_tensor = isinstance(a.meta.get("val"), torch.Tensor)
            other_block = block is not None and block_of(a) not in (None, block)
            leaf = a.op == "placeholder" or not _recomputable(a) or other_block or storage_of(a) in kept
            if is_tensor and leaf and (a.op == "placeholder" or not _must_recompute(a)):
                leaves.add(a)
            elif a.op == "placeholder" or not _recomputable(a):
                return None  # a size, or a value that is not a tensor
            else:
                todo.append(a)
    order = {n: k for k, n in enumerate(fw.graph.nodes)}
    return Chain(sorted(ops, key=order.__getitem__), sorted(leaves, key=order.__getitem__))


def apply(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, names: set[str],
          cost: timeline.CostModel) -> tuple[set[str], float]:
    """Recompute the saved values `names` in the backward (see the module doc). Returns those recomputed (one whose
    chain cannot be built from what the backward then receives stays saved) and the seconds of the ops added."""
    out = fw.graph.output_node()
    values = list(out.args[0])
    saved = values[num_fwd_outputs:]
    inputs = list(bw.graph.find_nodes(op="placeholder"))[:len(saved)]
    targets = [n for n in fw.graph.nodes if n.name in names and n in saved]  # in graph order: deterministic
    received = {v.name for v in saved if isinstance(v, fx.Node)} - {t.name for t in targets}
    changed = True
    while changed:  # a value that cannot be recomputed stays received, which may shorten the others' chains
        changed = False
        chains: dict[fx.Node, Chain] = {}
        kept = kept_storages(fw, received)
        for t in targets:
            if t.name in received:
                continue
            found = chain(fw, t, received, kept)
            if found is None:
                received.add(t.name)
                changed = True
            else:
                chains[t] = found
        if not changed:  # a value whose storage stays alive anyway (its base is saved for another) is kept
            alive = kept | {storage_of(leaf) for t, c in chains.items() if t.name not in received for leaf in c.leaves}
            for t in targets:
                if t.name not in received and storage_of(t) in alive:
                    received.add(t.name)
                    changed = True
    chains = {t: c for t, c in chains.items() if t.name not in received}
    if not chains:
        return set(), 0.0
    env: dict[fx.Node, fx.Node] = {}
    for k, v in enumerate(saved):
        if isinstance(v, fx.Node) and v.name in received:
            env.setdefault(v, inputs[k])
    new_leaves = list(dict.fromkeys(leaf for c in chains.values() for leaf in c.leaves if leaf not in env))
    for leaf in reversed(new_leaves):  # first among the saved values: sizes stay last, as AOTAutograd orders them
        if leaf.op != "placeholder":  # one name in both graphs, by which the split passes pair them
            leaf._rename(free_name(leaf, bw.graph))
        with bw.graph.inserting_before(next(iter(bw.graph.nodes))):
            ph = bw.graph.placeholder(leaf.name)
        ph.meta = dict(leaf.meta)
        env[leaf] = ph
    order = {n: k for k, n in enumerate(bw.graph.nodes)}
    first_use = {t: min((u for k, v in enumerate(saved) if v is t for u in inputs[k].users),
                        key=order.__getitem__, default=None) for t in chains}
    seconds = 0.0
    for t in sorted(chains, key=lambda t: order[first_use[t]] if first_use[t] is not None else len(order)):
        at = first_use[t]
        if at is None:
            continue
        for n in chains[t].ops:
            if n in env:
                if env[n].op != "placeholder":
                    hoist(bw.graph, env[n], at)
                continue
            with bw.graph.inserting_before(at):
                env[n] = bw.graph.node_copy(n, lambda a: env[a])
            env[n].meta["zc_recomputed"] = n.name
            env[n].meta["zc_note"] = f"recomputed for saved activation {t.name}"
            seconds += timeline.op_seconds(n, cost)
    for k, v in enumerate(saved):
        if v in chains:
            if v in env:
                inputs[k].replace_all_uses_with(env[v])
            bw.graph.erase_node(inputs[k])
    still_saved = [v for v in saved if v not in chains]
    out.args = (type(out.args[0])(values[:num_fwd_outputs] + new_leaves + still_saved),)
    fw.graph.eliminate_dead_code()
    return {t.name for t in chains}, seconds
