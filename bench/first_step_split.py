"""Where the first compiled forward and backward of rank 0 go: dynamo's own tracing, the zero backend's call (the
passes, AOTAutograd, inductor's forward), the rest (the backward's compile and run), and how long Python's garbage
collector ran in all that, with how many full collections; then what dynamo's guards on the compiled forward cost
each later call. GPT d=128, world 2 (gloo), stage 3, 4x128 tokens.

    python bench/first_step_split.py --layers 8,32                      # as a user runs it
    python bench/first_step_split.py --layers 8,32 --collector-on       # without backend.collector_paused
    python bench/first_step_split.py --layers 8,32 --presharded         # zcompile.shard_parameters first
    python bench/first_step_split.py --layers 8,32 --no-hook            # without before_trace: shard, then restart

The inductor cache is the process default (TORCHINDUCTOR_CACHE_DIR), so a second run measures a warm cache.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import resource
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zcompile.tools.launch import run_world  # noqa: E402


def worker(rank: int, world: int, layers: int, args) -> dict:
    import torch
    import zcompile
    from zcompile.compiler import backend, before_trace
    from zcompile.models.gpt import GPT, GPTConfig

    if args.collector_on:
        backend.collector_paused = contextlib.nullcontext
        before_trace.gc = types.SimpleNamespace(isenabled=gc.isenabled, disable=lambda: None, enable=gc.enable)
    if args.no_hook:  # as before before_trace: the backend shards after dynamo's first trace, which restarts
        before_trace.register = lambda: None
        torch._dynamo.callback_handler.clear()
    in_backend = [0.0]
    compile_ = backend._compile

    def timed_compile(*a, **k):
        t0 = time.perf_counter()
        try:
            return compile_(*a, **k)
        finally:
            in_backend[0] += time.perf_counter() - t0
    backend._compile = timed_compile

    collected, full, started = [0.0], [0], [0.0]

    def on_collect(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collected[0] += time.perf_counter() - started[0]
            full[0] += info["generation"] == 2

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=layers, n_head=4, n_embd=128))
    config = {"stage": 3, "backend": args.backend}
    if args.presharded:
        zcompile.shard_parameters(model, config)
    compiled = torch.compile(model, backend="zero", options={"config": config})
    x = torch.randint(0, 256, (4, 129), generator=torch.Generator().manual_seed(rank))
    gc.callbacks.append(on_collect)
    t0 = time.perf_counter()
    loss = compiled(x[:, :-1], x[:, 1:]).loss
    forward = time.perf_counter() - t0
    loss.backward()
    total = time.perf_counter() - t0
    gc.callbacks.remove(on_collect)
    return {"total": total, "forward": forward, "backend": in_backend[0], "collector": collected[0],
            "full": full[0], "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "guards_ms": _guard_check_ms(model, {"self": model, "idx": x[:, :-1], "targets": x[:, 1:]})}


def _guard_check_ms(model, frame_locals: dict, calls: int = 200) -> float | None:
    """What dynamo's guards on the compiled forward cost each call: its cache entry's guard check, timed."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    entries = _debug_get_cache_entry_list(type(model).forward.__code__)
    if len(entries) != 1 or not entries[0].guard_manager.check(frame_locals):
        return None
    check = entries[0].guard_manager.check
    t0 = time.perf_counter()
    for _ in range(calls):
        check(frame_locals)
    return (time.perf_counter() - t0) * 1e3 / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="8,32")
    ap.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    ap.add_argument("--collector-on", action="store_true", help="keep Python's collector on during compiles")
    ap.add_argument("--presharded", action="store_true", help="zcompile.shard_parameters before torch.compile")
    ap.add_argument("--no-hook", action="store_true", help="no compile-start hook (before_trace): shard after dynamo's "
                    "first trace and restart it, collector on during the traces")
    args = ap.parse_args()
    print("| layers | first fwd+bwd (s) | forward minus the backend call (s) | backend call (s) | backward (s) | collector (s) "
          "| full collections | peak RSS (MiB) | guard check per call (ms) |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
          flush=True)
    for layers in (int(n) for n in args.layers.split(",")):
        r = run_world(2, worker, layers, args, timeout=900)[0]
        print(f"| {layers} | {r['total']:.2f} | {r['forward'] - r['backend']:.2f} | {r['backend']:.2f} | "
              f"{r['total'] - r['forward']:.2f} | {r['collector']:.2f} | {r['full']} | {r['rss_mib']:.0f} | "
              f"{'-' if r['guards_ms'] is None else format(r['guards_ms'], '.2f')} |", flush=True)


if __name__ == "__main__":
    main()
