"""The user's module keeps DTensor parameters: each is `Shard(0)` over the world's 1-D mesh, and its local tensor is
a view of the storage the compiled graphs read (shard_store.ShardedParam), so the module is the single source of
truth, as with FSDP2: any torch.optim optimizer steps it, `model.zero_grad()`, `requires_grad_`, `p.norm()`,
`clip_grad_norm_`, `state_dict()` and torch.distributed.checkpoint work on it unchanged.

[Note: how a DTensor parameter enters a graph]
A module holding one gets a subclass whose attribute for the parameter is a property (SimpleFSDP's trick): outside a
forward it returns the DTensor; inside a forward it returns the whole parameter,
`p.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])`. Eagerly (an eval forward,
`model.generate`) that really all-gathers, and the backward reduce-scatters into `p.grad`. Under dynamo the same code
leaves `placeholder(DTensor) -> redistribute -> to_local` in the graph; `unwrap_graph` collapses each chain into
one plain placeholder of the parameter's full shape, so the passes see what they always saw, and the backend feeds
that placeholder with the shard (`shard_store.graph_inputs`), whose gradient `_GradsToParams` hands back to `p.grad`.
Dynamo guards on the DTensor itself, so `requires_grad_` toggled between steps recompiles as it should. While dynamo
traces for the zero backend the property returns a stand-in token instead, which costs dynamo less ([Note: tokens]);
the backend then guards on the DTensor's requires_grad itself.

Not DTensors (they stay plain, storage-free stand-ins as before): 0-d parameters, row-tiled parameters
(tile_linears: their rows per rank are not torch.chunk sizes) and parameters offloaded to NVMe.
"""
from __future__ import annotations

import copy
import copyreg
import functools
import itertools
import sys
import threading
import warnings
import weakref

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from zcompile.runtime import dcp_optimizers, dist_context, foreach_sharding_prop, grad_foreach, shard_store
from zcompile.errors import ZCompileError, ZeroError
from zcompile.config import Stage, Tier

_MESHES: dict = {}  # cache: (group name, device type) -> DeviceMesh over that group
_CLASSES: dict = {}  # cache: (module class, parameter names) -> its subclass with parameter properties
_forward = threading.local()  # depth of eager forwards of modules holding DTensor parameters
# module -> {parameter name: weakref to its ShardedParam}. Weak both ways: a module in a reference cycle (dynamo's
# tracer state can hold one until the next garbage collection) must not keep its shards alive one collection longer.
_OWNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PREPARED: weakref.WeakSet = weakref.WeakSet()  # every module of a tree shard_model ran on (prepared)
# A graph reads the storage of the parameters it was compiled for, not the DTensors dynamo passes it, so it must not
# be reused for another module instance of the same class (a second model, a deep copy), which dynamo's guards on
# types and tensor metadata allow: each module holding DTensor parameters carries its own number, which the
# parameter property reads while compiling, so dynamo guards on it.
_INSTANCES = itertools.count()


def eligible(zp: shard_store.ShardedParam) -> bool:
    return zp.stage >= Stage.OPTIMIZER and len(zp.shape) >= 1 and not zp.row_multiple and zp.param_tier != Tier.NVME


def mesh_for(zp: shard_store.ShardedParam, ctx: dist_context.DistContext, timeout_s: float) -> DeviceMesh:
    """The world's mesh on the device the shard lives on (a host-offloaded shard under NCCL: the gloo twin)."""
    device = zp.local_rows().device
    group = zp.group if device.type == ctx.device.type else dist_context.host_group(ctx, timeout_s)
    key = (group.group_name, device.type)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(group, device.type)
    return _MESHES[key]


def make_dtensor(zp: shard_store.ShardedParam, requires_grad: bool, ctx, timeout_s: float) -> nn.Parameter:
    """The DTensor parameter whose local tensor is this rank's rows of zp's storage."""
    zp.mesh = mesh_for(zp, ctx, timeout_s)
    param = nn.Parameter(zp.as_dtensor(zp.local_rows(), zp.mesh), requires_grad=requires_grad)
    param._zc = zp
    zp.dtensor = param
    shard_store.layout_changed()
    zp.wrapper_storage = param.untyped_storage()._cdata
    retire(zp)
    zp.token = token(zp)
    zp.seen_version = zp.versions()
    return param


def retire(zp: shard_store.ShardedParam) -> None:
    """The plain parameter the DTensor replaces keeps its shape over a single NaN: a reference the user took before
    the swap reads NaN and cannot be written (instead of reading freed or stale storage); toggling its requires_grad
    fails at the next run (shard_store.graph_inputs). An optimizer built before the swap is pointed at the DTensor
    (shard_store.adopt_optimizer)."""
    old = zp.standin = zp.param  # keep it alive: the optimizer may not hold it any more
    zp.standin_device = old.device
    zp.standin_grad = old.requires_grad
    with torch.no_grad():  # one NaN seen through every index: reads give NaN, writes fail (overlapping memory)
        old.data = torch.full((1,), float("nan"), dtype=old.dtype, device=old.device).expand(old.shape)


# [Note: tokens] What a zero-backend trace reads for a DTensor parameter. Dynamo wraps each DTensor it meets as a
# graph input (its local tensor too) and guards on its spec, its local tensor and its mesh with Python lambdas: at 32
# blocks that was most of dynamo's per-block cost and 1.4 ms of guard checks per call. The graph does not read the
# DTensor anyway (the backend feeds its placeholder with the shard, `shard_store.graph_inputs`), so while dynamo
# traces for the zero backend the property returns the parameter's token: a plain tensor of the whole parameter's
# shape, dtype and compute device over one NaN element, which requires grad (a floating one: inside the forward
# `requires_grad` reads True for a frozen parameter too, limitations.md). The backend (`unwrap_graph`) turns
# each token's placeholder into the whole parameter, requiring grad as the DTensor does, and guards that the
# module still holds that DTensor and on its requires_grad: what dynamo's own guards on the DTensor ensured.
# Other backends, and frames before_trace does not see, trace the DTensor path.
_zero_traces = 0  # dynamo compiles for the zero backend in progress (before_trace)


