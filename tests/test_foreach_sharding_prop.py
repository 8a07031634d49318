"""runtime/foreach_sharding_prop.py: torch's per-tensor scan of a foreach op's arguments for `_StridedShard`
placements runs once per op schema, and the original still runs wherever one is present; a foreach op's strategy is
expanded once per distinct tensor, with torch's result."""
import types

import pytest
import torch
from torch.distributed.tensor import _sharding_prop

from tests.harness import run_world
from zcompile.runtime import foreach_sharding_prop


class _Schema:
    def __init__(self, placements: list[tuple]):
        self.specs = [types.SimpleNamespace(placements=p) for p in placements]
        self.scans = 0

    @property
    def args_spec(self):  # torch's is a property that flattens every argument, each time
        self.scans += 1
        return self.specs


class _Strided:
    pass


def test_the_scan_runs_once_per_op_and_the_original_only_where_a_strided_shard_is():
    calls = []
    wrapped = foreach_sharding_prop._scanned_once(lambda strategy, schema: calls.append((strategy, schema)), _Strided)
    plain = _Schema([("shard",)] * 50)
    for child in range(50):  # one call per tensor of the foreach op, as the TupleStrategy branch makes them
        wrapped(child, plain)
    assert plain.scans == 1 and calls == []
    strided = _Schema([("shard",), ("shard", _Strided())])
    for child in range(3):
        wrapped(child, strided)
    assert strided.scans == 1 and calls == [(0, strided), (1, strided), (2, strided)]
    wrapped(3, plain)  # another op's schema: scanned again
    assert plain.scans == 2 and len(calls) == 3


def _adamw_steps(rank: int, world: int, wrapped: bool) -> dict:
    """Two foreach AdamW steps over a sharded model's DTensor parameters, with the scan and the expansion wrapped or
    torch's own."""
    import zcompile
    from tests import workers
    model = workers.build_model("gpt3")
    zcompile.shard_parameters(model, {"stage": 3, "backend": "eager"})
    for owner, name in ((_sharding_prop, "_propagate_use_strided_shard_flag"),
                        (_sharding_prop, "_expand_single_dim_strategy_to_mesh"),
                        (_sharding_prop.ShardingPropagator, "_propagate_tensor_meta_non_cached")):
        installed = getattr(owner, name, None)
        if installed is None:  # not in this torch
            continue
        assert hasattr(installed, "__wrapped__"), "sharding the model installs the wrappers"
        if not wrapped:
            setattr(owner, name, installed.__wrapped__)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2, foreach=True)
    torch.manual_seed(rank)
    for _ in range(2):
        for p in params:
            p.grad = torch.distributed.tensor.DTensor.from_local(torch.randn_like(p.to_local()), p.device_mesh,
                                                                 p.placements)
        opt.step()
    return {n: p.to_local().clone() for n, p in model.named_parameters()}


def test_an_optimizer_step_over_sharded_parameters_is_the_same_with_the_scan_and_expansion_wrapped():
    for ours, theirs in zip(run_world(2, _adamw_steps, True), run_world(2, _adamw_steps, False)):
        assert ours.keys() == theirs.keys()
        for name in ours:
            assert torch.equal(ours[name], theirs[name]), name


def _strided_foreach(rank: int, world: int) -> list:
    """A foreach op over a `_StridedShard` DTensor and a `Shard(0)` one, with the scan wrapped and with torch's own:
    each result's placements, shard order and values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    foreach_sharding_prop.install()
    installed = _sharding_prop._propagate_use_strided_shard_flag
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    a = distribute_tensor(torch.randn(8, 4), mesh, [_StridedShard(0, split_factor=2)])
    b = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    results = []
    for scan in (installed, installed.__wrapped__):
        _sharding_prop._propagate_use_strided_shard_flag = scan
        xs = [a.clone(), b.clone()]
        torch._foreach_add_(xs, [b.clone(), b.clone()])
        results.append([(str(x.placements), str(x._spec.shard_order), x.full_tensor()) for x in xs])
    _sharding_prop._propagate_use_strided_shard_flag = installed
    return results


@pytest.mark.skipif(not hasattr(_sharding_prop, "_propagate_use_strided_shard_flag"),
                    reason="this torch has no such scan (2.11)")
def test_a_foreach_op_over_a_strided_shard_is_the_same_with_the_scan_wrapped():
    """The wrapper on torch's own op schemas with a `_StridedShard` argument (the mocks above stand in for them):
    it scans them and hands the op to the original, with torch's result."""
    for ours, theirs in run_world(2, _strided_foreach):
        for (placements, order, value), (placements_, order_, value_) in zip(ours, theirs):
            assert (placements, order) == (placements_, order_)
            assert torch.equal(value, value_)


