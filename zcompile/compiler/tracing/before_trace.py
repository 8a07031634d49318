"""What zcompile does when dynamo starts compiling a frame for the `zero` backend, before it traces.

- **Shard the frame's modules.** Otherwise dynamo's first trace of a model runs over its plain parameters; the
  backend then shards them and restarts dynamo (dynamo_graph.ParametersSharded), throwing that whole trace away (2.2 s
  of a 32-layer compile, bench/results/compile-time-log.md). The modules the frame receives (the module of
  torch.compile(model), module arguments of a compiled function, a deep copy of a sharded model) are sharded as
  the backend would shard them after the trace (dtensor_params.shard_model), so the first trace reads the
  DTensors.
- **Trace parameters as tokens**: the parameter properties return stand-in tokens instead of the DTensors while a
  zero-backend compile is in progress (dtensor_params, [Note: tokens]).
- **Pause the cyclic garbage collector** for the whole compile of the frame, trace included (the backend's
  collector_paused covers only its own call; why: backend.collector_paused).
- **Keep transformers' once-warnings out of the graph**: `logger.warning_once` breaks dynamo's graph, and Hugging
  Face's `loss_function` calls it on every forward of a model whose class names no loss type (GPT2LMHeadModel):
  the loss then runs as a second graph, so the head and the loss are not chunked together (chunk_loss). While a
  zero-backend frame traces, dynamo ignores that method (its `ignore_logger_methods`), as it ignores the logger
  methods a user lists there; the warning is not printed. Other backends' traces are left as they were.
- **Say what to do when a traced-once block holds a graph break**: dynamo refuses to split the nested compile
  region (UncapturedHigherOrderOpError); the end callback adds a note naming zcompile's way out.
- **Refuse a compile under a forward dynamo skipped**: a frame compiled inside the module given to
  torch.compile whose own forward never started a zero-backend compile (its code skipped) and that nothing
  sharded would have that forward run eagerly on plain parameters; the error names zcompile.shard_parameters.

torch.compile calls a backend only after a trace, so this uses dynamo's compile start and end callbacks
(torch._dynamo.callback_handler) and finds the frame and its backend in dynamo's `_compile` frame up the stack
(the zero backend by its `zcompile_backend` mark). Sharding here saves the restart, and a frame dynamo then skips
(a graph break it cannot resume from) runs eagerly on the DTensor parameters, as with FSDP2. Whatever it cannot
see leaves the parameters plain for the backend's restart path (another torch's frame layout, parameters read
from a global, a config that does not load: the backend reports it, torch 2.11, whose dynamo fails on DTensor
parameters in a nested compile region before the backend can refuse one, and the first compile after
torch._dynamo.reset(), which drops every callback; the backend registers them again).
"""
from __future__ import annotations

import gc
import logging
import sys
import types
import weakref

import torch
import torch.nn as nn
from torch._dynamo import convert_frame
from torch._dynamo.eval_frame import OptimizedModule
from torch._dynamo.exc import UncapturedHigherOrderOpError

from zcompile import config as zconfig
from zcompile.compiler.tracing import warmup
from zcompile.errors import ZCompileError, reported_as_zcompile_errors
from zcompile.runtime import dtensor_params
from zcompile.runtime.dist_context import DistContext, set_group_timeout

_LOOK_UP = 12  # frames between the callback and dynamo's _compile: 6 on torch 2.11 and 2.13
_LOOK_UP_CALLER = 64  # frames between dynamo's _compile and the torch.compile'd module's call
# torch.compile(module)'s call, where a frame compiled inside the module finds it (None: not overridden in this torch)
_OPTIMIZED_CALL = getattr(OptimizedModule.__dict__.get("__call__"), "__code__", None)
_STARTED: weakref.WeakSet = weakref.WeakSet()  # modules of the frames dynamo started compiling for the zero backend
# per dynamo compile in progress: (the frame's modules if it compiles for the zero backend, else None; whether
# its start turned the collector off; dynamo's ignore_logger_methods to restore at its end, or None)
_compiles: list[tuple[list | None, bool, set | None]] = []


def register() -> None:
    """Install the callbacks once (again after torch._dynamo.reset() removed them). Called by the backend inside a
    compile whose start the callback missed: that frame's modules count as started (_refuse_skipped_root)."""
    handler = torch._dynamo.callback_handler
    if _on_start not in handler.start_callbacks:
        handler.register_start_callback(_on_start)
        try:
            found = _zero_frame(sys._getframe(1), _LOOK_UP_CALLER)
        except Exception:
            found = None
        if found is not None:
            _STARTED.update(_frame_modules(found[1]))
    if _on_end not in handler.end_callbacks:
        handler.register_end_callback(_on_end)


