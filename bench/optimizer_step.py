"""AdamW.step time on plain vs DTensor parameters (the benchmark GPT's 48 parameters, zcompile stage 3 shards over
2 gloo ranks), with torch's default loop and with foreach=True. Usage: python bench/optimizer_step.py"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from zcompile.tools.launch import run_world  # noqa: E402


def _time(rank: int, world: int, foreach: bool | None) -> dict:
    import zcompile
    from zcompile.models.gpt import GPT, GPTConfig
    out = {}
    for kind in ("plain", "dtensor"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=4, n_embd=128))
        if kind == "dtensor":
            zcompile.shard_parameters(model, {"stage": 3})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        for _ in range(3):
            opt.step()
        start = time.perf_counter()
        for _ in range(20):
            opt.step()
        out[kind] = (time.perf_counter() - start) / 20 * 1e3
    return out


if __name__ == "__main__":
    print("| AdamW | plain ms | DTensor ms |\n|---|---|---|")
    for foreach in (None, True):
        r = run_world(2, _time, foreach)[0]
        print(f"| foreach={foreach} | {r['plain']:.2f} | {r['dtensor']:.2f} |")
