"""Adam and AdamW steps on the local tensors of zcompile's DTensor parameters.

torch.optim's Adam over DTensors sends every foreach or fused op through DTensor's dispatch (sharding propagation,
wrapped outputs): about 75 (foreach) and 90 (fused) Python calls per parameter and step on this VM, against about 13
for the same update over plain tensors (issue 56). zcompile's DTensor parameters are Shard(0) rows of their group,
and Adam's gradient and moments of each are laid out the same way, so the update is elementwise over the local
tensors. At `optimizer.step()` the pre-hook runs torch's own functional `adam` (the optimizer's settings, foreach or
fused as the optimizer would choose for the DTensors) over the local tensors of those parameters and hides their
gradients from the optimizer's loop, which then skips them; the post-hook gives the gradients back. Same kernels on
the same tensors: bit-identical to the optimizer's own step.

Taken only where nothing could tell the difference: the optimizer is exactly torch.optim.Adam or AdamW, stepped
without a closure, with no hooks of its own, no GradScaler state, nothing differentiable, and zcompile's pre-hook the
last global one; every DTensor parameter with a gradient has a gradient and state (made by an earlier step: the
first step, which creates the state, is torch's) with its mesh, placements and local shape. Anything else: the
optimizer steps them as it would. Plain tensor parameters are always left to the optimizer's own loop.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam
from torch.optim.optimizer import _default_to_fused_or_foreach, _global_optimizer_pre_hooks


def step_locally(optimizer, last_hook) -> list | None:
    """Run `optimizer`'s update on the local tensors of its DTensor parameters whose gradient and state share their
    layout, and hide those gradients; returns what `give_back` restores, or None where the optimizer steps them all
    itself. `last_hook`: zcompile's global pre-hook, which must run last."""
    if (type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or optimizer._optimizer_step_pre_hooks
            or optimizer._optimizer_step_post_hooks or getattr(optimizer, "grad_scale", None) is not None
            or getattr(optimizer, "found_inf", None) is not None or torch.compiler.is_compiling()
            or next(reversed(_global_optimizer_pre_hooks.values()), None) is not last_hook):
        return None
    plans = []
    for group in optimizer.param_groups:
        plan = _group_plan(optimizer.state, group)
        if plan is None:
            return None
        plans.append(plan)
    hidden = []
    for group, (params, grads, states, steps, kwargs) in zip(optimizer.param_groups, plans):
        if not params:
            continue
        beta1, beta2 = group["betas"]
        adam([p._local_tensor for p in params], [g._local_tensor for g in grads],
             *[[t._local_tensor for t in ts] for ts in states], steps, beta1=beta1, beta2=beta2, lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["eps"], **kwargs)
        hidden.append((params, grads))
    for params, _ in hidden:
        for p in params:
            p.grad = None
    return hidden


def _group_plan(state: dict, group: dict) -> tuple | None:
    """(DTensor parameters to step locally, their gradients, [exp_avgs, exp_avg_sqs, max_exp_avg_sqs], their steps,
    adam's other arguments); None where the whole optimizer must step itself (a DTensor whose state is not made
    yet, or a group setting this does not cover). One loop, no calls per parameter but the state lookup: this runs
    every step."""
    if group.get("differentiable") or "decoupled_weight_decay" not in group:
        return None
    amsgrad = group["amsgrad"]
    with_grad = [p for p in group["params"] if p.grad is not None]
    taken = []
    for p in with_grad:
        if type(p) is not DTensor:
            continue  # the optimizer's own loop steps it
        g, s = p.grad, state.get(p)
        if not s or "exp_avg" not in s or (amsgrad and "max_exp_avg_sq" not in s):
            return None  # the first step makes the state: torch's own
        spec, shape = p._spec, p._local_tensor.shape
        for t in (g, s["exp_avg"], s["exp_avg_sq"], s["max_exp_avg_sq"] if amsgrad else g):
            if (type(t) is not DTensor or t._spec.mesh is not spec.mesh or t._spec.placements != spec.placements
                    or t._local_tensor.shape != shape):
                return None
        if p.dtype.is_complex:
            return None
        taken.append((p, g, s))
    params, grads = [p for p, _, _ in taken], [g for _, g, _ in taken]
    states = [[s[name] for _, _, s in taken] for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")[:2 + amsgrad]]
    steps = [s["step"] for _, _, s in taken]
    foreach, fused = group["foreach"], group["fused"]
    if params and fused is None and foreach is None:  # what adam() decides over the group's parameters
        _, foreach = _default_to_fused_or_foreach(with_grad, False, use_fused=False)
        if foreach and isinstance(group["lr"], torch.Tensor) and not group["capturable"]:
            foreach = False
    if not amsgrad:
        states.append([])
    return params, grads, states, steps, dict(
        amsgrad=amsgrad, maximize=group["maximize"], foreach=bool(foreach), fused=bool(fused),
        capturable=group["capturable"], differentiable=False, has_complex=False,
        decoupled_weight_decay=group["decoupled_weight_decay"])


def give_back(hidden: list | None) -> None:
    """Put back the gradients step_locally hid."""
    for params, grads in hidden or ():
        for p, g in zip(params, grads):
            p.grad = g
