"""chunk_loss: a language model's head and cross-entropy loss become one chunked op (`zcompile::linear_cross_entropy`).

Finds, in the dynamo graph, `cross_entropy(z.view(-1, V), target)` where z is `linear(x, weight[, bias])`, maybe
softcapped (`tanh(z / cap) * cap`, Gemma's final logits) and cast to fp32 (`.float()`, Hugging Face's loss), and
replaces the chain with the op: the forward and the backward each hold one chunk of rows' logits (`chunked_loss.
chunk_bytes` of fp32) instead of the [N, V] logits, their fp32 copy, log-softmax and gradient. When the graph uses
the logits elsewhere (a model returning them), those uses read the op's logits output, made once in the compute
dtype. The loss is the same as the unchunked one to rounding. A chain with anything else between the linear and the
loss (class weights, 'none' reduction, probabilities as targets, a use of the fp32 or flattened logits) is left as
it is, with the reason in the dumps' notes.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from zcompile.kernels import linear_cross_entropy as lce

_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)
_CROSS_ENTROPY = (torch.nn.functional.cross_entropy,)
_FLATTEN = ("view", "reshape", "flatten")
_CE_DEFAULTS = {"weight": None, "size_average": None, "ignore_index": -100, "reduce": None, "reduction": "mean",
                "label_smoothing": 0.0}
_CE_ARGS = ("input", "target", *_CE_DEFAULTS)


def _val(node):
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _is_method(node: fx.Node, names) -> bool:
    return node.op == "call_method" and node.target in names


def _upcast(node: fx.Node) -> bool:
    """`.float()` or `.to(torch.float32)`."""
    if _is_method(node, ("float",)):
        return True
    if not _is_method(node, ("to",)):
        return False
    dtype = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
    return dtype is torch.float32 and len(node.args) <= 2 and set(node.kwargs) <= {"dtype"}


def _scalar(node: fx.Node, fn, other: fx.Node) -> float | None:
    """The constant of `other fn c` (div or mul by a Python number), else None."""
    if node.op != "call_function" or node.target not in fn or len(node.args) != 2 or node.args[0] is not other:
        return None
    c = node.args[1]
    return float(c) if isinstance(c, (int, float)) and not isinstance(c, bool) else None


def _softcap(mul: fx.Node):
    """(the pre-cap logits, cap) when `mul` is `tanh(z / cap) * cap`, else None."""
    if mul.op != "call_function" or mul.target not in (operator.mul, torch.mul) or len(mul.args) != 2:
        return None
    tanh = mul.args[0]
    if not isinstance(tanh, fx.Node) or tanh.op != "call_function" or tanh.target not in (torch.tanh,) \
            or len(tanh.users) != 1:
        return None
    div = tanh.args[0]
    if not isinstance(div, fx.Node) or len(div.users) != 1:
        return None
    z = div.args[0] if div.args else None
    cap = _scalar(div, (operator.truediv, torch.div), z)
    return (z, cap) if cap and _scalar(mul, (operator.mul, torch.mul), tanh) == cap else None


def _match(ce: fx.Node):
    """(dict of the op's arguments and the nodes it replaces, None) or (None, why it is left)."""
    args = dict(zip(_CE_ARGS, ce.args), **ce.kwargs)
    extra = {k: v for k, v in args.items() if k in _CE_DEFAULTS and k not in ("ignore_index", "reduction",
                                                                              "label_smoothing")
             and v != _CE_DEFAULTS[k]}
    if extra:
        return None, f"cross_entropy with {sorted(extra)}"
    reduction = args.get("reduction", "mean")
    if reduction not in ("mean", "sum"):
        return None, f"reduction={reduction!r}"
    ignore_index, smoothing = args.get("ignore_index", -100), args.get("label_smoothing", 0.0)
    if not isinstance(ignore_index, int) or not isinstance(smoothing, (int, float)):
        return None, "ignore_index or label_smoothing is not a constant"
    node, target = args["input"], args["target"]
    val, tval = _val(node), _val(target)
    if val is None or val.dim() != 2 or tval is None or tval.dim() != 1 or tval.is_floating_point():
        return None, "the loss's input is not [tokens, classes] with class-index targets"
    chain = []  # the nodes between the linear and the loss, each read only by the next
    if _is_method(node, _FLATTEN):
        chain.append(node)
        node = node.args[0]
    upcast = isinstance(node, fx.Node) and _upcast(node)
    if upcast:
        chain.append(node)
        node = node.args[0]
    if any(len(n.users) != 1 for n in chain):
        return None, "the fp32 or flattened logits are used beside the loss"
    logits, cap = node, 0.0
    capped = _softcap(node) if isinstance(node, fx.Node) else None
    if capped is not None:
        node, cap = capped
        if len(node.users) != 1:
            return None, "the logits before softcapping are used beside the loss"
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _LINEAR:
        return None, "the loss's logits do not come from a linear layer"
    x, weight = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    zval = _val(logits)
    if _val(x) is None or zval is None or zval.dim() < 2 or not _flattens(val, zval):
        return None, "the loss's rows and classes are not the logits' flattened leading dimensions and last one"
    return {"x": x, "weight": weight, "bias": bias, "target": target, "ignore_index": ignore_index,
            "reduction": reduction, "label_smoothing": float(smoothing), "softcap": cap, "upcast": upcast,
            "logits": logits, "next": chain[-1] if chain else ce, "dtype": zval.dtype, "vocab": zval.shape[-1]}, None


def _flattens(val, zval) -> bool:
    """[N, V] is the [..., V] logits flattened (token counts may be symbolic)."""
    try:
        return bool(val.shape[-1] == zval.shape[-1] and val.shape[0] == math.prod(zval.shape[:-1]))
    except Exception:  # a symbolic comparison it cannot decide
        return False


def run(gm: fx.GraphModule, pctx) -> fx.GraphModule:
    section = pctx.cfg.chunked_loss
    if not section.enabled:
        return gm
    graph = gm.graph
    notes = gm.meta.setdefault("zc_notes", [])
    placeholders = {n: i for i, n in enumerate(graph.find_nodes(op="placeholder"))}
    for ce in [n for n in graph.nodes if n.op == "call_function" and n.target in _CROSS_ENTROPY]:
        m, why = _match(ce)
        if m is not None and _tiled(m["weight"], placeholders, pctx):
            m, why = None, "its weight is tiled (tile_linears gathers it a tile at a time)"
        if m is None:
            notes.append(f"chunk_loss: {ce.name} left unchunked: {why}")
            continue
        logits = m["logits"]
        returned = [u for u in logits.users if u is not m["next"]]
        inputs = [a for a in (m["x"], m["weight"], m["bias"], m["target"]) if isinstance(a, fx.Node)]
        at = max(inputs)  # (nodes compare by their place in the graph)
        if any(not at < u for u in returned):
            notes.append(f"chunk_loss: {ce.name} left unchunked: the logits are used before its targets exist")
            continue
        rows = lce.chunk_rows(section.chunk_bytes, m["vocab"])
        with graph.inserting_before(at.next):
            op = graph.call_function(torch.ops.zcompile.linear_cross_entropy.default, (
                m["x"], m["weight"], m["bias"], m["target"], m["ignore_index"], m["reduction"],
                m["label_smoothing"], m["softcap"], rows, bool(returned), m["upcast"],
                pctx.cfg.backend == "inductor", _keep_logits(pctx.cfg)))
            loss = graph.call_function(operator.getitem, (op, 0))
            new_logits = graph.call_function(operator.getitem, (op, 1)) if returned else None
        op.meta["zc_note"] = (f"chunk_loss: {m['vocab']} classes, {rows} rows per chunk"
                              + (f", softcap {m['softcap']}" if m["softcap"] else "")
                              + (", returns the logits" if returned else ""))
        ce.replace_all_uses_with(loss)
        for u in returned:
            u.replace_input_with(logits, new_logits)
        _erase_dead(graph, ce)
        notes.append(op.meta["zc_note"])
    return gm


def _keep_logits(cfg) -> bool:
    """The backward reads the returned logits (kept alive for it) unless `recompute_logits`, or under a
    memory_budget: whether the caller holds them through the backward is unknown to the plan, and a plan counting
    them kept is above the measured peak of one that drops them (by the logits' size)."""
    return not (cfg.chunked_loss.recompute_logits or cfg.memory_budget is not None)


def _tiled(weight, placeholders: dict, pctx) -> bool:
    """The weight is one tile_linears will tile (stage 3 `tiling`: stored by whole rows)."""
    if isinstance(weight, fx.Node) and _is_method(weight, ("to",)):
        weight = weight.args[0]
    zp = pctx.params.get(placeholders.get(weight))
    return bool(pctx.cfg.tiling is not None and zp is not None and zp.row_multiple)


def _erase_dead(graph: fx.Graph, node: fx.Node) -> None:
    """Erase `node` and whatever fed only it (the replaced chain, up to the linear)."""
    todo = [node]
    while todo:
        n = todo.pop()
        if n.users or n.op in ("placeholder", "output") or n.is_impure():
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        todo.extend(inputs)
