"""One dynamo graph's compile (`GraphCompile`): its state, and the order in which the stages see it.

    joint graph -> joint passes -> min-cut partition -> activation plan (memory budget) -> stage-3 persistence
    -> split passes on the forward and backward -> budget check -> schedule agreement -> per graph AOTAutograd
    hands over: fake inputs, liveness, commit (or, for zcompile plan, a dry runner)
"""
from __future__ import annotations

import contextlib
import itertools
import time

import torch.fx as fx
from torch._functorch.partitioners import min_cut_rematerialization_partition

from zcompile import config as zconfig
from zcompile.compiler import passes
from zcompile.compiler.codegen import commit, output_grads
from zcompile.compiler.debug import schedule_check
from zcompile.compiler.debug.dump import GraphDumper
from zcompile.compiler.graph import collectives, fake_values, graph_copies
from zcompile.compiler.graph.pass_context import PassContext
from zcompile.compiler.graph.placement import copy_graph
from zcompile.compiler.graph.topology import Topology
from zcompile.compiler.planning import liveness, planner, recompute, timeline
from zcompile.compiler.tracing import block_regions, partition, trace_blocks_once
from zcompile.compiler.memory_plan import MemoryPlan
from zcompile.runtime import shard_store
from zcompile.runtime.dist_context import DistContext

_graph_ids = itertools.count()  # numbers graphs in dumps and messages, per process


