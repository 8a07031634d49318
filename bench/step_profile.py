"""Where a training step's time goes: torch.profiler over a few steps of bench/compare.py's systems, same model and
data, each in fresh processes (rank 0 reported).

    python bench/step_profile.py --device cuda --size medium --micro 8 --seq 256 \\
        --systems fsdp2_compile,zcompile_z3,zcompile_z3_whole_graph

Per system: median step time unprofiled, then per profiled step the CPU ops dispatched, the kernels launched (CUDA),
the GPU busy time (sum of kernel times), and the profiler's table of the most expensive ops by self CPU time and,
on CUDA, by device time. A step whose wall time is far above its GPU busy time is bound by launching work (Python,
dispatch, small kernels), not by the kernels themselves.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import compare  # noqa: E402
from zcompile.tools.launch import run_world  # noqa: E402


def worker(rank: int, world: int, system: str, args) -> dict:
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    step = compare.SETUP[system](compare.build_model(args.model, args.size).to(device), world, device, args)

    def run(i):
        step(compare.batch(i, rank, world, args.micro, args.seq, device))
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        run(i)
        times.append(time.perf_counter() - t0)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(args.profiled):
            run(args.warmup + args.steps + i)
    events = prof.key_averages()
    n = args.profiled
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    tables = {"self CPU": events.table(sort_by="self_cpu_time_total", row_limit=args.rows)}
    if device.type == "cuda":
        tables["device"] = events.table(sort_by="self_device_time_total", row_limit=args.rows)
    return {"median_ms": 1e3 * statistics.median(times[args.warmup:]),
            "cpu_ops_per_step": sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CPU) / n,
            "kernels_per_step": len(kernels) / n,
            "gpu_busy_ms_per_step": sum(k.device_time_total for k in kernels) / 1e3 / n, "tables": tables}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--model", default="gpt", choices=["gpt", "llama"])
    ap.add_argument("--size", default="medium", choices=["small", "medium"])
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profiled", type=int, default=3)
    ap.add_argument("--rows", type=int, default=15)
    ap.add_argument("--systems", default="fsdp2_compile,zcompile_z3,zcompile_z3_whole_graph")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    env = {"ZC_TEST_PG": "nccl"} if args.device == "cuda" else {}
    summary = []
    for system in args.systems.split(","):
        r = run_world(args.world, worker, system, args, timeout=args.timeout, env=env)[0]
        summary.append(f"| {system} | {r['median_ms']:.1f} | {r['cpu_ops_per_step']:.0f} | "
                       f"{r['kernels_per_step']:.0f} | {r['gpu_busy_ms_per_step']:.1f} |")
        for name, table in r["tables"].items():
            print(f"### {system}: top ops by {name} time ({args.profiled} steps)\n{table}", flush=True)
    print(f"### {args.model}-{args.size}, {args.device}, world {args.world}, {args.micro}x{args.seq} tokens/rank, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}\n")
    print("| system | median step (ms) | CPU ops / step | kernels / step | GPU busy (ms) / step |\n|---|---:|---:|---:|---:|")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
