"""The memory planner's search for an activation plan that fits a memory budget: which saved activations the step
keeps, recomputes or (on an accelerator) offloads.

The search is handed a partition (forward and backward), optionally the partitioner itself (`min_cut(fraction)`)
and a way to measure a trial (`measure(graphs, offload_saved, compile_within, over) -> (FX plan's step peak, the
compiled code's)`, which the backend gives by running the split passes on copies and compiling them); it returns
the graphs to go on with and its decisions (`ActivationPlan`), or None where the partition fits as it is.
"""
from __future__ import annotations

import dataclasses
import gc
from typing import Callable

import torch
import torch.fx as fx

from zcompile.compiler.graph import graph_copies
from zcompile.compiler.planning import activation_plan, liveness, planner, timeline

# _knapsack_partition: the fractions of saved activation memory the partitioner's knapsack is asked to keep, in order
PARTITION_FRACTIONS = (0.5, 0.25, 0.12, 0.06, 0.03)
PARTITION_REFINE = 3  # bisection steps between the fraction that fits and the next larger one
PLAN_ROUNDS = 3  # activation plans compiled to check their peak in inductor's code

Measure = Callable[..., tuple[int, int]]


@dataclasses.dataclass
class ActivationPlan:
    forward: fx.GraphModule
    backward: fx.GraphModule
    offload_saved: frozenset  # the saved activations the forward sends to the host
    report: list[str]  # a summary line, then each saved activation's decision (activation_plan.report)
    notes: list[str]  # what the search did on the way (plans compiled over the budget and planned again)