class GraphCompile:
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
        self.memory = MemoryPlan(self)
        self.final: dict[str, fx.GraphModule] = {}
        self.planned: dict[str, liveness.Liveness] = {}  # liveness of each final graph, as compiled
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
        self.zero_fill_off = False  # the backward is loss-only: autograd passes no zeros for the other outputs
        self.loss_only: output_grads.LossOnly | None = None  # as committed

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

    def follows_code(self) -> bool:
        """Whether the planned peak comes from the compiled code (wrapper_memory): inductor in regions or one
        graph (nested regions call subgraphs, which it does not follow)."""
        return self.cfg.backend == "inductor" and self.cfg.regional_compile != "nested"

    def split_passes(self, gm: fx.GraphModule, kind: str, trial: dict | None = None,
                     offload_saved: frozenset | None = None) -> tuple[fx.GraphModule, PassContext]:
        """`trial`: a scratch record of offloaded activations for a trial run on copies (nothing is kept), which
        may offload the saved activations `offload_saved` instead of the planner's. The graph to keep, over a
        memory budget, is split again with the bucket cap halved until it fits (a bucket's members are alive
        together) or no bucket holds two collectives."""
        limit = self.cfg.memory_budget_bytes(self.ctx.device) if trial is None else None
        original = copy_graph(gm.graph) if limit is not None and self.cfg.bucket_mb > 0 else None
        cap = None
        while True:
            pctx = self.pctx(kind, trial, offload_saved)
            pctx.bucket_bytes = cap
            self.mark_compiler(gm)
            if trial is None:
                gm.meta["zc_notes"] = list(self.notes)
                self.dump(kind, "input", gm)
            with self.timed("zcompile passes"):
                gm = passes.run_phase("split", gm, pctx, None if trial is not None else self.dumper(kind))
                collectives.mark_cross_node(gm, self.topology, range(self.ctx.world))
                passes.fake_shard_inputs(gm, pctx)
            with self.timed("fake propagation"):
                fake_values.refresh(gm)
            if trial is None:
                self.final[kind] = gm
            if original is None or cap == 0 or (cap is None and not pctx.bucketed):
                return gm, pctx
            peak = planner.step_peak(planner.model_state(list(self.params.values())), {kind: liveness.analyze(gm)},
                                     self.cfg.accumulate_grads)
            if peak <= limit:
                return gm, pctx
            # no bucket left to split: none at all (a bucket of one still copies its member through a flat buffer)
            cap = (self.cfg.bucket_mb * 2**20 if cap is None else cap) / 2 if pctx.bucketed else 0.0
            self.notes.append(f"bucket_collectives: the {kind} planned a step peak of {liveness.fmt(peak)}, over "
                              f"memory_budget {liveness.fmt(limit)}: split again with "
                              + (f"buckets of up to {liveness.fmt(cap)}" if cap else "one collective per parameter"))
            gm = graph_copies.copy(gm, original)

    def mark_compiler(self, gm: fx.GraphModule) -> None:
        """Liveness counts what the graph's compiler writes to memory: inductor's kernels keep values in registers."""
        if self.cfg.backend == "inductor":
            liveness.compiled_by_inductor(gm, self.cfg.regional_compile)

    def partition(self, joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **kwargs):
        """AOTAutograd's partition function: the joint graph's stages up to the final forward and backward."""
        self.dump("joint", "input", joint)
        joint = self.joint_graph_passes(joint)
        with self.timed("zcompile passes"):
            joint = passes.run_phase("joint", joint, self.pctx("joint"), self.dumper("joint"))
        min_cut = partition.MinCut(joint, joint_inputs, num_fwd_outputs, self.timed, **kwargs)
        fw, bw = min_cut()
        if self.regions_kept:
            with self.timed("inline regions"):  # with a fake propagation of the forward (inline_partitioned)
                block_regions.inline_partitioned(fw, bw, num_fwd_outputs)
        self.num_fwd_outputs = num_fwd_outputs
        # where the blocks were inlined the whole joint graph is here: the partitioner itself can trade
        fw, bw = self.memory.plan_activations(fw, bw, None if self.regions_kept else min_cut)
        recompute.mark_released({"forward": fw, "backward": bw}, num_fwd_outputs)
        self.memory.plan_persistence({"forward": fw, "backward": bw})
        fw, self.fw_pctx = self.split_passes(fw, "forward")
        bw, self.bw_pctx = self.split_passes(bw, "backward")
        self.zero_fill_off = bool(output_grads.droppable(bw))  # known before the first forward runs
        self.memory.check_budget({"forward": fw, "backward": bw})
        self.dump.schedule({"forward": fw, "backward": bw}, timeline.CostModel.for_device(self.ctx.device))
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

    def joint_graph_passes(self, gm: fx.GraphModule) -> fx.GraphModule:
        if self.cfg.backend != "inductor":
            return gm
        with self.timed("joint graph passes"):
            return partition.joint_graph_passes(gm)

    def agree(self, graphs: dict[str, fx.GraphModule]) -> None:
        """The ranks compare the collective schedules of the graphs just compiled before running them."""
        self.announce(schedule_check.fingerprint(graphs))

    def announce(self, schedule: tuple[int, str]) -> None:
        """agree's exchange, for a schedule fingerprinted before (a graph loaded from the compile cache too)."""
        self.schedule = schedule
        schedule_check.announce(self.ctx, self.graph_id, *schedule, self.cfg.collective_timeout_s)

    def compiler(self, kind: str, gm: fx.GraphModule, example_inputs):
        """AOTAutograd's compiler for the graph `kind`: its stages from the graph handed over to its commit."""
        if kind == "inference":
            if self.regions_kept:
                trace_blocks_once.inline(gm)
            gm = self.joint_graph_passes(gm)
            self.memory.plan_persistence({"inference": gm})
            gm, pctx = self.split_passes(gm, kind)
            self.memory.check_budget({"inference": gm})
            self.dump.schedule({"inference": gm}, timeline.CostModel.for_device(self.ctx.device))
            if self.cfg.schedule_check:
                self.agree({"inference": gm})
        else:  # the graph AOTAutograd hands over (with its backward lowered at once, a copy of the partition's)
            pctx = self.fw_pctx if kind == "forward" else self.bw_pctx
            self.final[kind] = gm
        phs = gm.graph.find_nodes(op="placeholder")
        fake_inputs = commit.fake_inputs(phs, example_inputs, pctx)
        if not fake_values.hold_for(phs, fake_inputs):
            with self.timed("fake propagation"):
                fake_values.refresh(gm, fake_inputs)
        self.mark_compiler(gm)
        loss_only = self.backward_for_loss(kind, gm, fake_inputs)
        with self.timed("liveness"):
            planned = self.planned[kind] = liveness.analyze(gm if loss_only is None else loss_only.gm)
        if not self.commit:
            return commit.dry_runner(gm)
        return commit.commit_graph(self, kind, gm, fake_inputs, pctx, planned, loss_only)

    def backward_for_loss(self, kind: str, gm: fx.GraphModule, fake_inputs: list) -> output_grads.LossOnly | None:
        """The backward as compiled for steps whose only gradient is the loss's (output_grads), or None."""
        if kind != "backward":
            return None
        names = output_grads.droppable(gm)
        self.zero_fill_off = bool(names)
        return output_grads.LossOnly(gm, fake_inputs, names) if names else None
