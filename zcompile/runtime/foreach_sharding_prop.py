"""A quadratic scan in torch's DTensor sharding propagation of foreach ops, done once per op instead.

torch 2.13's `_sharding_prop._propagate_use_strided_shard_flag(strategy, op_schema)` runs once per tensor of a
foreach op (the TupleStrategy branch of `propagate_op_sharding_non_cached`) and each time flattens all of the op's
arguments (`op_schema.args_spec`, a pytree walk) looking for a `_StridedShard` placement: quadratic in the number of
tensors. The first foreach AdamW step over the 32-layer benchmark GPT's 356 DTensor parameters took 2.78 s against
1.58 s with the scan done once per op (world 2, this 2-core VM, 2026-11-27; later steps 33 ms either way: the result
is cached per op schema). FSDP2's parameters pay the same. `install` wraps the function so that the scan runs once
per op schema (the last one seen is remembered) and the original runs only where an argument has a
`_StridedShard` placement: where none has one, the original also returns without changing anything.

The same first step then, per foreach op, runs the op on fake tensors of every tensor's global layout for the
output layouts (`_propagate_tensor_meta_non_cached`) and builds each tensor's strategy on its own
(`expanded_foreach_strategy`: a per-tensor op schema and a mesh expansion, ~0.7 ms each): 1.9 s for the 32-layer
model's foreach ops over 356 parameters, counted in its compile time (FSDP2's parameters pay 2.6-2.9 s), although
each tensor's result depends only on its own layouts and strategies, which repeat for every block. `install` also
wraps both so that a foreach op computes one tensor of each distinct kind and hands every tensor its kind's result:
output layouts by (each list argument's layout and scalar type at that tensor), strategies by (its strategies in
each list argument, its output layout) (`_metas_deduplicated`, `_strategies_deduplicated`).
"""
from __future__ import annotations

import threading

_lock = threading.Lock()
_installed = False


