"""torch.distributed.checkpoint's state-dict API sees optimizers pointed at the DTensor parameters.

An optimizer built before the first forward holds the plain parameters that the DTensors replaced; zcompile points
it at the DTensors at its first step (`shard_store.adopt_optimizer`). `get_state_dict` / `set_state_dict` (and the
`*_optimizer_state_dict` functions) read the optimizer without stepping it: they map its parameters to names through
the module's current ones, so between the first forward and the first step they found none of them, handed out an
optimizer state dict without state and loaded a checkpoint's state into nothing; the next step started Adam from
zero (issue 50). Every one of those functions checks its arguments through `_verify_options` first, so
`install` wraps that to adopt the optimizers before anything reads them.
"""
from __future__ import annotations

import functools
import threading

_lock = threading.Lock()
_installed = False


def install() -> None:
    """Wrap torch's `_verify_options` (once per process; called when zcompile first shards a model)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        from torch.distributed.checkpoint import state_dict
        verify = getattr(state_dict, "_verify_options", None)
        if verify is not None:
            state_dict._verify_options = _adopting_first(verify)


def _adopting_first(verify):
    from zcompile.runtime.shard_store import adopt_optimizer

    @functools.wraps(verify)
    def _verify_options(model, optims, *args, **kwargs):
        for optim in optims:
            adopt_optimizer(optim)
            _check_nameable(model, optim)
            _init_state_under_gradients(optim)
        return verify(model, optims, *args, **kwargs)
    return _verify_options


def _check_nameable(model, optim) -> None:
    """The optimizer steps tensors zcompile keeps in place of the module's parameters (host masters of an offloaded
    optimizer, the flat shards of tiled or NVMe parameters): torch would name none of them and silently hand out,
    or load, no state for them."""
    from zcompile.errors import CheckpointError
    from zcompile.runtime.shard_store import owner
    params = {id(p) for p in model.parameters()}
    held = [zp for g in optim.param_groups for p in g["params"]
            if id(p) not in params and (zp := owner(p)) is not None]
    if held:
        names = ", ".join(zp.name or str(list(zp.shape)) for zp in held[:3])
        raise CheckpointError(
            f"the optimizer steps {len(held)} tensor(s) zcompile keeps in place of module parameters ({names}"
            f"{', ...' if len(held) > 3 else ''}: host masters of offload.optimizer, or tiled / NVMe shards); "
            "torch.distributed.checkpoint's state-dict API cannot name them and would hand out or load no state "
            "for them. Use zcompile.save_checkpoint / zcompile.load_checkpoint, which saves them per rank")


def _init_state_under_gradients(optim) -> None:
    """torch makes a stateless optimizer's state (`_init_optim_state`: a step with zero gradients and lr 0) only
    when no parameter has a gradient; after a backward it hands out, and loads, no state at all. Make it here with
    the gradients set aside and put back, as torch makes it without them."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state
    params = [p for g in optim.param_groups for p in g["params"]]
    if optim.state or all(p.grad is None for p in params):
        return
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        _init_optim_state(optim)
    finally:
        for p, g in zip(params, grads):
            p.grad = g
