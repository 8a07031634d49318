"""zcompile's gradient DTensors through `torch.nn.utils.clip_grad_norm_` on their local tensors.

clip_grad_norm_ over DTensor gradients costs DTensor's dispatch per gradient and per op: `_foreach_norm` wraps each
of its outputs as a DTensor (a dynamo-disabling constructor, ~13 Python calls each), and `_foreach_norm`, `stack` and
`_foreach_mul_` each hash every argument's spec for the sharding cache (one Python call per tensor and op). Over a
24-layer model's 292 gradients that doubled the clip's host work against plain tensors (bench/host_work.py).

The gradients a backward hands over (shard_store.ShardedParam.hand_grad) carry `GRAD_PLACEMENTS`, one tuple object
(so do DTensors DTensor derives from them, which keep their input's placements): seeing that object on every tensor
of a list on one 1-D mesh proves the Shard(0) layout without comparing placements. For such lists DTensor's
custom-op-handler table (`DTensor._op_dispatcher._custom_op_handlers`) runs these three ops on the local tensors
with one foreach kernel and hands out outputs with DTensor's own output specs, worked out by DTensor's default path
once per kind (norm type, dtype, mesh; stack length and dim) and reused. Anything else (other placements or
placement objects, a device mesh of several dimensions, a `dtype` or `out=` argument, the -inf norm, fake tensors
or a trace) takes DTensor's default path unchanged, so results and placements are DTensor's. One difference: the
infinity norm of a gradient of which a rank owns no rows is 0 on that rank here, where DTensor's path fails
(clipping by the infinity norm a model with a parameter of fewer rows than ranks), as long as every gradient of
the dtype is one of these (not, e.g., under compiled autograd).
"""
from __future__ import annotations

import math
import threading

import torch
from torch.distributed._functional_collectives import _are_we_tracing
from torch.distributed.tensor import DTensor, Replicate, Shard

GRAD_PLACEMENTS = (Shard(0),)  # the placements object of every gradient zcompile makes

_aten = torch.ops.aten
_lock = threading.Lock()
_installed = False
_norm_specs: dict = {}  # (mesh, ord, input dtype) -> the output spec DTensor gives
_stack_specs: dict = {}  # (input spec, length, dim) -> the output spec DTensor gives


def install() -> None:
    """Register the three handlers (once per process); a handler already there is kept as the fallback."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        handlers = DTensor._op_dispatcher._custom_op_handlers
        for op, fast in ((_aten._foreach_norm.Scalar, _foreach_norm),
                         (_aten.stack.default, _stack),
                         (_aten._foreach_mul_.Tensor, _foreach_mul_)):
            handlers[op] = _Handler(op, fast, handlers.get(op))


class _Handler:
    """`fast(args, kwargs)` where it applies (it returns NotImplemented otherwise), else the handler that was there
    before, else DTensor's default path (this handler taken out of the table for the call)."""

    def __init__(self, op, fast, before):
        self.op, self.fast, self.before = op, fast, before

    def __call__(self, op_call, args, kwargs):
        out = NotImplemented if _are_we_tracing() else self.fast(args, kwargs)  # (fake or traced: DTensor's path)
        if out is not NotImplemented:
            return out
        if self.before is not None:
            return self.before(op_call, args, kwargs)
        return _default(op_call, args, kwargs)


