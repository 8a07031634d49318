"""What the safety checks cost per call on this machine: the schedule check's record exchange (one 256-byte
all-gather before every compiled graph run; two per training step of a one-graph model) and the `nonfinite` check
(a foreach inf-norm over this rank's gradients plus one all-reduce of 2 x world int32 per optimizer step).

    python bench/check_cost.py --world 2 --calls 2000

It also times training steps of the small benchmark GPT (inductor) with `schedule_check` on and off, compiled side by
side in the same processes and stepped alternately, so machine noise hits both alike (--steps pairs).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zcompile.compiler import schedule_check  # noqa: E402
from zcompile.runtime.dist_context import DistContext  # noqa: E402
from zcompile.tools.launch import run_world  # noqa: E402


def _per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls // 5):
            fn()
        rounds.append((time.perf_counter() - t0) / (calls // 5) * 1e6)
    return statistics.median(rounds)


def paired_steps(rank: int, world: int, steps: int) -> dict:
    """Median step time (ms) with schedule_check on and off, the two models stepped alternately."""
    from bench.compare import batch, build_model, loss_of
    runs = {}
    for check in (True, False):
        model = torch.compile(build_model("gpt", "small"), backend="zero",
                              options={"config": {"stage": 3, "schedule_check": check}})
        runs[check] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), [])
    x = batch(0, rank, world, 4, 128, torch.device("cpu"))
    for k in range(steps + 3):
        for check, (model, opt, times) in runs.items():
            t0 = time.perf_counter()
            loss_of(model, x).backward()
            opt.step()
            opt.zero_grad()
            if k >= 3:
                times.append((time.perf_counter() - t0) * 1e3)
    return {"step_ms_check": statistics.median(runs[True][2]), "step_ms_no_check": statistics.median(runs[False][2])}


def worker(rank: int, world: int, calls: int, grads_mib: float, steps: int) -> dict:
    import torch.distributed as dist
    ctx = DistContext.current()
    mine = schedule_check.record(schedule_check.RUN, 1, "the forward")
    exchange = _per_call_us(lambda: schedule_check.exchange(ctx, mine, 300.0), calls)
    flags = torch.zeros(2 * world, dtype=torch.int32)
    all_reduce = _per_call_us(lambda: dist.all_reduce(flags), calls)
    grads = [torch.randn(int(grads_mib * 2**20 / 4 / 16)) for _ in range(16)]
    norm = _per_call_us(lambda: torch.isfinite(torch.stack(torch._foreach_norm(grads, float("inf")))).all(),
                        max(50, calls // 20))
    out = {"exchange_us": exchange, "all_reduce_us": all_reduce, "inf_norm_us": norm}
    return out | (paired_steps(rank, world, steps) if steps else {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--grads-mib", type=float, default=3.3, help="gradient bytes per rank for the inf-norm (MiB)")
    ap.add_argument("--steps", type=int, default=30, help="paired training steps (0: skip)")
    args = ap.parse_args()
    results = run_world(args.world, worker, args.calls, args.grads_mib, args.steps, timeout=900)
    worst = {k: max(r[k] for r in results) for k in results[0]}
    print(json.dumps({"world": args.world, "torch": torch.__version__, **{k: round(v, 1) for k, v in worst.items()}}))


if __name__ == "__main__":
    main()
