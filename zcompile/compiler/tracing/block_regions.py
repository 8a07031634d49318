"""Blocks traced once stay regions through AOTAutograd (`keep_block_regions`): AOTAutograd traces and partitions
each distinct block's forward+backward once (invoke_subgraph's own autograd support) instead of every block's
inlined copy. The backend inlines the partitioned forward and backward (trace_blocks_once.inline) before the split
passes, which see the graphs they always saw.

What zcompile adds to torch's machinery:
- each region is partitioned by the backend's `partition_region` (`mark`), which runs zcompile's joint passes
  (tag_param_recompute) with the region's parameter operands: a plain min-cut saves the transposes of gathered
  weights, which keeps every gathered weight alive from the forward to the backward under ZeRO-3;
- after inlining, the forward saves a region's parameter operand as the primal itself, under the region output's
  name: `inline_partitioned` gives the backward's placeholder the primal's name, by which the split passes find
  the parameters the backward gathers again;
- the region HOP's autograd key re-traces the body at every call to refuse input mutation (~6 s of a 32-layer
  GPT's joint trace): `why_not_bodies` checks each distinct body once, `mutation_check_once` skips the per-call
  check during zcompile's own AOTAutograd call;
- where a region cannot stay one (`why_not`, `why_not_bodies`), the backend inlines the blocks first, as without
  the key.
"""
from __future__ import annotations

import collections
import contextlib

import torch
import torch.fx as fx

from zcompile.compiler.graph import fake_values
from zcompile.compiler.tracing import trace_blocks_once
from zcompile.compiler.tracing.trace_blocks_once import body_of, calls
from zcompile.errors import ZCompileError

_ISG = torch.ops.higher_order.invoke_subgraph


def operands(call: fx.Node) -> tuple:
    return call.args[2:]


# keep_block_regions 'auto': kept where a block repeats at least this often. Each distinct block's joint trace and
# partition is cheaper kept, but the inlined forward is propagated once more and the partitions differ a little
# (bench/results/compile-time-log.md: at 8 layers kept compiled 1.1-2.0 s faster cold in 3 of 3 runs on
# 2026-11-26 evening, at 4 the same; the suite's 2-4 layer models stay inlined).
AUTO_MIN_CALLS = 8


def why_not(gm: fx.GraphModule, cfg) -> str | None:
    """Why this dynamo graph's regions cannot stay regions (they are inlined first), or None. tile_linears (a
    dynamo-phase pass) rewrites parameter uses, which sit inside the bodies; mixed_precision casts a region's
    parameter operands inside its body."""
    if cfg.keep_block_regions is False:
        return "off"
    found = calls(gm)
    if not found:
        return "no regions"
    if cfg.keep_block_regions == "auto":
        most = max(collections.Counter(id(body_of(gm, c)) for c in found).values())
        if most < AUTO_MIN_CALLS:
            return f"auto: a block repeats {most} times, fewer than {AUTO_MIN_CALLS}"
    if cfg.tiling is not None:
        return "tile_linears rewrites parameter uses"
    if any(calls(body_of(gm, c)) for c in found):
        return "a region inside a region"  # AOTAutograd pairs only top-level regions' forward and backward
    return None


def parameter_operands(gm: fx.GraphModule, params: dict) -> dict[int, dict] | None:
    """{id(body): {operand index: ShardedParam}} for the regions of `gm` (after unwrap_graph), whose placeholder
    k carries `params[k]`; None when two calls of one body pass parameters at different operands."""
    phs = {n: k for k, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    out: dict[int, dict] = {}
    for call in calls(gm):
        mine = {i: params[phs[a]] for i, a in enumerate(operands(call)) if a in phs and phs[a] in params}
        seen = out.setdefault(id(body_of(gm, call)), mine)
        if seen.keys() != mine.keys():
            return None
    return out


def why_not_bodies(gm: fx.GraphModule, example_inputs: list) -> str | None:
    """Why a region's body cannot stay a region, or None; each distinct body is traced once to aten ops (as the
    HOP's own schema check does). A body that writes its operands: the HOP refuses training through it. Random
    ops (dropout): inductor seeds them in its joint passes, which a region's partition would run without the
    seeds zcompile threads through the outer graph (job.GraphCompile.joint_graph_passes)."""
    from torch._guards import detect_fake_mode
    from torch._higher_order_ops.utils import check_input_alias_and_mutation_return_outputs, materialize_as_graph
    # dynamo's fake values (symbolic sizes under dynamic shapes); example_inputs only where a node has none
    phs = {n: x for n, x in zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs)}
    fake_mode = detect_fake_mode()  # the backend's (torch 2.13 gives it a copy of dynamo's, same shape env)
    done: set = set()
    for call in calls(gm):
        body = body_of(gm, call)
        if id(body) in done:
            continue
        done.add(id(body))
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            # one fake mode for all: dynamo's values and the parameters unwrap_graph made in the backend's
            args = tuple(_as_traced(_in_mode(_example(a, phs), fake_mode), p)
                         for a, p in zip(operands(call), placeholders(body)))
            traced = materialize_as_graph(body, args)
        if check_input_alias_and_mutation_return_outputs(traced)[3]:
            return "a block writes its inputs"
        if any(map(_draws_random, traced.graph.nodes)):
            return "random ops (dropout) in a block"
    return None


def _in_mode(x, fake_mode):
    """`x` as a fake tensor of `fake_mode` (a fake of another mode: a new one of the same layout)."""
    from torch._subclasses.fake_tensor import FakeTensor
    if fake_mode is None or not isinstance(x, FakeTensor) or x.fake_mode is fake_mode:
        return x
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device, requires_grad=x.requires_grad)


