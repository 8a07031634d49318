"""bucket_collectives: fuse per-parameter all-gathers, reduce-scatters and all-reduces into coalesced collectives.

Consecutive all-gathers (in order of first use) are merged, up to `bucket_mb` per bucket and never across two
blocks (items of a ModuleList, as FSDP2 wraps them: every block's schedule is then alike, which the regional compile
needs), into one flat all-gather of the members' concatenated shards, issued where the bucket's first member was and
waited on before the first member's first use; each member is then copied out of the rank-major result
([rank][member][shard]) at once, so the flat buffer dies right away (as FSDP2's copy-out). Reduce-scatters are
merged the same way into one flat `reduce_scatter_tensor` over the members' rank-major concatenation (all-reduces at
stages 0/1 into one `all_reduce_coalesced`), issued once the bucket's last gradient exists and waited on before the
next bucket is issued (collectives.limit_in_flight), so the backward keeps computing while one bucket is reduced.
One collective per bucket instead of one per parameter: fewer launches and fewer small messages. The dump names
every bucket's members. The cap is `bucket_mb`, or a smaller one the memory budget chose (job.GraphCompile.split_passes).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from zcompile.compiler.graph import blocks, collectives
from zcompile.compiler.graph import placement

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional


def _single(node: fx.Node, op: str) -> bool:
    return collectives.is_op(node, op) and node.target in collectives.COLLECTIVE_OPS


def _block(node: fx.Node) -> str | None:
    """The repeated module (transformer block) a collective serves: the block of the nearest op that uses the
    gathered parameter, or that computed the gradient being reduced."""
    frontier, seen = [node], set()
    downstream = not collectives.is_op(node, "reduce_scatter") and not collectives.is_op(node, "all_reduce")
    for _ in range(8):
        step = [m for n in frontier for m in (n.users if downstream else n.all_input_nodes) if m not in seen]
        seen.update(step)
        found = blocks.first_block(step)
        if found is not None or not step:
            return found
        frontier = step
    return None


def _bucket_key(node: fx.Node) -> tuple:
    comm = collectives.record(node)
    # a weight tile is its own bucket (tile_linears); a bucket stays within one block, so every block's schedule
    # is alike and the regional compile compiles it once
    return comm.dtype, comm.group, comm.tile, _block(node)


def _buckets(nodes: list[fx.Node], cap_bytes: float) -> list[list[fx.Node]]:
    buckets: list[list[fx.Node]] = []
    size = cap_bytes
    for n in nodes:
        b = collectives.record(n).bytes
        # one flat buffer holds one dtype (qwZ payloads are int8) and goes to one group (hpZ gathers in a node)
        new_kind = bool(buckets and buckets[-1]) and _bucket_key(buckets[-1][-1]) != _bucket_key(n)
        if (size + b > cap_bytes or new_kind) and buckets and buckets[-1]:
            buckets.append([])
            size = 0
        if not buckets:
            buckets.append([])
            size = 0
        buckets[-1].append(n)
        size += b
    return [b for b in buckets if len(b) > 1]


def _annotate(node: fx.Node, op: str, members: list[fx.Node], why: str) -> collectives.Collective:
    recs = [collectives.record(m) for m in members]
    return collectives.annotate(node, op, sum(r.bytes for r in recs), recs[0].group, why,
                                sum(r.numel for r in recs), recs[0].dtype, recs[0].ranks)


def _members_text(members: list[fx.Node]) -> str:
    return "; ".join(collectives.record(m).why.split(": ", 1)[-1] for m in members)


def _merge_gathers(graph: fx.Graph, members: list[fx.Node], bucket_id: int, kind: str) -> None:
    first = members[0]
    world, group = first.args[1], first.args[2]
    srcs = [m.args[0] for m in members]
    for src in srcs[1:]:  # a cast of a shard, a quantized payload: move it (and its inputs) up with the bucket
        placement.hoist(graph, src, first)
    shard_sizes = [collectives.record(m).numel // world for m in members]
    total = sum(shard_sizes)
    order = {n: k for k, n in enumerate(graph.nodes)}
    earliest_wait = min((collectives.wait_of(m) for m in members), key=order.get)
    dtype = _one_cast(members)
    with graph.inserting_before(first):
        if dtype is None:
            flat = graph.call_function(aten.cat.default, (srcs,))
        else:  # every member casts its shard to the bucket's dtype: cast the bucket once, not each member
            flat = graph.call_function(prims.convert_element_type.default,
                                       (graph.call_function(aten.cat.default, ([c.args[0] for c in srcs],)), dtype))
        buf = graph.call_function(aten.new_empty.default, (flat, [world * total]))
        ag = graph.call_function(c10d.all_gather_into_tensor_out.default, (flat, world, group), {"out": buf})
    _annotate(ag, "all_gather", members,
              f"{kind}: bucket {bucket_id} of {len(members)} params: {_members_text(members)}")
    with graph.inserting_before(earliest_wait):
        wait = graph.call_function(c10d.wait_tensor.default, (ag,))
        rows = graph.call_function(aten.view.default, (wait, [world, total]))
    wait.meta["zc_note"] = f"wait for bucket {bucket_id}, then copy each member out"
    offset, fulls = 0, []
    for size in shard_sizes:
        with graph.inserting_before(earliest_wait):  # still in the graph: old waits are erased after the loop
            block = graph.call_function(aten.slice.Tensor, (rows, 1, offset, offset + size))
            copy = graph.call_function(aten.clone.default, (block,), {"memory_format": torch.contiguous_format})
            fulls.append(graph.call_function(aten.view.default, (copy, [world * size])))
        offset += size
    for m, full in zip(members, fulls):
        collectives.replace_gather(graph, m, full)
    if dtype is not None:
        for c in srcs:
            graph.erase_node(c)


def _one_cast(members: list[fx.Node]) -> torch.dtype | None:
    """The dtype every member gathers a cast of a same-dtype tensor in, each cast read by its gather alone
    (shard_params casts a shard to the compute dtype before its gather); else None."""
    srcs = [m.args[0] for m in members]
    if not all(c.op == "call_function" and c.target is prims.convert_element_type.default
               and set(c.users) <= {m, m.kwargs.get("out")} and isinstance(c.args[0], fx.Node)
               for c, m in zip(srcs, members)):
        return None
    dtypes = {getattr(c.args[0].meta.get("val"), "dtype", None) for c in srcs}
    if len({c.args[1] for c in srcs}) != 1 or len(dtypes) != 1 or None in dtypes:
        return None
    return srcs[0].args[1]


def _merge_reductions(graph: fx.Graph, members: list[fx.Node], bucket_id: int, op: str) -> None:
    last = members[-1]
    inputs = [m.args[0] for m in members]
    why = f"backward: bucket {bucket_id} of {len(members)} grads: {_members_text(members)}"
    out = graph.output_node()
    if op == "all_reduce":
        with graph.inserting_before(last.next):
            coalesced = graph.call_function(c10d.all_reduce_coalesced.default, (inputs, "sum", last.args[2]))
        _annotate(coalesced, op, members, why)
        _rewire_waits(graph, members, coalesced, lambda wait: out, f"as late as possible: wait for grad bucket {bucket_id}")
        return
    # One flat reduce-scatter over a rank-major concatenation ([rank][member][shard]): gloo's coalesced
    # reduce-scatter runs member by member and is ~30x slower on 4 ranks (measured, see README).
    world, group = last.args[2], last.args[3]
    shard_sizes = [collectives.record(m).numel // world for m in members]
    with graph.inserting_before(last.next):
        rows = [graph.call_function(aten.view.default, (x, [world, s])) for x, s in zip(inputs, shard_sizes)]
        cat = graph.call_function(aten.cat.default, (rows, 1))
        flat = graph.call_function(aten.view.default, (cat, [world * sum(shard_sizes)]))
        rs = graph.call_function(c10d.reduce_scatter_tensor.default, (flat, "sum", world, group))
    _annotate(rs, op, members, why)
    collectives.update(rs, members=shard_sizes)  # per-rank segments, for quantize_gradients' blocks
    with graph.inserting_before(out):
        wait = graph.call_function(c10d.wait_tensor.default, (rs,))
    wait.meta["zc_note"] = f"as late as possible: wait for grad bucket {bucket_id}"
    offset = 0
    for m, s in zip(members, shard_sizes):
        old_wait = collectives.wait_of(m)
        with graph.inserting_before(out):
            shard = graph.call_function(aten.slice.Tensor, (wait, 0, offset, offset + s))
        offset += s
        old_wait.replace_all_uses_with(shard)
        graph.erase_node(old_wait)
        graph.erase_node(m)


def _rewire_waits(graph: fx.Graph, members: list[fx.Node], coalesced: fx.Node, place, note: str) -> None:
    """Replace each member collective and its wait by a wait on the member's output of `coalesced`, inserted
    before `place(old_wait)`."""
    for j, m in enumerate(members):
        wait = collectives.wait_of(m)
        with graph.inserting_before(place(wait)):
            item = graph.call_function(operator.getitem, (coalesced, j))
            new_wait = graph.call_function(c10d.wait_tensor.default, (item,))
        new_wait.meta["zc_note"] = f"{note}, member {j}"
        wait.replace_all_uses_with(new_wait)
        graph.erase_node(wait)
        graph.erase_node(m)


def run(gm: fx.GraphModule, pctx) -> fx.GraphModule:
    cap = pctx.cfg.bucket_mb * 2**20 if pctx.bucket_bytes is None else pctx.bucket_bytes
    if cap <= 0 or pctx.kind == "joint":
        return gm
    graph = gm.graph
    gathers = [n for n in graph.nodes if _single(n, "all_gather")]
    for k, members in enumerate(_buckets(gathers, cap)):
        pctx.bucketed |= len(members) > 1
        _merge_gathers(graph, members, k, pctx.kind)
    if pctx.kind == "backward":
        for op in ("reduce_scatter", "all_reduce"):
            reductions = [n for n in graph.nodes if _single(n, op)]
            for k, members in enumerate(_buckets(reductions, cap)):
                pctx.bucketed |= len(members) > 1
                _merge_reductions(graph, members, k, op)
        _sort_output_dependencies(graph)
        collectives.limit_in_flight(graph, ("reduce_scatter", "all_reduce"))
    return gm


def _sort_output_dependencies(graph: fx.Graph) -> None:
    """Waits were placed before the output; move each node that uses them (a dtype cast) after them."""
    order = {n: k for k, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        late = [a for a in node.all_input_nodes if order[a] > order[node]]
        if late and node.op != "output":
            latest = max(late, key=order.get)
            latest.append(node)
            order = {n: k for k, n in enumerate(graph.nodes)}
