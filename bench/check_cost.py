"""What the safety checks cost per call on this machine: the schedule check's record exchange (one 256-byte
all-gather before every compiled graph run; two per training step of a one-graph model) and the `nonfinite` check
(a foreach inf-norm over this rank's gradients plus one all-reduce of 2 x world int32 per optimizer step).

    python bench/check_cost.py --world 2 --calls 2000
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

from zcompile import schedule_check  # noqa: E402
from zcompile.dist_context import DistContext  # noqa: E402
from zcompile.launch import run_world  # noqa: E402


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


def worker(rank: int, world: int, calls: int, grads_mib: float) -> dict:
    import torch.distributed as dist
    ctx = DistContext.current()
    exchange = _per_call_us(lambda: schedule_check.exchange(ctx, schedule_check.RUN, 1, "the forward", 300.0), calls)
    flags = torch.zeros(2 * world, dtype=torch.int32)
    all_reduce = _per_call_us(lambda: dist.all_reduce(flags), calls)
    grads = [torch.randn(int(grads_mib * 2**20 / 4 / 16)) for _ in range(16)]
    norm = _per_call_us(lambda: torch.isfinite(torch.stack(torch._foreach_norm(grads, float("inf")))).all(),
                        max(50, calls // 20))
    return {"exchange_us": exchange, "all_reduce_us": all_reduce, "inf_norm_us": norm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--grads-mib", type=float, default=3.3, help="gradient bytes per rank for the inf-norm (MiB)")
    args = ap.parse_args()
    results = run_world(args.world, worker, args.calls, args.grads_mib, timeout=600)
    worst = {k: max(r[k] for r in results) for k in results[0]}
    print(json.dumps({"world": args.world, "torch": torch.__version__, **{k: round(v, 1) for k, v in worst.items()}}))


if __name__ == "__main__":
    main()
