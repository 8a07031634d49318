"""memory_budget acting on activations, beside checkpointing every block by hand (issue 48's CPU measurement).

    python bench/activation_budget.py                      # GPT-like, 4 layers, 128 wide, 8 x 256 tokens per rank
    python bench/activation_budget.py --fraction 0.5 --layers 4
    python bench/activation_budget.py --model llama --budget-from checkpoint   # issue 58: checkpoint's peak as budget

Runs, each in fresh processes (world 2, gloo; stage 3 and inductor by default), one after the other:
  unconstrained   the default config, no memory_budget: its measured tensor peak P sets the budget
  checkpoint      torch.utils.checkpoint around every block (use_reentrant=False), no budget: the user's manual way
  budget          memory_budget = fraction x P (or, with --budget-from checkpoint, checkpoint's measured peak): the
                  planner picks what to recompute (offload is no saving on a CPU)
Models: gpt (zcompile.models.gpt), llama (zcompile.models.llama: RMSNorm, rotary SDPA, SwiGLU), hf-llama (Hugging
Face's LlamaForCausalLM from a config; checkpoint is its gradient_checkpointing_enable()).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import compare  # noqa: E402
import zcompile  # noqa: E402
from zcompile.models.gpt import GPT, GPTConfig  # noqa: E402
from zcompile.models.llama import Llama, LlamaConfig  # noqa: E402
from zcompile.tools.launch import WorkerFailed, run_world  # noqa: E402


MODELS = ("gpt", "llama", "hf-llama")


def build(name: str, layers: int, width: int, seq: int, checkpoint: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "hf-llama":
        import transformers as tf
        model = tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=256, hidden_size=width, intermediate_size=int(width * 8 / 3) // 8 * 8, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=seq, attn_implementation="sdpa"))
        if checkpoint:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    if name == "llama":
        model = Llama(LlamaConfig(vocab_size=256, block_size=seq, n_layer=layers, n_head=4, n_embd=width))
    else:
        model = GPT(GPTConfig(vocab_size=256, block_size=seq, n_layer=layers, n_head=4, n_embd=width))
    if checkpoint:
        from torch.utils.checkpoint import checkpoint as ckpt
        for block in model.blocks:
            block.forward = functools.partial(ckpt, block.forward, use_reentrant=False)
    return model


def worker(rank: int, world: int, run: str, args, budget: int | None) -> dict:
    model = build(args.model, args.layers, args.width, args.seq, run == "checkpoint")
    config = {"stage": args.stage, "backend": args.backend}
    if budget is not None:
        config["memory_budget"] = budget
    compiled = torch.compile(model, backend="zero", options={"config": config})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i):
        g = torch.Generator().manual_seed(1000 * i + rank)
        xy = torch.randint(0, 256, (args.micro, args.seq + 1), generator=g)
        t0 = time.perf_counter()
        if args.model == "hf-llama":  # labels are shifted inside; no K/V cache, as gradient checkpointing sets
            loss = compiled(input_ids=xy[:, :-1], labels=xy[:, :-1], use_cache=False).loss
        else:
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
    phases = {phase: round(seconds, 1) for phase, seconds in compare.zcompile_phases().items()}
    return {"run": run, "median_step_s": statistics.median(times[2:]), "first_step_s": first, "peak_bytes": peak,
            "planned_bytes": zcompile.planned_step_peak(), "losses": losses,
            "decisions": zcompile.activation_decisions(), "compile_phases_s": phases}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt", choices=MODELS)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--fraction", type=float, default=0.5, help="memory_budget as a fraction of the measured peak")
    ap.add_argument("--budget-from", default="fraction", choices=["fraction", "checkpoint"],
                    help="memory_budget: --fraction of the unconstrained peak, or checkpoint's measured peak")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--stage", type=int, default=3, choices=[2, 3])
    ap.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    ap.add_argument("--rounds", type=int, default=3,
                    help="checkpoint and budget run alternately this many times (the step is their median)")
    ap.add_argument("--skip-unconstrained", action="store_true",
                    help="with --budget-from checkpoint: only checkpoint and budget (losses compared to checkpoint's)")
    ap.add_argument("--out", default="bench/results/activation_budget.md")
    args = ap.parse_args(argv)
    if args.skip_unconstrained and args.budget_from == "fraction":
        ap.error("--skip-unconstrained needs --budget-from checkpoint (the fraction is of the unconstrained peak)")
    rows = []
    for run in ["unconstrained"] * (not args.skip_unconstrained) + ["checkpoint", "budget"] * args.rounds:
        if run == "budget" and ("peak_bytes" not in rows[0] or any("error" in r for r in rows)):
            continue  # no budget to set, or it failed once: it fails every time
        budget = None
        if run == "budget":
            budget = int(args.fraction * rows[0]["peak_bytes"]) if args.budget_from == "fraction" else \
                next(r["peak_bytes"] for r in rows if r["run"] == "checkpoint")
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
    title = {"gpt": "GPT-like (zcompile.models.gpt)", "llama": "Llama-style (zcompile.models.llama)",
             "hf-llama": "Hugging Face LlamaForCausalLM"}[args.model]
    lines = [f"### {title}, {args.layers} layers, {args.width} wide, vocab 256, {args.micro} x {args.seq} tokens per "
             f"rank, world {args.world} (gloo, CPU {os.cpu_count()} cores), stage {args.stage}, {args.backend}, torch "
             f"{torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             f"`python bench/activation_budget.py {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
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
    lines += ["", f"Largest difference of any run's loss from the {rows[0]['run']} run's at the same step: {diff:.2e} "
              f"(inductor fuses a forward that returns fewer saved values differently).", "",
              "Where each run's compile spent its seconds (rank 0, zcompile's phases; `activation plan` is the search, its "
              "trial compiles included):", "",
              *(f"- {r['run']}: " + ", ".join(f"{k} {v}" for k, v in r.get("compile_phases_s", {}).items())
                for r in rows if r.get("compile_phases_s")), "",
              "Decisions under the budget (rank 0):", "", "```", *rows[-1].get("decisions", []), "```"]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    print("\n".join(lines))
    return rows


if __name__ == "__main__":
    main()