def _on_start(_args) -> None:
    try:
        found = _zero_frame(sys._getframe(1))
    except Exception:  # runs for every dynamo compile in the process: never fail another backend's
        found = None
    if found is None:
        _compiles.append((None, False, None))  # start and end come in pairs, for any backend
        return
    options, frame_locals, compiling = found
    modules = _frame_modules(frame_locals)
    _compiles.append((modules, gc.isenabled(), _ignore_once_warnings()))
    gc.disable()
    dtensor_params.zero_trace_started()
    _refuse_skipped_root(options, compiling, modules)
    _STARTED.update(modules)
    _shard_modules(options, modules)
    _cast_first_inputs(frame_locals)


def restarted_as_zero() -> None:
    """The backend restarts a stage-0 trace that began without the compile-start callback (after a bare
    torch._dynamo.reset(), or on torch 2.11): the new trace reads the tokens it just made, as one begun with the
    callback does (a stage-0 parameter has no DTensor path: traced plain in fp32, the model's code records fp32
    where the cast graph then computes bf16). The end callback, which the backend registered again, closes it."""
    if not dtensor_params.tracing_for_zero():
        _compiles.append(([], False, None))
        dtensor_params.zero_trace_started()


def _cast_first_inputs(frame_locals: dict) -> None:
    """The root's cast of its floating forward inputs (dtensor_params.cast_forward_inputs) is a forward pre-hook:
    it runs before the frame dynamo compiles, except on the call whose compile installed it. There a forward that
    takes `**kwargs` (Hugging Face's decorated forwards: `wrapped_func(*args, **kwargs)`) gets them cast here, in
    the dict the call made for it. A forward with named inputs is left to the mixed_precision pass's cast of the
    graph inputs on that first call."""
    selves = [frame_locals.get("self")] + list(frame_locals.get("args", ()))[:1]
    casts = [c for m in selves if isinstance(m, nn.Module) and (c := dtensor_params.input_cast_of(m)) is not None]
    kwargs = frame_locals.get("kwargs")
    if casts and isinstance(kwargs, dict):
        casts[0].cast_in_place(kwargs)


def _ignore_once_warnings() -> set | None:
    """Add transformers' `Logger.warning_once` (where transformers is imported) to dynamo's ignore_logger_methods;
    returns the set to restore, or None where nothing changed."""
    once = getattr(logging.Logger, "warning_once", None)
    config = torch._dynamo.config
    before = getattr(config, "ignore_logger_methods", None)
    if once is None or before is None or once in before:
        return None
    config.ignore_logger_methods = set(before) | {once}
    return before


def _on_end(_args) -> None:
    modules, paused, logger_methods = _compiles.pop() if _compiles else (None, False, None)
    if logger_methods is not None:
        torch._dynamo.config.ignore_logger_methods = logger_methods
    if modules is not None:
        dtensor_params.zero_trace_ended()
    if paused:
        gc.enable()
    failed = sys.exc_info()[1]  # the end callback runs as dynamo's compile of the frame unwinds
    if modules and isinstance(failed, UncapturedHigherOrderOpError) and any(
            getattr(type(m), "_zc_marked", False) for root in modules for m in root.modules()):
        failed.add_note(
            "zcompile: each repeated block is traced once as a nested compile region (trace_blocks_once), and a "
            "region cannot hold a graph break. Remove the graph break from the block's forward, or set "
            "trace_blocks_once: false in the zcompile config (the blocks are then traced inline, where dynamo "
            "splits the graph, or runs the frame eagerly on the DTensor parameters). A mixture-of-experts layer that "
            "loops over the experts its tokens were routed to (Hugging Face's experts_implementation='eager') "
            "breaks the graph at that data-dependent loop, and would run different code on each rank anyway: use "
            "one that runs every expert, such as its default 'grouped_mm'.")


def _shard_modules(options: dict | None, modules: list[nn.Module]) -> None:
    if not dtensor_params.trace_once_supported():
        return
    roots = {id(m): m for m in modules if dtensor_params.shardable(m)}
    if not roots:
        return
    try:
        cfg = zconfig.frozen(options)
        ctx = DistContext.current()
    except (zconfig.ConfigError, RuntimeError, ValueError):
        return  # the backend raises it with its context
    if not dtensor_params.rewrites_modules(cfg):
        return
    prepare(cfg, ctx)  # sharding may build meshes: under the configured timeout, as in the backend
    with reported_as_zcompile_errors():
        for root in roots.values():
            dtensor_params.shard_model(root, cfg, ctx)


def prepare(cfg: zconfig.Config, ctx: DistContext) -> None:
    """What every zero-backend compile does first, here or in the backend: start inductor's one-time CPU ISA probe
    (beside the tracing and passes that come before inductor) and put the group under `collective_timeout_s`."""
    if cfg.backend == "inductor":
        warmup.start(ctx.device)
    set_group_timeout(ctx, cfg.collective_timeout_s)


