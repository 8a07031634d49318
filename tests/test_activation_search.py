"""The memory planner's search (planning/activation_search.py) called directly, single process, no compile: a real
partition of a small MLP and a `measure` that counts the bytes the forward saves (the FX plan) and, for the code,
adds a fixed excess, as inductor's code can keep more alive than the FX order."""
import contextlib

import torch
import torch.fx as fx
from functorch.compile import aot_function, min_cut_rematerialization_partition, nop

from zcompile.compiler.planning import activation_search, recompute, timeline
from zcompile.compiler.planning.activation_search import ActivationSearch
from zcompile.compiler.tracing.partition import MinCut


def _mlp(x, w1, w2, w3):
    h1 = torch.tanh(x @ w1)
    h2 = torch.tanh(h1 @ w2)
    h3 = torch.sigmoid(h2 @ w3)
    return (h3 * h1.sum()).sum()


def _partition():
    """(joint graph, its inputs, number of forward outputs, forward, backward) of _mlp, as AOTAutograd hands them."""
    got = {}

    def partition(joint, inputs, *, num_fwd_outputs, **kw):
        got.update(joint=joint, inputs=inputs, n=num_fwd_outputs, kw=kw)
        fw, bw = min_cut_rematerialization_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kw)
        got.update(fw=fw, bw=bw)
        return fw, bw
    xs = [torch.randn(64, 64, requires_grad=True) for _ in range(4)]
    aot_function(_mlp, fw_compiler=nop, bw_compiler=nop, partition_fn=partition)(*xs)
    return got


def _saved_bytes(fw: fx.GraphModule, n: int) -> int:
    return sum(map(recompute.nbytes, recompute.saved_tensors(fw, n)))


class _Measure:
    """The FX plan's peak: the forward's saved bytes; the code's: that plus `excess` where compiled."""

    def __init__(self, n: int, excess: int = 0):
        self.n, self.excess, self.calls = n, excess, []

    def __call__(self, graphs, offload_saved=frozenset(), compile_within=None, over=None):
        self.calls.append((compile_within, over))
        fx_peak = _saved_bytes(graphs["forward"], self.n)
        compiled = compile_within is not None and fx_peak <= compile_within
        return fx_peak, fx_peak + self.excess if compiled else fx_peak


def _search(measure, n, follows_code=False):
    return ActivationSearch(measure, follows_code=follows_code, cost=timeline.CostModel.cpu(), num_fwd_outputs=n,
                            device=torch.device("cpu"), activation_min_bytes=0)


def test_a_partition_that_fits_is_left_as_it_is():
    p = _partition()
    measure = _Measure(p["n"])
    peak = _saved_bytes(p["fw"], p["n"])
    assert _search(measure, p["n"]).run(p["fw"], p["bw"], None, budget=peak) is None
    assert measure.calls == [(peak, None)]  # one trial, compiled within the budget


def test_the_rewrite_recomputes_until_the_saved_bytes_fit():
    """Without the partitioner (blocks kept as regions), zcompile's rewrite: fewer saved bytes, within the budget,
    a summary line and one line per saved activation, nothing offloaded on the CPU."""
    p = _partition()
    before = recompute.saved_tensors(p["fw"], p["n"])
    peak = _saved_bytes(p["fw"], p["n"])
    budget = peak * 3 // 4
    plan = _search(_Measure(p["n"]), p["n"]).run(p["fw"], p["bw"], None, budget)
    assert plan is not None and plan.offload_saved == frozenset() and plan.notes == []
    assert _saved_bytes(plan.forward, p["n"]) <= budget < peak
    assert "recompute" in plan.report[0] and len(plan.report) == 1 + len(before), plan.report
    assert "recompute" in "".join(plan.report[1:])


def _asking(min_cut):
    """min_cut, recording the fractions asked for."""
    asked = []

    def spy(fraction=None):
        asked.append(fraction)
        return min_cut(fraction)
    return spy, asked


class _RewriteFitsNothing(ActivationSearch):
    """The search where zcompile's rewrite of the partition it is handed finds no plan below the budget."""

    def _rewrite_activations(self, fw, bw, budget):
        if not getattr(self, "handed", False):
            self.handed = True  # the partition's own rewrite, the first one asked for
            chosen, seconds, _, every = super()._rewrite_activations(fw, bw, budget)
            return chosen, seconds, float("inf"), every
        return super()._rewrite_activations(fw, bw, budget)


def test_the_rewrite_comes_first_and_the_knapsack_where_it_does_not_fit():
    """With the joint graph at hand, zcompile's rewrite of the partition is tried first: where it fits, no
    partition is asked for. Where it does not, the largest knapsack fraction whose partition fits is taken (then
    bisected toward the next larger one), and the report names it."""
    p = _partition()
    peak = _saved_bytes(p["fw"], p["n"])
    min_cut = MinCut(p["joint"], p["inputs"], p["n"], lambda phase: contextlib.nullcontext(), **p["kw"])
    spy, asked = _asking(min_cut)
    plan = _search(_Measure(p["n"]), p["n"]).run(p["fw"], p["bw"], spy, peak - 1)
    assert plan is not None and _saved_bytes(plan.forward, p["n"]) < peak and asked == []
    assert "activation_memory_budget" not in plan.report[0] and "recompute" in plan.report[0], plan.report
    spy, asked = _asking(min_cut)
    search = _RewriteFitsNothing(_Measure(p["n"]), follows_code=False, cost=timeline.CostModel.cpu(),
                                 num_fwd_outputs=p["n"], device=torch.device("cpu"), activation_min_bytes=0)
    plan = search.run(p["fw"], p["bw"], spy, peak - 1)
    assert plan is not None and _saved_bytes(plan.forward, p["n"]) < peak
    assert asked[0] == activation_search.PARTITION_FRACTIONS[0]
    assert "activation_memory_budget" in plan.report[0], plan.report


def test_a_plan_over_the_budget_in_the_code_is_planned_again_lower():
    """Following the code: a plan whose compiled peak is over the budget by `excess` is searched again for a
    budget lowered by the excess, at most PLAN_ROUNDS times, each round noted; the report gives the code's peak."""
    p = _partition()
    peak = _saved_bytes(p["fw"], p["n"])
    budget = peak * 3 // 4
    excess = peak // 8
    plan = _search(_Measure(p["n"], excess), p["n"], follows_code=True).run(p["fw"], p["bw"], None, budget)
    assert plan is not None and "as compiled by inductor" in plan.report[0]
    assert _saved_bytes(plan.forward, p["n"]) + excess <= budget
    assert 1 <= len(plan.notes) < activation_search.PLAN_ROUNDS and "planning again" in plan.notes[0]