class ActivationSearch:
    """`measure` as in the module doc; `follows_code`: its second peak comes from compiled code (inductor), which
    the search then checks each plan against."""

    def __init__(self, measure: Measure, *, follows_code: bool, cost: timeline.CostModel, num_fwd_outputs: int,
                 device: torch.device, activation_min_bytes: int):
        self.measure, self.follows_code, self.cost = measure, follows_code, cost
        self.num_fwd_outputs, self.device, self.activation_min_bytes = num_fwd_outputs, device, activation_min_bytes
        self.offload_saved: frozenset = frozenset()
        self.report: list[str] = []

    def peak(self, graphs: dict, offload_saved: frozenset = frozenset(), compiled: bool = False,
             over: float | None = None) -> int:
        """The measured step peak of a trial: the FX plan's, or with `compiled` the code's (`over` as measure's)."""
        return self.measure(graphs, offload_saved, float("inf") if compiled else None, over)[1]

    def run(self, fw: fx.GraphModule, bw: fx.GraphModule, min_cut, budget: int) -> ActivationPlan | None:
        """Recompute (or offload) saved activations until the step fits `budget`. First zcompile's rewrite of `fw`
        and `bw` (_rewrite_activations: per saved activation keep, recompute or offload, the cheapest per byte
        first); where that does not fit and `min_cut(fraction)` can partition the whole joint graph again, the
        partitioner's own recompute knapsack (_knapsack_partition), then the rewrite from the knapsack's partition
        that came closest. The search plans from the FX graphs; where the code is followed, the
        plan found is compiled and its peak read from the code: where that is over the budget (inductor's fusion
        keeps more alive than the FX order does), the search runs again for a budget lowered by the excess, up to
        PLAN_ROUNDS times."""
        peak, code = self.measure({"forward": fw, "backward": bw}, frozenset(), budget, None)
        if code <= budget:
            return None
        notes: list[str] = []
        originals = [graph_copies.copy(gm) for gm in (fw, bw)] if self.follows_code else []
        target = budget - (code - peak)
        for round_ in range(PLAN_ROUNDS):
            if round_:  # the rewrite works in place: start again from copies of the partition
                fw, bw = (graph_copies.copy(g) for g in originals)
            f, b, planned = self._plan_for(fw, bw, min_cut, peak, target, budget)
            if not self.follows_code:
                break
            code = self.peak({"forward": f, "backward": b}, self.offload_saved, compiled=True, over=budget)
            if code <= budget:
                break
            lower = min(target, planned) - (code - budget)  # below this plan's FX peak: another plan
            notes.append(f"memory planner: the plan for {liveness.fmt(target)} compiles to a step peak of "
                         f"{liveness.fmt(code)} (inductor's code), over memory_budget "
                         f"{liveness.fmt(budget)}: planning again for {liveness.fmt(lower)}")
            target = lower
        if self.follows_code:
            self.report[0] += f"; as compiled by inductor: step peak {liveness.fmt(code)} (its code)"
        return ActivationPlan(f, b, self.offload_saved, self.report, notes)

    def _plan_for(self, fw: fx.GraphModule, bw: fx.GraphModule, min_cut, peak: int, target: int, budget: int
                  ) -> tuple[fx.GraphModule, fx.GraphModule, int]:
        """The search for a planned (FX) step peak of at most `target`: the forward and backward chosen and their
        planned peak, with self.report and self.offload_saved set. The rewrite of the partition comes first: it
        needs no partition of its own (each knapsack fraction costs a min-cut of the whole joint graph, ~10 s at
        Llama 2 7B's 32 layers), and where both fit, its plan was the cheaper one by the cost model or within 12%
        of the knapsack's (docs/planner.md). Where nothing fits, the rewrite of the partition is the smallest plan
        found."""
        self.offload_saved = frozenset()
        f, b = (graph_copies.copy(g) for g in (fw, bw)) if min_cut else (fw, bw)  # the rewrite works in place
        own = self._rewrite_activations(f, b, target)
        if own[2] <= target or not min_cut:
            return self._rewritten(f, b, own, peak, budget)
        fits, closest = self._knapsack_partition(min_cut, peak, target)
        if fits is not None:
            fraction, kf, kb, planned = fits
            self.report = activation_plan.partition_report(fw, bw, kf, kb, self.num_fwd_outputs, fraction, self.cost,
                                                           peak, planned, budget)
            return kf, kb, planned
        if closest is not None:
            fraction, kf, kb, start_peak = closest
            theirs = self._rewrite_activations(kf, kb, target)
            if theirs[2] <= target:
                plan = self._rewritten(kf, kb, theirs, start_peak, budget)
                self.report[0] += (f"; from the partitioner's recompute knapsack at activation_memory_budget "
                                   f"{fraction:.3g} (planned step peak {liveness.fmt(peak)} with every saved "
                                   "activation kept)")
                self.report += activation_plan.partition_report(fw, bw, kf, kb, self.num_fwd_outputs, fraction,
                                                                self.cost, peak, start_peak, budget)
                return plan
        return self._rewritten(f, b, own, peak, budget)

    def _rewritten(self, f: fx.GraphModule, b: fx.GraphModule, rewrite: tuple, start_peak: int, budget: int
                   ) -> tuple[fx.GraphModule, fx.GraphModule, int]:
        """A rewrite's graphs and planned peak, with self.report and self.offload_saved set from its choices."""
        chosen, seconds, planned, every = rewrite
        self.offload_saved = frozenset(c.name for c in chosen if c.action == "offload")
        self.report = activation_plan.report(every, chosen, seconds, start_peak, planned, budget)
        return f, b, planned

    def _knapsack_partition(self, min_cut, peak: int, budget: int) -> tuple:
        """The partitioner's knapsack (`activation_memory_budget`): the largest of PARTITION_FRACTIONS whose
        planned step peak fits, then bisected PARTITION_REFINE times toward the next larger one (the peak is not
        monotone in the fraction: this finds a boundary, not the largest fraction that fits), as (fraction, forward,
        backward, peak); and where none fits, None and the one with the lowest peak below `peak` (or None)."""
        fits, over, closest = None, 1.0, None
        for fraction in PARTITION_FRACTIONS:
            f, b = min_cut(fraction)
            p = self.peak({"forward": f, "backward": b})
            if p <= budget:
                fits = (fraction, f, b, p)
                break
            over = fraction
            if p < (closest[3] if closest else peak):  # below some fraction the knapsack's peak rises again
                closest = (fraction, f, b, p)
        if fits is None:
            return None, closest
        for _ in range(PARTITION_REFINE):
            middle = (fits[0] + over) / 2
            f, b = min_cut(middle)
            p = self.peak({"forward": f, "backward": b})
            if p <= budget:
                fits = (middle, f, b, p)
            else:
                over = middle
        return fits, None

    def _rewrite_activations(self, fw: fx.GraphModule, bw: fx.GraphModule, budget: int) -> tuple:
        """zcompile's rewrite on one partition, in place: (choices made, seconds they add, planned peak, every
        saved activation's choice or keep)."""
        n_out, cost = self.num_fwd_outputs, self.cost
        options, kept = activation_plan.options(fw, n_out, cost, self.device, self.activation_min_bytes)

        def peak_of(chosen):
            f, b = (graph_copies.copy(gm) for gm in (fw, bw))
            chosen, _ = activation_plan.apply(f, b, n_out, chosen, cost)
            offload = frozenset(c.name for c in chosen if c.action == "offload")
            try:
                return self.peak({"forward": f, "backward": b}, offload)
            finally:  # the collector is paused while compiling: each trial's graphs are cycles, all young (a full
                del f, b  # collection walks the whole heap: ~0.5 s a trial on Hugging Face's Llama)
                gc.collect(1)

        chosen, planned = planner.choose_activations(options, peak_of, budget)
        chosen, seconds = activation_plan.apply(fw, bw, n_out, chosen, cost)
        return chosen, seconds, planned, options + kept
