"""memory_budget acting on activations, beside checkpointing every block by hand (issue 48's CPU measurement).

    python bench/activation_budget.py                      # GPT-like, 4 layers, 128 wide, 8 x 256 tokens per rank
    python bench/activation_budget.py --fraction 0.5 --layers 4

Runs, each in fresh processes (world 2, gloo, stage 3, inductor), one after the other:
  unconstrained   the default config, no memory_budget: its measured tensor peak P sets the budget
  checkpoint      torch.utils.checkpoint around every block (use_reentrant=False), no budget: the user's manual way
  budget          memory_budget = fraction x P: the planner picks what to recompute (offload is no saving on a CPU)
checkpoint and budget run alternately `--rounds` times (the step is noisy with two ranks on two cores).
Reported per run: median step (the median of the rounds'), tensor peak per rank (zcompile.step_tensor_peak), planned peak, first step, the losses
(against the unconstrained run's) and the planner's decisions. The inductor cache is the user's (first steps are
warm after the first run).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zcompile  # noqa: E402
from zcompile.models.gpt import GPT, GPTConfig  # noqa: E402
from zcompile.tools.launch import WorkerFailed, run_world  # noqa: E402


def build(layers: int, width: int, seq: int, checkpoint: bool) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=seq, n_layer=layers, n_head=4, n_embd=width))
    if checkpoint:
        from torch.utils.checkpoint import checkpoint as ckpt
        for block in model.blocks:
            block.forward = functools.partial(ckpt, block.forward, use_reentrant=False)
    return model


def worker(rank: int, world: int, run: str, args, budget: int | None) -> dict:
    model = build(args.layers, args.width, args.seq, run == "checkpoint")
    config = {"stage": 3, "backend": "inductor"}
    if budget is not None:
        config["memory_budget"] = budget
    compiled = torch.compile(model, backend="zero", options={"config": config})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i):
        g = torch.Generator().manual_seed(1000 * i + rank)
        xy = torch.randint(0, 256, (args.micro, args.seq + 1), generator=g)
        t0 = time.perf_counter()
        loss = compiled(xy[:, :-1], xy[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, loss.item()

    first, loss0 = step(0)
    times, losses = [], [loss0]
    for i in range(1, args.steps):
        t, value = step(i)
        times.append(t)
        losses.append(value)
    steps = iter(range(10**6, 10**6 + 3))
    peak = zcompile.step_tensor_peak(lambda: step(next(steps)), repeats=3)["peak"]
    return {"run": run, "median_step_s": statistics.median(times[2:]), "first_step_s": first, "peak_bytes": peak,
            "planned_bytes": zcompile.planned_step_peak(), "losses": losses,
            "decisions": zcompile.activation_decisions()}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--fraction", type=float, default=0.5, help="memory_budget as a fraction of the measured peak")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3,
                    help="checkpoint and budget run alternately this many times (the step is their median)")
    ap.add_argument("--out", default="bench/results/activation_budget.md")
    args = ap.parse_args(argv)
    rows = []
    for run in ["unconstrained"] + ["checkpoint", "budget"] * args.rounds:
        if run == "budget" and ("peak_bytes" not in rows[0] or any("error" in r for r in rows)):
            continue  # no budget to set, or it failed once: it fails every time
        budget = int(args.fraction * rows[0]["peak_bytes"]) if run == "budget" else None
        try:
            r = run_world(args.world, worker, run, args, budget, timeout=900)[0]
        except WorkerFailed as e:  # a budget below the smallest plan: the error says what it would need
            last = next(line for line in reversed(e.errors[min(e.errors)].splitlines()) if "Error:" in line)
            last = last.split("Error: ", 1)[1]
            rows.append({"run": run, "budget": budget, "error": last})
            print(f"{run}: failed: {last}", flush=True)
            continue
        r["budget"] = budget
        rows.append(r)
        print(f"{run}: {r['median_step_s'] * 1e3:.1f} ms, peak {r['peak_bytes'] / 2**20:.2f} MiB "
              f"(planned {r['planned_bytes'] / 2**20:.2f}), first {r['first_step_s']:.1f} s", flush=True)
    ran = [r for r in rows if "error" not in r]
    diff = max(abs(a - b) for r in ran for a, b in zip(r["losses"], rows[0]["losses"]))
    lines = [f"### GPT-like, {args.layers} layers, {args.width} wide, vocab 256, {args.micro} x {args.seq} tokens per "
             f"rank, world {args.world} (gloo, CPU {os.cpu_count()} cores), stage 3, inductor, torch "
             f"{torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             f"Step: the median over {args.rounds} round(s) of each run's median step (checkpoint and budget run "
             "alternately, each in fresh processes; the rounds' values in brackets).", "",
             "| run | memory_budget (MiB) | step (ms) | tensor peak / rank (MiB) | planned (MiB) | first step (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in dict.fromkeys(r["run"] for r in rows):
        mine = [r for r in rows if r["run"] == name]
        b = f"{mine[0]['budget'] / 2**20:.2f}" if mine[0]["budget"] else "-"
        if any("error" in r for r in mine):
            lines.append(f"| {name} | {b} | failed: {next(r['error'] for r in mine if 'error' in r)} |")
            continue
        steps = [r["median_step_s"] * 1e3 for r in mine]
        each = f" [{', '.join(f'{t:.1f}' for t in steps)}]" if len(steps) > 1 else ""
        lines.append(f"| {name} | {b} | {statistics.median(steps):.1f}{each} | "
                     f"{max(r['peak_bytes'] for r in mine) / 2**20:.2f} | {mine[0]['planned_bytes'] / 2**20:.2f} | "
                     f"{mine[0]['first_step_s']:.1f} |")
    lines += ["", f"Largest difference of any run's loss from the unconstrained run's at the same step: {diff:.2e} "
              f"(inductor fuses a forward that returns fewer saved values differently).", "",
              "Decisions under the budget (rank 0):", "", "```", *rows[-1].get("decisions", []), "```"]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    print("\n".join(lines))
    return rows


if __name__ == "__main__":
    main()