@torch._dynamo.assume_constant_result
def tracing_for_zero() -> bool:
    """Whether a zero-backend compile is in progress (the properties return tokens). Read at trace time without a
    guard: the compiled code serves a call whatever this returns then."""
    return _zero_traces > 0


def token(zp: shard_store.ShardedParam) -> torch.Tensor | None:
    """The parameter's token, in the dtype the forward computes in (mixed_precision): the model's code then traces
    what it does with a bf16 parameter (`x.to(self.weight.dtype)`, `hidden.to(input_dtype)`), as under FSDP2, whose
    forward sees the unsharded bf16 parameter. The graph input stays the fp32 parameter; the mixed_precision pass
    casts it where it is first used. None where no token can stand in (`strided_at_trace`)."""
    if strided_at_trace(zp):
        return None
    floating = zp.dtype.is_floating_point or zp.dtype.is_complex
    with torch.no_grad():
        one = torch.full((1,) * len(zp.shape), float("nan") if floating else 0, dtype=zp.compute_dtype,
                         device=zp.standin_device)
    token = one.expand(zp.shape).detach().requires_grad_(floating)
    token._zc_token_of = weakref.ref(zp)
    return token


def strided_at_trace(zp: shard_store.ShardedParam) -> bool:
    """A parameter of three or more dimensions (a mixture of experts' stacked weights): kernels such as
    `_grouped_mm` check its strides while dynamo traces, which a token (one element, every stride 0) fails. Such
    a parameter is traced through its DTensor (stages 1-3: the whole parameter, contiguous) or, at stage 0, as
    the plain parameter cast to the compute dtype."""
    return len(zp.shape) >= 3


def cast_at_trace(zp: shard_store.ShardedParam) -> bool:
    """A stage-0 parameter that would have a token but cannot (`strided_at_trace`): while dynamo traces for the zero
    backend its property returns the plain parameter cast to the compute dtype."""
    return tokened(zp) and strided_at_trace(zp)


def token_owner(t) -> shard_store.ShardedParam | None:
    """The ShardedParam whose token `t` is."""
    ref = getattr(t, "_zc_token_of", None)
    return ref() if ref is not None else None


def zero_trace_started() -> None:
    """Dynamo starts compiling a frame for the zero backend (before_trace): the modules' tokens follow their
    parameters (a parameter the user replaced is traced as it is), and the properties return them."""
    global _zero_traces
    refresh_tokens()
    _zero_traces += 1


def zero_trace_ended() -> None:
    global _zero_traces
    _zero_traces -= 1


def refresh_tokens() -> None:
    for module, names in list(_OWNED.items()):
        tokens = module.__dict__.get("_zc_tokens")
        if tokens is None:
            continue
        for name, ref in names.items():
            zp = ref()
            if zp is not None and zp.token is not None and module._parameters.get(name) is zp.held():
                if zp.token.dtype != zp.compute_dtype:  # a config named it after the token was made
                    zp.token = token(zp)
                tokens[name] = zp.token
            else:
                tokens.pop(name, None)


# -- the module side: swap parameters, properties, eager forwards

def shard_parameters(model: nn.Module, config) -> nn.Module:
    """Replace the model's parameters by their DTensor shards now, as its first compiled forward would (like FSDP2's
    fully_shard): references taken afterwards (optimizers, freezing lists, EMA copies) are the parameters. `config`:
    the same path or mapping given to torch.compile. Returns the model."""
    from zcompile import config as zconfig
    cfg = zconfig.from_options({"config": config})
    ctx = dist_context.DistContext.current()
    if rewrites_modules(cfg):
        shard_model(getattr(model, "_orig_mod", model), cfg, ctx)
    return model


def rewrites_modules(cfg) -> bool:
    """Whether a config changes how the model's modules hold or present their parameters: DTensors at stages 1-3,
    compute-dtype tokens at stage 0 under mixed precision (shard_model)."""
    return cfg.stage >= Stage.OPTIMIZER or cfg.mixed_precision.enabled


def shard_model(root: nn.Module, cfg, ctx) -> int:
    """shard_module for a config, then (trace_blocks_once) mark the repeated blocks; at stage 0, token_module.
    Returns how many parameters were replaced (given a token at stage 0)."""
    from functools import partial
    register = partial(shard_store.register_for, cfg, ctx)
    if cfg.mixed_precision.enabled and cfg.mixed_precision.cast_forward_inputs:
        cast_forward_inputs(root, cfg.mixed_precision.param_dtype)
    if cfg.stage == Stage.DDP:
        count = token_module(root, register)
    else:
        count = shard_module(root, register, ctx, cfg.collective_timeout_s)
        if count and cfg.trace_blocks_once and trace_once_supported():
            mark_blocks(root)
    _PREPARED.update(root.modules())
    return count


def prepared(root: nn.Module) -> bool:
    """shard_model ran on `root`, or on a tree holding each of its modules that has parameters (a wrapper around a
    model given to zcompile.shard_parameters): its forward, traced or eager, reads zcompile's parameters."""
    return root in _PREPARED or all(m in _PREPARED for m in root.modules() if m._parameters)