def install() -> None:
    """Wrap the scan, the expansion and the layouts (once per process); what a torch lacks (2.11 has no scan) is
    left as it is."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        try:
            from torch.distributed.tensor import _sharding_prop
            from torch.distributed.tensor.placement_types import _StridedShard
        except ImportError:
            return
        scan = getattr(_sharding_prop, "_propagate_use_strided_shard_flag", None)
        if scan is not None:
            _sharding_prop._propagate_use_strided_shard_flag = _scanned_once(scan, _StridedShard)
        expand = getattr(_sharding_prop, "_expand_single_dim_strategy_to_mesh", None)
        if expand is not None:
            _sharding_prop._expand_single_dim_strategy_to_mesh = _strategies_deduplicated(expand)
        propagator = _sharding_prop.ShardingPropagator
        metas = getattr(propagator, "_propagate_tensor_meta_non_cached", None)
        if metas is not None:
            propagator._propagate_tensor_meta_non_cached = _metas_deduplicated(metas)


def _scanned_once(original, strided_shard: type):
    last = threading.local()  # (op schema, whether an argument has a _StridedShard placement) per thread

    def propagate_use_strided_shard_flag(op_strategy, op_schema) -> None:
        seen = getattr(last, "seen", None)
        if seen is None or seen[0] is not op_schema:
            seen = last.seen = (op_schema, any(isinstance(p, strided_shard)
                                               for spec in op_schema.args_spec for p in spec.placements))
        if seen[1]:
            original(op_strategy, op_schema)

    propagate_use_strided_shard_flag.__wrapped__ = original
    return propagate_use_strided_shard_flag


def _strategies_deduplicated(original):
    from torch.distributed.tensor._op_schema import OpSchema, TupleStrategy

    def expand_single_dim_strategy_to_mesh(mesh, op_schema, strategy_info, output_tensor_meta):
        expanded = original(mesh, op_schema, strategy_info, output_tensor_meta)
        if getattr(expanded, "__name__", "") != "expanded_foreach_strategy":
            return expanded
        groups = _groups(op_schema, output_tensor_meta, TupleStrategy)
        if groups is None:
            return expanded
        firsts, group_of = groups
        small = OpSchema(op_schema.op, tuple(TupleStrategy([a.children[i] for i in firsts])
                                             if isinstance(a, TupleStrategy) else a for a in op_schema.args_schema),
                         op_schema.kwargs_schema)
        metas = ([output_tensor_meta[i] for i in firsts] if isinstance(output_tensor_meta, (list, tuple))
                 else output_tensor_meta)
        expanded_small = original(mesh, small, strategy_info, metas)

        def expanded_foreach_strategy(op, args_schema, kwargs_schema):
            children = expanded_small(op, small.args_meta, small.kwargs_meta).children
            return TupleStrategy(children=[children[g] for g in group_of])
        return expanded_foreach_strategy

    expand_single_dim_strategy_to_mesh.__wrapped__ = original
    return expand_single_dim_strategy_to_mesh


def _groups(op_schema, output_tensor_meta, tuple_strategy: type):
    """(the first tensor of each group, each tensor's group) of a foreach op's tensors grouped by what their strategy
    depends on: their strategy in each list argument and their output layout. None where nothing repeats, or the
    op has a form this does not know (a list in its keyword arguments, unhashable strategies)."""
    lists = [a for a in op_schema.args_schema if isinstance(a, tuple_strategy)]
    if not lists or any(isinstance(v, tuple_strategy) for v in op_schema.kwargs_schema.values()):
        return None
    n = len(lists[0].children)
    metas = output_tensor_meta if isinstance(output_tensor_meta, (list, tuple)) else None
    if any(len(a.children) != n for a in lists) or (metas is not None and len(metas) != n):
        return None
    return _grouped((tuple(tuple((s.output_specs, s.input_specs) for s in a.children[i].strategies) for a in lists),
                     metas[i] if metas is not None else None) for i in range(n))


class _Unkeyed(Exception):
    """A tensor whose result this cannot key (a plain tensor in a list, a symbolic scalar): left to torch."""


def _grouped(keys) -> tuple[list[int], list[int]] | None:
    """(the first index of each distinct key, each index's group) of `keys`; None where none repeats or one cannot
    be made or hashed (symbolic sizes, a spec without its layout, `_Unkeyed`)."""
    firsts: list[int] = []
    index: dict = {}
    group_of: list[int] = []
    try:
        for i, key in enumerate(keys):
            g = index.setdefault(key, len(firsts))
            if g == len(firsts):
                firsts.append(i)
            group_of.append(g)
    except (TypeError, AttributeError, _Unkeyed):
        return None
    return (firsts, group_of) if len(firsts) < len(group_of) else None


def _metas_deduplicated(original):
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema

    def propagate_tensor_meta_non_cached(self, op_schema):
        groups = _meta_groups(op_schema, DTensorSpec) if op_schema.op.name().startswith("aten::_foreach_") else None
        if groups is None:
            return original(self, op_schema)
        firsts, group_of, n = groups
        small = OpSchema(op_schema.op, tuple(type(a)(a[i] for i in firsts) if _is_list(a, n) else a
                                             for a in op_schema.args_schema), op_schema.kwargs_schema)
        out = original(self, small)
        if out is None:  # an in-place op
            return None
        if not isinstance(out, (list, tuple)) or len(out) != len(firsts):
            return original(self, op_schema)
        return type(out)(out[g] for g in group_of)

    propagate_tensor_meta_non_cached.__wrapped__ = original
    return propagate_tensor_meta_non_cached


def _is_list(arg, n: int) -> bool:
    return isinstance(arg, (list, tuple)) and len(arg) == n


def _meta_groups(op_schema, spec_type: type):
    """(the first tensor of each kind, each tensor's kind, how many) of a foreach op's tensors by what their output
    layouts depend on: at their index, each list argument's global layout (a DTensor) or type (a scalar). None
    where nothing repeats or the op's form is not one this knows."""
    lists = [a for a in op_schema.args_schema if isinstance(a, (list, tuple)) and a]
    if not lists or not any(isinstance(x, spec_type) for x in lists[0]):
        return None
    n = len(lists[0])
    if any(len(a) != n for a in lists) or any(isinstance(v, (list, tuple)) for v in op_schema.kwargs_schema.values()):
        return None
    groups = _grouped(tuple(_layout_key(a[i], spec_type) for a in lists) for i in range(n))
    return None if groups is None else (*groups, n)


def _layout_key(x, spec_type: type):
    if isinstance(x, spec_type):
        meta = x.tensor_meta
        return tuple(meta.shape), tuple(meta.stride), meta.dtype
    if x is None or isinstance(x, (bool, int, float, complex)):
        return type(x)
    raise _Unkeyed
