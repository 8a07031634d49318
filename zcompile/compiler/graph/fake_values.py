"""Fake values (node.meta["val"]) of a graph's nodes: re-propagated after a rewrite, which liveness, the
schedule dump and inductor read."""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._prims_common import compute_required_storage_length
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch.fx.experimental.proxy_tensor import snapshot_fake
from torch.fx.passes.fake_tensor_prop import FakeTensorProp


def refresh(gm: fx.GraphModule, inputs: list | None = None) -> list:
    """Re-run fake propagation after the passes changed input shapes and added nodes; returns the fake inputs.

    `inputs` overrides the placeholders' own values (AOTAutograd re-strides saved activations to the layout the
    compiled forward really produces; the backward must be compiled for those strides).
    """
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if inputs is None:
        inputs = [n.meta["val"] for n in phs]
    fake_mode = detect_fake_mode(inputs)
    assert fake_mode is not None, "graph placeholders carry no fake values"
    for n, v in zip(phs, inputs):
        n.meta["val"] = v
    RepeatedLayoutProp(gm, fake_mode).propagate_dont_convert_inputs(*inputs)
    return inputs


def hold_for(phs: list[fx.Node], inputs: list) -> bool:
    """Whether the graph's fake values already hold for `inputs`: the same fake mode and, input by input, the same
    shapes and strides (a dynamic size: the same expression in the same symbols), dtypes and devices (then
    re-propagating, seconds on a deep model and ~9x that with dynamic shapes, would change nothing)."""
    vals = [n.meta.get("val") for n in phs]
    if detect_fake_mode(vals) is not detect_fake_mode(inputs):
        return False
    for v, x in zip(vals, inputs):
        if isinstance(v, torch.SymInt) and isinstance(x, torch.SymInt):
            if _sizes((v,)) != _sizes((x,)):
                return False
            continue
        if not (isinstance(v, torch.Tensor) and isinstance(x, torch.Tensor)):
            return False
        if (_sizes(v.shape) != _sizes(x.shape) or _sizes(v.stride()) != _sizes(x.stride())
                or (v.dtype, v.device) != (x.dtype, x.device)):
            return False
    return True


def _sizes(dims) -> tuple:
    """Sizes to compare without guarding: ints, and a SymInt by its expression (== on SymInts would add a guard)."""
    return tuple(d.node.expr if isinstance(d, torch.SymInt) else d for d in dims)


class RepeatedLayoutProp(FakeTensorProp):
    """FakeTensorProp that runs each distinct (op, input layouts, which inputs share a storage, constant arguments)
    once per graph: a later node with the same ones (the next block's copy of a node) gets new fake tensors of the
    layouts the first produced, built directly (a meta tensor each, no dispatch), aliasing the same input or output
    as the first one's did.
    A deep model's graph repeats every block's nodes; FakeTensor's own dispatch cache still builds a key and
    rebuilds its output through ~700 Python calls per node. Dynamic sizes, outputs that are not tensors and ops
    that change a tensor's metadata in place run through FakeTensorProp as before."""

    def __init__(self, module: fx.GraphModule, mode):
        super().__init__(module, mode)
        self._layouts: dict[int, tuple] = {}  # id(tensor) -> layout key, for the values this run holds
        self._memo: dict[tuple, tuple] = {}   # (op, argument keys, storage sharing) -> recipe of its outputs
        self.rebuilt: list[fx.Node] = []  # nodes whose values were rebuilt from an earlier node's layouts

    def run_node(self, n: fx.Node):
        if _writes_metadata(n):  # a rebuilt input's node holds its env value itself: keep it as it was
            for a in n.all_input_nodes:
                if a.meta.get("val") is self.env[a]:
                    a.meta["val"] = snapshot_fake(self.env[a])
            return super().run_node(n)
        key = self._key(n)
        if key is None:
            return super().run_node(n)
        flat_in = _tensors(n.args, n.kwargs, self.env)
        key = key, _sharing(flat_in)  # an output may alias an input: which inputs share a storage matters too
        recipe = self._memo.get(key)
        if recipe is not None:
            out = _build(recipe, flat_in, self._mode)
            n.meta["val"] = fx.node.map_aggregate(out, lambda v: v)  # a list as FakeTensorProp stores it
            self.rebuilt.append(n)
            return out
        result = super().run_node(n)
        recipe = _recipe(result, flat_in)
        if recipe is not None:
            self._memo[key] = recipe
        return result

    def _key(self, n: fx.Node) -> tuple | None:
        op = n.target
        if n.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
            return None
        try:
            return op, self._arg_key(n.args), self._arg_key(tuple(sorted(n.kwargs.items())))
        except _NotKeyable:
            return None

    def _arg_key(self, a):
        if isinstance(a, fx.Node):
            return self._layout(self.env[a])
        if isinstance(a, (tuple, list)):
            return type(a), tuple(self._arg_key(x) for x in a)
        if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                       torch.memory_format)):
            return type(a), a
        raise _NotKeyable

    def _layout(self, v) -> tuple:
        k = self._layouts.get(id(v))
        if k is not None and k[0] is v:
            return k[1]
        if type(v) is not FakeTensor or v.constant is not None:
            raise _NotKeyable
        shape, stride, offset = tuple(v.shape), v.stride(), v.storage_offset()
        if not all(type(d) is int for d in (*shape, *stride, offset)):
            raise _NotKeyable  # a dynamic size: the value depends on its symbols, not the layout alone
        layout = (shape, stride, offset, v.dtype, v.device, v.requires_grad)
        self._layouts[id(v)] = (v, layout)
        return layout