def cast_forward_inputs(root: nn.Module, dtype: torch.dtype) -> None:
    """FSDP2's MixedPrecisionPolicy(cast_forward_inputs=True) on the root: floating tensors among its forward's
    arguments become `dtype` before it runs. Dynamo traces the hook, so the model's code sees bf16 `inputs_embeds`
    as under FSDP2 (a cast the mixed_precision pass puts on the graph input comes after the trace: the code has
    recorded fp32 as constants by then, `hidden.to(input_dtype)`)."""
    if input_cast_of(root) is None:
        root.register_forward_pre_hook(_CastInputs(dtype), with_kwargs=True)


class _CastInputs:
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def _cast(self, t):
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.is_floating_point() and t.dtype != self.dtype:
            return t.to(self.dtype)
        return t

    def __call__(self, module, args, kwargs):
        return torch.utils._pytree.tree_map(self._cast, (args, kwargs))

    def cast_in_place(self, kwargs: dict) -> None:
        """Cast the `**kwargs` dict a call made for the forward (not the caller's own dict)."""
        kwargs.update(torch.utils._pytree.tree_map(self._cast, kwargs))

    def __reduce__(self):  # a pickled or deep-copied model is not zcompile's: it gets its inputs as given
        return _Unchanged, ()


def input_cast_of(module: nn.Module) -> _CastInputs | None:
    return next((h for h in module._forward_pre_hooks.values() if isinstance(h, _CastInputs)), None)


class _Unchanged:
    def __call__(self, module, args, kwargs):
        return None


def shard_module(root: nn.Module, register, ctx, timeout_s: float) -> int:
    """Replace every eligible parameter of `root` (and its submodules, tied ones once) by its DTensor; `register`
    maps a plain parameter to its ShardedParam. Returns how many were replaced."""
    foreach_sharding_prop.install()  # the optimizer's first foreach step over the DTensors
    grad_foreach.install()  # clip_grad_norm_ over their gradients
    dcp_optimizers.install()  # get_state_dict / set_state_dict before an optimizer's first step
    done: dict[int, nn.Parameter] = {}
    for path, module in root.named_modules():
        names = []
        for name, p in list(module._parameters.items()):
            if not _to_shard(module, name, p):
                continue
            if id(p) not in done:
                plain = _whole(p) if isinstance(p, DTensor) else p  # alive until make_dtensor keeps it (retire)
                zp = register(plain)
                if not eligible(zp):
                    continue
                zp.name = zp.name or f"{path}.{name}".lstrip(".")
                done[id(p)] = zp.dtensor if zp.dtensor is not None else make_dtensor(zp, p.requires_grad, ctx, timeout_s)
                p._zc_dtensor = done[id(p)]  # an optimizer built before this still holds p: adopt_optimizer maps it
            module._parameters[name] = done[id(p)]
            zp = done[id(p)]._zc
            _own(module, name, zp)
            names.append(name)
            if zp.standin_device != done[id(p)].device:  # a host-offloaded shard of a parameter computed on a GPU
                module.__dict__.setdefault("_zc_compute_device", {})[name] = zp.standin_device
        if names:
            _with_properties(module, names)
    return len(done)


def tokened(zp: shard_store.ShardedParam) -> bool:
    """Stage 0 under mixed precision: the parameter stays plain (every rank holds it; it is the graph input), and
    zero-backend traces read its token, in the compute dtype, as a DTensor parameter's are read."""
    return zp.stage == Stage.DDP and zp.compute_dtype != zp.dtype and len(zp.shape) >= 1


def token_module(root: nn.Module, register) -> int:
    """Give every parameter of `root` that `tokened` a token its module's property returns while dynamo traces for
    the zero backend, so the model's code sees the compute dtype as at stages 1-3. Returns how many tokens were
    made."""
    count = 0
    for path, module in root.named_modules():
        names = []
        for name, p in list(module._parameters.items()):
            if p is None or isinstance(p, DTensor) or not p.is_floating_point():
                continue
            zp = register(p)
            if not tokened(zp):
                continue
            if cast_at_trace(zp):  # no token; new to the property: the trace must restart to read the cast
                count += name not in _OWNED.get(module, {})
            elif zp.token is None:
                zp.name = zp.name or f"{path}.{name}".lstrip(".")
                zp.token = token(zp)
                count += 1
            _own(module, name, zp)
            names.append(name)
        if names:
            _with_properties(module, names, replicated=True)
    return count


def _own(module: nn.Module, name: str, zp: shard_store.ShardedParam) -> None:
    """Record that `module.<name>` is zp's (refresh_tokens, _reattach) and what traces read for it."""
    # A parameter without a token (strided_at_trace) has no key, as refresh_tokens leaves it: a key holding None
    # made the first graph guard on it, and refresh_tokens' removal then failed that guard (a second compile).
    tokens = module.__dict__.setdefault("_zc_tokens", {})
    if zp.token is not None:
        tokens[name] = zp.token
    else:
        tokens.pop(name, None)
    _OWNED.setdefault(module, {})[name] = weakref.ref(zp)


def owned(module: nn.Module) -> dict:
    """{parameter name: ShardedParam} of the parameters zcompile sharded in `module`."""
    return {name: zp for name, ref in _OWNED.get(module, {}).items() if (zp := ref()) is not None}


def shardable(root: nn.Module) -> bool:
    """`root` holds parameters shard_module would look at (`_to_shard`)."""
    return any(_to_shard(m, name, p) for m in root.modules() for name, p in m._parameters.items())


def _to_shard(module: nn.Module, name: str, p) -> bool:
    """shard_module looks at this parameter: a plain one, or a DTensor of a deep copy of a module zcompile sharded
    (not zcompile's yet)."""
    return p is not None and (not isinstance(p, DTensor) or _copied(module, name))


def _copied(module: nn.Module, name: str) -> bool:
    """The parameter is a DTensor of a deep copy of a module zcompile sharded (an EMA model): not zcompile's yet."""
    return name in getattr(type(module), "_zc_param_names", ()) and name not in _OWNED.get(module, {})


