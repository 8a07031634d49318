"""The `zero` dynamo backend: dynamo graph -> passes -> AOTAutograd -> passes on forward/backward -> compiler.

    torch.compile(model, backend="zero", options={"config": "zero3.yaml"})

Parameters arrive as graph inputs and are identified by identity (`example_inputs[i]` is the nn.Parameter), so graph
breaks and recompiles map them to the same shards. The returned callable replaces each parameter argument with the
tensor the graph was compiled for (the shard at stages 2/3) and appends the side inputs a pass asked for.

Compiling decides; committing acts. The passes and the planner only rewrite graphs and record decisions (side
inputs, subgroups, which parameters stay whole, where optimizer state lives). `_GraphCompile.commit_graph` is the
one step that turns them into runtime state: process groups, whole-parameter buffers and their all-gather, host
masters, the compiled graph and the function that runs it. `zcompile plan` compiles without committing
(`dry_backend`): nothing is allocated or communicated, and the "run" returns meta tensors.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import gc
import inspect
import itertools
import time
import warnings
import weakref
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module
from torch._guards import detect_fake_mode
from torch._inductor.decomposition import select_decomp_table
from torch.utils._python_dispatch import _disable_current_modes

from zcompile import config as zconfig
from zcompile.compiler import backends, collectives, liveness, passes, planner, schedule_check, timeline
from zcompile.compiler import activation_plan, aot_graph_logs, before_trace, block_regions, fake_values, graph_cache
from zcompile.compiler import blocks, recompute, trace_blocks_once, wrapper_memory
from zcompile.compiler.backends import regions
from zcompile.runtime import dtensor_params, groups, memory_trace, nonfinite, offload_engine, shard_store
from zcompile.runtime import collective_traffic
from zcompile.runtime.dist_context import DistContext
from zcompile.compiler.dump import GraphDumper
from zcompile.errors import MemoryBudgetError, ZCompileError, ZeroError, reported_as_zcompile_errors
from zcompile.compiler.pass_context import PassContext, SideInput
from zcompile.compiler.passes import placement
from zcompile.compiler.topology import Topology
from zcompile.config import Stage, Tier

_graph_ids = itertools.count()  # numbers graphs in dumps and messages, per process
# _knapsack_partition: the fractions of saved activation memory the partitioner's knapsack is asked to keep, in order
PARTITION_FRACTIONS = (0.5, 0.25, 0.12, 0.06, 0.03)
PARTITION_REFINE = 3  # bisection steps between the fraction that fits and the next larger one
PLAN_ROUNDS = 3  # activation plans compiled to check their peak in inductor's code (plan_activations)


def _set_placeholder_vals(gm: fx.GraphModule, pctx: PassContext) -> None:
    """Shard placeholders take shard-shaped fake values; side-input placeholders take full-shape ones. A whole
    parameter's shard is a view of its full buffer, as at run time, so liveness counts that storage once."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([n.meta.get("val") for n in phs if "val" in n.meta])
    buffers: dict = {}

    def full_buffer(zp):
        if zp not in buffers:
            buffers[zp] = torch.empty(zp.padded_numel, dtype=zp.dtype, device=pctx.dist.device)
        return buffers[zp]

    with fake_mode:
        for ph in pctx.param_placeholders(gm).values():
            ph.meta[liveness.PARAMETER] = True
        if pctx.cfg.stage >= Stage.GRADIENTS:
            for i, ph in pctx.param_placeholders(gm).items():
                zp = pctx.params[i]
                if zp.keeps_full:
                    ph.meta["val"] = full_buffer(zp)[zp.rank * zp.shard_numel:(zp.rank + 1) * zp.shard_numel]
                else:
                    where = pctx.dist.device if zp.param_tier == Tier.DEVICE else "cpu"
                    ph.meta["val"] = torch.empty(zp.shard_numel, dtype=zp.dtype, device=where)
                pctx.own_placeholders.add(ph.name)
        for ph in phs:
            side = ph.meta.get("zc_side")
            if side is None:
                continue
            zp = side.zp
            if side.kind == "full":
                ph.meta["val"] = full_buffer(zp)[: zp.numel].view(zp.shape)
                ph.meta[liveness.PARAMETER] = True
            else:
                ph.meta["val"] = torch.empty(zp.secondary_numel, dtype=zp.secondary_dtype, device=pctx.dist.device)
            pctx.own_placeholders.add(ph.name)


def _tangents_note(gm: fx.GraphModule) -> str:
    """The backward's gradients of non-scalar forward outputs: autograd fills one with zeros for every output the
    loss does not use (the logits beside a loss, a Hugging Face model's K/V cache), and they count."""
    outs = [n for n in gm.graph.find_nodes(op="placeholder") if n.name.startswith("tangents")
            and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].numel() > 1]
    if not outs:
        return ""
    nbytes = sum(map(recompute.nbytes, outs))
    return (f", gradients of {len(outs)} forward output(s) {liveness.fmt(nbytes)}: one the loss does not use is "
            "zero-filled by autograd, e.g. a Hugging Face model's K/V cache (call it with use_cache=False) or "
            "logits returned beside the loss")


