"""Train the small GPT with zcompile.

    torchrun --nproc-per-node 2 examples/train_gpt.py                     # 2 CPU ranks (gloo), ZeRO-3, inductor
    torchrun --nproc-per-node 2 examples/train_gpt.py --config examples/configs/zero2.yaml --steps 100
    torchrun --nproc-per-node 1 examples/train_gpt.py --device cuda       # one GPU (NCCL)

The corpus is byte-level text: --data FILE, or by default the source of a few modules of Python's own standard
library (always on disk, no download). Prints loss, step time and per-rank memory.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

import zcompile
from zcompile.models.gpt import GPT, GPTConfig


def load_corpus(path: str | None) -> torch.Tensor:
    if path:
        data = open(path, "rb").read()
    else:
        import argparse as a, json.decoder as j, textwrap as t, string as s
        data = "".join(inspect.getsource(m) for m in (t, s, j, a)).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(corpus: torch.Tensor, batch: int, block: int, rank: int, world: int, seed: int):
    """Each rank draws its own disjoint micro-batch of the same global batch."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, corpus.numel() - block - 1, (world * batch,), generator=g)[rank::world]
        chunk = torch.stack([corpus[s:s + block + 1] for s in starts.tolist()])
        yield chunk[:, :-1], chunk[:, 1:]


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "configs", "zero3.yaml"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--data", default=None)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--save", default=None, help="directory for a checkpoint at the end (zcompile.save_checkpoint)")
    ap.add_argument("--json", default=None, help="write the summary here (rank 0)")
    args = ap.parse_args(argv)

    cfg = zcompile.config.load(args.config)  # fail fast on a bad config, before any process group work
    started_here = not dist.is_initialized()  # else the caller's group (tests/test_examples.py), left to it
    ctx = zcompile.init_distributed("nccl" if args.device == "cuda" else "gloo", config=cfg)
    device = ctx.device
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=args.block, n_layer=args.layers, n_head=4,
                          n_embd=args.embd)).to(device)
    model = torch.compile(model, backend="zero", options={"config": cfg})
    if cfg.offload.optimizer in ("cpu", "nvme"):  # host-side Adam (the nvme tier needs it): fused CPU AdamW
        opt = zcompile.CPUAdam(model.parameters(), lr=args.lr, weight_decay=0.1)
    else:
        # foreach: one kernel per op over all parameters (torch's CPU default, a loop, pays DTensor dispatch per op)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, foreach=True)
    data = batches(load_corpus(args.data).to(device), args.batch, args.block, ctx.rank, ctx.world, seed=1)

    times, losses = [], []
    say = print if ctx.rank == 0 else (lambda *a, **k: None)
    say(f"zero-{cfg.stage} on {ctx.world} rank(s), {sum(p.numel() for p in model.parameters()):,} parameters: "
        f"compiling the model in the first step ({cfg.backend}; about a minute on 2 CPU cores)...", flush=True)
    bar = tqdm(range(args.steps), disable=ctx.rank != 0, desc=f"zero-{cfg.stage} x{ctx.world}", delay=0.1)
    for step in bar:
        x, y = next(data)
        t0 = time.perf_counter()
        loss = model(x, y).loss
        loss.backward()
        zcompile.clip_grad_norm_(model, args.clip)
        opt.step()
        if step == args.steps - 1:
            report = zcompile.memory_report(model, opt)
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if step == 0 and ctx.rank == 0:
            bar.write(f"compiled and ran the first step in {times[0]:.1f} s")
        bar.set_postfix(loss=f"{losses[-1]:.3f}", step_ms=f"{times[-1] * 1e3:.0f}")

    steady = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    gpu = f", GPU peak {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB" if device.type == "cuda" else ""
    lines = [None] * ctx.world
    dist.all_gather_object(lines, f"{report}\n[rank {ctx.rank}] peak RSS {peak_rss_mib():.0f} MiB{gpu}")
    if ctx.rank == 0:
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; compile (first step) {times[0]:.1f} s, "
              f"median step {steady * 1e3:.1f} ms")
        print("\n".join(lines))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"losses": losses, "step_s": times, "stage": cfg.stage, "world": ctx.world}, f)
    if args.save:
        zcompile.save_checkpoint(args.save, model, opt, extra={"step": args.steps})
    if started_here:
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
