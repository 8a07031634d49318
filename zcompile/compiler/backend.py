"""The `zero` dynamo backend: dynamo graph -> passes -> AOTAutograd -> passes on forward/backward -> compiler.

    torch.compile(model, backend="zero", options={"config": "zero3.yaml"})

Parameters arrive as graph inputs and are identified by identity (`example_inputs[i]` is the nn.Parameter), so graph
breaks and recompiles map them to the same shards. The returned callable replaces each parameter argument with the
tensor the graph was compiled for (the shard at stages 2/3) and appends the side inputs a pass asked for.

This module wires the stages (the package's docstring lists them); one graph's compile is a job.GraphCompile.
Compiling decides; committing acts. The passes and the planner only rewrite graphs and record decisions (side
inputs, subgroups, which parameters stay whole, where optimizer state lives). codegen/commit.py's `commit_graph` is
the one step that turns them into runtime state: process groups, whole-parameter buffers and their all-gather, host
masters, the compiled graph and the function that runs it. `zcompile plan` compiles without committing
(`dry_backend`): nothing is allocated or communicated, and the "run" returns meta tensors.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import weakref

import torch.fx as fx
import torch.nn as nn
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.decomposition import select_decomp_table

from zcompile import config as zconfig
from zcompile.compiler import passes
from zcompile.compiler.codegen import graph_cache, output_grads
from zcompile.compiler.debug import aot_graph_logs, schedule_check
from zcompile.compiler.job import GraphCompile
from zcompile.compiler.planning import planner
from zcompile.compiler.tracing import before_trace, block_regions, dynamo_graph, trace_blocks_once
from zcompile.errors import ZCompileError, reported_as_zcompile_errors
from zcompile.runtime import dtensor_params, shard_store
from zcompile.runtime.dist_context import DistContext


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
        # before sharding: with DTensor parameters torch 2.11's dynamo fails on them itself
        dynamo_graph.refuse_nested_regions(gm)
    if dtensor_params.rewrites_modules(cfg):
        dynamo_graph.shard_modules_of(gm, example_inputs, cfg, ctx)  # restarts dynamo when it replaced parameters
    job, run = _compile_graph(gm, example_inputs, cfg, ctx, commit=True)
    _COMPILED.add(job)
    for zp in job.params.values():
        zp.nonfinite = cfg.nonfinite
        zp.release_full()
    return run


zero_backend.zcompile_backend = True  # how before_trace recognizes it (the registry may hold only its entry point)


def dry_backend(cfg: zconfig.Config, ctx: DistContext, jobs: list):
    """A dynamo backend that compiles for `ctx` (DistContext.without_group) without committing: every graph's
    passes, planner and analysis run, nothing is allocated or communicated, each graph's `GraphCompile` is
    appended to `jobs`, and running the result returns meta tensors. For zcompile plan (use schedule_check=False:
    there is no group to agree over)."""
    def backend(gm: fx.GraphModule, example_inputs):
        with collector_paused():
            job, run = _compile_graph(gm, example_inputs, cfg, ctx, commit=False)
        jobs.append(job)
        return run
    return backend


def _compile_graph(gm: fx.GraphModule, example_inputs, cfg: zconfig.Config, ctx: DistContext, commit: bool):
    """One dynamo graph through the passes and AOTAutograd: (its GraphCompile, the function dynamo calls)."""
    example_inputs = list(example_inputs)
    if not dtensor_params.trace_once_supported():
        dynamo_graph.refuse_nested_regions(gm)
    why_inlined = block_regions.why_not(gm, cfg)
    if why_inlined is not None and trace_blocks_once.inline(gm):
        trace_blocks_once.forget_reuse()
    example_inputs, dparams, dropped = dtensor_params.unwrap_graph(gm, example_inputs)
    is_param = [isinstance(x, nn.Parameter) or i in dparams for i, x in enumerate(example_inputs)]
    identity = schedule_check.graph_identity(gm, example_inputs, is_param, cfg)
    inputs_text = dynamo_graph.inputs_text(example_inputs, is_param)
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
    job = GraphCompile(cfg, ctx, params, len(example_inputs), identity, inputs_text, commit)
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
        out = job.compiled(*args)
        if job.zero_fill_off:
            output_grads.no_zero_fill(out)
        return out

    return job, run


def _keep_regions(gm: fx.GraphModule, example_inputs: list, job: GraphCompile, why: str | None) -> bool:
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


def _boxed(job: GraphCompile, kind: str, gm: fx.GraphModule, example_inputs):
    with collector_paused():  # the backward compiles at the first backward, outside zero_backend
        return job.compiler(kind, gm, example_inputs)
