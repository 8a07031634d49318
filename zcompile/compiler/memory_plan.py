"""The memory planner's side of one graph compile (`MemoryPlan`): trials, the activation plan's search, which
parameters stay whole, and the budget check.

A trial runs the split passes on copies of a forward and backward (nothing kept) and reads their planned step peak
from the FX plan and, where inductor's code is followed, from the code generated as the commit will compile it (no
kernel built: codegen.inductor.code_only). The search (planning/activation_search.py) and the stage-3 persistence
choice (planning/budget.py) measure plans this way; the split passes and the compile are the job's, which is why
this sits above the stage folders."""
from __future__ import annotations

import contextlib

import torch.fx as fx

from zcompile.compiler import codegen
from zcompile.compiler.codegen import graph_cache, inductor, output_grads, regions
from zcompile.compiler.graph import graph_copies
from zcompile.compiler.planning import budget, liveness, planner, recompute, timeline, wrapper_memory
from zcompile.compiler.planning.activation_search import ActivationSearch


class MemoryPlan:
    """The memory plan of one graph compile (`job`, a job.GraphCompile). Within a search (`searching`), a plan met
    again is not split again; across it, the compiled code's layout of a graph met again is not compiled again."""

    def __init__(self, job):
        self.job = job
        self.code_layouts: dict = {}  # (kind, graph_copies.identity) -> what inductor's code allocates
        self.peaks: dict | None = None  # while searching: (graphs' identities, offloaded) -> FX step peak

    @contextlib.contextmanager
    def searching(self):
        self.peaks = {}
        try:
            yield
        finally:
            self.peaks = None

    def measure(self, graphs: dict[str, fx.GraphModule], offload_saved: frozenset = frozenset(),
                compile_within: float | None = None, over: float | None = None) -> tuple[int, int]:
        """(the FX plan's step peak, the compiled code's) of `graphs` (kind -> graph), from one run of the split
        passes on copies of them (parameters not yet decided whole count as sharded): the copies are compiled as
        they will be, where inductor's code says what it allocates (wrapper_memory), only where the code is
        followed (job.follows_code) and the FX peak is within `compile_within`; otherwise the second is the
        first. `over`: the compiles stop once the graphs compiled so far, the backward first, put the step over
        it (the others could only add), and the peak returned is theirs."""
        job, key = self.job, None
        if self.peaks is not None:  # within a search: later rounds plan the same graphs again
            key = (tuple((kind, graph_copies.identity(gm)) for kind, gm in graphs.items()), offload_saved)
            peak = self.peaks.get(key)
            if peak is not None and (compile_within is None or peak > compile_within or not job.follows_code()):
                return peak, peak
        scratch: dict = {}  # the trial's forward tells its backward which activations it offloaded
        copies = {kind: graph_copies.copy(gm) for kind, gm in graphs.items()}
        recompute.mark_released(copies, job.num_fwd_outputs)
        split = {kind: output_grads.as_run(kind, job.split_passes(gm, kind, trial=scratch,
                                                                  offload_saved=offload_saved)[0])
                 for kind, gm in copies.items()}
        lives = {kind: liveness.analyze(gm) for kind, gm in split.items()}
        state = planner.model_state(list(job.params.values()))
        peak = planner.step_peak(state, lives, job.cfg.accumulate_grads)
        if key is not None:
            self.peaks[key] = peak
        if compile_within is None or peak > compile_within or not job.follows_code():
            return peak, peak
        code: dict[str, liveness.Liveness] = {}
        with job.timed("trial compile"):
            for kind in sorted(split, key=lambda k: k != "backward"):  # where inductor's code outgrows the plan
                code[kind] = self.code_liveness(split[kind], kind, lives[kind])
                if over is not None and planner.step_peak(state, code, job.cfg.accumulate_grads) > over:
                    break
        return peak, planner.step_peak(state, code, job.cfg.accumulate_grads)

    def code_liveness(self, gm: fx.GraphModule, kind: str, planned: liveness.Liveness) -> liveness.Liveness:
        """`planned` with its peak from inductor's code for `gm`, generated here as the commit will compile it (a
        trial: the compile reports nothing to AOTAutograd and builds no kernel; inductor's FX graph cache serves the
        commit's compile of the same graph its code, as graph_cache.region_compiles keys both alike)."""
        key = (kind, graph_copies.identity(gm))
        if key not in self.code_layouts:  # a plan found again in a later round, or the final graphs check_budget reads
            cfg = self.job.cfg
            fakes = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
            with regions.no_output_strides(), graph_cache.region_compiles(), inductor.code_only():
                program = codegen.compile_graph(cfg.backend, gm, fakes, kind, cfg.regional_compile)
            self.code_layouts[key] = getattr(program, "layout", None)
        layout = self.code_layouts[key]
        return wrapper_memory.graph_liveness(gm, planned, layout) if layout else planned

    def plan_activations(self, fw: fx.GraphModule, bw: fx.GraphModule, min_cut=None
                         ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """With a memory budget the step does not fit, the memory planner's search (ActivationSearch) over trials
        of this graph: the forward and backward to go on with."""
        job = self.job
        limit = job.cfg.memory_budget_bytes(job.ctx.device)
        if limit is None or not job.cfg.plan_activations:
            return fw, bw
        search = ActivationSearch(self.measure, follows_code=job.follows_code(),
                                  cost=timeline.CostModel.for_device(job.ctx.device),
                                  num_fwd_outputs=job.num_fwd_outputs, device=job.ctx.device,
                                  activation_min_bytes=job.cfg.offload.activation_min_bytes)
        with self.searching(), job.timed("activation plan"):
            plan = search.run(fw, bw, min_cut, limit)
        if plan is None:
            return fw, bw
        job.offload_saved, job.activation_plan = plan.offload_saved, plan.report
        where = f" (each decision: graph{job.graph_id}_activations.txt)" if job.dump.dir else ""
        job.notes += plan.notes + [plan.report[0] + where]
        job.dump.text("activations", plan.report)
        return plan.forward, plan.backward

    def check_budget(self, graphs: dict[str, fx.GraphModule]) -> None:
        """budget.check over the final graphs, with their peaks from inductor's code where it is followed."""
        job, lives, run = self.job, {}, None
        if job.cfg.memory_budget_bytes(job.ctx.device) is not None:
            run = {kind: output_grads.as_run(kind, gm) for kind, gm in graphs.items()}
            lives = {kind: liveness.analyze(gm) for kind, gm in run.items()}
            if job.follows_code():
                with job.timed("trial compile"):
                    lives = {kind: self.code_liveness(gm, kind, lives[kind]) for kind, gm in run.items()}
        self.code_layouts.clear()  # they hold the trials' graphs
        budget.check(job.cfg, job.ctx.device, list(job.params.values()), graphs, lives, job.notes,
                     job.activation_plan, f"graph {job.graph_id} ({job.inputs_text})", run)

    def plan_persistence(self, graphs: dict[str, fx.GraphModule]) -> None:
        """budget.plan_persistence, the headroom measured by a compiled trial of `graphs`."""
        job = self.job
        note = budget.plan_persistence(job.cfg, job.ctx.device, list(job.params.values()),
                                       bool(job.activation_plan),
                                       lambda: self.measure(graphs, compile_within=float("inf"))[1])
        if note:
            job.notes.append(note)