def _default(op_call, args, kwargs):
    """DTensor's own dispatch of the op: with no custom handler for it, the C++ entry takes its usual path. Another
    thread calling the op meanwhile takes that path too: DTensor's result (slower; for the infinity norm over a rank
    owning no rows, DTensor's error)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    mine = handlers.pop(op_call, None)
    try:
        return op_call(*args, **kwargs)
    finally:
        if mine is not None:
            handlers[op_call] = mine


def _locals(tensors) -> tuple[list, object] | None:
    """The local tensors of a list of zcompile gradients of one dtype on one 1-D mesh, and that mesh; None if any is
    not one."""
    if not tensors or type(tensors) not in (list, tuple):
        return None
    first = tensors[0]
    if type(first) is not DTensor:
        return None
    mesh, dtype = first._spec.mesh, first.dtype
    if mesh.ndim != 1:
        return None
    for t in tensors:  # loops, not generators: a generator resumes (a Python call) per tensor
        if type(t) is not DTensor:
            return None
        spec = t._spec
        if spec.placements is not GRAD_PLACEMENTS or spec.mesh is not mesh or t.dtype is not dtype:
            return None
    return [t._local_tensor for t in tensors], mesh


def _foreach_norm(args, kwargs):
    # clip_grad_norm_'s call: (tensors, ord); DTensor's entry drops arguments equal to their defaults
    if len(args) > 2 or (kwargs and set(kwargs) != {"ord"}):
        return NotImplemented
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    found = None if ord_ == -math.inf else _locals(args[0])
    if found is None:
        return NotImplemented
    local, mesh = found
    key = (mesh, ord_, args[0][0].dtype)
    spec = _norm_specs.get(key)
    if spec is None or spec.mesh is not mesh:  # (an equal mesh of another group: its own spec)
        spec = _norm_specs[key] = _norm_spec(mesh, args[0][0], ord_)
    norms = _max_norms(local) if ord_ == math.inf else torch._foreach_norm(local, ord_)
    new = DTensor.__new__
    return [new(DTensor, n, spec, requires_grad=False) for n in norms]


def _norm_spec(mesh, like: DTensor, ord_):
    """DTensor's output spec of _foreach_norm for gradients like `like`: its own answer for a one-element gradient
    of each rank (`like`'s part may be empty, where the infinity norm fails)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    one = torch.zeros(1, dtype=like.dtype, device=like._local_tensor.device)
    spec = DTensorSpec(mesh, GRAD_PLACEMENTS, tensor_meta=TensorMeta(torch.Size([mesh.size()]), (1,), like.dtype))
    template = DTensor.__new__(DTensor, one, spec, requires_grad=False)
    return _default(_aten._foreach_norm.Scalar, ([template], ord_), {})[0]._spec


def _max_norms(local: list) -> list:
    """The infinity norms of `local`, 0 for a rank's empty part (max |x| of nothing, under a Partial(max) of
    values >= 0): DTensor's own path fails there (torch's _foreach_norm has no identity for it), on the rank that
    owns no rows of a small parameter."""
    sizes = [t.numel() for t in local]
    if all(sizes):
        return torch._foreach_norm(local, math.inf)
    found = iter(torch._foreach_norm([t for t, n in zip(local, sizes) if n], math.inf) if any(sizes) else ())
    return [next(found) if n else torch.zeros((), dtype=t.dtype, device=t.device) for t, n in zip(local, sizes)]


def _stack(args, kwargs):
    tensors = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if kwargs and set(kwargs) != {"dim"} or type(tensors) not in (list, tuple) or not tensors:
        return NotImplemented
    first = tensors[0]
    if type(first) is not DTensor:
        return NotImplemented
    spec = first._spec
    for norm_spec in list(_norm_specs.values()):  # only the norms made above: stacking them needs no redistribution
        if spec is norm_spec:
            break
    else:
        return NotImplemented
    for t in tensors:  # which share one spec object
        if type(t) is not DTensor or t._spec is not spec:
            return NotImplemented
    key = (spec, len(tensors), dim)
    out_spec = _stack_specs.get(key)
    if out_spec is None:
        out = _default(_aten.stack.default, args, kwargs)
        _stack_specs[key] = out._spec
        return out
    local = torch.stack([t._local_tensor for t in tensors], dim)
    return DTensor.__new__(DTensor, local, out_spec, requires_grad=False)


def _foreach_mul_(args, kwargs):
    if kwargs or len(args) != 2:
        return NotImplemented
    found = _locals(args[0])
    other = args[1]
    if found is None or type(other) is not DTensor:
        return NotImplemented
    local, mesh = found
    spec = other._spec
    if spec.mesh is not mesh or spec.tensor_meta is None or spec.tensor_meta.shape != () \
            or spec.placements != (Replicate(),):
        return NotImplemented
    torch._foreach_mul_(local, other._local_tensor)
    return None