def _mixed_foreach(rank: int, world: int) -> list:
    """Foreach ops (list, scalar, scalar-list, out-of-place, reduction, an int one promoting by the scalar's type)
    over DTensors of repeated and distinct layouts (Shard(0) and Replicate of one shape, other shapes, bf16, a
    `_StridedShard`), with the expansion and layouts wrapped and with torch's own: each op's sharding decision and
    each result's placements and values, and how many tensors each computed for."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    foreach_sharding_prop.install()
    from torch.distributed.tensor import DTensor
    installed = _sharding_prop._expand_single_dim_strategy_to_mesh
    prop = DTensor._op_dispatcher.sharding_propagator
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    layouts = [((8, 4), [Shard(0)], torch.float32), ((8, 4), [Replicate()], torch.float32)] * 3 + [
        ((6,), [Shard(0)], torch.float32), ((8, 4), [Shard(0)], torch.bfloat16), ((4, 8), [Shard(0)], torch.float32)]
    if hasattr(_sharding_prop, "_propagate_use_strided_shard_flag"):  # torch 2.11's foreach ops fail on one
        layouts.append(((8, 4), [_StridedShard(0, split_factor=2)], torch.float32))
    base = [distribute_tensor(torch.randn(shape).to(dtype), mesh, placements) for shape, placements, dtype in layouts]
    decisions, expanded, faked = [], [], []
    ints = [distribute_tensor(torch.arange(32).view(8, 4) * k, mesh, [Shard(0)]) for k in range(4)]

    def recorded(op_schema):  # each op's sharding decision (on a miss of torch's caches, cleared for each pass)
        out = type(prop).propagate_op_sharding_non_cached(prop, op_schema)
        specs = out.output_spec if isinstance(out.output_spec, (list, tuple)) else [out.output_spec]
        decisions.append((str(op_schema.op), str(out.output_spec), [getattr(s, "tensor_meta", None) for s in specs],
                          out.needs_redistribute, str(out.redistribute_schema)))
        return out

    meta_prop = type(prop)._propagate_tensor_meta_non_cached

    def counted_metas(self, op_schema):  # torch's, counting the tensors each foreach op's layouts are computed for
        if op_schema.op.name().startswith("aten::_foreach_"):
            faked.append(len(next(a for a in op_schema.args_schema if isinstance(a, (list, tuple)))))
        return meta_prop.__wrapped__(self, op_schema)

    def counted(mesh_, op_schema, info, metas):  # torch's, counting the tensors each foreach expansion expands
        expand = installed.__wrapped__(mesh_, op_schema, info, metas)

        def expanded_foreach_strategy(op, args_schema, kwargs_schema):
            out = expand(op, args_schema, kwargs_schema)
            expanded.append(len(out.children))
            return out
        return expanded_foreach_strategy if expand.__name__ == "expanded_foreach_strategy" else expand

    results = []
    prop.propagate_op_sharding_non_cached = recorded
    try:
        for ours in (True, False):
            prop.propagate_op_sharding.cache_clear()
            torch._C._clear_DTensor_sharding_propagator_cache()
            _sharding_prop._expand_single_dim_strategy_to_mesh = (
                foreach_sharding_prop._strategies_deduplicated(counted) if ours else counted)
            type(prop)._propagate_tensor_meta_non_cached = (
                foreach_sharding_prop._metas_deduplicated(counted_metas) if ours else counted_metas)
            xs = [x.clone() for x in base]
            ys = [x.clone() * 0.5 for x in base]
            torch._foreach_add_(xs, ys, alpha=0.25)
            torch._foreach_mul_(xs, 1.5)
            torch._foreach_addcdiv_(xs, ys, [y.abs() + 1 for y in ys], [0.1 * k for k in range(len(xs))])
            zs = torch._foreach_sqrt([x.abs() for x in xs])
            torch._foreach_lerp_(xs, zs, 0.3)
            norms = torch._foreach_norm(xs)
            try:  # int64 + int stays int64, + float is float32
                promoted = torch._foreach_add(ints, [1, 2.5, 3, 4.5])
            except NotImplementedError:  # torch 2.11 has no DTensor strategy for a scalar list
                promoted = []
            results.append({"decisions": list(decisions), "expanded": list(expanded), "faked": list(faked),
                            "floats": len(base), "ints": bool(promoted),
                            "values": [(str(t.placements), str(t.dtype), t.full_tensor())
                                       for t in [*xs, *zs, *norms, *promoted]]})
            decisions.clear()
            expanded.clear()
            faked.clear()
    finally:
        del prop.propagate_op_sharding_non_cached
        _sharding_prop._expand_single_dim_strategy_to_mesh = installed
        type(prop)._propagate_tensor_meta_non_cached = meta_prop
        torch._C._clear_DTensor_sharding_propagator_cache()
    return results


@pytest.mark.skipif(not hasattr(_sharding_prop, "_expand_single_dim_strategy_to_mesh"),
                    reason="this torch expands no single-dim strategies")
def test_a_foreach_op_expands_each_distinct_tensor_once_with_torchs_result():
    for ours, theirs in run_world(2, _mixed_foreach):
        assert ours["decisions"] == theirs["decisions"] and len(ours["decisions"]) >= 5
        for (placements, dtype, value), (placements_, dtype_, value_) in zip(ours["values"], theirs["values"]):
            assert (placements, dtype) == (placements_, dtype_)
            assert torch.equal(value, value_)
        n, ints = ours["floats"], [2] if ours["ints"] else []  # the ints' op runs on torch 2.13
        # n float tensors of n - 4 strategies (two repeated 3 times), 4 ints of 2 output dtypes: each foreach op
        # expands n - 4 (the ints' op 2) where torch's expands n (4)
        if theirs["expanded"] or hasattr(_sharding_prop, "_propagate_use_strided_shard_flag"):  # 2.11 expands none
            assert ours["expanded"] == [n - 4] * 5 + ints and theirs["expanded"] == [n] * 5 + [4] * len(ints), \
                (ours["expanded"], theirs["expanded"])
        # output layouts, from the global layouts only: 4 kinds of the floats (Shard(0), Replicate and the strided
        # shard of 8x4 float32 are one), 2 of the ints (the scalar's type)
        # (on 2.11 the ints' op computes its layouts, then finds no strategy)
        assert n in theirs["faked"] and set(theirs["faked"]) <= {n, 4} and len(theirs["faked"]) >= 6, theirs["faked"]
        assert ours["faked"] == [4 if t == n else 2 for t in theirs["faked"]], (ours["faked"], theirs["faked"])