def placeholders(body: fx.GraphModule) -> list[fx.Node]:
    return [n for n in body.graph.nodes if n.op == "placeholder"]


def _as_traced(x, ph: fx.Node):
    """`x` in the dtype dynamo traced the body with: a parameter's token is in the compute dtype, which
    mixed_precision's cast inside the body gives it (it runs after this check)."""
    traced = ph.meta.get("example_value")
    if isinstance(x, torch.Tensor) and isinstance(traced, torch.Tensor) and x.dtype != traced.dtype \
            and x.is_floating_point() and traced.is_floating_point():
        return x.to(traced.dtype)
    return x


def _example(arg, phs: dict):
    if not isinstance(arg, fx.Node):
        return arg
    return arg.meta["example_value"] if "example_value" in arg.meta else phs[arg]


def _draws_random(node: fx.Node) -> bool:
    """A seeded random op; attention with dropout_p 0 (Hugging Face models in training mode) draws nothing."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    for k, arg in enumerate(op._schema.arguments):
        if arg.name == "dropout_p":
            p = node.args[k] if k < len(node.args) else node.kwargs.get("dropout_p", arg.default_value)
            return p != 0
    return True


def mark(gm: fx.GraphModule, params: dict[int, dict], partition) -> None:
    """Each call's region is partitioned by `partition(its parameter operands, joint, joint_inputs, **kwargs)`
    (AOTAutograd reads the partitioner from the forward call's meta["custom"]); `params`: parameter_operands."""
    from torch._higher_order_ops.invoke_subgraph import NestedCompileRegionOptions
    options = {}
    for call in calls(gm):
        body = id(body_of(gm, call))
        if body not in options:
            options[body] = NestedCompileRegionOptions(partitioner=_Partitioner(partition, params[body]))
        call.meta.setdefault("custom", {})["nested_region_config"] = options[body]


class _Partitioner:
    def __init__(self, partition, params: dict):
        self.partition, self.params = partition, params

    def __deepcopy__(self, memo):  # AOTAutograd copies the call's meta["custom"] to the backward's nodes
        return self

    def __call__(self, joint: fx.GraphModule, joint_inputs, **kwargs):
        return self.partition(self.params, joint, joint_inputs, **kwargs)


@contextlib.contextmanager
def mutation_check_once():
    """Within zcompile's AOTAutograd call (the bodies were checked by `why_not_bodies`): the HOP's autograd key
    skips its per-call schema, which re-traces the body."""
    old = _ISG._supports_training_input_mutation
    _ISG._supports_training_input_mutation = True
    try:
        yield
    finally:
        _ISG._supports_training_input_mutation = old


def inline_partitioned(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> None:
    """Inline the region calls of a partitioned forward and backward, then give each saved tensor one name in both
    graphs again, as AOTAutograd's partition does (the split passes pair a saved forward value with the backward's
    input by name: PassContext.param_placeholders, offload_activations). A region's forward hands its parameter
    operands on to its backward, so the inlined forward saves the primal itself: the backward's input takes the
    primal's name. Any other saved value takes a name free in both graphs. A second save of one value is left
    unused. The graphs' Python code is not regenerated here: the split passes, which come next, recompile both."""
    names = [v.name if isinstance(v, fx.Node) else None for v in _saved(fw, num_fwd_outputs)]
    trace_blocks_once.inline(fw, recompile=False)  # the split passes recompile both at their end
    trace_blocks_once.inline(bw, recompile=False)
    # torch's fake invoke_subgraph returns the same values for every call of a body with the same inputs' metadata:
    # block 0's and block 1's saved activations would share one fake storage, which liveness counts once
    fake_values.refresh(fw)
    inputs = {n.name: n for n in bw.graph.find_nodes(op="placeholder")}
    pairs = [(inputs[name], value) for name, value in zip(names, _saved(fw, num_fwd_outputs))
             if name in inputs and isinstance(value, fx.Node)]
    for ph, value in pairs:
        ph.meta["val"] = value.meta["val"]
    named = {value: ph for ph, value in pairs if ph.name == value.name}
    for ph, value in pairs:
        if ph.name == value.name:
            continue
        if value in named:
            ph.replace_all_uses_with(named[value])
            continue
        name = value.name if value.op == "placeholder" else free_name(value, bw.graph)
        value._rename(name)
        with bw.graph.inserting_before(ph):
            new = bw.graph.placeholder(name)
        if new.name != name:
            raise ZCompileError(f"backward graph: cannot name the saved value {name} ({new.name})")
        new.meta = dict(ph.meta)
        ph.replace_all_uses_with(new)
        bw.graph.erase_node(ph)
        named[value] = new
    for gm in (fw, bw):
        gm.graph.lint()


def free_name(value: fx.Node, bw: fx.Graph) -> str:
    """`value`'s name if the backward never used it, else a new one neither graph used (fx never frees a name)."""
    fw_used, bw_used = value.graph._graph_namespace._used_names, bw._graph_namespace._used_names
    if value.name not in bw_used:
        return value.name
    k = 0
    while (name := f"{value.name}_saved" + (f"_{k}" if k else "")) in fw_used or name in bw_used:
        k += 1
    return name


def _saved(fw: fx.GraphModule, num_fwd_outputs: int) -> list:
    return list(fw.graph.output_node().args[0][num_fwd_outputs:])