def _whole(p: DTensor) -> nn.Parameter:
    """A plain parameter holding a DTensor parameter's whole value (all-gathered: every rank calls this)."""
    with torch.no_grad():
        return nn.Parameter(p.full_tensor(), requires_grad=p.requires_grad)


def _with_properties(module: nn.Module, names: list[str], replicated: bool = False) -> None:
    """`replicated`: the parameters stay plain (token_module): only the properties, and pickling and deep copies
    see the module's own class."""
    if "_zc_instance" not in module.__dict__:
        module._zc_instance = next(_INSTANCES)
    module.__dict__.setdefault("_zc_compute_device", {})
    cls = type(module)
    have = getattr(cls, "_zc_param_names", frozenset())
    want = have | frozenset(names)
    if want == have:
        return
    base = cls.__bases__[0] if have else cls
    key = (base, want, replicated)
    if key not in _CLASSES:
        own = {"__reduce_ex__": _reduce_as_base} if replicated else {
            "_apply": _apply, "_load_from_state_dict": _load_from_state_dict, "__deepcopy__": _deepcopy,
            "__reduce_ex__": _no_pickle}
        _CLASSES[key] = type(base.__name__, (base,), {**{n: property(_getter(n)) for n in want},
                                                      "_zc_param_names": want, "_zc_base": base,
                                                      "_zc_in_region": False, **own,
                                                      "__module__": base.__module__})
    module.__class__ = _CLASSES[key]
    if not have and not replicated:
        module.register_forward_pre_hook(_enter_forward)
        module.register_forward_hook(_leave_forward, always_call=True)


def _getter(name: str):
    def get(self):
        if torch.compiler.is_compiling() and tracing_for_zero():
            token = self._zc_tokens.get(name)
            if token is not None:  # the parameter is still zcompile's DTensor: see [Note: tokens]
                return token  # no _zc_instance: the backend's guard on the parameter's ShardedParam covers it
            p = self._parameters[name]
            zp = getattr(p, "_zc", None)
            if zp is not None and not isinstance(p, DTensor) and cast_at_trace(zp):
                return p.to(zp.compute_dtype)  # what a token would say; the placeholder stays the parameter
        p = self._parameters[name]
        if not isinstance(p, DTensor) or not (torch.compiler.is_compiling() or getattr(_forward, "depth", 0)):
            return p
        # never true: reading it makes dynamo guard on it (see _INSTANCES); a marked block reads it outside
        if not self._zc_in_region and self._zc_instance < 0:
            raise AssertionError
        full = p.redistribute(p.device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        device = self._zc_compute_device.get(name)
        if device is not None:  # gathered on the host mesh (offload.params: cpu): computed where the model runs
            full = full.to(device)
        zp = getattr(p, "_zc", None)
        if zp is not None and full.dtype != zp.compute_dtype:  # mixed_precision, as the token's dtype says
            full = full.to(zp.compute_dtype)
        if not torch.compiler.is_compiling():  # eager: the reduce-scatter sums; average like the compiled graphs
            full = _MeanGrad.apply(full, p.device_mesh.size())
        return full
    return get


def hook_forward_of(block: nn.Module, members) -> None:
    """The eager-forward hooks of `members` (modules holding DTensor parameters) move to `block`, which holds them:
    a forward of the block then gathers their parameters, as FSDP2's hooks on a sharded block do. (Dynamo guards
    on each module's hook handles, which differ per module: inside a region traced once they would fail its reuse
    for every other block, see compiler/tracing/trace_blocks_once.py.)"""
    for m in members:
        ours = [k for k, h in m._forward_pre_hooks.items() if h is _enter_forward]
        ours += [k for k, h in m._forward_hooks.items() if h is _leave_forward]
        for k in ours:
            for hooks in (m._forward_pre_hooks, m._forward_hooks, m._forward_hooks_always_called):
                hooks.pop(k, None)
    if _enter_forward not in block._forward_pre_hooks.values():
        block.register_forward_pre_hook(_enter_forward)
        block.register_forward_hook(_leave_forward, always_call=True)


def _enter_forward(module, args):
    if not torch.compiler.is_compiling():
        _forward.depth = getattr(_forward, "depth", 0) + 1


def _leave_forward(module, args, output):
    if not torch.compiler.is_compiling():
        _forward.depth -= 1


class _MeanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, world):
        ctx.world = world
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g / ctx.world, None


# -- torch replacing a parameter's tensor: nn.Module._apply (model.to, .float(), .cuda()) swaps a DTensor
# parameter's contents for a new tensor's (torch.utils.swap_tensors), load_state_dict(assign=True) installs another
# object. Afterwards zcompile's storage (what the graphs read) takes the values and the module keeps its one parameter
# object (what optimizers and the user hold), re-pointed at that storage: FSDP2's FSDPParam.reset_sharded_param.

def _apply(self, fn, recurse=True):
    out = self._zc_base._apply(self, fn, recurse)
    _reattach(self, "nn.Module._apply (model.to(), .float(), .half(), .double(), .cuda(), ...)")
    return out


def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                          error_msgs):
    for name, zp in owned(self).items():  # a whole (unsharded) tensor per rank: this rank takes its rows
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and tuple(value.shape) == zp.shape:
            rows = zp.as_rows(value.detach().reshape(-1)[zp.lo:]).to(zp.local_rows().device)
            state_dict[prefix + name] = zp.as_dtensor(rows, zp.mesh)
    self._zc_base._load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                                        unexpected_keys, error_msgs)
    _reattach(self, "load_state_dict(assign=True)")


