"""Side-by-side: DDP, FSDP2 (eager and compiled), DeepSpeed ZeRO-3 and zcompile stages 1-3 on the same model, data,
world size and dtype. Each system runs in fresh processes.

    python bench/compare.py --world 2 --model gpt                      # CPU, gloo
    python bench/compare.py --world 1 --model gpt --device cuda        # one GPU, NCCL

Reports per system: median step time (after warm-up), ratio to zcompile stage 3, per-rank peak RSS (VmHWM over the
timed steps, malloc's mmap threshold pinned to 1 MiB), per-rank peak tensor bytes (CPU: zcompile.step_tensor_peak, live
storages at a step's start plus the CPU allocator's highest rise in the step; CUDA: max_memory_allocated), model-state
bytes (unique storages of parameters, gradients and optimizer state on rank 0), collective bytes per step, compile
(first-step) time, final loss; tokens/s. Writes a Markdown table, a JSON file and a PNG plot.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zcompile  # noqa: E402
from zcompile.tools.launch import WorkerFailed, run_world  # noqa: E402
from zcompile.models.gpt import GPT, GPTConfig  # noqa: E402

SYSTEMS = ["ddp", "fsdp2", "fsdp2_compile", "deepspeed_z3", "zcompile_z1", "zcompile_z2", "zcompile_z3"]
# --systems all adds these: the scheduling passes off or retuned, ZeRO++ and offload
SCHEDULING = ["zcompile_z3_unbucketed", "zcompile_z3_1mb_buckets", "zcompile_z3_no_prefetch", "zcompile_z3_no_check",
              "zcompile_z3_whole_graph"]
ZEROPP = ["zcompile_z3_zeropp"]  # and this (bench/zeropp.py compares convergence and cross-node bytes)
OFFLOAD = ["zcompile_z3_offload"]  # and this (bench/offload.py: tiers, NVMe, overlap)
LR = 1e-3


# ---------------------------------------------------------------- models and data
def build_model(name: str, size: str) -> torch.nn.Module:
    torch.manual_seed(0)
    d, layers = {"small": (128, 4), "medium": (512, 6)}[size]
    if name == "gpt":
        return GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=layers, n_head=4, n_embd=d))
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=d, intermediate_size=int(d * 8 / 3) // 8 * 8,
                                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=256))
    raise ValueError(name)


def blocks_of(model: torch.nn.Module):
    return model.blocks if isinstance(model, GPT) else model.model.layers


def loss_of(model, x: torch.Tensor) -> torch.Tensor:
    inner = getattr(model, "module", getattr(model, "_orig_mod", model))
    if isinstance(inner, GPT) or isinstance(getattr(inner, "_orig_mod", None), GPT):
        return model(x[:, :-1], x[:, 1:]).loss
    return model(input_ids=x[:, :-1], labels=x[:, :-1]).loss


def batch(step: int, rank: int, world: int, micro: int, seq: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 256, (world * micro, seq + 1), generator=g).chunk(world)[rank].to(device)


# ---------------------------------------------------------------- measurement
def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            t = t.to_local() if hasattr(t, "to_local") else t
            key = (t.untyped_storage().data_ptr(), t.device)
            if key not in seen and t.untyped_storage().nbytes() > 0:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def _optimizer_tensors(opt) -> list:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]


class CommCounter(TorchDispatchMode):
    """Bytes of c10d collectives issued through the dispatcher (eager systems)."""
    SIZES = {"allreduce_": "in", "allgather_": "out", "_allgather_base_": "out", "allgather_into_tensor_coalesced_": "out",
             "reduce_scatter_": "in", "_reduce_scatter_base_": "in", "reduce_scatter_tensor_coalesced_": "in",
             "broadcast_": "in", "alltoall_base_": "in"}

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func.name().split("::")[1]
            side = self.SIZES.get(name)
            if side is not None:
                ts = args[0] if side == "out" else args[1 if name.startswith("_") else 0]
                ts = ts if isinstance(ts, (list, tuple)) else [ts]
                flat = [t for x in ts for t in (x if isinstance(x, (list, tuple)) else [x])]
                self.bytes += sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))
        return func(*args, **(kwargs or {}))


def peak_rss_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) / 1024 for l in f if l.startswith("VmHWM:"))


# ---------------------------------------------------------------- systems: each returns (step(x, measure) -> (loss, state_bytes|None))
def zcompile_phases() -> dict[str, float]:
    """Seconds of zcompile's compile phases in this process (each graph's job.timed), summed over its graphs."""
    from zcompile.compiler import backend
    phases: dict[str, float] = {}
    for job in backend._COMPILED:
        for phase, seconds in job.times.items():
            phases[phase] = phases.get(phase, 0.0) + seconds
    return phases


def _plain_step(model, opt, params_fn):
    def step(x, measure=False):
        loss = loss_of(model, x)
        loss.backward()
        opt.step()
        state = _storage_bytes(list(params_fn()) + [p.grad for p in params_fn()] + _optimizer_tensors(opt)) \
            if measure else None
        opt.zero_grad()
        return loss.detach(), state
    return step


# _DTENSOR_FOREACH: on CPU torch's optimizers default to the per-parameter loop, where each op on a DTensor pays
# DTensor's dispatch (2026-11-24, a probe since removed: bench/results/compile-time-log.md): AdamW.step over the GPT's
# 48 parameters, world 2, 10.1 ms on DTensors vs 4.7 ms on plain tensors with the default; 4.9 vs 5.3 ms with
# foreach=True. So FSDP2 and
# zcompile (DTensor parameters) step with foreach=True and DDP keeps the default. On CUDA torch defaults to foreach.


def setup_ddp(model, world, device, args):
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    step = _plain_step(ddp, torch.optim.AdamW(ddp.parameters(), lr=LR), ddp.parameters)
    # the reducer's gradient buckets live in C++ only, out of reach of a scan of the Python heap
    step.hidden_bytes = lambda: sum(int(b) for b in ddp._get_ddp_logging_data()["bucket_sizes"].split(","))
    return step


def _fsdp2(model, world, device, compiled):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (world,))
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    run = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)  # DTensor parameters: see _DTENSOR_FOREACH
    return _plain_step(run, opt, model.parameters)


def setup_fsdp2(model, world, device, args):
    return _fsdp2(model, world, device, compiled=False)


def setup_fsdp2_compile(model, world, device, args):
    return _fsdp2(model, world, device, compiled=True)


def setup_deepspeed_z3(model, world, device, args):
    import deepspeed
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                           dist_init_required=False)

    def step(x, measure=False):
        loss = loss_of(engine, x)
        engine.backward(loss)
        engine.step()
        state = None
        if measure:
            zopt = engine.optimizer
            held = [getattr(p, "ds_tensor", None) for p in model.parameters()] + _optimizer_tensors(zopt.optimizer)
            for attr in ("fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat", "grad_partitions_flat_buffer",
                         "averaged_gradients"):
                v = getattr(zopt, attr, None)
                held += list(v.values()) if isinstance(v, dict) else (v if isinstance(v, list) else [v])
            state = _storage_bytes([t for x in held for t in (x if isinstance(x, list) else [x])])
        return loss.detach(), state
    return step


def _zcompile(stage, **extra):
    def setup(model, world, device, args):
        config = {"stage": stage, "backend": "inductor", **extra}
        compiled = torch.compile(model, backend="zero", options={"config": config})
        opt = torch.optim.AdamW(compiled.parameters(), lr=LR, foreach=True)  # see _DTENSOR_FOREACH

        def step(x, measure=False):
            loss = loss_of(compiled, x)
            loss.backward()
            opt.step()
            state = zcompile.memory_report(compiled, opt).total if measure else None
            opt.zero_grad()
            return loss.detach(), state
        return step
    return setup


def setup_zeropp(model, world, device, args):
    """qwZ + hpZ + qgZ, the world split into two simulated nodes (hpZ is a no-op with one rank per node)."""
    g = max(1, world // 2)
    return _zcompile(3, quantize_weights={}, quantize_gradients={}, hpz_partition_size=g,
                     ranks_per_node=g)(model, world, device, args)


SETUP = {"ddp": setup_ddp, "fsdp2": setup_fsdp2, "fsdp2_compile": setup_fsdp2_compile,
         "deepspeed_z3": setup_deepspeed_z3, "zcompile_z1": _zcompile(1), "zcompile_z2": _zcompile(2),
         "zcompile_z3": _zcompile(3),
         # the scheduling passes switched off, for their before/after
         "zcompile_z3_unbucketed": _zcompile(3, bucket_mb=0, prefetch=0),
         "zcompile_z3_1mb_buckets": _zcompile(3, bucket_mb=1),  # about one block's parameters, as FSDP2 wraps them
         "zcompile_z3_no_prefetch": _zcompile(3, prefetch=0),
         # without the per-run schedule check (one 256-byte all-gather per graph run): its cost
         "zcompile_z3_no_check": _zcompile(3, schedule_check=False),
         # one inductor graph per forward/backward instead of compiled block regions and eager glue
         "zcompile_z3_whole_graph": _zcompile(3, regional_compile=False),
         "zcompile_z3_zeropp": setup_zeropp,
         # ZeRO-Infinity on host memory: the state column then counts only what stays on the device
         "zcompile_z3_offload": _zcompile(3, offload={"optimizer": "cpu", "params": "cpu", "activations": "cpu"})}


def worker(rank: int, world: int, system: str, args) -> dict:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: fixed, so peak RSS is comparable across systems
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    model = build_model(args.model, args.size).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    step = SETUP[system](model, world, device, args)

    def timed(i, measure=False):
        x = batch(i, rank, world, args.micro, args.seq, device)
        t0 = time.perf_counter()
        loss, state = step(x, measure)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, loss.item(), state

    first, _, _ = timed(0)
    for i in range(1, args.warmup):
        timed(i)
    peak_rss_reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(args.warmup, args.warmup + args.steps):
        t, loss, _ = timed(i)
        times.append(t)
        losses.append(loss)
    rss = peak_rss_mib()
    gpu_peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
    n = args.warmup + args.steps
    # tensor peak on CPU: live storages at a step's start + the allocator's highest rise in it
    # (zcompile/runtime/allocator_peak.py); taken before the accounting step, after which DDP (run under a dispatch
    # mode) keeps a gradient-sized list alive
    tensor = None
    if device.type == "cpu":
        steps = iter(range(n, n + 3))
        tensor = zcompile.step_tensor_peak(lambda: timed(next(steps)), repeats=3,
                                           hidden_bytes=getattr(step, "hidden_bytes", lambda: 0)())
        n += 3
    # one more step for the accounting: state bytes and communicated bytes
    if system.startswith("zcompile"):
        zcompile.reset_traffic()
        _, _, state = timed(n, measure=True)
        comm = sum(zcompile.traffic().values())
    else:
        with CommCounter() as counter:
            _, _, state = timed(n, measure=True)
        comm = counter.bytes
    median = statistics.median(times)
    return {"system": system, "median_step_s": median, "compile_s": max(first - median, 0.0), "peak_rss_mib": rss,
            "gpu_peak_mib": gpu_peak, "tensor_peak": tensor, "state_bytes": state, "comm_bytes": comm,
            "final_loss": losses[-1], "losses": losses, "num_params": num_params,
            "tokens_per_s": world * args.micro * args.seq / median}


def run_system(system: str, args) -> dict:
    env = {"ZC_TEST_PG": "nccl"} if args.device == "cuda" else {}
    try:
        results = run_world(args.world, worker, system, args, timeout=args.timeout, env=env)
    except WorkerFailed as e:
        print(f"--- {system} failed:\n{e.errors[min(e.errors)]}", file=sys.stderr)
        last = e.errors[min(e.errors)].strip().splitlines()[-1]
        return {"system": system, "error": last}
    r0 = results[0]
    r0["peak_rss_mib_max"] = max(r["peak_rss_mib"] for r in results)
    if r0["tensor_peak"] is not None:
        r0["tensor_peak_mib_max"] = max(r["tensor_peak"]["peak"] for r in results) / 2**20
    return r0


def markdown(rows: list[dict], args, header: str) -> str:
    base = next((r for r in rows if r["system"] == "zcompile_z3" and "error" not in r), None)
    out = [header, "",
           "| system | median step (ms) | vs zcompile z3 | tokens/s | peak RSS / rank (MiB) | "
           + ("GPU peak (MiB) | " if args.device == "cuda" else "tensor peak / rank (MiB) | ")
           + "model-state bytes / rank (MiB) | comm / step (MiB) | compile (s) | final loss |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['system']} | failed: {r['error'][:150]} |")
            continue
        ratio = r["median_step_s"] / base["median_step_s"] if base else float("nan")
        tensor = r.get("tensor_peak_mib_max")
        peak = f" {r['gpu_peak_mib']:.0f} |" if args.device == "cuda" else \
            (f" {tensor:.1f} |" if tensor is not None else " n/a |")
        state = f"{r['state_bytes'] / 2**20:.2f}" if r["state_bytes"] is not None else "n/a"
        out.append(f"| {r['system']} | {r['median_step_s'] * 1e3:.1f} | {ratio:.2f}x | {r['tokens_per_s']:.0f} | "
                   f"{r['peak_rss_mib_max']:.0f} |{peak} {state} | {r['comm_bytes'] / 2**20:.2f} | "
                   f"{r['compile_s']:.1f} | {r['final_loss']:.4f} |")
    return "\n".join(out) + "\n"


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (saying so) when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
        return None
    return plt


def plot(rows: list[dict], path: str, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    ok = [r for r in rows if "error" not in r]
    names = [r["system"] for r in ok]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    a.barh(names, [r["median_step_s"] * 1e3 for r in ok])
    a.set_xlabel("median step (ms)")
    peak = [r.get("tensor_peak_mib_max") or r.get("gpu_peak_mib") for r in ok]
    if all(p is not None for p in peak):
        b.barh(names, peak, color="lightgray", label="peak tensor bytes")
    b.barh(names, [(r["state_bytes"] or 0) / 2**20 for r in ok], label="model state")
    b.set_xlabel("per rank (MiB)")
    b.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--model", default="gpt", choices=["gpt", "llama"])
    ap.add_argument("--size", default="small", choices=["small", "medium"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--micro", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, or 'all' (adds the zcompile "
                    "stage-3 variants without bucketing / prefetch or with 1 MiB buckets, with ZeRO++ on two simulated "
                    "nodes, and with offload to host memory)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--merge", action="store_true", help="replace only these systems' rows in an existing result")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    tag = f"{args.model}-{args.size}-{args.device}-w{args.world}"
    rows = []
    systems = SYSTEMS + SCHEDULING + ZEROPP + OFFLOAD if args.systems == "all" else args.systems.split(",")
    for system in systems:
        t0 = time.time()
        rows.append(run_system(system, args))
        print(f"{system}: {'failed: ' + rows[-1]['error'] if 'error' in rows[-1] else 'ok'} ({time.time() - t0:.0f} s)",
              flush=True)
    json_path = os.path.join(args.out, f"{tag}.json")
    if args.merge and os.path.exists(json_path):
        fresh = {r["system"]: r for r in rows}
        old = json.load(open(json_path))["rows"]
        rows = [fresh.pop(r["system"], r) for r in old] + list(fresh.values())
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    header = (f"### {args.model} ({rows[0].get('num_params', 0):,} params), world {args.world}, {device}, fp32, "
              f"{args.micro}x{args.seq} tokens/rank/step, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    md = markdown(rows, args, header)
    print(md)
    with open(os.path.join(args.out, f"{tag}.md"), "w") as f:
        f.write(md)
    with open(json_path, "w") as f:
        json.dump({"args": vars(args), "device": device, "rows": rows}, f, indent=1)
    plot(rows, os.path.join(args.out, f"{tag}.png"), header[4:])


if __name__ == "__main__":
    main()
