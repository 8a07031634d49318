"""fake_values.refresh: the fake value of every node, rebuilt for a repeated block's nodes from the first block's
layouts (RepeatedLayoutProp), is what FakeTensorProp gives, storage sharing included."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.multiprocessing.reductions import StorageWeakRef

from zcompile.compiler.graph import fake_values


def _block(x, w):
    h = x @ w
    a, b = h.split(4, dim=1)                  # two views of h
    c = a.transpose(0, 1).contiguous()        # a view, then a new tensor
    d = b.clone()
    d.add_(1.0)                               # in place: its output is d
    e = h.view(torch.int32)                   # a view as another dtype
    var, mean = torch.var_mean(h, dim=0)      # two new tensors
    top = torch.max(h, dim=1)                 # a named tuple
    g = h.new_empty(3)
    g.resize_(4, 8)                           # changes g's size in place
    z = d.new_zeros(2, 5)[:, 1:]              # a view with an offset
    z.t_()                                    # changes z's strides in place
    return (x + c.sum() + d.sum() + e.float().sum() + var.sum() + mean.sum() + top.values.sum()
            + g.sum() + z.sum())


def _model(x, w):
    for _ in range(4):
        x = _block(x, w)
    return x


def _describe(gm: fx.GraphModule) -> list:
    """Each node's values (layout, dtype, storage size, view or not) and which earlier node's storage each shares."""
    first: dict = {}
    out = []
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        vals = v if isinstance(v, (tuple, list)) else [v]
        row = []
        for t in vals:
            if not isinstance(t, torch.Tensor):
                row.append(repr(t))
                continue
            ref = StorageWeakRef(t.untyped_storage())
            first.setdefault(ref, n.name)
            row.append((tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad,
                        t.untyped_storage().nbytes(), t._is_view(), first[ref]))
        out.append((n.name, type(v).__name__, row))
    return out


def _traced(tracing_mode="fake"):
    return make_fx(_model, tracing_mode=tracing_mode)(torch.randn(8, 8), torch.randn(8, 8))


def _symbolic(n: fx.Node) -> bool:
    v = n.meta.get("val")
    return any(isinstance(d, torch.SymInt) for t in (v if isinstance(v, (tuple, list)) else [v])
               if isinstance(t, torch.Tensor) for d in (*t.shape, *t.stride()))


@pytest.mark.parametrize("tracing_mode", ["fake", "symbolic"])
def test_repeated_blocks_get_the_values_fake_tensor_prop_gives_them(tracing_mode):
    gm = _traced(tracing_mode)
    inputs = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    mode = torch._guards.detect_fake_mode(inputs)
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    expected = _describe(gm)
    prop = fake_values.RepeatedLayoutProp(gm, mode)
    prop.propagate_dont_convert_inputs(*inputs)
    assert _describe(gm) == expected
    ops = {n.target for n in prop.rebuilt}
    if tracing_mode == "symbolic":  # a node whose sizes are symbols runs through FakeTensorProp
        assert prop.rebuilt and not any(map(_symbolic, prop.rebuilt))
        assert any(map(_symbolic, gm.graph.nodes))
        return
    per_block = len([n for n in gm.graph.nodes if n.op == "call_function"]) // 4
    assert len(prop.rebuilt) > 2 * per_block  # blocks 2-4 (block 1 reads w and x as given, as block 2 does not)
    for op in (torch.ops.aten.mm.default, torch.ops.aten.split.Tensor, torch.ops.aten.add_.Tensor,
               torch.ops.aten.var_mean.correction, torch.ops.aten.max.dim, torch.ops.aten.slice.Tensor):
        assert op in ops, op
    # written metadata, and a view as another dtype: run each time
    assert not ops & {torch.ops.aten.resize_.default, torch.ops.aten.t_.default, torch.ops.aten.view.dtype}


def _adds_into(x):
    c1 = x.new_zeros(8, 8)
    torch.add(c1.view(8, 8), x, out=c1)  # its first input is its output's storage
    c2, a2 = x.new_zeros(8, 8), x.new_zeros(8, 8)
    torch.add(a2, x, out=c2)  # the same layouts, three storages: the output is c2's, not a2's
    return c1 + c2


def test_an_output_aliases_the_input_it_aliased_when_the_inputs_share_storage_differently():
    gm = make_fx(_adds_into, tracing_mode="fake")(torch.randn(8, 8))
    adds = [n for n in gm.graph.nodes if n.target is torch.ops.aten.add.out]
    assert len(adds) == 2
    inputs = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    mode = torch._guards.detect_fake_mode(inputs)
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    expected = _describe(gm)
    fake_values.RepeatedLayoutProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    assert _describe(gm) == expected
    out, c2 = adds[1].meta["val"], adds[1].kwargs["out"].meta["val"]
    assert out.untyped_storage()._cdata == c2.untyped_storage()._cdata


def test_refresh_sets_every_nodes_value_after_a_rewrite():
    gm = _traced()
    mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    with gm.graph.inserting_after(mm):
        doubled = gm.graph.call_function(torch.ops.aten.cat.default, ([mm, mm], 1))
    mm.replace_all_uses_with(doubled, delete_user_cb=lambda u: u is not doubled)
    with gm.graph.inserting_after(doubled):
        half = gm.graph.call_function(torch.ops.aten.slice.Tensor, (doubled, 1, 0, 8))
    doubled.replace_all_uses_with(half, delete_user_cb=lambda u: u is not half)
    gm.recompile()
    fake_values.refresh(gm)
    assert tuple(doubled.meta["val"].shape) == (8, 16) and tuple(half.meta["val"].shape) == (8, 8)
    assert half.meta["val"].untyped_storage()._cdata == doubled.meta["val"].untyped_storage()._cdata
    assert all("val" in n.meta for n in gm.graph.nodes if n.op != "output")
