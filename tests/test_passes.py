"""Each pass alone, in one process, on a small graph: which nodes it inserts, in which order, and what it records.

Parameters live on the meta device and the DistContext has no process group (world 2 unless said, rank 0), so
nothing runs or communicates. End-to-end parity of the same passes is in test_parity and friends.
"""
import dataclasses
import operator

import pytest
import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from tests.pass_graphs import call, context, node, ops, records, trace
from zcompile.compiler.graph import collectives
from zcompile.compiler.passes import (bucket_collectives, mixed_precision, offload_activations, offload_grads,
                                      offload_params, prefetch, quantize_gradients, quantize_weights, reduce_grads,
                                      secondary_partition, shard_params, tag_param_recompute, tile_linears,
                                      update_in_backward)

GATHER = ["new_empty", "all_gather_into_tensor_out", "wait_tensor"]


def _linear_fw(primals_1, x):
    return torch.mm(x, primals_1.t())


def _two_linears_fw(primals_1, primals_2, x):
    return torch.mm(torch.mm(x, primals_1.t()).relu(), primals_2.t())


def _bw_graph(w_shapes=((6, 4), (6, 6))):
    """A backward graph returning the gradients of two parameters (argument indices 0 and 1) and of no input (2)."""
    def bw(x, h, tangents_1):
        g_first = torch.mm(tangents_1.t(), x)   # [6, 4]: produced first
        g_second = torch.mm(tangents_1.t(), h)  # [6, 6]
        return g_first, g_second, None
    return trace(bw, (3, 4), (3, 6), (3, 6))


# -- dynamo phase

