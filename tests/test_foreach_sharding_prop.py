"""runtime/foreach_sharding_prop.py: torch's per-tensor scan of a foreach op's arguments for `_StridedShard`
placements runs once per op schema, and the original still runs wherever one is present."""
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
    """Two foreach AdamW steps over a sharded model's DTensor parameters, with the scan wrapped or torch's own."""
    import zcompile
    from tests import workers
    model = workers.build_model("gpt3")
    zcompile.shard_parameters(model, {"stage": 3, "backend": "eager"})
    installed = _sharding_prop._propagate_use_strided_shard_flag
    assert hasattr(installed, "__wrapped__"), "sharding the model installs the wrapper"
    if not wrapped:
        _sharding_prop._propagate_use_strided_shard_flag = installed.__wrapped__
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2, foreach=True)
    torch.manual_seed(rank)
    for _ in range(2):
        for p in params:
            p.grad = torch.distributed.tensor.DTensor.from_local(torch.randn_like(p.to_local()), p.device_mesh,
                                                                 p.placements)
        opt.step()
    return {n: p.to_local().clone() for n, p in model.named_parameters()}


@pytest.mark.skipif(not hasattr(_sharding_prop, "_propagate_use_strided_shard_flag"),
                    reason="this torch has no such scan (2.11)")
def test_an_optimizer_step_over_sharded_parameters_is_the_same_with_the_scan_wrapped():
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