class _GraphCompile:
    """One dynamo graph's trip through the passes and the compiler."""

    def __init__(self, cfg: zconfig.Config, ctx: DistContext, params: dict[int, shard_store.ShardedParam],
                 num_args: int, identity: int = 0, inputs_text: str = "", commit: bool = True):
        self.cfg, self.ctx, self.params, self.num_args = cfg, ctx, params, num_args
        self.commit = commit  # False: a dry compile (zcompile plan), whose graphs are analyzed, never run
        self.identity, self.inputs_text = identity, inputs_text  # schedule_check.graph_identity; what the inputs are
        self.graph_id = next(_graph_ids)
        self.topology = Topology.resolve(ctx.world, cfg.ranks_per_node, cfg.source)
        for zp in params.values():
            zp.cross_fraction = self.topology.cross_fraction(range(ctx.world))
        self.dump = GraphDumper(cfg.dump_dir, ctx.rank, self.graph_id)
        self.final: dict[str, fx.GraphModule] = {}
        self.planned: dict[str, liveness.Liveness] = {}  # liveness of each final graph, as compiled
        self.code_layouts: dict = {}  # (kind, _identity) -> what inductor's code allocates (code_liveness)
        self.trials: dict | None = None  # within plan_activations: (graphs' _identity, offloaded) -> FX step peak
        self.notes: list[str] = []  # planner decisions, shown at the top of every dump of this graph
        self.num_fwd_outputs = 0
        self.offloaded: dict[str, int] = {}  # saved activations the forward sends to the host, by name
        self.offload_saved: frozenset = frozenset()  # of those, the ones the planner chose (plan_activations)
        self.activation_plan: list[str] = []  # plan_activations' decision per saved activation, for the user
        self.times: dict[str, float] = {}  # seconds spent per compile phase (bench/compile_time.py reads them)
        # graph kind -> (regions, regions running compiled code, distinct regions compiled)
        self.regions: dict[str, tuple[int, int, int]] = {}
        self.regions_kept = False  # the blocks traced once went through AOTAutograd as regions (block_regions)
        self.schedule: tuple[int, str] = (0, "")  # schedule_check.fingerprint of the compiled graphs
        # kind -> (final graph, its pass context, subgroup names -> process group names), as committed
        self.committed: dict[str, tuple[fx.GraphModule, PassContext, dict[str, str]]] = {}

    @contextlib.contextmanager
    def timed(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - t0

    def pctx(self, kind: str, offloaded: dict | None = None, offload_saved: frozenset | None = None) -> PassContext:
        return PassContext(self.cfg, self.ctx, kind, self.params, self.num_args, self.topology,
                           num_fwd_outputs=self.num_fwd_outputs,
                           offloaded=self.offloaded if offloaded is None else offloaded,
                           offload_saved=self.offload_saved if offload_saved is None else offload_saved)

    def dumper(self, kind: str):
        """on_pass for run_phase: dump the graph after each pass (None when not dumping)."""
        return (lambda name, gm: self.dump(kind, name, gm)) if self.dump.dir else None

    def split_passes(self, gm: fx.GraphModule, kind: str, trial: dict | None = None,
                     offload_saved: frozenset | None = None) -> tuple[fx.GraphModule, PassContext]:
        """`trial`: a scratch record of offloaded activations for a trial run on copies (nothing is kept), which
        may offload the saved activations `offload_saved` instead of the planner's. The graph to keep, over a
        memory budget, is split again with the bucket cap halved until it fits (a bucket's members are alive
        together) or no bucket holds two collectives."""
        budget = self.cfg.memory_budget_bytes(self.ctx.device) if trial is None else None
        original = placement.copy_graph(gm.graph) if budget is not None and self.cfg.bucket_mb > 0 else None
        cap = None
        while True:
            gm, pctx = self._split_once(gm, kind, trial, offload_saved, cap)
            if original is None or cap == 0 or (cap is None and not pctx.bucketed):
                return gm, pctx
            peak = planner.step_peak(planner.model_state(list(self.params.values())), {kind: liveness.analyze(gm)},
                                     self.cfg.accumulate_grads)
            if peak <= budget:
                return gm, pctx
            # no bucket left to split: none at all (a bucket of one still copies its member through a flat buffer)
            cap = (self.cfg.bucket_mb * 2**20 if cap is None else cap) / 2 if pctx.bucketed else 0.0
            self.notes.append(f"bucket_collectives: the {kind} planned a step peak of {liveness.fmt(peak)}, over "
                              f"memory_budget {liveness.fmt(budget)}: split again with "
                              + (f"buckets of up to {liveness.fmt(cap)}" if cap else "one collective per parameter"))
            gm = _copy(gm, original)

    def _split_once(self, gm: fx.GraphModule, kind: str, trial: dict | None, offload_saved: frozenset | None,
                    cap: float | None) -> tuple[fx.GraphModule, PassContext]:
        pctx = self.pctx(kind, trial, offload_saved)
        pctx.bucket_bytes = cap
        self.mark_compiler(gm)
        if trial is None:
            gm.meta["zc_notes"] = list(self.notes)
            self.dump(kind, "input", gm)
        with self.timed("zcompile passes"):
            gm = passes.run_phase("split", gm, pctx, None if trial is not None else self.dumper(kind))
            collectives.mark_cross_node(gm, self.topology, range(self.ctx.world))
            _set_placeholder_vals(gm, pctx)
        with self.timed("fake propagation"):
            fake_values.refresh(gm)
        if trial is None:
            self.final[kind] = gm
        return gm, pctx

    def cost_model(self) -> timeline.CostModel:
        return timeline.CostModel.cpu() if self.ctx.device.type == "cpu" else timeline.CostModel()  # meta: a plan

    def trial_peak(self, graphs: dict[str, fx.GraphModule], offload_saved: frozenset = frozenset(),
                   compiled: bool = False, over: float | None = None) -> int:
        """The planned step peak of `graphs` (kind -> graph), from the split passes run on copies of them
        (parameters not yet decided whole count as sharded). `compiled`: with the copies compiled as they will be,
        where inductor's code says what it allocates (wrapper_memory; the FX plan with backend eager); `over`: the
        compiles stop once the graphs compiled so far, the backward first, put the step over it (the others could
        only add), and the peak returned is theirs."""
        return self.trial_peaks(graphs, offload_saved, float("inf") if compiled else None, over)[1]

    def trial_peaks(self, graphs: dict[str, fx.GraphModule], offload_saved: frozenset = frozenset(),
                    compile_within: float | None = None, over: float | None = None) -> tuple[int, int]:
        """(the FX plan's step peak, the compiled code's) of `graphs`, from one run of the split passes on copies:
        the copies are compiled only where the code is followed (follows_code) and the FX peak is within
        `compile_within`; otherwise the second is the first. `over`: as in trial_peak."""
        key = None
        if self.trials is not None:  # within plan_activations: later rounds plan the same graphs again
            key = (tuple((kind, _identity(gm)) for kind, gm in graphs.items()), offload_saved)
            peak = self.trials.get(key)
            if peak is not None and (compile_within is None or peak > compile_within or not self.follows_code()):
                return peak, peak
        scratch: dict = {}  # the trial's forward tells its backward which activations it offloaded
        copies = {kind: _copy(gm) for kind, gm in graphs.items()}
        self.mark_released(copies)
        split = {kind: self.split_passes(gm, kind, trial=scratch, offload_saved=offload_saved)[0]
                 for kind, gm in copies.items()}
        lives = {kind: liveness.analyze(gm) for kind, gm in split.items()}
        state = planner.model_state(list(self.params.values()))
        peak = planner.step_peak(state, lives, self.cfg.accumulate_grads)
        if key is not None:
            self.trials[key] = peak
        if compile_within is None or peak > compile_within or not self.follows_code():
            return peak, peak
        code: dict[str, liveness.Liveness] = {}
        with self.timed("trial compile"):
            for kind in sorted(split, key=lambda k: k != "backward"):  # where inductor's code outgrows the plan
                code[kind] = self.code_liveness(split[kind], kind, lives[kind])
                if over is not None and planner.step_peak(state, code, self.cfg.accumulate_grads) > over:
                    break
        return peak, planner.step_peak(state, code, self.cfg.accumulate_grads)

    def follows_code(self) -> bool:
        """Whether the planned peak comes from the compiled code (wrapper_memory): inductor in regions or one
        graph (nested regions call subgraphs, which it does not follow)."""
        return self.cfg.backend == "inductor" and self.cfg.regional_compile != "nested"

    def code_liveness(self, gm: fx.GraphModule, kind: str, planned: liveness.Liveness) -> liveness.Liveness:
        """`planned` with its peak from inductor's code for `gm`, compiled here as commit_graph will (a trial: the
        compile reports nothing to AOTAutograd; inductor's FX graph cache serves the commit's compile of the same
        graph, as graph_cache.region_compiles keys both alike)."""
        key = (kind, _identity(gm))
        if key not in self.code_layouts:  # a plan found again in a later round, or the final graphs check_budget reads
            fakes = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
            with regions.no_output_strides(), graph_cache.region_compiles():
                program = backends.compile_graph(self.cfg.backend, gm, fakes, kind, self.cfg.regional_compile)
            self.code_layouts[key] = getattr(program, "layout", None)
        layout = self.code_layouts[key]
        return wrapper_memory.graph_liveness(gm, planned, layout) if layout else planned

    def mark_compiler(self, gm: fx.GraphModule) -> None:
        """Liveness counts what the graph's compiler writes to memory: inductor's kernels keep values in registers."""
        if self.cfg.backend == "inductor":
            liveness.compiled_by_inductor(gm, self.cfg.regional_compile)

    def mark_released(self, graphs: dict[str, fx.GraphModule]) -> None:
        """The backward frees the saved activations only it holds after their last use (liveness.mark_released),
        and the gradients of the forward's outputs: AOTAutograd hands them over boxed (measured on
        bench/activation_budget.py's Llama: the zero-filled gradient of the logits beside the loss, 2 MiB, is gone
        by the backward's peak)."""
        if "forward" in graphs and "backward" in graphs:
            bw = graphs["backward"]
            tangents = {ph.name for ph in bw.graph.find_nodes(op="placeholder") if ph.name.startswith("tangents")}
            liveness.mark_released(bw, recompute.released_saved(graphs["forward"], self.num_fwd_outputs) | tangents)

    def plan_activations(self, fw: fx.GraphModule, bw: fx.GraphModule, min_cut=None
                         ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """With a memory budget the step does not fit, recompute (or, on an accelerator, offload) saved
        activations until it fits. First, where `min_cut(fraction)` can partition the whole joint graph again, the
        partitioner's own recompute knapsack (_knapsack_partition); where no fraction fits, zcompile's rewrite
        (_rewrite_activations: per saved activation keep, recompute or offload, the cheapest per byte first), from
        the knapsack's partition that came closest, then, where that does not fit, from `fw` and `bw`. The search
        plans from the FX graphs; with inductor, the plan found is compiled and its peak read from the code
        (wrapper_memory): where that is over the budget (inductor's fusion keeps more alive than the FX order
        does), the search runs again for a budget lowered by the excess, up to PLAN_ROUNDS times. Returns the
        forward and backward to go on with."""
        budget = self.cfg.memory_budget_bytes(self.ctx.device)
        if budget is None or not self.cfg.plan_activations:
            return fw, bw
        self.trials = {}
        try:
            return self._plan_activations(fw, bw, min_cut, budget)
        finally:
            self.trials = None

    def _plan_activations(self, fw: fx.GraphModule, bw: fx.GraphModule, min_cut, budget: int
                          ) -> tuple[fx.GraphModule, fx.GraphModule]:
        with self.timed("activation plan"):
            peak, code = self.trial_peaks({"forward": fw, "backward": bw}, compile_within=budget)
            if code <= budget:
                return fw, bw
            originals = [_copy(gm) for gm in (fw, bw)] if self.follows_code() else []
            target = budget - (code - peak)
            for round_ in range(PLAN_ROUNDS):
                if round_:  # the rewrite works in place: start again from copies of the partition
                    fw, bw = (_copy(g) for g in originals)
                f, b, planned = self._plan_for(fw, bw, min_cut, peak, target, budget)
                if not self.follows_code():
                    break
                code = self.trial_peak({"forward": f, "backward": b}, self.offload_saved, compiled=True, over=budget)
                if code <= budget:
                    break
                lower = min(target, planned) - (code - budget)  # below this plan's FX peak: another plan
                self.notes.append(f"memory planner: the plan for {liveness.fmt(target)} compiles to a step peak of "
                                  f"{liveness.fmt(code)} (inductor's code), over memory_budget "
                                  f"{liveness.fmt(budget)}: planning again for {liveness.fmt(lower)}")
                target = lower
            if self.follows_code():
                self.activation_plan[0] += f"; as compiled by inductor: step peak {liveness.fmt(code)} (its code)"
        where = f" (each decision: graph{self.graph_id}_activations.txt)" if self.dump.dir else ""
        self.notes.append(self.activation_plan[0] + where)
        self.dump.text("activations", self.activation_plan)
        return f, b

    def _plan_for(self, fw: fx.GraphModule, bw: fx.GraphModule, min_cut, peak: int, target: int, budget: int
                  ) -> tuple[fx.GraphModule, fx.GraphModule, int]:
        """plan_activations' search for a planned (FX) step peak of at most `target`: the forward and backward
        chosen and their planned peak, with self.activation_plan and self.offload_saved set."""
        cost = self.cost_model()
        self.offload_saved = frozenset()
        fits, closest = self._knapsack_partition(min_cut, peak, target) if min_cut else (None, None)
        if fits is not None:
            fraction, f, b, planned = fits
            self.activation_plan = activation_plan.partition_report(fw, bw, f, b, self.num_fwd_outputs,
                                                                    fraction, cost, peak, planned, budget)
            return f, b, planned
        for fraction, f, b, start_peak in ([closest] if closest else []) + [(None, fw, bw, peak)]:
            chosen, seconds, planned, every = self._rewrite_activations(f, b, target)
            if planned <= target:
                break
        self.offload_saved = frozenset(c.name for c in chosen if c.action == "offload")
        self.activation_plan = activation_plan.report(every, chosen, seconds, start_peak, planned, budget)
        if fraction is not None:  # on the knapsack's partition
            self.activation_plan[0] += (f"; from the partitioner's recompute knapsack at "
                                        f"activation_memory_budget {fraction:.3g} (planned step peak "
                                        f"{liveness.fmt(peak)} with every saved activation kept)")
            self.activation_plan += activation_plan.partition_report(
                fw, bw, f, b, self.num_fwd_outputs, fraction, cost, peak, start_peak, budget)
        return f, b, planned

    def _knapsack_partition(self, min_cut, peak: int, budget: int) -> tuple:
        """The partitioner's knapsack (`activation_memory_budget`): the largest of PARTITION_FRACTIONS whose
        planned step peak fits, then bisected PARTITION_REFINE times toward the next larger one (the peak is not
        monotone in the fraction: this finds a boundary, not the largest fraction that fits), as (fraction, forward,
        backward, peak); and where none fits, None and the one with the lowest peak below `peak` (or None)."""
        fits, over, closest = None, 1.0, None
        for fraction in PARTITION_FRACTIONS:
            f, b = min_cut(fraction)
            p = self.trial_peak({"forward": f, "backward": b})
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
            p = self.trial_peak({"forward": f, "backward": b})
            if p <= budget:
                fits = (middle, f, b, p)
            else:
                over = middle
        return fits, None

    def _rewrite_activations(self, fw: fx.GraphModule, bw: fx.GraphModule, budget: int) -> tuple:
        """zcompile's rewrite on one partition, in place: (choices made, seconds they add, planned peak, every
        saved activation's choice or keep)."""
        n_out, cost = self.num_fwd_outputs, self.cost_model()
        options, kept = activation_plan.options(fw, n_out, cost, self.ctx.device, self.cfg.offload.activation_min_bytes)

        def peak_of(chosen):
            f, b = (_copy(gm) for gm in (fw, bw))
            chosen, _ = activation_plan.apply(f, b, n_out, chosen, cost)
            offload = frozenset(c.name for c in chosen if c.action == "offload")
            try:
                return self.trial_peak({"forward": f, "backward": b}, offload)
            finally:  # the collector is paused while compiling: each trial's graphs are cycles
                del f, b
                gc.collect()

        chosen, planned = planner.choose_activations(options, peak_of, budget)
        chosen, seconds = activation_plan.apply(fw, bw, n_out, chosen, cost)
        return chosen, seconds, planned, options + kept

    def plan_persistence(self, graphs: dict[str, fx.GraphModule]) -> None:
        """Stage 3: decide which parameters of this graph stay whole (planner.choose_persistent). With a memory
        budget, the headroom is the budget minus the planned step peak with every parameter sharded, measured by
        running the split passes on copies of the graphs; none where the activation plan had to recompute or
        offload to fit (whole parameters would take back what that costs step time to free)."""
        undecided = [zp for zp in self.params.values()
                     if zp.stage == Stage.PARAMETERS and not zp.persist_decided and zp.param_tier == Tier.DEVICE]
        if not undecided:
            return
        budget = self.cfg.memory_budget_bytes(self.ctx.device)
        headroom = None
        if budget is not None and not self.activation_plan:  # memory freed by recomputing is not spent again
            headroom = max(0, budget - self.trial_peak(graphs, compiled=True))
        chosen, why = planner.choose_persistent(undecided, self.cfg.persist_threshold_bytes, headroom)
        for zp in undecided:
            zp.persist_decided = True
            zp.persistent = zp in chosen  # decided here; the commit step gives them their whole buffers
        if chosen or budget is not None or self.cfg.persist_threshold_bytes:
            self.notes.append(why)

    def _note_unbounded_sizes(self, graphs: dict[str, fx.GraphModule]) -> None:
        """memory_budget checks a dynamic size at its declared maximum; one without is checked only at its
        compile-time value: say so (a warning and a note in the dumps), since a larger batch may then not fit."""
        sizes = {k: v for gm in graphs.values() for k, v in liveness.unbounded_sizes(gm).items()}
        if not sizes:
            return
        msg = (f"{self.cfg.source}: memory_budget is checked with the dynamic sizes "
               + ", ".join(f"{k} = {v}" for k, v in sorted(sizes.items()))
               + f" of graph {self.graph_id} ({self.inputs_text}) at their compile-time values: nothing declares "
               "their maximum, so a larger batch or sequence is not checked against the budget. Declare it with "
               "torch._dynamo.mark_dynamic(x, dim, min=..., max=...) on the inputs")
        self.notes.append(msg)
        for gm in graphs.values():
            gm.meta.setdefault("zc_notes", []).append(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)

    def check_budget(self, graphs: dict[str, fx.GraphModule]) -> None:
        """A plan whose step peak exceeds `memory_budget` fails here (over_budget: error), before anything runs."""
        budget = self.cfg.memory_budget_bytes(self.ctx.device)
        if budget is None:
            for zp in self.params.values():
                zp.decide_optimizer_tier(offload=False)  # 'auto' without a budget: nothing asks to offload
            return
        lives = {kind: liveness.analyze(gm) for kind, gm in graphs.items()}
        if self.follows_code():
            with self.timed("trial compile"):
                lives = {kind: self.code_liveness(gm, kind, lives[kind]) for kind, gm in graphs.items()}
        self.code_layouts.clear()  # they hold the trials' graphs
        self._note_unbounded_sizes(graphs)
        zps = list(self.params.values())
        state = planner.model_state(zps)
        peak = planner.step_peak(state, lives, self.cfg.accumulate_grads)
        auto = [zp for zp in zps if zp.optim_tier == Tier.AUTO]
        if auto:  # offload.optimizer auto: the optimizer state stays on the device if the step fits with it there
            for zp in auto:
                zp.decide_optimizer_tier(offload=peak > budget)
            self.notes.append(f"offload: optimizer state of {len(auto)} param(s) "
                              + ("on the host (the step does not fit the budget with it on the device)"
                                 if peak > budget else "on the device (the step fits the budget)"))
            for gm in graphs.values():
                gm.meta.setdefault("zc_notes", []).append(self.notes[-1])
            state = planner.model_state(zps)
            peak = planner.step_peak(state, lives, self.cfg.accumulate_grads)
        if peak <= budget:
            return
        worst, terms = planner.peak_terms(state, lives, self.cfg.accumulate_grads)
        msg = (f"{self.cfg.source}: planned step peak {liveness.fmt(peak)} per rank exceeds memory_budget "
               f"{liveness.fmt(budget)}: " + " + ".join(f"{what} {liveness.fmt(n)}" for what, n in terms))
        if worst is None:
            msg += " (the optimizer step)"
        else:
            g = lives[worst]
            msg += (f" + {worst} graph inputs {liveness.fmt(g.input_bytes)} (shards, batch"
                    + _tangents_note(graphs[worst]) + ") "
                    f"+ transient peak {liveness.fmt(g.peak_bytes)} after {g.peak_node}"
                    + (f" (with the saved activations, {liveness.fmt(g.saved_bytes)} at the backward's start)"
                       if g.saved_bytes else ""))
        msg += (". Offload moves state off the device: offload.optimizer (cpu/nvme), offload.params (cpu/nvme, "
                "stage 3), offload.activations (cpu); tiling splits large linears")
        if self.activation_plan:
            msg += (f". This is already the smallest plan the memory planner found ({self.activation_plan[0]}); "
                    f"it needs a memory_budget of at least {liveness.fmt(peak)}")
        if self.cfg.over_budget == "warn":
            for gm in graphs.values():
                gm.meta.setdefault("zc_notes", []).append(f"OVER BUDGET: {msg}")
            return
        raise MemoryBudgetError(msg)

    def joint_graph_passes(self, gm: fx.GraphModule) -> fx.GraphModule:
        """Inductor's joint-graph passes, which torch.compile runs in its own partition function and zcompile, which
        partitions itself, runs here (backend inductor; off with torch._inductor.config.use_joint_graph_passes):
        among them the seeding of random ops (dropout's `rand` becomes seeded `inductor_random`, the seeds kept for
        the backward) and scatter_upon_const_tensor, without which the NLL loss's backward writes a logits-size
        fp32 buffer of zeros before scattering into it. Not constant_fold_uniform_value: it makes one node of the
        uniform constants every block computes (Hugging Face Llama's), which the regional cut then reads from
        another block's region, before it is computed (a nested body) or after it was freed (regions)."""
        if self.cfg.backend != "inductor":
            return gm
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import _recursive_joint_graph_passes
        from torch._inductor.virtualized import V
        fake_mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")])
        with self.timed("joint graph passes"), V.set_fake_mode(fake_mode), \
                inductor_config.patch(joint_graph_constant_folding=False):
            if "skip_invoke_subgraph" in inspect.signature(_recursive_joint_graph_passes).parameters:
                return _recursive_joint_graph_passes(gm, skip_invoke_subgraph=True)  # regions: partition_region
            return _recursive_joint_graph_passes(gm)  # an older torch

    def partition(self, joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **kwargs):
        self.dump("joint", "input", joint)
        joint = self.joint_graph_passes(joint)
        with self.timed("zcompile passes"):
            joint = passes.run_phase("joint", joint, self.pctx("joint"), self.dumper("joint"))
        # lazy graph modules: the passes change both graphs, and what runs them (regions, inductor) reads the graph,
        # so their Python code is generated only if something calls or prints them
        cuts: dict = {}  # fraction -> its partition: each round of the budget's search asks for the same ones

        def min_cut(fraction: float | None = None):
            # the partitioner's knapsack keeps `fraction` of the activation memory it can choose to save (None: as
            # torch is configured); on a copy: the budget's search partitions the joint graph again
            if fraction in cuts:
                return tuple(_copy(gm) for gm in cuts[fraction])  # the search rewrites what it is handed
            knapsack = contextlib.nullcontext() if fraction is None else \
                torch._functorch.config.patch(activation_memory_budget=fraction)
            with self.timed("partition"), _use_lazy_graph_module(True), knapsack:
                fw, bw = min_cut_rematerialization_partition(fx.GraphModule(joint, placement.copy_graph(joint.graph)),
                                                             joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
                bw = _lazy(bw)  # the partitioner rebuilds the backward as a plain GraphModule when it reorders
            if fraction is None:
                return fw, bw
            cuts[fraction] = fw, bw
            return _copy(fw), _copy(bw)

        fw, bw = min_cut()
        if self.regions_kept:
            with self.timed("inline regions"):  # with a fake propagation of the forward (inline_partitioned)
                block_regions.inline_partitioned(fw, bw, num_fwd_outputs)
        self.num_fwd_outputs = num_fwd_outputs
        # where the blocks were inlined the whole joint graph is here: the partitioner itself can trade
        fw, bw = self.plan_activations(fw, bw, None if self.regions_kept else min_cut)
        self.mark_released({"forward": fw, "backward": bw})
        self.plan_persistence({"forward": fw, "backward": bw})
        fw, self.fw_pctx = self.split_passes(fw, "forward")
        bw, self.bw_pctx = self.split_passes(bw, "backward")
        self.check_budget({"forward": fw, "backward": bw})
        self.dump.schedule({"forward": fw, "backward": bw}, self.cost_model())
        if self.cfg.schedule_check:
            self.agree({"forward": fw, "backward": bw})
        return fw, bw

    def partition_region(self, params: dict, joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int,
                         **kwargs):
        """The forward+backward of one block region (block_regions): the joint passes with its parameter operands
        (`params`, by operand index: the region's primals), then the min-cut."""
        primals = [n for n in joint.graph.find_nodes(op="placeholder") if n.name.startswith("primals")]
        pctx = PassContext(self.cfg, self.ctx, "joint", params, len(primals), self.topology,
                           num_fwd_outputs=num_fwd_outputs)
        joint = self.joint_graph_passes(joint)
        with self.timed("zcompile passes"):
            joint = passes.run_phase("joint", joint, pctx)
        with self.timed("partition"):
            return min_cut_rematerialization_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                                       **kwargs)

    def agree(self, graphs: dict[str, fx.GraphModule]) -> None:
        """The ranks compare the collective schedules of the graphs just compiled before running them."""
        self.announce(schedule_check.fingerprint(graphs))

    def announce(self, schedule: tuple[int, str]) -> None:
        """agree's exchange, for a schedule fingerprinted before (a graph loaded from the compile cache too)."""
        self.schedule = schedule
        schedule_check.announce(self.ctx, self.graph_id, *schedule, self.cfg.collective_timeout_s)

    def run_check(self, kind: str):
        """Before each run of this graph's `kind`: the ranks confirm they run the same graph (schedule_check), and
        whether they refresh whole-parameter copies first. check(refresh: bool) or None."""
        if not self.cfg.schedule_check or self.ctx.world == 1:
            return None
        mine = [schedule_check.record(schedule_check.RUN,
                                      schedule_check.digest(self.identity, self.schedule[0], kind, refresh),
                                      f"the {kind} of graph {self.graph_id} ({self.inputs_text})"
                                      + (", refreshing whole parameters after a step" if refresh else ""))
                for refresh in (False, True)]
        return lambda refresh: schedule_check.exchange(self.ctx, mine[refresh], self.cfg.collective_timeout_s)

    def compiler(self, kind: str, gm: fx.GraphModule, example_inputs):
        if kind == "inference":
            if self.regions_kept:
                trace_blocks_once.inline(gm)
            gm = self.joint_graph_passes(gm)
            self.plan_persistence({"inference": gm})
            gm, pctx = self.split_passes(gm, kind)
            self.check_budget({"inference": gm})
            self.dump.schedule({"inference": gm}, self.cost_model())
            if self.cfg.schedule_check:
                self.agree({"inference": gm})
        else:  # the graph AOTAutograd hands over (with its backward lowered at once, a copy of the partition's)
            pctx = self.fw_pctx if kind == "forward" else self.bw_pctx
            self.final[kind] = gm
        # AOTAutograd's example inputs carry the real layout of saved activations; ours, the shards and side inputs.
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        fake_inputs = [n.meta["val"] if n.name in pctx.own_placeholders or k >= len(example_inputs)
                       or not isinstance(example_inputs[k], torch.Tensor) else _on_tier(n, example_inputs[k])
                       for k, n in enumerate(phs)]
        if not fake_values.hold_for(phs, fake_inputs):
            with self.timed("fake propagation"):
                fake_values.refresh(gm, fake_inputs)
        self.mark_compiler(gm)
        with self.timed("liveness"):
            planned = self.planned[kind] = liveness.analyze(gm)
        if not self.commit:
            return _dry_runner(gm)
        return self.commit_graph(kind, gm, fake_inputs, pctx, planned)

    def cache_record(self, kind: str) -> tuple[fx.GraphModule, dict[str, str], dict]:
        """What graph_cache stores of the committed graph `kind`: the graph, the names its commit gave its subgroups,
        and a record of the pass context's side inputs (by parameter index), subgroups and own placeholders, with the
        forward (or inference) graph also the job's decisions."""
        gm, pctx, made = self.committed[kind]
        index = {id(zp): i for i, zp in self.params.items()}
        record = {"side_inputs": [(index[id(s.zp)], s.kind) for s in pctx.side_inputs],
                  "subgroups": list(pctx.subgroups), "own_placeholders": sorted(pctx.own_placeholders)}
        if kind != "backward":
            record.update(
                params={i: (zp.persist_decided, zp.persistent, zp.optim_tier, zp.secondary_numel,
                            getattr(zp, "secondary_dtype", None)) for i, zp in self.params.items()},
                notes=list(self.notes), num_fwd_outputs=self.num_fwd_outputs, offloaded=dict(self.offloaded),
                schedule=self.schedule, activation_plan=list(self.activation_plan))
        return gm, made, record

    def load_cached(self, kind: str, record: dict, gm: fx.GraphModule) -> Callable:
        """graph_cache hit: the graph `kind` (`gm`, as unpickled) and the decisions compiling it made, restored into
        this job, then committed as a compiled graph would be."""
        gm = _lazy(gm)  # unpickled without its code: generated if run (eager, a whole graph)
        if kind != "backward":
            for i, (decided, persistent, tier, secondary, secondary_dtype) in record["params"].items():
                zp = self.params[i]
                zp.persist_decided, zp.persistent, zp.optim_tier = decided, persistent, tier
                if secondary:
                    zp.use_secondary(secondary, secondary_dtype)
            self.notes = list(record["notes"])
            self.num_fwd_outputs = record["num_fwd_outputs"]
            self.offloaded.update(record["offloaded"])
            self.activation_plan = list(record["activation_plan"])
            if self.cfg.schedule_check:  # part of the cache key: as when this graph was stored
                self.announce(record["schedule"])
        pctx = self.pctx(kind)
        pctx.side_inputs = [SideInput(self.params[i], side_kind) for i, side_kind in record["side_inputs"]]
        pctx.subgroups = list(record["subgroups"])
        pctx.own_placeholders = set(record["own_placeholders"])
        self.final[kind] = gm
        fake_inputs = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
        self.mark_compiler(gm)
        with self.timed("liveness"):
            planned = self.planned[kind] = liveness.analyze(gm)
        return self.commit_graph(kind, gm, fake_inputs, pctx, planned)

    def commit_graph(self, kind: str, gm: fx.GraphModule, fake_inputs: list, pctx: PassContext,
                     planned: liveness.Liveness):
        """The commit step: what compiling decided becomes runtime state, and the graph becomes a function.
        Every rank reaches it at the same point (process groups and whole-parameter gathers are collective)."""
        zps = list(self.params.values())
        with _disable_current_modes():  # real buffers and collectives, not AOTAutograd's fake tracing mode
            shard_store.make_persistent(zps)
            for zp in zps:
                zp.attach_master()
            made = {g.name: groups.realize(self.ctx, g, self.cfg.collective_timeout_s).name for g in pctx.subgroups}
        collectives.rename_groups(gm, made)
        self.committed[kind] = (gm, pctx, made)
        with self.timed(f"{self.cfg.backend} {kind}"):
            compiled = backends.compile_graph(self.cfg.backend, gm, fake_inputs, kind, self.cfg.regional_compile)
        if hasattr(compiled, "regions"):
            self.regions[kind] = (compiled.regions, compiled.compiled_regions, compiled.compiled)
            planned = self.planned[kind] = wrapper_memory.graph_liveness(gm, planned, compiled.layout)
        side = list(pctx.side_inputs)
        sched = collectives.schedule(gm)
        reads = [n.args[1] for n in gm.graph.nodes if n.target is torch.ops.zcompile.read_shard.default]
        read_ahead = reads if self.cfg.offload.overlap else []

        check = self.run_check(kind)
        watch_loss = kind == "forward" and self.cfg.nonfinite != "off"
        whole = [zp for zp in zps if zp.keeps_full] if kind != "backward" else []
        # gradient shards copied to pinned host memory without blocking (offload_grads): done before autograd reads
        host_grads = self.ctx.device.type == "cuda" and any(
            isinstance(o, fx.Node) and o.target is torch.ops.zcompile.to_host.default
            for o in gm.graph.output_node().args[0])

        def run_graph(args):
            stale = [zp for zp in whole if zp.stale()]
            if check is not None:
                check(bool(stale))
            if stale:
                shard_store.gather_full(stale)
            collective_traffic.count(sched)
            if reads:
                offload_engine.start_reads(read_ahead)
            if side:  # a longer list, and the caller's cleared: the graph frees its inputs after their last use
                args, given = list(args), args
                given.clear()
                args.extend(s.value() for s in side)
            if memory_trace.RUNS is not None:
                out = memory_trace.run_measured(compiled, args, self.graph_id, kind, planned)
            else:
                out = compiled(args)
            if host_grads:
                torch.cuda.current_stream(self.ctx.device).synchronize()
            if watch_loss:
                nonfinite.note_forward(zps, out[:self.num_fwd_outputs or len(out)])
            return out

        run_graph._boxed_call = True
        return run_graph


def _copy(gm: fx.GraphModule, graph: fx.Graph | None = None) -> fx.GraphModule:
    """A copy of `gm` (of `graph`, if given) to transform, as a _LazyGraphModule: the budget's search copies and
    splits graphs dozens of times, and generating each copy's Python code took a fifth of its time."""
    new = _LazyGraphModule(gm, placement.copy_graph(gm.graph if graph is None else graph))
    new.meta.update({k: copy.copy(v) for k, v in gm.meta.items()})  # a new GraphModule starts with empty meta
    return new


def _identity(gm: fx.GraphModule) -> int:
    """What inductor's code for `gm` depends on, hashed: per node its op, target and arguments (nodes by name), what
    regions cut by and wrapper_memory counts (block, released, tier) and each placeholder's layout. Two graphs with
    the same identity compile to the same code. (Not gm.code: generating it costs ten times as much.)"""
    def layout(v):
        return (tuple(map(str, v.shape)), tuple(map(str, v.stride())), v.dtype, v.device.type) \
            if isinstance(v, torch.Tensor) else str(v)
    return hash(tuple((n.name, n.op, str(n.target), repr(n.args), repr(n.kwargs), blocks.block_of(n),
                       n.meta.get(liveness.RELEASED), n.meta.get("zc_tier"),
                       layout(n.meta.get("val")) if n.op == "placeholder" else None) for n in gm.graph.nodes))


def _lazy(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` as a _LazyGraphModule (same graph and meta): its recompile only marks, its code is generated when read."""
    lazy = _LazyGraphModule.from_graphmodule(gm)
    if lazy is not gm:
        lazy.meta.update(gm.meta)  # a new GraphModule starts with empty meta
    return lazy


def _on_tier(node: fx.Node, example: torch.Tensor) -> torch.Tensor:
    """A saved activation the forward offloaded arrives on the host, in the layout the compiled forward produced."""
    if node.meta.get("zc_tier") != "cpu" or example.device.type == "cpu":
        return example
    with detect_fake_mode([example]) or _disable_current_modes():
        return torch.empty_strided(example.shape, example.stride(), dtype=example.dtype, device="cpu")


def _dry_runner(gm: fx.GraphModule):
    """A dry compile's graph function: meta tensors shaped like the graph's outputs, nothing computed."""
    (outs,) = gm.graph.output_node().args
    vals = [o.meta.get("val") if isinstance(o, fx.Node) else o for o in outs]

    def run(args):
        return [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                if isinstance(v, torch.Tensor) else v for v in vals]

    run._boxed_call = True
    return run


_COMPILED: weakref.WeakSet = weakref.WeakSet()  # registry: committed graphs still in use (planned_step_peak)


def planned_step_peak() -> int:
    """The largest planned per-rank step peak (device bytes) of the graphs compiled in this process whose model
    is still alive: resident gradients and optimizer state plus a graph's inputs and transients
    (planner.step_peak)."""
    gc.collect()  # a dropped model's parameters and graphs form cycles: free them before counting
    peaks = [planner.step_peak(planner.model_state(list(job.params.values())), job.planned, job.cfg.accumulate_grads)
             for job in _COMPILED if job.planned]
    return max(peaks, default=0)


def activation_decisions() -> list[str]:
    """The memory planner's decision for each saved activation (keep, recompute, offload, with its cost) of the
    graphs compiled in this process whose model is still alive; empty where no memory_budget made it act."""
    gc.collect()
    return [line for job in sorted(_COMPILED, key=lambda j: j.graph_id) for line in job.activation_plan]


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while a graph compiles, back on (if it was on) after. A compile builds
    hundreds of thousands of long-lived objects (FX nodes, fake tensors, sympy expressions), so each full
    collection during it rescans them all and their number grows with depth: at 32 layers five full collections
    cost ~1.1 s of the first step (bench/results/compile-time-log.md). The compile's cyclic garbage is collected
    after."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def zero_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, **kwargs):
    """The `zero` backend for torch.compile."""
    before_trace.register()  # again after torch._dynamo.reset() dropped it, for the next frame's trace
    with reported_as_zcompile_errors(), collector_paused():
        return _compile(gm, example_inputs, options, **kwargs)


def _compile(gm: fx.GraphModule, example_inputs, options: dict | None = None, **kwargs):
    if kwargs:
        raise zconfig.ConfigError(f"zero backend: unexpected arguments {sorted(kwargs)}; pass options={{'config': ...}}")
    cfg = zconfig.frozen(options)
    ctx = DistContext.current()
    before_trace.prepare(cfg, ctx)
    if not dtensor_params.trace_once_supported():
        _refuse_nested_regions(gm)  # before sharding: with DTensor parameters torch 2.11's dynamo fails on them itself
    if dtensor_params.rewrites_modules(cfg):
        _shard_modules_of(gm, example_inputs, cfg, ctx)  # restarts dynamo when it replaced parameters
    job, run = _compile_graph(gm, example_inputs, cfg, ctx, commit=True)
    _COMPILED.add(job)
    for zp in job.params.values():
        zp.nonfinite = cfg.nonfinite
        zp.release_full()
    return run


zero_backend.zcompile_backend = True  # how before_trace recognizes it (the registry may hold only its entry point)


def dry_backend(cfg: zconfig.Config, ctx: DistContext, jobs: list):
    """A dynamo backend that compiles for `ctx` (DistContext.without_group) without committing: every graph's
    passes, planner and analysis run, nothing is allocated or communicated, each graph's `_GraphCompile` is
    appended to `jobs`, and running the result returns meta tensors. For zcompile plan (use schedule_check=False:
    there is no group to agree over)."""
    def backend(gm: fx.GraphModule, example_inputs):
        with collector_paused():
            job, run = _compile_graph(gm, example_inputs, cfg, ctx, commit=False)
        jobs.append(job)
        return run
    return backend


def _compile_graph(gm: fx.GraphModule, example_inputs, cfg: zconfig.Config, ctx: DistContext, commit: bool):
    """One dynamo graph through the passes and AOTAutograd: (its _GraphCompile, the function dynamo calls)."""
    example_inputs = list(example_inputs)
    if not dtensor_params.trace_once_supported():
        _refuse_nested_regions(gm)
    why_inlined = block_regions.why_not(gm, cfg)
    if why_inlined is not None and trace_blocks_once.inline(gm):
        trace_blocks_once.forget_reuse()
    example_inputs, dparams, dropped = dtensor_params.unwrap_graph(gm, example_inputs)
    is_param = [isinstance(x, nn.Parameter) or i in dparams for i, x in enumerate(example_inputs)]
    identity = schedule_check.graph_identity(gm, example_inputs, is_param, cfg)
    inputs_text = _inputs_text(example_inputs, is_param)
    if cfg.schedule_check:  # before anything here communicates: a rank compiling alone meets the others' checks
        schedule_check.exchange(ctx, schedule_check.record(schedule_check.COMPILE, identity,
                                                           f"a new graph for {inputs_text}"), cfg.collective_timeout_s)
    params = {i: shard_store.register_for(cfg, ctx, x, attach=commit) for i, x in enumerate(example_inputs)
              if isinstance(x, nn.Parameter) and i not in dparams}
    for i, zp in dparams.items():
        if zp.stage != cfg.stage or zp.world != ctx.world:
            raise ZCompileError(f"parameter {list(zp.shape)} is sharded for stage {zp.stage} over {zp.world} ranks; "
                                f"this compile asks for stage {cfg.stage} over {ctx.world}: use one config per model")
        params[i] = zp
    params = dict(sorted(params.items()))
    job = _GraphCompile(cfg, ctx, params, len(example_inputs), identity, inputs_text, commit)
    job.regions_kept = _keep_regions(gm, example_inputs, job, why_inlined)
    job.dump("dynamo", "input", gm)
    with job.timed("zcompile passes"):
        gm = passes.run_phase("dynamo", gm, job.pctx("dynamo"), job.dumper("dynamo"))

    cached = graph_cache.usable(job)

    def compiler(kind: str):
        return graph_cache.compiler(job, kind, _boxed) if cached else functools.partial(_boxed, job, kind)
    try:
        with block_regions.mutation_check_once() if job.regions_kept else contextlib.nullcontext(), \
                graph_cache.keyed(job) if cached else contextlib.nullcontext(), aot_graph_logs.quiet():
            compiled = aot_autograd(
                fw_compiler=compiler("forward"),
                bw_compiler=compiler("backward"),
                inference_compiler=compiler("inference"),
                partition_fn=job.partition,
                decompositions=select_decomp_table(),
            )(gm, example_inputs)
    except graph_cache.LoadFailed as failed:
        error = failed.raised()
        if error is failed.error:
            raise error from None
        raise error from failed.error
    if job.regions_kept:
        trace_blocks_once.forget_reuse()

    skip, kept = set(dropped), len(example_inputs)
    # dynamo keeps `run` for the life of the process (a global of the user's module, even after
    # torch._dynamo.reset()), so `run` holds the job weakly and the job lives as long as its parameters do:
    # dropping the model frees its shards and graphs as it does without zcompile.
    job.compiled = compiled
    for zp in params.values():
        zp.jobs.append(job)
    held, job_ref = (None if params else job), weakref.ref(job)

    def run(*args):
        job = held or job_ref()
        if job is None:
            raise ZCompileError("this compiled graph's parameters were freed (the model was dropped); compile the "
                                "model again")
        # dynamo passes the meshes of DTensor parameters as graph inputs on some versions, not on others
        args = [a for k, a in enumerate(args) if k not in skip] if len(args) > kept else list(args)
        shard_store.graph_inputs(args, job.params)
        return job.compiled(*args)

    return job, run


def _keep_regions(gm: fx.GraphModule, example_inputs: list, job: _GraphCompile, why: str | None) -> bool:
    """keep_block_regions: mark the blocks' regions for job.partition_region, or inline them now when one cannot
    stay a region (`why`, from block_regions.why_not, or found here), saying why in the dumps' notes."""
    if why is None:
        regions = block_regions.parameter_operands(gm, job.params)
        why = ("two calls of a block pass parameters at different operands" if regions is None
               else block_regions.why_not_bodies(gm, example_inputs))
        if why is None:
            block_regions.mark(gm, regions, job.partition_region)
            return True
        if trace_blocks_once.inline(gm):
            trace_blocks_once.forget_reuse()
    if why not in ("off", "no regions"):
        job.notes.append(f"keep_block_regions: blocks inlined before AOTAutograd ({why})")
    return False


def _refuse_nested_regions(gm: fx.GraphModule) -> None:
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


class _ParametersSharded(torch._dynamo.exc.RestartAnalysis, ZeroError):
    """Raised by the first compile that meets plain parameters: they are now DTensors, so dynamo traces again."""

    def __init__(self, count: int):
        self.restart_reason = f"zcompile replaced {count} parameters by DTensor shards"
        ZeroError.__init__(self, self.restart_reason)


def _shard_modules_of(gm: fx.GraphModule, example_inputs, cfg: zconfig.Config, ctx: DistContext) -> None:
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
        raise _ParametersSharded(count)


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


def _inputs_text(example_inputs, is_param: list[bool]) -> str:
    """The non-parameter inputs, briefly: 'inputs 2x16 int64, 2x16 int64'."""
    shown = ["x".join(map(str, x.shape)) + " " + str(x.dtype).removeprefix("torch.")
             for x, param in zip(example_inputs, is_param) if isinstance(x, torch.Tensor) and not param]
    return "inputs " + (", ".join(shown[:6]) + (", ..." if len(shown) > 6 else "") if shown else "none")


def _boxed(job: _GraphCompile, kind: str, gm: fx.GraphModule, example_inputs):
    with collector_paused():  # the backward compiles at the first backward, outside zero_backend
        return job.compiler(kind, gm, example_inputs)
