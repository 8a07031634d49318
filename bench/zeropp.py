"""ZeRO++ (qwZ + hpZ + qgZ) against plain ZeRO-3: convergence over many steps and cross-node bytes, on a simulated
K-node cluster (gloo processes on one machine, `ranks_per_node` = world / K).

    python bench/zeropp.py --world 4 --nodes 2 --steps 200            # fp32 and bf16

Data: arithmetic token sequences (learnable). Reports per dtype and system: the loss curve, final loss (mean of the last 10 steps, and the last step's), median
step time, collective bytes per step and rank, and the cross-node volume per node in units of M (model bytes in the
compute dtype; ZeRO++ paper: 3M for ZeRO-3, 0.75M with all three, times (K-1)/K here). Writes Markdown, JSON and
a PNG of the loss curves.
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

import zcompile  # noqa: E402
from bench.compare import build_model, loss_of  # noqa: E402
from zcompile.tools.launch import run_world  # noqa: E402

LR = 1e-3


def batch(step: int, rank: int, world: int, micro: int, seq: int) -> torch.Tensor:
    """Learnable data: arithmetic sequences (start + stride * t) mod 256, so the loss falls far below ln(256) and
    a worse gradient shows (random tokens would only teach the unigram distribution)."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, 256, (world * micro, 1), generator=g)
    stride = torch.randint(1, 8, (world * micro, 1), generator=g)
    return ((start + stride * torch.arange(seq + 1)) % 256).chunk(world)[rank]


def config(system: str, dtype: str, world: int, nodes: int, block_w: int, block_g: int) -> dict:
    mp = {"param_dtype": dtype, **({"reduce_dtype": dtype} if dtype == "bf16" else {})}
    cfg = {"stage": 3, "backend": "inductor", "mixed_precision": mp, "ranks_per_node": world // nodes}
    parts = {"qwz": {"quantize_weights": {"block": block_w}}, "hpz": {"hpz_partition_size": world // nodes},
             "qgz": {"quantize_gradients": {"block": block_g}}}
    for name, extra in parts.items():
        if system in (name, "zeropp"):
            cfg.update(extra)
    return cfg


def worker(rank: int, world: int, cfg: dict, args) -> dict:
    model = build_model("gpt", args.size)
    params = sum(p.numel() for p in model.parameters())
    compiled = torch.compile(model, backend="zero", options={"config": cfg})
    opt = torch.optim.AdamW(compiled.parameters(), lr=LR)
    losses, times = [], []
    for i in range(args.steps):
        if i == args.steps - 1:
            zcompile.reset_traffic()
        x = batch(i, rank, world, args.micro, args.seq)
        t0 = time.perf_counter()
        loss = loss_of(compiled, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return {"losses": losses, "median_step_s": statistics.median(times[5:]), "params": params,
            "traffic": zcompile.traffic(), "cross_node": zcompile.traffic(cross_node=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--size", default="small", choices=["small", "medium"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--systems", default="zero3,zeropp", help="zero3 (first, the baseline), zeropp (all three), "
                    "or one of qwz, hpz, qgz alone")
    ap.add_argument("--block-weights", type=int, default=2048)
    ap.add_argument("--block-grads", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for dtype in args.dtypes.split(","):
        for system in args.systems.split(","):
            cfg = config(system, dtype, args.world, args.nodes, args.block_weights, args.block_grads)
            t0 = time.time()
            r = run_world(args.world, worker, cfg, args, timeout=args.timeout)[0]
            item = 2 if dtype == "bf16" else 4
            M = item * r["params"]
            g = args.world // args.nodes
            rows.append({"dtype": dtype, "system": system, "config": cfg, **r,
                         "final_loss_mean10": statistics.mean(r["losses"][-10:]),
                         "comm_per_rank_M": sum(r["traffic"].values()) / M,
                         "cross_node_per_node_M": g * sum(r["cross_node"].values()) / M})
            print(f"{dtype} {system}: {time.time() - t0:.0f} s", flush=True)
    tag = f"zeropp-gpt-{args.size}-w{args.world}-n{args.nodes}" + ("" if args.systems == "zero3,zeropp" else
                                                                   "-" + args.systems.replace(",", "-"))
    header = (f"### ZeRO++ vs ZeRO-3: gpt-{args.size} ({rows[0]['params']:,} params), {args.world} ranks as "
              f"{args.nodes} simulated nodes, {args.steps} steps, qwZ block {args.block_weights}, qgZ block "
              f"{args.block_grads}, CPU ({os.cpu_count()} cores), torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    out = [header, "", "| dtype | system | final loss (mean last 10) | vs ZeRO-3 | last step loss | median step (ms) | "
           "comm / step / rank (M) | cross-node / step / node (M) |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        base = next(b for b in rows if b["dtype"] == r["dtype"] and b["system"] == "zero3")
        rel = (r["final_loss_mean10"] - base["final_loss_mean10"]) / base["final_loss_mean10"]
        out.append(f"| {r['dtype']} | {r['system']} | {r['final_loss_mean10']:.4f} | {rel:+.2%} | "
                   f"{r['losses'][-1]:.4f} | {r['median_step_s'] * 1e3:.1f} | {r['comm_per_rank_M']:.3f} | "
                   f"{r['cross_node_per_node_M']:.3f} |")
    md = "\n".join(out) + ("\n\nM = model bytes in the compute dtype. Cross-node per node = (K-1)/K x the ZeRO++ "
                           "paper's volume: ZeRO-3 3M, ZeRO++ 0.75M (bf16) + block scales.\n")
    print(md)
    with open(os.path.join(args.out, f"{tag}.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out, f"{tag}.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 4))
        for r in rows:
            ax.plot(r["losses"], label=f"{r['dtype']} {r['system']}", lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
        ax.set_title(header[4:], fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, f"{tag}.png"), dpi=100)
    except ImportError:
        print("matplotlib not installed: no plot")


if __name__ == "__main__":
    main()