class _NotKeyable(Exception):
    pass


# in-place ops that change their input's size, strides or storage (a copy of the output's layout would not)
_METADATA_WRITERS = {torch.ops.aten.resize_.default, torch.ops.aten.resize_as_.default,
                     torch.ops.aten.set_.source_Storage, torch.ops.aten.set_.source_Storage_storage_offset,
                     torch.ops.aten.set_.source_Tensor, torch.ops.aten.set_.default}


def _writes_metadata(n: fx.Node) -> bool:
    op = n.target
    return isinstance(op, torch._ops.OpOverload) and (op in _METADATA_WRITERS or torch.Tag.inplace_view in op.tags)


def _tensors(args, kwargs, env) -> list:
    out = []
    fx.node.map_arg((args, kwargs), lambda n: out.append(env[n]))
    return [v for v in out if isinstance(v, torch.Tensor)]


def _storage(t: torch.Tensor) -> int:
    """Which storage `t` is (the values compared are alive for the whole propagation)."""
    return t.untyped_storage()._cdata


def _sharing(tensors: list) -> tuple:
    """For each tensor, the position of the first one with its storage."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(_storage(t), k) for k, t in enumerate(tensors))


def _recipe(result, inputs: list) -> tuple | None:
    """How to rebuild `result` from other inputs of the same layouts: its structure, and per tensor its layout and
    where its storage comes from (an input's, an earlier output's, or a new one of the same size)."""
    single = isinstance(result, torch.Tensor)
    outs = [result] if single else result
    if not isinstance(outs, (tuple, list)):
        return None
    in_storages = [_storage(x) for x in inputs]
    seen: list = []  # each output's storage, None for a None output
    parts = []
    for o in outs:
        if o is None:
            parts.append(None)
            seen.append(None)
            continue
        if type(o) is not FakeTensor or o.constant is not None:
            return None
        shape, stride, offset = tuple(o.shape), o.stride(), o.storage_offset()
        nbytes = o.untyped_storage().nbytes()
        if not all(type(d) is int for d in (*shape, *stride, offset, nbytes)):
            return None
        ref = _storage(o)
        if ref in in_storages:
            k = in_storages.index(ref)
            source, same_dtype = ("input", k), inputs[k].dtype == o.dtype
        elif ref in seen:
            k = seen.index(ref)
            source, same_dtype = ("output", k), outs[k].dtype == o.dtype
        else:
            fresh = offset == 0 and nbytes == compute_required_storage_length(shape, stride, 0) * o.dtype.itemsize
            source, same_dtype = ("new", None if fresh else nbytes), nbytes % o.dtype.itemsize == 0
        if not same_dtype:
            return None  # a view as another dtype: as_strided keeps the base's
        seen.append(ref)
        parts.append((shape, stride, offset, o.dtype, o.device, source))
    return single, type(result), tuple(parts)


def _build(recipe: tuple, inputs: list, mode):
    single, kind, parts = recipe
    built: list = []
    with in_kernel_invocation_manager(mode):
        for p in parts:
            if p is None:
                built.append(None)
                continue
            shape, stride, offset, dtype, device, (where, what) = p
            if where == "new" and what is None:  # as the op allocated it: not a view
                built.append(FakeTensor(mode, torch.empty_strided(shape, stride, dtype=dtype, device="meta"), device))
                continue
            if where == "new":
                base = torch.empty((what // dtype.itemsize,), dtype=dtype, device="meta")
            else:
                base = inputs[what] if where == "input" else built[what]
            meta = torch.ops.aten.as_strided.default(base, shape, stride, offset)
            built.append(FakeTensor(mode, meta, device))
    return built[0] if single else kind(built)