def _deepcopy(self, memo):
    """copy.deepcopy (an EMA model, AveragedModel): the copy's parameters are DTensors of their own, same placement,
    not zcompile's. Copied here: torch's Tensor.__deepcopy__ takes a DTensor whose wrapper has a storage offset (rows
    inside a stage 1/2 buffer) for a plain tensor and fails on its data-less storage."""
    if "_zc_tokens" in self.__dict__:  # the copy's parameters are not zcompile's: no tokens until it shards them
        memo[id(self.__dict__["_zc_tokens"])] = {}
    for name in _OWNED.get(self, {}):
        p = self._parameters.get(name)
        if p is not None and id(p) not in memo:
            with torch.no_grad():
                clone = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                if p.grad is not None:
                    clone.grad = p.grad.detach().clone()
            memo[id(p)] = clone
    twin = copy._reconstruct(self, memo, *object.__reduce_ex__(self, 4))
    twin._zc_instance = next(_INSTANCES)
    return twin


def _reduce_as_base(self, protocol):
    """A module whose plain parameters have tokens (token_module) pickles and deep-copies as its own class, without
    them (a copy compiled with zcompile gets its own)."""
    state = {k: v for k, v in self.__dict__.items() if k not in ("_zc_tokens", "_zc_instance", "_zc_compute_device")}
    return copyreg._reconstructor, (self._zc_base, object, None), state


def _no_pickle(self, protocol):
    """torch.save(model), pickle, copy.copy: the module's classes are zcompile's and its parameters are shards of
    this process group, so a pickle could not be loaded elsewhere (FSDP2's modules cannot be pickled either). Said
    here instead of pickle's "it's not the same object as torch.nn...Linear"."""
    raise ZeroError(
        f"cannot pickle {self._zc_base.__name__} (torch.save(model), pickle or copy.copy of a module): zcompile "
        f"sharded its parameters {sorted(self._zc_param_names)} into DTensors of this process group. Save "
        "model.state_dict() instead (each rank its DTensor shards, as with FSDP2; load it into the same sharded "
        "model), zcompile.full_state_dict(model) for whole tensors, zcompile.save_checkpoint or "
        "torch.distributed.checkpoint; copy.deepcopy(model) works")


def _reattach(module: nn.Module, what: str) -> None:
    for name, zp in owned(module).items():
        p = module._parameters.get(name)
        in_storage = isinstance(p, DTensor) and p._local_tensor.data_ptr() == zp.local_rows().data_ptr()
        if p is None or (p is zp.dtensor and getattr(p, "_zc", None) is zp and in_storage):
            continue
        problem = _mismatch(p, zp)
        if problem is None and not in_storage:
            with torch.no_grad():
                zp.load_rows(p._local_tensor)
        module._parameters[name] = zp.dtensor
        zp.dtensor._zc = zp
        shard_store.repoint_dtensor(zp)
        if problem is not None:
            if zp.dtensor.grad is not None and _mismatch(zp.dtensor.grad, zp):
                zp.dtensor.grad = None
            raise ZeroError(
                f"{what} made parameter {zp.name} {problem} after zcompile sharded it (at the "
                f"first compiled forward or zcompile.shard_parameters) as a {zp.dtype} DTensor, Shard(0) over "
                f"{zp.world} ranks, on {zp.local_rows().device.type}. Its storage and the compiled graphs keep that "
                "layout: convert the model before it is sharded, use `mixed_precision` in the config or "
                "torch.autocast for another compute dtype, and load state dicts without assign (they are copied in). "
                "The parameter keeps its values")


def _mismatch(t: torch.Tensor, zp: shard_store.ShardedParam) -> str | None:
    """What keeps `t` from standing for zp's parameter (None: it can)."""
    if not isinstance(t, DTensor):
        return f"a {type(t).__name__}, not a DTensor"
    if tuple(t.shape) != zp.shape:
        return f"of shape {list(t.shape)}"
    if t.dtype != zp.dtype:
        return f"{t.dtype}"
    if t._local_tensor.device != zp.local_rows().device:
        return f"on {t._local_tensor.device}"
    if tuple(t.placements) != (Shard(0),) or t.device_mesh != zp.mesh:
        return f"placed {tuple(t.placements)} over {t.device_mesh}"
    return None


# -- the module side: repeated blocks traced once (compiler/tracing/trace_blocks_once.py inlines them again).
# What reads a per-instance constant inside a nested compile region fails dynamo's reuse for every other block: the
# parameter properties guard on `_zc_instance` and dynamo guards on each module's hook handles, so inside a marked
# block the properties skip the instance (the block's outer forward reads the instances of the modules it holds, in
# the frame that calls the region) and the eager-forward hooks move to the block (hook_forward_of).

_BLOCK_CLASSES: dict = {}  # cache: a block class -> its subclass whose forward calls it as a nested compile region
# Dynamo traces a region again for each block whose guards differ from every trace so far (a shape, a flag, an
# input it cannot compare) and by default fails past 8 such traces of one function; more only cost time.
MAX_TRACES = 1 << 30


def trace_once_supported() -> bool:
    """torch 2.11's dynamo fails on DTensor parameters inside a nested compile region; 2.13's traces them."""
    return hasattr(torch.compiler, "nested_compile_region") and torch.__version__ >= (2, 13)


