"""Training on batches whose sequence length changes: what each new shape costs, zcompile vs FSDP2 + torch.compile.

    python bench/new_shapes.py                                  # GPT d=128, 8 layers, world 2, CPU (gloo)
    python bench/new_shapes.py --mark-dynamic                   # the inputs' sequence dim marked dynamic
    python bench/new_shapes.py --seq-lens 128,96,64,112,128,80 --layers 8 --systems zcompile_z3

Each system runs the same steps (bench/compare.py's data, 4 sequences per rank) in fresh processes with a fresh
inductor cache, one step per listed sequence length. Without --mark-dynamic, dynamo compiles the first length as
static shapes and, at the first change, recompiles once with a dynamic sequence dim (automatic dynamic shapes); the
compiled graph then serves every later length. With --mark-dynamic the first compile is already dynamic. Reports
each step's wall time (a step that compiles shows it), the number of graphs dynamo compiled, and the final loss.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compare  # noqa: E402
from zcompile.models.gpt import GPT, GPTConfig  # noqa: E402
from zcompile.tools.launch import WorkerFailed, run_world  # noqa: E402

SYSTEMS = {"fsdp2_compile": compare.setup_fsdp2_compile, "zcompile_z3": compare._zcompile(3)}


def worker(rank: int, world: int, system: str, args) -> dict:
    from torch._dynamo.utils import counters
    if args.mark_dynamic:  # the model's inputs are slices of the batch, made in compare.loss_of: mark those
        def loss_of(model, x):
            idx, targets = x[:, :-1], x[:, 1:]
            for t in (idx, targets):
                torch._dynamo.mark_dynamic(t, 1)
            return model(idx, targets).loss
        compare.loss_of = loss_of
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=args.layers, n_head=4, n_embd=128))
    step = SYSTEMS[system](model, world, torch.device("cpu"), args)
    seqs = [int(s) for s in args.seq_lens.split(",")]
    times, loss = [], None
    for i, seq in enumerate(seqs):
        x = compare.batch(i, rank, world, args.micro, seq, torch.device("cpu"))
        t0 = time.perf_counter()
        loss, _ = step(x)
        times.append(time.perf_counter() - t0)
    return {"seq_lens": seqs, "step_s": times, "graphs": counters["stats"]["unique_graphs"], "loss": loss.item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", default="128,96,64,112,128,80")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--systems", default="fsdp2_compile,zcompile_z3")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--mark-dynamic", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    rows = []
    for system in args.systems.split(","):
        with tempfile.TemporaryDirectory(prefix="zc-inductor-cache-") as cache:
            try:
                res = run_world(args.world, worker, system, args, timeout=args.timeout,
                                env={"TORCHINDUCTOR_CACHE_DIR": cache})[0]
            except WorkerFailed as e:
                res = {"error": e.errors[min(e.errors)].strip().splitlines()[-1]}
        rows.append({"system": system, **res})
        print(system, res, flush=True)
    seqs = args.seq_lens.split(",")
    header = (f"### New sequence lengths: GPT d=128, {args.layers} layers, world {args.world} (gloo), CPU "
              f"({os.cpu_count()} cores), {args.micro} sequences/rank, "
              f"{'sequence dim marked dynamic' if args.mark_dynamic else 'automatic dynamic shapes'}, "
              f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    md = [header, "", "| system | " + " | ".join(f"step {k + 1}: T={s} (s)" for k, s in enumerate(seqs))
          + " | graphs compiled | final loss |", "|---|" + "---:|" * (len(seqs) + 2)]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['system']} | failed: {r['error'][:150]} |")
            continue
        md.append(f"| {r['system']} | " + " | ".join(f"{t:.2f}" for t in r["step_s"])
                  + f" | {r['graphs']} | {r['loss']:.4f} |")
    text = "\n".join(md) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, "new_shapes" + (f"-{args.tag}" if args.tag else ""))
    with open(base + ".md", "w") as f:
        f.write(text)
    with open(base + ".json", "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
