"""The graph dynamo hands the backend, before AOTAutograd: the modules its parameters come from are sharded (their
parameters become DTensors and dynamo traces the frame again), a nested compile region of the user's is refused, and
its non-parameter inputs are named for messages."""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from zcompile import config as zconfig
from zcompile.compiler.tracing import before_trace, trace_blocks_once
from zcompile.errors import ZCompileError, ZeroError
from zcompile.runtime import dtensor_params, shard_store
from zcompile.runtime.dist_context import DistContext


def refuse_nested_regions(gm: fx.GraphModule) -> None:
    """A region the user marked with torch.compiler.nested_compile_region reaches the backend as one opaque call
    (invoke_subgraph): its parameter uses are hidden from the passes, which would leave them unsharded."""
    found = trace_blocks_once.calls(gm)
    if not found:
        return
    where = (found[0].meta.get("stack_trace") or "").strip().splitlines()[-2:]
    raise ZCompileError(
        "the model calls a torch.compiler.nested_compile_region (" + (" ".join(w.strip() for w in where)
                                                                       or found[0].name)
        + "): zcompile must see the parameter uses inside it to shard them. Remove the decorator: zcompile "
        "compiles repeated blocks once by itself (regional_compile, docs/compile-time.md)")


class ParametersSharded(torch._dynamo.exc.RestartAnalysis, ZeroError):
    """Raised by the first compile that meets plain parameters: they are now DTensors, so dynamo traces again."""

    def __init__(self, count: int):
        self.restart_reason = f"zcompile replaced {count} parameters by DTensor shards"
        ZeroError.__init__(self, self.restart_reason)


def shard_modules_of(gm: fx.GraphModule, example_inputs, cfg: zconfig.Config, ctx: DistContext) -> None:
    """Shard every parameter of the modules this graph reads parameters from, replacing them by DTensors in the
    modules (dtensor_params), then restart dynamo's analysis of the frame so it traces the DTensors. Parameters that
    stay plain (0-d, tiled, NVMe) are registered when their graph compiles, as stand-ins."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    plain = [(ph, x) for ph, x in zip(phs, example_inputs)
             if isinstance(x, nn.Parameter) and not isinstance(x, dtensor_params.DTensor)]
    unowned = [ph for ph, x in zip(phs, example_inputs)  # e.g. of a deep copy of a model zcompile sharded
               if isinstance(x, dtensor_params.DTensor) and isinstance(x, nn.Parameter)
               and shard_store.owner(x) is None]
    if not plain and not unowned:
        return
    roots = {id(root): root for root in map(_root_module, unowned) if root is not None}
    for ph, x in plain:
        zp = shard_store.register_for(cfg, ctx, x)
        if zp.token is not None or not (dtensor_params.eligible(zp) or dtensor_params.tokened(zp)):
            continue
        root = _root_module(ph)
        if root is None:
            raise ZCompileError(f"cannot find the module that holds parameter {ph.name} (dynamo source "
                                f"{_source_name(ph)}): compile the model (torch.compile(model, ...)) or a function "
                                "that calls it")
        roots[id(root)] = root
    count = sum(dtensor_params.shard_model(root, cfg, ctx) for root in roots.values())
    if count:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
        if tx is not None and hasattr(tx, "speculation_log"):
            tx.speculation_log.clear()  # the new trace takes other paths (the parameters' properties)
        if cfg.stage == zconfig.Stage.DDP:
            before_trace.restarted_as_zero()
        raise ParametersSharded(count)


def _source_name(ph: fx.Node) -> str:
    grapharg = ph.meta.get("grapharg")
    if grapharg is None:
        return "?"
    name = grapharg.source.name
    return name() if callable(name) else name


def _root_module(ph: fx.Node) -> nn.Module | None:
    """The outermost module on the dynamo source path of a parameter placeholder (L['self'], G['model'], ...)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator
    grapharg = ph.meta.get("grapharg")
    tx = InstructionTranslator.current_tx()
    if grapharg is None or tx is None:
        return None
    source, chain = grapharg.source, []
    while source is not None:
        chain.append(source)
        source = getattr(source, "base", None)
    scope = {"L": tx.f_locals, "G": tx.f_globals}
    for src in reversed(chain):  # outermost first
        name = src.name() if callable(src.name) else src.name
        try:
            obj = eval(name, {}, scope)  # a dynamo source name is an expression over L and G
        except Exception:
            continue
        if isinstance(obj, nn.Module):
            return obj
    return None


def inputs_text(example_inputs, is_param: list[bool]) -> str:
    """The non-parameter inputs, briefly: 'inputs 2x16 int64, 2x16 int64'."""
    shown = ["x".join(map(str, x.shape)) + " " + str(x.dtype).removeprefix("torch.")
             for x, param in zip(example_inputs, is_param) if isinstance(x, torch.Tensor) and not param]
    return "inputs " + (", ".join(shown[:6]) + (", ..." if len(shown) > 6 else "") if shown else "none")