def repeated_blocks(root: nn.Module) -> list[nn.Module]:
    """The items of the model's ModuleLists/Sequentials that repeat a class at least twice and hold parameters."""
    found = []
    for module in root.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        items = list(module.children())
        for item in items:
            same = sum(type(other) is type(item) for other in items)
            composite = any(True for _ in item.children())  # a block, not the Linears of an MLP's Sequential
            if same >= 2 and composite and any(True for _ in item.parameters()) and item not in found:
                found.append(item)
    return [b for b in found if not any(b is not o and _contains(o, b) for o in found)]  # outermost only


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def mark_blocks(root: nn.Module) -> int:
    """Mark the repeated blocks of `root` for tracing once, after shard_module gave their modules parameter
    properties; again after it sharded more of them (adapters added later). Returns how many blocks are marked.
    A block gets a subclass (one per class) whose forward calls the class's own as a nested compile region."""
    count = 0
    _define_encoder_decoder_recorder()
    for block in repeated_blocks(root):
        members = {path: m for path, m in block.named_modules() if getattr(type(m), "_zc_param_names", None)}
        if not members:
            continue
        for m in members.values():
            m._zc_in_region = True
        hook_forward_of(block, members.values())
        # by path: a deep copy of the block (an EMA model) reads its own modules
        block._zc_members = tuple(tuple(path.split(".")) if path else () for path in members)
        if not getattr(type(block), "_zc_marked", False):
            block.__class__ = _marked_class(type(block))
        count += 1
    return count


def _marked_class(cls: type) -> type:
    if cls not in _BLOCK_CLASSES:
        forward = cls.forward
        body = _region_body(forward)
        region = torch.compiler.nested_compile_region(body)
        body.__marked_compile_region_max_reuse_entries__ = MAX_TRACES
        _BLOCK_CLASSES[cls] = type(cls.__name__, (cls,), {
            "forward": _outer_forward, "_zc_region": region, "_zc_inline": forward, "_zc_marked": True,
            "__reduce_ex__": _no_pickle_block, "__deepcopy__": _deepcopy_block, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__})
    return _BLOCK_CLASSES[cls]


def _region_body(forward):
    """The block's forward as a region: an output that is one of its inputs (T5's position bias, computed by the
    first block and handed on by the others) leaves as a copy, since a region's outputs may not alias its inputs.
    Called with `_zc_record_cache=<keyword>` (an empty KV cache, `_empty_cache_call`), that keyword gets a recorder
    made inside the region (`_zc_record_pair`: of an encoder-decoder cache), whose recorded keys and values the
    region also returns."""
    @functools.wraps(forward)
    def body(self, *args, **kwargs):
        record = kwargs.pop("_zc_record_cache", None)  # the keyword of an empty KV cache (_empty_cache_call)
        pair = kwargs.pop("_zc_record_pair", False)
        if record is not None:
            recorder = _ENCODER_DECODER_RECORDER() if pair else _KVRecorder()
            kwargs[record] = recorder
        out = forward(self, *args, **kwargs)
        inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        out = torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: t.clone() if any(t is i for i in inputs) else t, out)
        return out if record is None else (out, recorder.recorded())
    return body


class _KVRecorder:
    """What a block traced as a region gets for an empty Hugging Face KV cache (`_empty_cache_call`): `update` keeps
    the block's new keys and values and returns them, as an empty cache's first update does; the outer forward
    writes them into the real cache after the region."""

    def __init__(self):
        self.keys = self.values = None

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        self.keys, self.values = key_states, value_states
        return key_states, value_states

    def get_seq_length(self, layer_idx=0) -> int:
        return 0

    def recorded(self) -> tuple:
        return self.keys, self.values


_ENCODER_DECODER_RECORDER: type | None = None  # made by mark_blocks where transformers is imported (below)


def _define_encoder_decoder_recorder() -> None:
    """The recorder for an empty encoder-decoder cache (T5, BART, Whisper): an EncoderDecoderCache, since their
    attention picks the self- or cross-attention cache by that type, holding a `_KVRecorder` for each. Defined
    outside any trace (dynamo cannot trace a class statement), once transformers' caches are imported."""
    global _ENCODER_DECODER_RECORDER
    cache_utils = sys.modules.get("transformers.cache_utils")
    if _ENCODER_DECODER_RECORDER is not None or cache_utils is None:
        return

    class _EncoderDecoderRecorder(cache_utils.EncoderDecoderCache):
        def __init__(self):  # nothing stored: the outer forward writes the real cache after the region
            self.self_attention_cache, self.cross_attention_cache, self.is_updated = _KVRecorder(), _KVRecorder(), {}

        def recorded(self) -> tuple:
            return self.self_attention_cache.recorded() + self.cross_attention_cache.recorded()
    _ENCODER_DECODER_RECORDER = _EncoderDecoderRecorder


def _write_recorded(cache, idx: int, recorded: tuple) -> None:
    """Store what a block's region recorded for layer `idx` into the real cache, as the block's own updates would
    have: keys and values (a DynamicCache's recorder returns that pair), or, an encoder-decoder cache's four,
    self-attention ones first, then cross-attention ones, the layer marked updated so the next decoding step
    reuses them."""
    if len(recorded) == 2:
        if recorded[0] is not None:
            cache.update(recorded[0], recorded[1], idx)
        return
    if recorded[0] is not None:
        cache.self_attention_cache.update(recorded[0], recorded[1], idx)
    if recorded[2] is not None:
        cache.cross_attention_cache.update(recorded[2], recorded[3], idx)
        cache.is_updated[idx] = True


_WARNED_INLINE: set = set()  # (block class, what it was given) warned about once per process


@torch._dynamo.assume_constant_result
def _warn_inline(block: str, held: str) -> bool:
    """Run by dynamo while it traces (its result is taken as a constant): say once why a block is traced inline."""
    if (block, held) not in _WARNED_INLINE:
        _WARNED_INLINE.add((block, held))
        warnings.warn(f"zcompile: {block} is called with {held}, which a block's region cannot hold (only an empty "
                      "Hugging Face DynamicCache or EncoderDecoderCache can be): those calls are traced inline, so "
                      "compile time grows with depth; in training pass use_cache=False", stacklevel=2)
    return True


