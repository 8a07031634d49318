"""runtime/grad_foreach.py: torch.nn.utils.clip_grad_norm_ over zcompile's gradient DTensors runs its foreach ops on
the local tensors, with DTensor's own results (values and placements) on uneven shards, a rank owning no rows,
several norm types and dtypes, and plain torch's on the whole gradients (also for the infinity norm with a rank
owning no rows, where DTensor's path fails); other DTensors take DTensor's default path."""
import contextlib
import math

import torch
from torch.distributed.tensor import DTensor

from tests.harness import run_world
from zcompile.runtime import grad_foreach

_FP32 = [((5, 3), torch.float32), ((1, 4), torch.float32), ((7,), torch.float32)]  # uneven rows; a rank owns none
_MIXED = _FP32 + [((4, 2), torch.bfloat16)]  # clip_grad_norm_ groups by dtype: two norm calls, one stack


def _params(mesh, ours: bool, seed: int, shapes: list) -> list:
    """DTensor parameters whose `.grad`s are Shard(0) DTensors of random values: zcompile's kind (its placements
    object, as shard_store makes them) or distribute_tensor's."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    torch.manual_seed(seed)
    params = []
    for shape, dtype in shapes:
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, [Shard(0)]))
        g = distribute_tensor(torch.randn(shape).to(dtype), mesh, [Shard(0)])
        if ours:
            spec = DTensorSpec(mesh, grad_foreach.GRAD_PLACEMENTS, tensor_meta=g._spec.tensor_meta)
            g = DTensor.__new__(DTensor, g._local_tensor, spec, requires_grad=False)
        p.grad = g
        params.append(p)
    return params


class _Counted:
    """A handler's fast path, noting each call it served."""

    def __init__(self, handler, served: list):
        self.handler, self.inner, self.served = handler, handler.fast, served

    def __call__(self, args, kwargs):
        out = self.inner(args, kwargs)
        if out is not NotImplemented:
            self.served.append(str(self.handler.op))
        return out


@contextlib.contextmanager
def _handlers(fast: bool):
    """Inside: zcompile's three handlers counting the ops they serve (the list yielded), or (`fast` False) taken out
    of DTensor's table, so DTensor's own path runs."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    mine = {op: h for op, h in handlers.items() if isinstance(h, grad_foreach._Handler)}
    assert len(mine) == 3, "zcompile registers three handlers"
    served = []
    for h in mine.values():
        h.fast = _Counted(h, served)
    try:
        if not fast:
            for op in mine:
                del handlers[op]
        yield served
    finally:
        handlers.update(mine)
        for h in mine.values():
            h.fast = h.fast.inner


def _clipped(mesh, ours: bool, fast: bool, norm_type: float, shapes: list) -> tuple:
    """clip_grad_norm_ with the handlers installed (`fast`) or taken out of DTensor's table: the total norm (its
    placements and value), each clipped gradient's placements and local values, and the ops a handler served."""
    with _handlers(fast) as served:
        torch.nn.utils.clip_grad_norm_(_params(mesh, ours, 4, shapes), max_norm=0.5, norm_type=norm_type)
        served.clear()  # a step before: what the handlers learn from DTensor's path at first, they reuse
        params = _params(mesh, ours, 3, shapes)
        total = torch.nn.utils.clip_grad_norm_(params, max_norm=0.5, norm_type=norm_type)
        return (str(total.placements), total.full_tensor(),
                [(str(p.grad.placements), p.grad.to_local().clone(), p.grad.full_tensor()) for p in params], served)


