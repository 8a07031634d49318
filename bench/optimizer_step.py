"""AdamW.step time on plain vs DTensor parameters (the benchmark GPT, zcompile stage 3 shards over 2 gloo ranks),
with torch's default loop and with foreach=True: the first step (DTensor's sharding propagation of each op, cached
after; counted in bench/compile_time.py's compile time) and the mean of 20 later ones.

    python bench/optimizer_step.py               # 4 layers (48 parameters)
    python bench/optimizer_step.py --layers 32   # 356 parameters
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from zcompile.tools.launch import run_world  # noqa: E402


def _time(rank: int, world: int, foreach: bool | None, layers: int) -> dict:
    import zcompile
    from zcompile.models.gpt import GPT, GPTConfig
    out = {}
    for kind in ("plain", "dtensor"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=layers, n_head=4, n_embd=128))
        if kind == "dtensor":
            zcompile.shard_parameters(model, {"stage": 3})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        start = time.perf_counter()
        opt.step()
        out[kind + " first"] = (time.perf_counter() - start) * 1e3
        for _ in range(2):
            opt.step()
        start = time.perf_counter()
        for _ in range(20):
            opt.step()
        out[kind] = (time.perf_counter() - start) / 20 * 1e3
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    print(f"{args.layers} layers\n| AdamW | plain: first / later ms | DTensor: first / later ms |\n|---|---|---|")
    for foreach in (None, True):
        r = run_world(2, _time, foreach, args.layers)[0]
        print(f"| foreach={foreach} | {r['plain first']:.1f} / {r['plain']:.2f} | "
              f"{r['dtensor first']:.1f} / {r['dtensor']:.2f} |")
