"""Ranks agree on what they are about to run before they communicate.

Every rank contributes one fixed-size record (`RECORD_BYTES`: what it is doing, a 63-bit identity, a readable line) to
an all-gather at three points:
- before it compiles a graph (identity: the parameters the graph takes, in order, the other inputs' dtypes, the
  config);
- after compiling, the collective schedule of the result (every collective's op, dtype, elements, bytes, group and
  the parameters or bucket members it moves, as the passes described them);
- before every run of a compiled graph (identity: the compile identity, the collective schedule and which part of
  the graph runs);
- where a rank stops with an error while its peers go on to one of the points above (`fail`): they raise PeerFailed
  with its reason there instead of waiting for it.
The record's size never depends on what a rank does, so ranks that diverge (one recompiles for a new shape, takes
another branch, runs an eval forward alone, read another config) meet in the same exchange and all raise
ScheduleMismatch naming what each rank was doing, instead of exchanging mismatched buffers (gloo aborts the process)
or silently mixing different parameters. A peer that never arrives (stopped, hung, exited) fails the exchange after
the group's timeout (`collective_timeout_s`): PeerTimeout. Records are CPU tensors (under NCCL over a gloo group of
the same ranks), so the check never waits for the GPU. It costs one 256-byte all-gather per graph run (see
docs/failure-behaviour.md); `schedule_check: false` turns all of it off.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

import torch
import torch.fx as fx
from torch.utils._python_dispatch import _disable_current_modes

from zcompile.compiler.graph import collectives
from zcompile.runtime.dist_context import DistContext, all_gather_flat, host_group
from zcompile.errors import PeerFailed, PeerTimeout, ScheduleMismatch

RECORD_BYTES = 256
_TEXT = RECORD_BYTES - 16
COMPILE, SCHEDULE, RUN, FAILED = 1, 2, 3, 4
_PHASES = {COMPILE: "compiling", SCHEDULE: "compiled", RUN: "running", FAILED: "failed:"}


def digest(*parts) -> int:
    """A 63-bit identity of `parts` (their JSON text), the same on every rank for the same values."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


def graph_identity(gm: fx.GraphModule, example_inputs, is_param: list[bool], cfg) -> int:
    """What a rank is about to compile, as far as its collectives depend on it: which parameters the graph takes,
    in order (dynamo names them by module path), with their shapes and dtypes; the other tensor inputs' dtypes and
    ranks; the config (less where dumps go). Not sizes of activations or dynamic-shape symbols: ranks may see other
    sequence lengths or batch sizes at the same time and still move the same parameters."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params = [(ph.name, list(x.shape), str(x.dtype)) for ph, x, param in zip(phs, example_inputs, is_param) if param]
    others = [(str(x.dtype), x.dim()) for x, param in zip(example_inputs, is_param)
              if isinstance(x, torch.Tensor) and not param]
    settings = dataclasses.replace(cfg, dump=None, source="")
    return digest(params, others, repr(settings))


def fingerprint(graphs: dict[str, fx.GraphModule]) -> tuple[int, str]:
    """(identity, readable summary) of the collectives of the given graphs, in issue order."""
    desc = {kind: [(c["op"], str(c.get("dtype")), c.get("numel"), c["bytes"], _group(c), c.get("why"))
                   for c in collectives.schedule(gm)] for kind, gm in graphs.items()}
    summary = ", ".join(f"{k}: {len(v)} collectives / {sum(c[3] for c in v)} bytes" for k, v in desc.items())
    return digest(desc), summary


def _group(c: dict) -> str:
    """The same on every rank: a subgroup's name differs between the ranks of different subgroups."""
    return f"subgroup of {len(c['ranks'])}" if c.get("ranks") else c["group"]


def record(phase: int, identity: int, what: str) -> torch.Tensor:
    """This rank's record: phase and identity (compared), then `what` (shown when they differ)."""
    with _disable_current_modes():  # a real tensor, also when built while AOTAutograd traces under a fake mode
        out = torch.zeros(RECORD_BYTES, dtype=torch.uint8)
        out[:16].view(torch.int64).copy_(torch.tensor([phase, identity]))
        raw = what.encode()[:_TEXT]
        out[16:16 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out


def _decode(rec: torch.Tensor) -> tuple[int, int, str]:
    phase, identity = rec[:16].view(torch.int64).tolist()
    return phase, identity, bytes(rec[16:].tolist()).rstrip(b"\0").decode(errors="replace")


def exchange(ctx: DistContext, mine: torch.Tensor, timeout_s: float) -> None:
    """All ranks contribute their `record`; raise on every rank unless all phases and identities match."""
    if ctx.world == 1:
        return
    with _disable_current_modes():  # may be called while AOTAutograd traces under a fake mode
        everyone = torch.empty(ctx.world, RECORD_BYTES, dtype=torch.uint8)
        try:
            all_gather_flat(everyone.view(-1), mine, host_group(ctx, timeout_s))
        except RuntimeError as e:
            phase, _, what = _decode(mine)
            raise PeerTimeout(
                f"rank {ctx.rank}: while {_PHASES[phase]} {what}, the other ranks did not join within "
                f"collective_timeout_s={timeout_s:g}s or left the group: a peer is stopped, hung, crashed, or runs "
                f"other code. ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})"
            ) from None
        if bool((everyone[:, :16] == mine[:16]).all()):
            return
        rows = [_decode(r) for r in everyone]
    if rows[ctx.rank][0] == FAILED:  # `fail`: this rank raises its own error
        return
    failed = [(r, text) for r, (p, _, text) in enumerate(rows) if p == FAILED]
    if failed:
        raise PeerFailed(f"rank {ctx.rank}: " + "; ".join(f"rank {r} failed: {text}" for r, text in failed)
                         + f". This rank stops too (it was {_PHASES[rows[ctx.rank][0]]} {rows[ctx.rank][2]}).")
    lines = "\n".join(f"  rank {r}: {_PHASES.get(p, '?')} {text} [{h:015x}]" for r, (p, h, text) in enumerate(rows))
    raise ScheduleMismatch(
        f"rank {ctx.rank}: ranks are about to run different graphs or collective schedules; running them would "
        f"abort in the collective library or mix different parameters.\n{lines}\n"
        "Every rank must run the same model code path with the same config, input shapes and world size at each "
        "step (a shape or branch that differs on one rank recompiles or picks another graph there: pad or drop "
        "uneven last batches, keep data-dependent control flow the same on every rank, run eval forwards on every "
        "rank; a mixture-of-experts layer that loops over the experts its tokens were routed to, such as Hugging "
        "Face's experts_implementation='eager', branches per rank: use one that runs every expert, such as its "
        "default 'grouped_mm').")


def announce(ctx: DistContext, graph_id: int, identity: int, summary: str, timeout_s: float) -> None:
    """After compiling: ranks compare their collective schedules (`fingerprint`) before running them."""
    exchange(ctx, record(SCHEDULE, identity, f"graph {graph_id} ({summary})"), timeout_s)


def fail(ctx: DistContext, reason: str, timeout_s: float) -> None:
    """This rank stops with `reason`: its record meets the peers' next exchange (each compile and each graph run has
    one), where they raise PeerFailed with the reason instead of waiting for this rank until `collective_timeout_s`.
    Peers that never get to an exchange leave this rank waiting that long at most; it then raises its own error."""
    try:
        exchange(ctx, record(FAILED, 0, reason), timeout_s)
    except PeerTimeout:
        pass
