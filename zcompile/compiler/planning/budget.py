"""What a memory budget decides once the activation plan is made: which parameters stay whole (stage 3), where
'auto' optimizer state lives, and whether the planned step fits (else a MemoryBudgetError naming each term)."""
from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.fx as fx

from zcompile import config as zconfig
from zcompile.compiler.graph.tangents import tangents
from zcompile.compiler.planning import liveness, planner, recompute
from zcompile.config import Stage, Tier
from zcompile.errors import MemoryBudgetError


def plan_persistence(cfg: zconfig.Config, device: torch.device, params: list, activation_planned: bool,
                     step_peak: Callable[[], int]) -> str | None:
    """Stage 3: decide which parameters of this graph stay whole (planner.choose_persistent); returns the note to
    show, if any. With a memory budget, the headroom is the budget minus `step_peak()`, the planned step peak with
    every parameter sharded; none where the activation plan had to recompute or offload to fit
    (`activation_planned`: whole parameters would take back what that costs step time to free)."""
    undecided = [zp for zp in params
                 if zp.stage == Stage.PARAMETERS and not zp.persist_decided and zp.param_tier == Tier.DEVICE]
    if not undecided:
        return None
    budget = cfg.memory_budget_bytes(device)
    headroom = None
    if budget is not None and not activation_planned:  # memory freed by recomputing is not spent again
        headroom = max(0, budget - step_peak())
    chosen, why = planner.choose_persistent(undecided, cfg.persist_threshold_bytes, headroom)
    for zp in undecided:
        zp.persist_decided = True
        zp.persistent = zp in chosen  # decided here; the commit step gives them their whole buffers
    return why if chosen or budget is not None or cfg.persist_threshold_bytes else None


def note_unbounded_sizes(graphs: dict[str, fx.GraphModule], source: str, graph_text: str) -> str | None:
    """memory_budget checks a dynamic size at its declared maximum; one without is checked only at its
    compile-time value: say so (a warning, and the note returned, also put in the graphs' dumps), since a larger
    batch may then not fit. `source`: the config; `graph_text`: which graph, for the message."""
    sizes = {k: v for gm in graphs.values() for k, v in liveness.unbounded_sizes(gm).items()}
    if not sizes:
        return None
    msg = (f"{source}: memory_budget is checked with the dynamic sizes "
           + ", ".join(f"{k} = {v}" for k, v in sorted(sizes.items()))
           + f" of {graph_text} at their compile-time values: nothing declares their maximum, so a larger batch or "
           "sequence is not checked against the budget. Declare it with torch._dynamo.mark_dynamic(x, dim, min=..., "
           "max=...) on the inputs")
    for gm in graphs.values():
        gm.meta.setdefault("zc_notes", []).append(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=4)
    return msg


def check(cfg: zconfig.Config, device: torch.device, params: list, graphs: dict[str, fx.GraphModule],
          lives: dict[str, liveness.Liveness], notes: list[str], activation_report: list[str], graph_text: str,
          run_graphs: dict[str, fx.GraphModule] | None = None) -> None:
    """A plan whose step peak (`lives`: each graph's liveness, as compiled) exceeds `memory_budget` fails here
    (over_budget: error), before anything runs; 'auto' optimizer state is placed. Appends its notes to `notes` and
    the graphs'. `run_graphs`: the graphs as run, where they differ (a loss-only backward)."""
    budget = cfg.memory_budget_bytes(device)
    if budget is None:
        for zp in params:
            zp.decide_optimizer_tier(offload=False)  # 'auto' without a budget: nothing asks to offload
        return
    note = note_unbounded_sizes(graphs, cfg.source, graph_text)
    if note:
        notes.append(note)
    state = planner.model_state(params)
    peak = planner.step_peak(state, lives, cfg.accumulate_grads)
    auto = [zp for zp in params if zp.optim_tier == Tier.AUTO]
    if auto:  # offload.optimizer auto: the optimizer state stays on the device if the step fits with it there
        for zp in auto:
            zp.decide_optimizer_tier(offload=peak > budget)
        notes.append(f"offload: optimizer state of {len(auto)} param(s) "
                     + ("on the host (the step does not fit the budget with it on the device)"
                        if peak > budget else "on the device (the step fits the budget)"))
        for gm in graphs.values():
            gm.meta.setdefault("zc_notes", []).append(notes[-1])
        state = planner.model_state(params)
        peak = planner.step_peak(state, lives, cfg.accumulate_grads)
    if peak <= budget:
        return
    worst, terms = planner.peak_terms(state, lives, cfg.accumulate_grads)
    msg = (f"{cfg.source}: planned step peak {liveness.fmt(peak)} per rank exceeds memory_budget "
           f"{liveness.fmt(budget)}: " + " + ".join(f"{what} {liveness.fmt(n)}" for what, n in terms))
    if worst is None:
        msg += " (the optimizer step)"
    else:
        g = lives[worst]
        msg += (f" + {worst} graph inputs {liveness.fmt(g.input_bytes)} (shards, batch"
                + tangents_note((run_graphs or graphs)[worst]) + ") "
                f"+ transient peak {liveness.fmt(g.peak_bytes)} after {g.peak_node}"
                + (f" (with the saved activations, {liveness.fmt(g.saved_bytes)} at the backward's start)"
                   if g.saved_bytes else ""))
    msg += (". Offload moves state off the device: offload.optimizer (cpu/nvme), offload.params (cpu/nvme, "
            "stage 3), offload.activations (cpu); tiling splits large linears")
    if activation_report:
        msg += (f". This is already the smallest plan the memory planner found ({activation_report[0]}); "
                f"it needs a memory_budget of at least {liveness.fmt(peak)}")
    if cfg.over_budget == "warn":
        for gm in graphs.values():
            gm.meta.setdefault("zc_notes", []).append(f"OVER BUDGET: {msg}")
        return
    raise MemoryBudgetError(msg)


def tangents_note(gm: fx.GraphModule) -> str:
    """The backward's gradients of non-scalar forward outputs, as the backward run takes them: where the graph
    returns no scalar loss (codegen/output_grads.py drops them beside one), each output that requires a gradient
    gets one, zero-filled by autograd where no loss uses it, and they count."""
    outs = [n for n in tangents(gm) if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].numel() > 1]
    if not outs:
        return ""
    nbytes = sum(map(recompute.nbytes, outs))
    return (f", gradients of {len(outs)} forward output(s) {liveness.fmt(nbytes)}: this graph returns no scalar "
            "loss, so its backward takes a gradient for every output that requires one (autograd fills one no loss "
            "uses with zeros): return the loss from the compiled model, or detach what no loss uses")