def _empty_cache_call(block: nn.Module, args, kwargs) -> tuple | None:
    """(keyword, cache, layer index) when a block's only input that is not a value is a keyword argument holding a
    Hugging Face DynamicCache, or an EncoderDecoderCache of two DynamicCaches, with nothing stored for this block
    yet (a training forward with the config's default `use_cache=True`, the prefill of `generate`), and the block's
    attentions use one layer index (a recorder keeps one layer's keys and values); None otherwise (the block is then
    traced inline)."""
    names = [k for k, v in kwargs.items() if not _values_only(v)]
    if len(names) != 1 or not _values_only(args):
        return None
    cache = kwargs[names[0]]
    layers = {m.layer_idx for m in block.modules() if isinstance(getattr(m, "layer_idx", None), int)}
    if len(layers) != 1:  # e.g. two attentions with their own layers of the cache in one block
        return None
    (idx,) = layers
    if _hf_cache(cache, "EncoderDecoderCache"):
        if _ENCODER_DECODER_RECORDER is None:
            return None
        parts = (getattr(cache, "self_attention_cache", None), getattr(cache, "cross_attention_cache", None))
        if not all(_hf_cache(c, "DynamicCache") and c.get_seq_length(idx) == 0 for c in parts) or \
                cache.is_updated.get(idx):
            return None
    elif not _hf_cache(cache, "DynamicCache") or cache.get_seq_length(idx) != 0:
        return None
    return names[0], cache, idx


def _hf_cache(cache, name: str) -> bool:
    """`cache` is transformers' own class `name` (a subclass may store or read differently)."""
    return type(cache).__name__ == name and type(cache).__module__.startswith("transformers")


def _outer_forward(self, *args, **kwargs):
    # the instances of the modules inside, read outside the region (see above); traced with tokens, the backend's
    # guards on each parameter's ShardedParam tell instances apart
    for path in () if torch.compiler.is_compiling() and tracing_for_zero() else self._zc_members:
        m = self
        for name in path:  # a path the user rewired since (adapters) is skipped until mark_blocks runs again
            m = getattr(m, name, None)
        if getattr(m, "_zc_instance", 0) < 0:
            raise AssertionError
    if not _values_only((args, kwargs)):
        found = _empty_cache_call(self, args, kwargs)
        if found is None:
            if torch.compiler.is_compiling():
                held = sorted({type(leaf).__name__ for leaf in torch.utils._pytree.tree_leaves((args, kwargs))
                               if not isinstance(leaf, _VALUES)})
                _warn_inline(type(self).__qualname__, ", ".join(held))
            return type(self)._zc_inline(self, *args, **kwargs)
        name, cache, idx = found
        record = {name: None, "_zc_record_cache": name}
        if _hf_cache(cache, "EncoderDecoderCache"):
            record["_zc_record_pair"] = True
        out, recorded = type(self)._zc_region(self, *args, **{**kwargs, **record})
        _write_recorded(cache, idx, recorded)
        return out
    return type(self)._zc_region(self, *args, **kwargs)


_VALUES = (torch.Tensor, int, float, bool, str, type(None), torch.dtype, torch.device)


def _values_only(tree) -> bool:
    """A region is a function of its inputs: an object a block may write to (a Hugging Face KV `Cache`, which the
    attention updates) is state outside it, which a nested compile region cannot write where the state aliases an
    input (dynamo: "an intermediate tensor ... aliases an input or output"). Such a call is traced inline, except
    with an empty Hugging Face DynamicCache or EncoderDecoderCache (`_empty_cache_call`)."""
    return all(isinstance(leaf, _VALUES) for leaf in torch.utils._pytree.tree_leaves(tree))


def _deepcopy_block(self, memo):
    """copy.deepcopy of a marked block (an EMA model): as without the mark (pickling is refused, below)."""
    return copy._reconstruct(self, memo, *object.__reduce_ex__(self, 4))


def _no_pickle_block(self, protocol):
    raise ZeroError(f"cannot pickle {type(self).__qualname__} (torch.save(model), pickle or copy.copy of a module): "
                    "zcompile sharded the parameters of its modules into DTensors of this process group. Save "
                    "model.state_dict() instead (each rank its DTensor shards, as with FSDP2), "
                    "zcompile.full_state_dict(model) for whole tensors, zcompile.save_checkpoint or "
                    "torch.distributed.checkpoint; copy.deepcopy(model) works")


# -- the graph side

def _calls(node: torch.fx.Node, method: str) -> bool:
    """`node` calls DTensor.<method>: a call_method node (torch 2.13), or dynamo's `prim_<method>` closure (2.11)."""
    return node.target == method or getattr(node.target, "__name__", None) == f"prim_{method}"