@pytest.mark.parametrize("output_dtype", [None, "fp32"])
def test_mixed_precision_casts_at_first_use_and_outputs_back_if_asked(output_dtype):
    """Outputs stay in the compute dtype (FSDP2's default: a language model's logits are never copied to fp32);
    `output_dtype: fp32` casts them back."""
    g = fx.Graph()
    w, x = g.placeholder("w"), g.placeholder("x")
    for ph, shape in ((w, (6, 4)), (x, (3, 4))):
        ph.meta["example_value"] = torch.empty(shape, device="meta")
    a = g.call_method("relu", (x,))
    y = g.call_function(torch.matmul, (a, g.call_method("t", (w,))))
    y.meta["example_value"] = torch.empty(3, 6, device="meta")
    g.output((y,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    mp = {"param_dtype": "bf16", "output_dtype": output_dtype}
    gm = mixed_precision.run(gm, context({"stage": 3, "mixed_precision": mp}, "dynamo", {0: (6, 4)}, 2))
    calls = [(n.op, n.target, n.args[0].name, getattr(n.args[1], "name", n.args[1]) if len(n.args) > 1 else None)
             for n in gm.graph.nodes if n.op in ("call_method", "call_function")]
    # x cast before relu; w cast after relu (its first use), not at the top; the output cast back to fp32 if asked
    back = [("call_method", "to", "matmul", torch.float32)] if output_dtype else []
    assert calls == [("call_method", "to", "x", torch.bfloat16), ("call_method", "relu", "to_1", None),
                     ("call_method", "to", "w", torch.bfloat16), ("call_method", "t", "to", None),
                     ("call_function", torch.matmul, "relu", "t")] + back
    (out,) = gm.graph.output_node().args[0]
    assert out.name == ("to_2" if output_dtype else "matmul")


def test_mixed_precision_is_a_no_op_in_fp32():
    gm = trace(_linear_fw, (6, 4), (3, 4))
    before = ops(gm)
    assert ops(mixed_precision.run(gm, context({"stage": 3}, "dynamo", {0: (6, 4)}, 2))) == before


def test_tile_linears_splits_a_big_linear_into_row_tiles():
    g = fx.Graph()
    w, x, b = g.placeholder("w"), g.placeholder("x"), g.placeholder("b")
    y = g.call_function(torch._C._nn.linear, (x, w, b))
    g.output((y,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    cfg = {"stage": 3, "tiling": {"min_bytes": 64, "tiles": 2}}
    pctx = context(cfg, "dynamo", {0: (8, 4), 2: (8,)}, 3)
    assert pctx.params[0].row_multiple == 2 and not pctx.params[2].row_multiple
    gm = tile_linears.run(gm, pctx)
    assert ops(gm) == ["weight_tiles", "getitem", "getitem", "linear", "linear", "stack", "unflatten", "transpose",
                       "flatten", "narrow", "add"]
    tiles = call(gm, "weight_tiles")
    assert tiles.args == (node(gm, "w"), 2, 2, pctx.params[0].shard_numel // 4)
    linears = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch._C._nn.linear]
    assert linears[0].args[0].name == "x"


# -- joint phase

def test_tag_param_recompute_tags_nodes_computed_from_parameters_only():
    def joint(primals_1, primals_2):
        wt = primals_1.t()                 # parameter only: recompute in backward
        return torch.mm(primals_2, wt)     # depends on an input: saved as usual
    gm = trace(joint, (6, 4), (3, 4))
    gm = tag_param_recompute.run(gm, context({"stage": 3}, "joint", {0: (6, 4)}, 2))
    tagged = {n.name for n in gm.graph.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE}
    assert tagged == {"t"}


def test_tag_param_recompute_leaves_stage_1_alone():
    gm = trace(lambda primals_1, primals_2: torch.mm(primals_2, primals_1.t()), (6, 4), (3, 4))
    gm = tag_param_recompute.run(gm, context({"stage": 1}, "joint", {0: (6, 4)}, 2))
    assert not any("recompute" in n.meta for n in gm.graph.nodes)


# -- split phase: parameters

def test_shard_params_gathers_before_first_use():
    gm = trace(_linear_fw, (5, 4), (3, 4))  # 5 rows over 2 ranks: 3 rows each, padded
    pctx = context({"stage": 3}, "forward", {0: (5, 4)}, 2)
    gm = shard_params.run(gm, pctx)
    assert ops(gm) == GATHER + ["slice", "view", "t", "mm"]
    (rec,) = records(gm)
    assert (rec.op, rec.numel, rec.bytes, rec.param, rec.dtype) == ("all_gather", 24, 96, 0, torch.float32)
    assert call(gm, "slice").args[1:] == (0, 0, 20)


def test_shard_params_gathers_in_the_compute_dtype_when_every_use_casts():
    def fw(primals_1, x):
        return torch.mm(x.to(torch.bfloat16), primals_1.to(torch.bfloat16).t())
    gm = trace(fw, (6, 4), (3, 4))
    gm = shard_params.run(gm, context({"stage": 3}, "forward", {0: (6, 4)}, 2))
    names = ops(gm)
    assert names.count("_to_copy") == 1 and names[names.index("new_empty") - 1] == "convert_element_type"
    (rec,) = records(gm)
    assert rec.dtype == torch.bfloat16 and rec.bytes == 24 * 2


def test_shard_params_backward_regathers_saved_parameters():
    gm = trace(lambda primals_1, tangents_1: torch.mm(tangents_1, primals_1), (6, 4), (3, 6))
    gm = shard_params.run(gm, context({"stage": 3}, "backward", {0: (6, 4)}, 1))
    assert ops(gm) == GATHER + ["view", "mm"]
    assert "re-gather" in records(gm)[0].why


def test_shard_params_stage_2_reads_the_whole_parameter_as_a_side_input():
    gm = trace(_linear_fw, (6, 4), (3, 4))
    pctx = context({"stage": 2}, "forward", {0: (6, 4)}, 2)
    gm = shard_params.run(gm, pctx)
    assert records(gm) == [] and ops(gm) == ["t", "mm"]
    side = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    assert side.name == "zc_full_param_0" and call(gm, "t").args[0] is side
    assert [s.kind for s in pctx.side_inputs] == ["full"] and pctx.side_inputs[0].zp is pctx.params[0]


def test_offload_params_reloads_host_shards_right_before_their_gather():
    cfg = {"stage": 3, "offload": {"params": "cpu", "optimizer": "cpu"}}
    pctx = context(cfg, "forward", {0: (6, 4)}, 2)
    gm = offload_params.run(shard_params.run(trace(_linear_fw, (6, 4), (3, 4)), pctx), pctx)
    assert ops(gm) == ["to_device"] + GATHER + ["view", "t", "mm"]
    assert node(gm, "primals_1").meta["zc_tier"] == "cpu"
    assert call(gm, "new_empty").args[0] is call(gm, "to_device")


@pytest.mark.parametrize("size", [2, "node"])
def test_secondary_partition_keeps_a_block_copy_and_regathers_within_the_block(size):
    """hpZ over 2 ranks, given as a number or as the node's ranks (2 per node)."""
    cfg = {"stage": 3, "hpz_partition_size": size}
    fw_ctx = context(cfg, "forward", {0: (8, 4)}, 2, world=4, rank=1, ranks_per_node=2)
    fw = secondary_partition.run(shard_params.run(trace(_linear_fw, (8, 4), (3, 4)), fw_ctx), fw_ctx)
    assert ops(fw) == GATHER + ["slice", "copy_", "view", "t", "mm"]
    zp = fw_ctx.params[0]
    assert zp.secondary_numel == 16 and call(fw, "slice").args[1:] == (0, 16, 32)  # rank 1: block position 1
    assert [s.kind for s in fw_ctx.side_inputs] == ["secondary"]
    bw_ctx = context(cfg, "backward", {0: (8, 4)}, 1, world=4, rank=1, ranks_per_node=2)
    bw_ctx.params[0] = zp  # the backward of the same parameter
    bw = trace(lambda primals_1, tangents_1: torch.mm(tangents_1, primals_1), (8, 4), (3, 8))
    bw = secondary_partition.run(shard_params.run(bw, bw_ctx), bw_ctx)
    (rec,) = records(bw)
    assert rec.ranks == (0, 1) and rec.numel == 32 and "secondary" in rec.why
    gather = next(n for n in bw.graph.nodes if collectives.is_op(n, "all_gather"))
    assert gather.args[0].name.startswith("zc_secondary_param")


def test_quantize_weights_gathers_int8_blocks_and_dequantizes():
    cfg = {"stage": 3, "quantize_weights": {"block": 8}}
    pctx = context(cfg, "forward", {0: (6, 4)}, 2)
    gm = quantize_weights.run(shard_params.run(trace(_linear_fw, (6, 4), (3, 4)), pctx), pctx)
    names = ops(gm)
    assert names[0] == "quantize_int8_payload" and "dequantize_int8_payload" in names
    assert (names.index("all_gather_into_tensor_out") < names.index("wait_tensor")
            < names.index("dequantize_int8_payload"))
    # 6 values in one block of 6 (+ 4 scale bytes) per rank, [rank][values | scales]
    x = torch.randn(6)
    payload = torch.ops.zcompile.quantize_int8_payload(x, 8)
    assert payload.shape == (10,) and payload.dtype == torch.int8
    full = torch.ops.zcompile.dequantize_int8_payload(torch.cat([payload, payload]), 6, 8, torch.float32)
    assert full.shape == (12,) and (full - torch.cat([x, x])).abs().max() <= x.abs().max() / 127 / 2 * 1.0001
    (rec,) = records(gm)
    assert rec.dtype == torch.int8 and rec.param == 0 and "qwZ" in rec.why  # still names its parameter


# -- split phase: gradients

def test_reduce_grads_reduce_scatters_each_gradient_where_it_is_produced_one_in_flight():
    gm = _bw_graph()
    pctx = context({"stage": 3}, "backward", {0: (6, 4), 1: (6, 6)}, 3)
    gm = reduce_grads.run(gm, pctx)
    names = ops(gm)
    first_rs, second_rs = [k for k, n in enumerate(names) if n == "reduce_scatter_tensor"]
    waits = [k for k, n in enumerate(names) if n == "wait_tensor"]
    assert names.index("mm") < first_rs < names.index("mm", names.index("mm") + 1)  # issued before the 2nd grad
    assert waits[0] < second_rs  # one in flight: the first is waited on before the second is issued
    recs = records(gm)
    assert [r.numel for r in recs] == [24, 36] and all(r.op == "reduce_scatter" for r in recs)
    muls = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor]
    assert [m.args[1] for m in muls] == [0.5, 0.5]  # pre-scaled by 1/world
    out = list(gm.graph.output_node().args[0])
    assert out[2] is None and all(o.target is torch.ops._c10d_functional.wait_tensor.default for o in out[:2])


def test_reduce_grads_all_reduces_whole_gradients_at_stage_1():
    gm = reduce_grads.run(_bw_graph(), context({"stage": 1}, "backward", {0: (6, 4), 1: (6, 6)}, 3))
    assert [r.op for r in records(gm)] == ["all_reduce", "all_reduce"]


def test_bucket_collectives_merges_gathers_and_reductions():
    cfg = {"stage": 3, "bucket_mb": 1}
    fw_ctx = context(cfg, "forward", {0: (6, 4), 1: (6, 6)}, 3)
    fw = trace(_two_linears_fw, (6, 4), (6, 6), (3, 4))
    fw = bucket_collectives.run(shard_params.run(fw, fw_ctx), fw_ctx)
    (rec,) = records(fw)
    assert rec.op == "all_gather" and rec.numel == 60 and "bucket 0 of 2 params" in rec.why
    names = ops(fw)
    assert names[:4] == ["cat", "new_empty", "all_gather_into_tensor_out", "wait_tensor"]
    assert names.count("clone") == 2  # each member copied out of the flat buffer
    bw_ctx = context(cfg, "backward", {0: (6, 4), 1: (6, 6)}, 3)
    bw = bucket_collectives.run(reduce_grads.run(_bw_graph(), bw_ctx), bw_ctx)
    (rec,) = records(bw)
    assert rec.op == "reduce_scatter" and rec.members == [12, 18] and rec.numel == 60


def test_bucket_collectives_casts_a_bucket_once():
    """Members that gather bf16 casts of their fp32 shards: the bucket concatenates the shards and casts once (one
    op per bucket where the issue runs eagerly, instead of one per parameter), and still moves bf16 bytes."""
    def fw(primals_1, primals_2, x):
        h = torch.mm(x.to(torch.bfloat16), primals_1.to(torch.bfloat16).t())
        return torch.mm(h, primals_2.to(torch.bfloat16).t())
    ctx = context({"stage": 3, "bucket_mb": 1}, "forward", {0: (6, 4), 1: (6, 6)}, 3)
    gm = bucket_collectives.run(shard_params.run(trace(fw, (6, 4), (6, 6), (3, 4)), ctx), ctx)
    names = ops(gm)
    assert names.count("convert_element_type") == 1 and names.count("cat") == 1, names
    cast = call(gm, "convert_element_type")
    assert cast.args[0].target is torch.ops.aten.cat.default and cast.args[1] == torch.bfloat16
    assert [a.op for a in cast.args[0].args[0]] == ["placeholder", "placeholder"]  # the fp32 shards
    (rec,) = records(gm)
    assert rec.dtype == torch.bfloat16 and rec.bytes == 60 * 2


def _in_block(gm: fx.GraphModule, target_ops: dict[str, str]) -> None:
    """Give the named op's nodes a module stack, as dynamo records it for `blocks.<k>` of a model."""
    for n in gm.graph.nodes:
        path = target_ops.get(n.name)
        if path is not None:
            n.meta["nn_module_stack"] = {path: (path, torch.nn.Module)}


def test_bucket_collectives_keeps_each_block_in_its_own_buckets():
    """Two parameters used by two transformer blocks: one bucket each (FSDP2's per-block groups), forward and
    backward, so every block's schedule is alike for the regional compile."""
    cfg = {"stage": 3, "bucket_mb": 1}
    fw_ctx = context(cfg, "forward", {0: (6, 4), 1: (6, 6)}, 3)
    fw = trace(_two_linears_fw, (6, 4), (6, 6), (3, 4))
    _in_block(fw, {"mm": "L['self'].blocks.0", "relu": "L['self'].blocks.0", "mm_1": "L['self'].blocks.1"})
    fw = bucket_collectives.run(shard_params.run(fw, fw_ctx), fw_ctx)
    assert [r.numel for r in records(fw)] == [24, 36] and "clone" not in ops(fw)
    bw_ctx = context(cfg, "backward", {0: (6, 4), 1: (6, 6)}, 3)
    bw = _bw_graph()
    _in_block(bw, {"mm": "L['self'].blocks.0", "mm_1": "L['self'].blocks.1"})
    bw = bucket_collectives.run(reduce_grads.run(bw, bw_ctx), bw_ctx)
    assert [r.members for r in records(bw)] == [None, None]


def test_bucket_collectives_with_zero_mb_keeps_one_collective_per_parameter():
    cfg = {"stage": 3, "bucket_mb": 0}
    bw_ctx = context(cfg, "backward", {0: (6, 4), 1: (6, 6)}, 3)
    bw = bucket_collectives.run(reduce_grads.run(_bw_graph(), bw_ctx), bw_ctx)
    assert [r.members for r in records(bw)] == [None, None]


def test_quantize_gradients_turns_reduce_scatters_into_two_int4_all_to_alls():
    cfg = {"stage": 3, "bucket_mb": 0, "quantize_gradients": {"block": 8}}
    pctx = context(cfg, "backward", {0: (8, 4), 1: (8, 8)}, 3, world=4, rank=0, ranks_per_node=2)
    bw = trace(lambda x, h, tangents_1: (torch.mm(tangents_1.t(), x), torch.mm(tangents_1.t(), h), None),
               (3, 4), (3, 8), (3, 8))
    bw = quantize_gradients.run(reduce_grads.run(bw, pctx), pctx)
    recs = records(bw)
    assert [r.op for r in recs] == ["all_to_all"] * 4
    assert [r.ranks for r in recs] == [(0, 1), (0, 2)] * 2  # intra-node, then inter-node, per gradient
    assert all(r.dtype == torch.uint8 for r in recs)
    names = ops(bw)
    assert "reduce_scatter_tensor" not in names
    assert names.count("quantize_int4_rows") == 4 and names.count("dequantize_sum_int4_rows") == 4


# -- split phase: activations and order

def test_offload_activations_sends_big_saved_tensors_to_the_host_and_reloads_them():
    cfg = {"stage": 3, "offload": {"activations": "cpu", "activation_min_bytes": 40}}
    fw_ctx = context(cfg, "forward", {}, 1)
    fw_ctx.num_fwd_outputs = 1
    fw = trace(lambda x: (x.sum(), x.relu(), x[:1].relu()), (3, 4))  # saves relu (48 B) and relu_1 (16 B)
    fw = offload_activations.run(fw, fw_ctx)
    out = list(fw.graph.output_node().args[0])
    assert out[1].target is torch.ops.zcompile.to_host.default and out[1].args[0].name == "relu"
    assert out[2].name == "relu_1" and fw_ctx.offloaded == {"relu": 48}
    bw_ctx = context(cfg, "backward", {}, 1)
    bw_ctx.offloaded = fw_ctx.offloaded
    bw = trace(lambda relu, relu_1, tangents_1: (relu * tangents_1 + relu_1.sum(),), (3, 4), (1, 4), ())
    bw = offload_activations.run(bw, bw_ctx)
    assert ops(bw)[0] == "to_device" and node(bw, "relu").meta["zc_tier"] == "cpu"
    assert "zc_tier" not in node(bw, "relu_1").meta


def test_prefetch_issues_each_gather_one_ahead():
    def fw(primals_1, primals_2, primals_3, x):
        h = torch.mm(x, primals_1.t()).relu()
        h = torch.mm(h, primals_2.t()).relu()
        return torch.mm(h, primals_3.t())
    cfg = {"stage": 3, "bucket_mb": 0, "prefetch": 1}
    pctx = context(cfg, "forward", {0: (4, 4), 1: (4, 4), 2: (4, 4)}, 4)
    gm = shard_params.run(trace(fw, (4, 4), (4, 4), (4, 4), (3, 4)), pctx)
    before = [n.name for n in gm.graph.nodes if collectives.is_op(n, "all_gather")]
    gm = prefetch.run(gm, pctx)
    nodes = list(gm.graph.nodes)
    gathers = [n for n in nodes if collectives.is_op(n, "all_gather")]
    assert [g.name for g in gathers] == before
    waits = [collectives.wait_of(g) for g in gathers]
    # gather k+1 is issued before gather k is waited on; waits stay right before their uses
    for k in range(2):
        assert nodes.index(gathers[k + 1]) < nodes.index(waits[k])
    assert nodes.index(gathers[0]) < nodes.index(gathers[1]) < nodes.index(gathers[2])
    mms = [n for n in nodes if n.target is torch.ops.aten.mm.default]
    assert all(nodes.index(waits[k]) < nodes.index(mms[k]) for k in range(3))
    assert nodes.index(waits[1]) > nodes.index(mms[0])  # not waited on before the first layer ran
    assert all("[prefetched 1 gather(s) ahead]" in collectives.record(g).why for g in gathers)


def test_prefetch_zero_leaves_the_graph_alone():
    pctx = context({"stage": 3, "prefetch": 0}, "forward", {0: (4, 4)}, 2)
    gm = shard_params.run(trace(_linear_fw, (4, 4), (3, 4)), pctx)
    before = [n.name for n in gm.graph.nodes]
    assert [n.name for n in prefetch.run(gm, pctx).graph.nodes] == before


def test_offload_grads_moves_the_reduced_shard_not_the_full_gradient():
    """The split pipeline in its order: a host shard's gradient is reduce-scattered on the device (NCCL has no host
    path) and only its 1/world shard is copied to the host, as the backward's output."""
    from zcompile.compiler.passes import run_phase
    cfg = {"stage": 3, "offload": {"params": "cpu", "optimizer": "cpu"}}
    pctx = context(cfg, "backward", {0: (6, 4), 1: (6, 6)}, 3)  # device "meta": not the host
    gm = run_phase("split", _bw_graph(), pctx)
    out = list(gm.graph.output_node().args[0])
    for k, (lo, hi) in ((0, (0, 12)), (1, (12, 30))):  # rank 0's rows of each: 3 of 6 rows
        assert out[k].target is torch.ops.zcompile.to_host.default and out[k].meta["zc_tier"] == "cpu"
        piece = out[k].args[0]
        assert piece.target is torch.ops.aten.slice.Tensor and piece.args[2:] == (lo, hi)
        wait = piece.args[0]
        assert collectives.is_op(wait.args[0], "reduce_scatter")  # the scatter's output, not its input
    assert ops(gm).count("to_host") == 2


def test_offload_grads_alone_copies_host_parameters_gradients_and_leaves_the_rest():
    """Run alone on a backward graph: each gradient of a host-resident parameter becomes a `zcompile::to_host` copy
    as the graph's output; a device-resident parameter's gradient, a non-parameter output, a forward graph and a
    CPU job (where the shard already is on the host) are left as they are."""
    cfg = {"stage": 3, "offload": {"params": "cpu", "optimizer": "cpu"}}
    pctx = context(cfg, "backward", {0: (6, 4), 1: (6, 6)}, 3)
    pctx.params[1].param_tier = pctx.params[1].param_tier.DEVICE  # this one stays on the device
    gm = offload_grads.run(_bw_graph(), pctx)
    out = list(gm.graph.output_node().args[0])
    assert out[0].target is torch.ops.zcompile.to_host.default and out[0].args[0].target is torch.ops.aten.mm.default
    assert out[1].target is torch.ops.aten.mm.default and out[2] is None
    assert ops(gm).count("to_host") == 1 and any("1 gradient shard(s)" in n for n in gm.meta["zc_notes"])
    for kind, device in (("forward", "meta"), ("backward", "cpu")):
        other = context(cfg, kind, {0: (6, 4), 1: (6, 6)}, 3)
        other.dist = dataclasses.replace(other.dist, device=torch.device(device))
        assert "to_host" not in ops(offload_grads.run(_bw_graph(), other)), (kind, device)


def _four_grads_bw(x, h, tangents_1):
    t2 = tangents_1 * 2
    return (torch.mm(tangents_1.t(), x), torch.mm(tangents_1.t(), h), torch.mm(t2.t(), x), torch.mm(t2.t(), h), None)


def test_update_in_backward_hands_each_bucket_over_right_after_its_reduce_scatter():
    """The split pipeline in its order, two buckets of two parameters: bucket_collectives cuts every member out of
    its bucket at the end of the graph; the pass moves the first bucket's slices up to right after its wait and
    hands them over there (one grads_ready naming both), before the second bucket's reduce-scatter is issued. Off,
    or for a forward graph: no call."""
    from zcompile.compiler.passes import run_phase
    wait_op, ready = torch.ops._c10d_functional.wait_tensor.default, torch.ops.zcompile.grads_ready.default
    shapes = {0: (6, 4), 1: (6, 6), 2: (6, 4), 3: (6, 6)}
    cfg = {"stage": 3, "bucket_mb": 250 / 2**20, "offload": {"optimizer": "cpu", "update_in_backward": True}}
    pctx = context(cfg, "backward", shapes, 5)
    gm = run_phase("split", trace(_four_grads_bw, (3, 4), (3, 6), (3, 6)), pctx)
    order = list(gm.graph.nodes)
    out = list(gm.graph.output_node().args[0])
    calls = [n for n in order if n.target is ready]
    assert [c.args[1] for c in calls] == [[pctx.params[0].key, pctx.params[1].key],
                                          [pctx.params[2].key, pctx.params[3].key]]
    for c, members in zip(calls, ((0, 1), (2, 3))):
        assert c.args[0] == [out[i] for i in members]
        wait = out[members[0]].args[0]
        assert wait.target is wait_op and all(out[i].args[0] is wait for i in members)
        assert order.index(c) == order.index(wait) + 3  # the wait, the two slices, the hand-over
    second_issue = [n for n in order if collectives.is_op(n, "reduce_scatter")][1]
    assert order.index(calls[0]) < order.index(second_issue)
    for off_cfg, kind in ((dict(cfg, offload={"optimizer": "cpu"}), "backward"), (cfg, "forward")):
        other = context(off_cfg, kind, {0: (6, 4), 1: (6, 6)}, 3)
        graph = _bw_graph() if kind == "backward" else trace(_two_linears_fw, (6, 4), (6, 6), (3, 4))
        assert "grads_ready" not in ops(update_in_backward.run(graph, other)), kind


def test_a_phase_whose_pass_breaks_the_graph_fails_naming_the_passes(monkeypatch):
    """The graph is linted once per phase (each lint walks the whole graph): a malformed result still fails, and
    the error names the passes that ran."""
    from zcompile.compiler import passes

    def breaks(gm, pctx):  # the matmul moved before the weight's transpose it reads
        mm, t = call(gm, "mm"), call(gm, "t")
        t.prepend(mm)
        return gm
    monkeypatch.setitem(passes.PASSES, "shard_params", breaks)
    gm = trace(_linear_fw, (4, 4), (3, 4))
    with pytest.raises(AssertionError, match=r"after pass\(es\) \[.*'shard_params'.*\] is malformed"):
        passes.run_phase("split", gm, context({"stage": 3}, "forward", {0: (4, 4)}, 2))
