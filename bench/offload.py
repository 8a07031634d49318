"""ZeRO-Infinity offload against plain ZeRO-3: device memory planned per rank, bytes moved between tiers, step time
with and without NVMe read-ahead, and the loss (which must not change).

    python bench/offload.py --world 2 --size medium --steps 20 --nvme-path /tmp/zc-nvme

Systems: zero3 (no offload), opt_cpu (optimizer state on the host), cpu (optimizer state, parameter shards and
saved activations on the host), nvme (parameter shards and Adam moments in files, read ahead on a thread pool),
nvme_sync (the same, every file read when the graph needs it: offload.overlap false), tiled (zero3 with
memory-centric tiling of linears of at least --tile-mb). Every system steps with zcompile.CPUAdam (torch's fused
AdamW kernel) so the losses are comparable bit for bit. On this CPU-only machine the "device" is host memory too:
the device column is what the planner counts against `memory_budget`, the tier traffic is real copies and real
file I/O (the page cache is not dropped between steps, so NVMe reads may be served from memory).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zcompile  # noqa: E402
from bench.compare import batch, build_model, loss_of  # noqa: E402
from zcompile.tools.launch import run_world  # noqa: E402

LR = 1e-3
SYSTEMS = ("zero3", "opt_cpu", "cpu", "nvme", "nvme_sync", "tiled")


def config(system: str, args) -> dict:
    cfg = {"stage": 3, "backend": args.backend}
    nvme = {"optimizer": "nvme", "params": "nvme", "activations": "cpu", "nvme_path": args.nvme_path}
    extra = {"zero3": {}, "opt_cpu": {"offload": {"optimizer": "cpu"}},
             "cpu": {"offload": {"optimizer": "cpu", "params": "cpu", "activations": "cpu"}},
             "nvme": {"offload": nvme}, "nvme_sync": {"offload": dict(nvme, overlap=False)},
             "tiled": {"tiling": {"min_bytes": f"{args.tile_mb}MiB", "tiles": 4}}}[system]
    return {**cfg, **extra}


def worker(rank: int, world: int, system: str, args) -> dict:
    cfg = config(system, args)
    model = build_model("gpt", args.size)
    compiled = torch.compile(model, backend="zero", options={"config": cfg})
    opt = zcompile.CPUAdam(compiled.parameters(), lr=LR)
    losses, times = [], []
    for i in range(args.warmup + args.steps + 1):
        if i == args.warmup + args.steps:
            zcompile.reset_offload_traffic()
        x = batch(i, rank, world, args.micro, args.seq, "cpu")
        t0 = time.perf_counter()
        loss = loss_of(compiled, x)
        loss.backward()
        opt.step()
        if i == args.warmup + args.steps:
            report = zcompile.memory_report(compiled, opt)
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return {"system": system, "config": cfg, "losses": losses,
            "median_step_s": statistics.median(times[args.warmup:args.warmup + args.steps]),
            "planned_peak": zcompile.planned_step_peak(), "tiers": zcompile.offload_traffic(),
            "device_state": report.total, "host_state": report.host_bytes, "nvme_state": report.nvme_bytes,
            "params": sum(p.numel() for p in model.parameters())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--size", default="medium", choices=["small", "medium"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--nvme-path", default="/tmp/zcompile-bench-nvme")
    ap.add_argument("--tile-mb", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for system in args.systems.split(","):
        shutil.rmtree(args.nvme_path, ignore_errors=True)
        t0 = time.time()
        rows.append(run_world(args.world, worker, system, args, timeout=args.timeout)[0])
        print(f"{system}: {time.time() - t0:.0f} s", flush=True)
    shutil.rmtree(args.nvme_path, ignore_errors=True)
    mib = 1 / 2**20
    header = (f"### Offload: gpt-{args.size} ({rows[0]['params']:,} params), world {args.world}, {args.backend}, "
              f"{args.micro}x{args.seq} tokens/rank/step, CPU ({os.cpu_count()} cores), torch {torch.__version__}, "
              f"{time.strftime('%Y-%m-%d')}")
    out = [header, "", "| system | median step (ms) | vs zero3 | planned device peak / rank (MiB) | model state "
           "device / host / nvme (MiB) | per step: device->cpu / cpu->device / cpu->nvme / nvme->cpu (MiB) | "
           "final loss |", "|---|---:|---:|---:|---:|---:|---:|"]
    base = next((r for r in rows if r["system"] == "zero3"), rows[0])
    for r in rows:
        t = r["tiers"]
        out.append(f"| {r['system']} | {r['median_step_s'] * 1e3:.1f} | {r['median_step_s'] / base['median_step_s']:.2f}x "
                   f"| {r['planned_peak'] * mib:.2f} | {r['device_state'] * mib:.2f} / {r['host_state'] * mib:.2f} / "
                   f"{r['nvme_state'] * mib:.2f} | {t.get('device->cpu', 0) * mib:.2f} / "
                   f"{t.get('cpu->device', 0) * mib:.2f} / {t.get('cpu->nvme', 0) * mib:.2f} / "
                   f"{t.get('nvme->cpu', 0) * mib:.2f} | {r['losses'][-1]:.6f} |")
    md = "\n".join(out) + "\n"
    print(md)
    tag = f"offload-gpt-{args.size}-w{args.world}-{args.backend}"
    with open(os.path.join(args.out, f"{tag}.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out, f"{tag}.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