def unwrap_graph(gm: torch.fx.GraphModule, example_inputs: list) -> tuple[list, dict, list[int]]:
    """Collapse `placeholder(DTensor) -> redistribute -> to_local` into a plain full-shape placeholder, also where the
    chain is inside the body of an activation checkpoint (torch.utils.checkpoint under dynamo); a token's placeholder
    ([Note: tokens]) stands for the whole parameter already and gets the guards dynamo kept on the DTensor.

    Returns (example inputs for AOTAutograd, {input index: ShardedParam}, indices of dropped inputs: the meshes)."""
    from torch._guards import detect_fake_mode
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode()
    inputs, params = list(example_inputs), {}
    for k, (ph, x) in enumerate(zip(phs, example_inputs)):
        zp = token_owner(x)
        token = zp is not None
        if token:
            _guard_token(ph, zp)
            ph._rename(ph.name.replace("_zc_tokens_", "_parameters_"))  # as dynamo names a parameter it reads
            requires_grad = zp.held().requires_grad
        else:
            zp = shard_store.owner(x) if isinstance(x, DTensor) else None
            requires_grad = getattr(x, "requires_grad", False)
        if zp is None:
            if isinstance(x, DTensor) and getattr(x, "_is_param", False):
                raise ZeroError(
                    f"the compiled model has a DTensor parameter of shape {list(x.shape)} that zcompile did not shard "
                    f"(placements {tuple(x.placements)}), e.g. one sharded by fully_shard: zcompile shards plain "
                    "parameters itself (and deep copies of the models it sharded); load its state_dict() into a "
                    "fresh model and compile that")
            continue
        with fake_mode:
            fake = torch.empty(zp.shape, dtype=zp.dtype, device=zp.standin_device, requires_grad=requires_grad)
        _collapse(gm, ph, zp, fake, token)
        inputs[k] = fake
        params[k] = zp
    _drop_unused_operands(gm)
    dropped = [k for k, (ph, x) in enumerate(zip(phs, example_inputs)) if isinstance(x, DeviceMesh) and not ph.users]
    for k in dropped:
        gm.graph.erase_node(phs[k])
    if params:
        gm.graph.lint()
        gm.recompile()
    drop = set(dropped)
    kept = [k for k in range(len(inputs)) if k not in drop]  # old index of each kept input
    return [inputs[k] for k in kept], {new: params[k] for new, k in enumerate(kept) if k in params}, dropped


# Higher-order ops that call their body (args[0]) with their args from an index on: torch.utils.checkpoint under
# dynamo, and the blocks traced once where they stay regions (keep_block_regions). {op: index of its first operand}
_WRAPPERS = {torch.ops.higher_order.tag_activation_checkpoint: 1, torch.ops.higher_order.wrap: 1,
             torch.ops.higher_order.invoke_subgraph: 2}


def _wraps(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in _WRAPPERS


def _operands(node: torch.fx.Node) -> tuple:
    return node.args[_WRAPPERS[node.target]:]


def _collapse(gm: torch.fx.GraphModule, ph: torch.fx.Node, zp: shard_store.ShardedParam, fake: torch.Tensor,
              token: bool) -> None:
    """Each `redistribute -> to_local` of placeholder `ph` becomes `ph`, which now stands for the whole parameter
    (`fake`); a wrapper that takes `ph` passes it on, so the same happens to its body's placeholder."""
    if ph.meta.get("zc_whole"):
        return  # a body that several wrapper calls share (a block traced once): collapsed already
    for use in list(ph.users):
        if _wraps(use):
            body = getattr(gm, use.args[0].target)
            inner = [n for n in body.graph.nodes if n.op == "placeholder"]
            for i, arg in enumerate(_operands(use)):
                if arg is ph:
                    _collapse(body, inner[i], zp, fake, token)
            continue  # the body recompiles once, in _drop_unused_operands (once per parameter cost seconds)
        if token:
            continue  # a token stands for the whole parameter already
        if not _calls(use, "redistribute") or not all(_calls(u, "to_local") for u in use.users):
            raise ZCompileError(
                f"parameter {ph.name} of shape {list(zp.shape)} is used as a DTensor inside the compiled region "
                f"({use.format_node()}); read it as a module attribute (self.<name>) there, which gives the "
                "whole tensor, or call it outside the compiled model")
        for to_local in list(use.users):
            to_local.replace_all_uses_with(ph)
            gm.graph.erase_node(to_local)
        gm.graph.erase_node(use)
    ph.meta["example_value"] = fake
    ph.meta["zc_whole"] = True


def _guard_token(ph: torch.fx.Node, zp: shard_store.ShardedParam) -> None:
    """Dynamo's guards for what a token stands for (see [Note: tokens]): the module (the token's dict's owner)
    still holds zp's DTensor, which requires grad as it does now."""
    from torch._dynamo.guards import GuardBuilder, install_guard
    from torch._dynamo.source import AttrSource, DictGetItemSource
    source = getattr(ph.meta.get("grapharg"), "source", None)
    tokens = getattr(source, "base", None)
    if not (isinstance(source, DictGetItemSource) and isinstance(tokens, AttrSource) and tokens.member == "_zc_tokens"):
        raise ZCompileError(f"parameter {zp.label} reached the graph through {source}, not through "
                            "its module's _zc_tokens: this torch's dynamo names sources otherwise than zcompile knows")
    param = DictGetItemSource(AttrSource(tokens.base, "_parameters"), source.index)
    # identity through the parameter's ShardedParam: an ID_MATCH on the parameter would hold a weak reference to it,
    # and torch.utils.swap_tensors (model.to(), nn.Module._apply) refuses to swap a tensor that has one
    install_guard(AttrSource(param, "_zc").make_guard(GuardBuilder.ID_MATCH),
                  AttrSource(param, "requires_grad").make_guard(GuardBuilder.EQUALS_MATCH))


def _drop_unused_operands(gm: torch.fx.GraphModule, dropped: dict | None = None) -> None:
    """A wrapper's body no longer reads the meshes it redistributed over: drop them from body and call. A body
    that several calls share (a block traced once) loses them at its first call; `dropped` ({id(body): operand
    indices}) drops the same from the others."""
    dropped = {} if dropped is None else dropped
    for node in list(gm.graph.nodes):
        if not _wraps(node):
            continue
        body = getattr(gm, node.args[0].target)
        if id(body) not in dropped:
            _drop_unused_operands(body, dropped)
            inner = [n for n in body.graph.nodes if n.op == "placeholder"]
            dropped[id(body)] = {i for i, p in enumerate(inner) if not p.users}
            for i in dropped[id(body)]:
                body.graph.erase_node(inner[i])
            body.graph.lint()
            body.recompile()
        unused = dropped[id(body)]
        first = _WRAPPERS[node.target]
        node.args = (*node.args[:first], *[a for i, a in enumerate(node.args[first:]) if i not in unused])
