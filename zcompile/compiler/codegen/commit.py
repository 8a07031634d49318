"""The commit step: what compiling one graph decided becomes runtime state (process groups, whole-parameter buffers
and their gathers, host masters), the graph is compiled by its backend, and the function that runs it is made.
Also what the graph cache stores of a committed graph and restores on a hit. `job` is the graph's
backend.GraphCompile."""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils._python_dispatch import _disable_current_modes

from zcompile.compiler import codegen
from zcompile.compiler.codegen import output_grads
from zcompile.compiler.debug import schedule_check
from zcompile.compiler.graph import collectives, graph_copies
from zcompile.compiler.graph.pass_context import PassContext, SideInput
from zcompile.compiler.planning import liveness, wrapper_memory
from zcompile.runtime import collective_traffic, groups, memory_trace, nonfinite, offload_engine, shard_store


def commit_graph(job, kind: str, gm: fx.GraphModule, fake_inputs: list, pctx: PassContext,
                 planned: liveness.Liveness, loss_only: output_grads.LossOnly | None = None):
    """The commit step: what compiling decided becomes runtime state, and the graph becomes a function.
    Every rank reaches it at the same point (process groups and whole-parameter gathers are collective).
    `loss_only`: the backward compiled without the non-scalar outputs' gradients (`gm` compiled as traced when a
    step brings one)."""
    zps = list(job.params.values())
    with _disable_current_modes():  # real buffers and collectives, not AOTAutograd's fake tracing mode
        shard_store.make_persistent(zps)
        for zp in zps:
            zp.attach_master()
        made = {g.name: groups.realize(job.ctx, g, job.cfg.collective_timeout_s).name for g in pctx.subgroups}
    collectives.rename_groups(gm, made)
    job.committed[kind] = (gm, pctx, made)
    run_gm, run_fakes = gm, fake_inputs
    if kind == "backward":
        job.loss_only = loss_only
    if loss_only is not None:
        collectives.rename_groups(loss_only.gm, made)
        run_gm, run_fakes = loss_only.gm, loss_only.fake_inputs

    def compile_one(graph: fx.GraphModule, fakes: list) -> Callable:
        with job.timed(f"{job.cfg.backend} {kind}"):
            return codegen.compile_graph(job.cfg.backend, graph, fakes, kind, job.cfg.regional_compile)

    compiled = compile_one(run_gm, run_fakes)
    if hasattr(compiled, "regions"):
        job.regions[kind] = (compiled.regions, compiled.compiled_regions, compiled.compiled)
        planned = job.planned[kind] = wrapper_memory.graph_liveness(run_gm, planned, compiled.layout)
    side = list(pctx.side_inputs)
    if loss_only is not None:
        loss_only.num_args -= len(side)
    sched = collectives.schedule(gm)
    reads = [n.args[1] for n in gm.graph.nodes if n.target is torch.ops.zcompile.read_shard.default]
    read_ahead = reads if job.cfg.offload.overlap else []

    check = run_check(job, kind)
    watch_loss = kind == "forward" and job.cfg.nonfinite != "off"
    whole = [zp for zp in zps if zp.keeps_full] if kind != "backward" else []
    # gradient shards copied to pinned host memory without blocking (offload_grads): done before autograd reads
    host_grads = job.ctx.device.type == "cuda" and any(
        isinstance(o, fx.Node) and o.target is torch.ops.zcompile.to_host.default
        for o in gm.graph.output_node().args[0])

    # a backward with grad mode off records nothing: below autograd's keys its functional collectives skip torch's
    # Python autograd wrapper (six calls each). Not the forward: AOTAutograd reads its outputs' view metadata
    below_autograd = kind == "backward"

    compile_full = functools.partial(compile_one, gm, fake_inputs)  # a step that brings a dropped gradient

    def run_graph(args):
        run = compiled if loss_only is None else loss_only.select(args, compiled, compile_full)
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
            out = memory_trace.run_measured(run, args, job.graph_id, kind, planned)
        elif below_autograd and not torch.is_grad_enabled():
            with torch._C._AutoDispatchBelowAutograd():
                out = run(args)
        else:
            out = run(args)
        if host_grads:
            torch.cuda.current_stream(job.ctx.device).synchronize()
        if watch_loss:
            nonfinite.note_forward(zps, out[:job.num_fwd_outputs or len(out)])
        return out

    run_graph._boxed_call = True
    return run_graph