def _zero_frame(frame, look_up: int = _LOOK_UP) -> tuple[dict | None, dict, types.FrameType] | None:
    """(torch.compile's options, the locals of the frame dynamo compiles, dynamo's `_compile` frame) when that
    frame, at most `look_up` frames up the stack, compiles for the zero backend; None otherwise."""
    frame = _frame_running(frame, getattr(getattr(convert_frame, "_compile", None), "__code__", None), look_up)
    if frame is None:
        return None
    names = frame.f_locals
    wrapper = getattr(names.get("compiler_fn"), "_torchdynamo_orig_backend", None)  # torch.compile's wrapper
    backend = getattr(wrapper, "compiler_fn", None)
    if getattr(backend, "zcompile_backend", False) is not True or not isinstance(names.get("locals"), dict):
        return None
    return getattr(wrapper, "kwargs", {}).get("options"), names["locals"], frame


def _frame_running(frame, code, look_up: int):
    """The first of `frame` and at most `look_up` - 1 frames up from it that runs `code`; None if none does (or
    `code` is None)."""
    for _ in range(look_up):
        if frame is None or code is None:
            return None
        if frame.f_code is code:
            return frame
        frame = frame.f_back
    return None


def _compile_wrapper(callback):
    """torch.compile's backend wrapper at the end of dynamo's chain of wrapped callbacks."""
    for _ in range(8):
        inner = getattr(callback, "_torchdynamo_orig_backend", None)
        if inner is None:
            return callback
        callback = inner
    return None


def _refuse_skipped_root(options: dict | None, compiling: types.FrameType, modules: list[nn.Module]) -> None:
    """A frame compiled inside the module given to torch.compile whose own forward dynamo never started to compile
    (its code is skipped: torch.compiler.disable, or marked by an earlier compile in the process that could not
    trace it, e.g. FSDP2's hooks) and that nothing sharded: that forward runs eagerly on plain parameters beside
    submodules compiled with sharded ones (under mixed_precision its first matmul fails on bf16 activations and
    fp32 weights, otherwise the step refuses the unreduced gradients). Say why, at the first call. A forward whose
    compile started (and gave up: a graph break in a loop) is left to the step's check: its frame may still shard
    the model (a resume function), and on torch 2.11 the backend's restart path shards it, not this hook."""
    try:
        root = _skipped_root(compiling, modules)
    except Exception:  # another torch's frame layout: the step's check remains
        return
    if root is None:
        return
    try:
        cfg = zconfig.frozen(options)
    except (zconfig.ConfigError, RuntimeError, ValueError):
        return  # the backend raises it with its context
    if not dtensor_params.rewrites_modules(cfg):
        return  # nothing is sharded: the optimizer step refuses the gradients eager code left unreduced
    inner = getattr(compiling.f_locals.get("code"), "co_qualname", "a function")
    outer = type(root).__name__
    raise ZCompileError(
        f"dynamo compiles {inner} inside {outer}, the module given to torch.compile(..., backend='zero'), but never "
        f"started to compile {outer}'s own forward, which runs eagerly on parameters zcompile has not sharded, beside "
        "submodules compiled with sharded ones: dynamo skips that code (torch.compiler.disable on it, or an earlier "
        "compile in this process that could not trace it marked it skipped, such as FSDP2 + torch.compile of the "
        "same class; or its compile started before zcompile's hook was back, after a bare torch._dynamo.reset()). "
        "Call zcompile.shard_parameters(model, config) before the first forward: the forward then runs eagerly on "
        "the DTensor parameters, as under FSDP2.")


def _skipped_root(compiling: types.FrameType, modules: list[nn.Module]) -> nn.Module | None:
    """The module of the torch.compile(module) call up the stack whose compile `compiling` belongs to (the same
    torch.compile wrapper), when it is not one of the frame's `modules`, no zero-backend compile of its own frame
    started, and it is not prepared (dtensor_params.prepared)."""
    frame = _frame_running(compiling.f_back, _OPTIMIZED_CALL, _LOOK_UP_CALLER)
    if frame is None:
        return None
    compiled = frame.f_locals.get("self")
    root = getattr(compiled, "_orig_mod", None)
    if (not isinstance(root, nn.Module) or any(m is root for m in modules) or root in _STARTED
            or dtensor_params.prepared(root)):
        return None
    ours = _compile_wrapper(compiling.f_locals.get("compiler_fn"))
    theirs = _compile_wrapper(getattr(getattr(compiled, "dynamo_ctx", None), "callback", None))
    return root if ours is not None and ours is theirs else None


def _frame_modules(frame_locals: dict) -> list[nn.Module]:
    values = list(frame_locals.values())
    values += [v for t in values if isinstance(t, tuple) for v in t]  # `*args` of a decorated forward: (self, ...)
    return [m for m in map(_module_of, values) if m is not None]


def _module_of(value) -> nn.Module | None:
    if isinstance(value, nn.Module):
        return value
    owner = getattr(value, "__self__", None)  # a bound method, e.g. model.forward
    return owner if isinstance(owner, nn.Module) else None