def _worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    grad_foreach.install()
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for ours in (True, False):
        for norm_type in (2.0, math.inf, 1.0):
            for name, shapes in (("fp32", _FP32), ("mixed", _MIXED)):
                plain = [p.grad.full_tensor() for p in _params(mesh, ours, 3, shapes)]
                params = [torch.nn.Parameter(torch.zeros_like(g)) for g in plain]
                for p, g in zip(params, plain):
                    p.grad = g
                reference = (torch.nn.utils.clip_grad_norm_(params, max_norm=0.5, norm_type=norm_type),
                             [p.grad for p in params])
                # DTensor's own path fails for the infinity norm on the rank owning no rows of a gradient
                default = None if norm_type == math.inf else _clipped(mesh, ours, False, norm_type, shapes)
                if norm_type == math.inf and not ours:
                    continue
                out[ours, norm_type, name] = (_clipped(mesh, ours, True, norm_type, shapes), default, reference)
    return out


def test_clip_grad_norm_over_zcompile_gradients_gives_dtensors_results_on_the_local_tensors():
    aten = grad_foreach._aten
    for rank_out in run_world(2, _worker):
        assert len(rank_out) == 10
        for (ours, norm_type, shapes), (fast, default, reference) in rank_out.items():
            placements, total, grads, served = fast
            if ours:  # per dtype group: the norms and the scaling; the stack of norms of one dtype
                groups = 1 if shapes == "fp32" else 2
                expected = ([aten._foreach_norm.Scalar, aten._foreach_mul_.Tensor] * groups
                            + ([aten.stack.default] if groups == 1 else []))
                assert sorted(map(str, served)) == sorted(map(str, expected)), (norm_type, shapes, served)
            else:
                assert served == [], "DTensors that are not zcompile's gradients take DTensor's path"
            total_ref, grads_ref = reference
            assert total.item() > 0.5, "the test clips"
            # (a bf16 gradient's norm is rounded to bf16 per rank, then summed: to bf16's precision)
            tol = dict(rtol=1e-2, atol=1e-2) if shapes == "mixed" else {}
            torch.testing.assert_close(total, total_ref.to(total.dtype), **tol)
            for (_, _, whole), ref in zip(grads, grads_ref):
                torch.testing.assert_close(whole, ref, **tol)
            if default is None:
                continue
            placements_, total_, grads_, served_ = default
            assert served_ == []
            assert placements == placements_
            assert torch.equal(total, total_), (ours, norm_type, shapes)
            for (p, g, _), (p_, g_, _) in zip(grads, grads_):
                assert p == p_
                assert torch.equal(g, g_), (ours, norm_type, shapes)


def _compiled_model_clip(rank: int, world: int) -> dict:
    """A GPT compiled for the zero backend (eager code, stage 3, world 2),
    one backward twice: torch's clip_grad_norm_ over the gradients the backward handed over, with the handlers and
    with DTensor's own path."""
    from tests import workers
    model = workers.build_model("gpt")
    run = torch.compile(model, backend="zero", options={"config": {"stage": 3, "backend": "eager"}})
    torch.manual_seed(1)
    idx = torch.randint(0, workers.VOCAB, (workers.MICRO, workers.SEQ))
    out = {}
    for fast in (True, False):
        model.zero_grad(set_to_none=True)
        run(idx, idx).loss.backward()
        params = list(model.parameters())
        assert all(p.grad._spec.placements is grad_foreach.GRAD_PLACEMENTS for p in params), \
            "the backward hands over gradients with grad_foreach's placements"
        out[fast] = _clip_with(params, fast)
    return out


def _clip_with(params: list, fast: bool) -> tuple:
    with _handlers(fast) as served:
        total = torch.nn.utils.clip_grad_norm_(params, max_norm=0.1)
        return total.full_tensor(), [p.grad.to_local().clone() for p in params], served


def test_a_compiled_models_gradients_take_the_local_path_with_dtensors_result():
    for out in run_world(2, _compiled_model_clip):
        (total, grads, served), (total_, grads_, served_) = out[True], out[False]
        assert "aten._foreach_norm.Scalar" in served and "aten._foreach_mul_.Tensor" in served and served_ == []
        assert torch.equal(total, total_) and total.item() > 0.1
        for g, g_ in zip(grads, grads_):
            assert torch.equal(g, g_)