def run_check(job, kind: str):
    """Before each run of this graph's `kind`: the ranks confirm they run the same graph (schedule_check), and
    whether they refresh whole-parameter copies first. check(refresh: bool) or None."""
    if not job.cfg.schedule_check or job.ctx.world == 1:
        return None
    mine = [schedule_check.record(schedule_check.RUN,
                                  schedule_check.digest(job.identity, job.schedule[0], kind, refresh),
                                  f"the {kind} of graph {job.graph_id} ({job.inputs_text})"
                                  + (", refreshing whole parameters after a step" if refresh else ""))
            for refresh in (False, True)]
    return lambda refresh: schedule_check.exchange(job.ctx, mine[refresh], job.cfg.collective_timeout_s)


def cache_record(job, kind: str) -> tuple[fx.GraphModule, dict[str, str], dict]:
    """What graph_cache stores of the committed graph `kind`: the graph, the names its commit gave its subgroups,
    and a record of the pass context's side inputs (by parameter index), subgroups and own placeholders, with the
    forward (or inference) graph also the job's decisions."""
    gm, pctx, made = job.committed[kind]
    index = {id(zp): i for i, zp in job.params.items()}
    record = {"side_inputs": [(index[id(s.zp)], s.kind) for s in pctx.side_inputs],
              "subgroups": list(pctx.subgroups), "own_placeholders": sorted(pctx.own_placeholders)}
    if kind != "backward":
        record.update(
            params={i: (zp.persist_decided, zp.persistent, zp.optim_tier, zp.secondary_numel,
                        getattr(zp, "secondary_dtype", None)) for i, zp in job.params.items()},
            notes=list(job.notes), num_fwd_outputs=job.num_fwd_outputs, offloaded=dict(job.offloaded),
            schedule=job.schedule, activation_plan=list(job.activation_plan))
    return gm, made, record


def load_cached(job, kind: str, record: dict, gm: fx.GraphModule) -> Callable:
    """graph_cache hit: the graph `kind` (`gm`, as unpickled) and the decisions compiling it made, restored into
    this job, then committed as a compiled graph would be."""
    gm = graph_copies.lazy(gm)  # unpickled without its code: generated if run (eager, a whole graph)
    if kind != "backward":
        for i, (decided, persistent, tier, secondary, secondary_dtype) in record["params"].items():
            zp = job.params[i]
            zp.persist_decided, zp.persistent, zp.optim_tier = decided, persistent, tier
            if secondary:
                zp.use_secondary(secondary, secondary_dtype)
        job.notes = list(record["notes"])
        job.num_fwd_outputs = record["num_fwd_outputs"]
        job.offloaded.update(record["offloaded"])
        job.activation_plan = list(record["activation_plan"])
        if job.cfg.schedule_check:  # part of the cache key: as when this graph was stored
            job.announce(record["schedule"])
    pctx = job.pctx(kind)
    pctx.side_inputs = [SideInput(job.params[i], side_kind) for i, side_kind in record["side_inputs"]]
    pctx.subgroups = list(record["subgroups"])
    pctx.own_placeholders = set(record["own_placeholders"])
    job.final[kind] = gm
    fake_inputs = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    job.mark_compiler(gm)
    loss_only = job.backward_for_loss(kind, gm, fake_inputs)
    with job.timed("liveness"):
        planned = job.planned[kind] = liveness.analyze(gm if loss_only is None else loss_only.gm)
    return commit_graph(job, kind, gm, fake_inputs, pctx, planned, loss_only)


def fake_inputs(phs: list[fx.Node], example_inputs: list, pctx: PassContext) -> list:
    """The values the graph is compiled for: AOTAutograd's example inputs carry the real layout of saved
    activations; ours, the shards and side inputs."""
    return [n.meta["val"] if n.name in pctx.own_placeholders or k >= len(example_inputs)
            or not isinstance(example_inputs[k], torch.Tensor) else on_tier(n, example_inputs[k])
            for k, n in enumerate(phs)]


def on_tier(node: fx.Node, example: torch.Tensor) -> torch.Tensor:
    """A saved activation the forward offloaded arrives on the host, in the layout the compiled forward produced."""
    if node.meta.get("zc_tier") != "cpu" or example.device.type == "cpu":
        return example
    with detect_fake_mode([example]) or _disable_current_modes():
        return torch.empty_strided(example.shape, example.stride(), dtype=example.dtype, device="cpu")


def dry_runner(gm: fx.GraphModule):
    """A dry compile's graph function: meta tensors shaped like the graph's outputs, nothing computed."""
    (outs,) = gm.graph.output_node().args
    vals = [o.meta.get("val") if isinstance(o, fx.Node) else o for o in outs]

    def run(args):
        return [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                if isinstance(v, torch.Tensor) else v for v in vals]

    run._boxed_call = True
    return run
