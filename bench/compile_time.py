"""Compile time against model depth: zcompile vs FSDP2 + torch.compile and single-process torch.compile.

    python bench/compile_time.py --layers 2,8,16,32                          # CPU, gloo, world 2
    python bench/compile_time.py --layers 8 --systems zcompile_z3 --world 2  # one point
    python bench/compile_time.py --layers 32 --systems zcompile_z3 --profile --out /tmp/p  # + pstats of rank 0
    python bench/compile_time.py --layers 8,32 --systems zcompile_z3_eager_graphs  # all but inductor, per phase

For each system and depth (GPT, d=128, 4 heads, bench/compare.py's data: 4x128 tokens per rank) two launches in
fresh processes: cold (an empty inductor cache directory) and warm (the same directory again, as a second launch of
a job would find it). Compile time = the torch.compile(...) calls + first step - median of the next steps. The calls
count because torch.compile(model) with inductor imports inductor's compiler there (~0.4 s on the benchmark VM),
which the zero backend imports in its first step (counted since 2026-11-27 19:50 UTC; before, the first step only).
Reports per run: compile time, step time, where zcompile's compile time goes (dynamo tracing, AOTAutograd and its
partitioner, zcompile's passes, fake propagation, liveness, inductor per graph), the first optimizer step (both
systems), inductor's FX graph cache and AOTAutograd cache hits/misses, and for zcompile how many graph regions ran,
how many of them ran compiled code (the others eagerly) and how many distinct ones were compiled
(codegen/regions.py), with each inductor compile's seconds, nodes and kernels in the JSON ('region compiles'), and
the kernels inductor built in the cold launch (distinct sources, and the kernels each cached graph defines, summed).
Writes a Markdown table, a JSON file and a PNG plot to bench/results.
"""
from __future__ import annotations

import argparse
import cProfile
import glob
import json
import os
import pickle
import re
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compare  # noqa: E402
from zcompile.tools.launch import WorkerFailed, run_world  # noqa: E402
from zcompile.models.gpt import GPT, GPTConfig  # noqa: E402

def _presharded(model, world, device, args):
    """zcompile_z3_eager_graphs after zcompile.shard_parameters: dynamo traces the DTensor parameters only once."""
    import zcompile
    zcompile.shard_parameters(model, {"stage": 3, "backend": "eager"})
    return compare._zcompile(3, backend="eager")(model, world, device, args)


SYSTEMS = {
    "torch_compile_1proc": None,  # plain torch.compile, one process, no sharding: the floor
    "fsdp2_compile": compare.setup_fsdp2_compile,  # fully_shard per block + torch.compile(model)
    "zcompile_z2": compare._zcompile(2),
    "zcompile_z3": compare._zcompile(3),  # regional_compile and keep_block_regions 'auto'
    "zcompile_z3_regional": compare._zcompile(3, regional_compile=True),  # regions at any depth
    "zcompile_z3_nested": compare._zcompile(3, regional_compile="nested"),  # block bodies called from one graph
    "zcompile_z3_trace_every_block": compare._zcompile(3, trace_blocks_once=False),  # dynamo inlines each block
    # AOTAutograd traces and partitions each distinct block once, or every block's inlined copy
    "zcompile_z3_keep_block_regions": compare._zcompile(3, keep_block_regions=True),
    "zcompile_z3_inline_block_regions": compare._zcompile(3, keep_block_regions=False),
    "zcompile_z3_whole_graph": compare.SETUP["zcompile_z3_whole_graph"],  # one inductor graph per fw/bw
    "zcompile_z3_zeropp": compare.setup_zeropp,
    "zcompile_z3_eager_graphs": compare._zcompile(3, backend="eager"),  # everything but inductor: tracing, passes
    "zcompile_z3_eager_graphs_presharded": _presharded,
}


def _plain_compile(model, world, device, args):
    run = torch.compile(model)
    return compare._plain_step(run, torch.optim.AdamW(model.parameters(), lr=compare.LR, foreach=True),
                               model.parameters)


def _dynamo_phases() -> dict:
    """Seconds per phase from torch's own compile timers (the same that TORCH_LOGS=dynamo prints)."""
    from torch._dynamo.utils import compilation_time_metrics as m
    total = lambda key: sum(m.get(key, []))  # noqa: E731
    dynamo = total("_compile.compile_inner")
    return {"dynamo total": dynamo, "dynamo tracing": max(dynamo - total("OutputGraph.call_user_compiler"), 0.0),
            "aot trace joint": total("aot_trace_joint_graph"), "inductor": total("compile_fx_inner"),
            "backward compile (lazy)": total("backward._backward_impl")}


def _time_first_trace() -> dict:
    """Times dynamo's first trace of the step, which zcompile ends by a restart once it made the parameters
    DTensors: seconds from the step's start to that restart, under 'first trace'."""
    from zcompile.compiler.tracing import dynamo_graph
    record, shard = {}, dynamo_graph.shard_modules_of

    def timed(*a, **kw):
        try:
            return shard(*a, **kw)
        except dynamo_graph.ParametersSharded:
            record.setdefault("first trace", time.perf_counter() - record["start"])
            raise
    dynamo_graph.shard_modules_of = timed
    return record


def _time_region_compiles() -> list:
    """Seconds, FX nodes and generated C++/Triton kernels of each inductor compile zcompile makes (one per distinct
    region, in compile order), under 'region compiles' in the JSON."""
    from zcompile.compiler.codegen import inductor
    record, compile_inductor = [], inductor.compile_inductor

    def timed(gm, example_inputs, kind):
        t0 = time.perf_counter()
        compiled = compile_inductor(gm, example_inputs, kind)
        record.append({"kind": kind, "s": round(time.perf_counter() - t0, 2),
                       "nodes": sum(n.op == "call_function" for n in gm.graph.nodes),
                       "kernels": len(kernel_sources(getattr(compiled, "source_code", "") or ""))})
        return compiled
    inductor.compile_inductor = timed
    return record


# A kernel in inductor's generated Python: `async_compile.cpp_pybinding([arg types], r'''<C++>''')` or
# `async_compile.triton('name', '''<Triton>''', device_str='cuda')`, the call's opening on one line.
_KERNEL = re.compile(r"async_compile\.(?:cpp_pybinding|triton)\([^\n]*?'''(.*?)'''", re.S)


def kernel_sources(code: str) -> list[str]:
    """The source of each kernel (C++ or Triton) that inductor's generated module `code` defines, in order."""
    return _KERNEL.findall(code)


def kernels_built(cache_dir: str) -> dict:
    """Kernels in the inductor graphs a launch wrote to `cache_dir` (its FX graph cache, one entry per graph key):
    how many the graphs define (each graph's own, summed: a kernel may run more than once in its graph) and how
    many distinct sources among them. Each distinct C++ kernel is one g++ build (1.1-1.6 s each on the 2-core VM,
    whatever its size: bench/results/compile-time-log.md), so on CPU the distinct count sets most of a cold
    compile."""
    defined, distinct = 0, set()
    for key in glob.glob(os.path.join(cache_dir, "fxgraph", "*", "*")):  # one entry per key: ranks write the same
        try:
            with open(min(glob.glob(os.path.join(key, "*"))), "rb") as f:
                code = getattr(pickle.load(f), "source_code", "") or ""
        except Exception:  # not a cached graph (an empty key directory, a partial write)
            continue
        found = kernel_sources(code)
        defined += len(found)
        distinct.update(found)
    return {"kernels defined": defined, "distinct kernels": len(distinct)}


def _timed_torch_compile():
    """torch.compile, timed, for the setup: its seconds are part of the compile time (the zero backend defers
    what torch.compile(model) with inductor does at once). `.real` is the original."""
    real = torch.compile

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            timed.seconds += time.perf_counter() - t0
    timed.seconds, timed.real = 0.0, real
    torch.compile = timed
    return timed


def _time_optimizer_steps() -> list:
    """Seconds of each optimizer step, in order (torch's global step hooks): the first step over DTensor parameters
    propagates their sharding for every foreach op, which counts in the compile time of both FSDP2 and zcompile."""
    from torch.optim import optimizer
    times, start = [], {}
    optimizer.register_optimizer_step_pre_hook(lambda opt, args, kwargs: start.__setitem__("t", time.perf_counter()))
    optimizer.register_optimizer_step_post_hook(
        lambda opt, args, kwargs: times.append(time.perf_counter() - start["t"]))
    return times


def _cache_counters() -> dict:
    from torch._dynamo.utils import counters
    return {"fx graph cache hit": counters["inductor"]["fxgraph_cache_hit"],
            "fx graph cache miss": counters["inductor"]["fxgraph_cache_miss"],
            "aot cache hit": counters["aot_autograd"]["autograd_cache_hit"],
            "aot cache miss": counters["aot_autograd"]["autograd_cache_miss"]}


def worker(rank: int, world: int, system: str, layers: int, args, run: str = "") -> dict:
    torch.manual_seed(0)
    device = torch.device("cpu")
    model = GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=layers, n_head=4, n_embd=128))
    setup = _plain_compile if system == "torch_compile_1proc" else SYSTEMS[system]
    compile_calls = _timed_torch_compile()
    try:
        step = setup(model, world, device, args)
    finally:
        torch.compile = compile_calls.real
    restart = _time_first_trace() if system.startswith("zcompile") else {}
    region_compiles = _time_region_compiles() if system.startswith("zcompile") else []
    optimizer_steps = _time_optimizer_steps()
    times = []
    for i in range(1 + args.steps):
        x = compare.batch(i, rank, world, args.micro, args.seq, device)
        profile = cProfile.Profile() if args.profile and rank == 0 and i == 0 else None
        t0 = restart["start"] = time.perf_counter()
        if profile is not None:
            profile.enable()
        loss, _ = step(x)
        times.append(time.perf_counter() - t0)
        if profile is not None:
            profile.disable()
            profile.dump_stats(os.path.join(args.out, f"profile-{system}-{layers}-{run}.pstats"))
    median = statistics.median(times[1:])
    out = {"first_s": times[0], "step_s": median, "torch.compile calls_s": compile_calls.seconds,
           "compile_s": compile_calls.seconds + max(times[0] - median, 0.0),
           "loss": loss.item(), "phases": _dynamo_phases(), "cache": _cache_counters(),
           "first optimizer step_s": optimizer_steps[0] if optimizer_steps else None,
           "optimizer step_s": statistics.median(optimizer_steps[1:]) if len(optimizer_steps) > 1 else None}
    if system.startswith("zcompile"):
        from zcompile.compiler import backend
        jobs = list(backend._COMPILED)
        phases = compare.zcompile_phases()
        if "first trace" in restart:
            phases["dynamo first trace (restarted)"] = restart["first trace"]
        out["zcompile_phases"] = phases
        out["regions"] = {f"{job.graph_id}:{kind}": r for job in jobs for kind, r in job.regions.items()}
        out["region compiles"] = region_compiles
    return out


def run_one(system: str, layers: int, cache_dir: str, args, run: str) -> dict:
    world = 1 if system == "torch_compile_1proc" else args.world
    env = {"TORCHINDUCTOR_CACHE_DIR": cache_dir}
    try:
        return run_world(world, worker, system, layers, args, run, timeout=args.timeout, env=env)[0]
    except WorkerFailed as e:
        last = e.errors[min(e.errors)].strip().splitlines()[-1]
        print(f"--- {system} {layers} layers failed:\n{e.errors[min(e.errors)]}", file=sys.stderr)
        return {"error": last}


def markdown(rows: list[dict], header: str) -> str:
    out = [header, "",
           "| system | layers | step (ms) | cold compile (s) | warm compile (s) | cold: dynamo tracing / zcompile "
           "passes+analysis / inductor (s) | warm: FX graph cache hit/miss, AOT cache hit/miss | regions: run / "
           "compiled code / distinct compiled (fw, bw) | kernels built: distinct / defined by the graphs | "
           "first optimizer step, cold / warm (s) | final loss |",
           "|---|---:|---:|---:|---:|---|---|---|---|---|---:|"]
    for r in rows:
        cold, warm = r["cold"], r["warm"]
        if "error" in cold or "error" in warm:
            out.append(f"| {r['system']} | {r['layers']} | failed: {(cold.get('error') or warm.get('error'))[:120]} |")
            continue
        p, z = cold["phases"], cold.get("zcompile_phases", {})
        ours = sum(v for k, v in z.items() if not k.startswith(("inductor", "eager", "dynamo")))
        c = warm["cache"]
        regions = ", ".join("/".join(map(str, r)) for r in cold.get("regions", {}).values()) or "-"
        out.append(f"| {r['system']} | {r['layers']} | {warm['step_s'] * 1e3:.0f} | {cold['compile_s']:.1f} | "
                   f"{warm['compile_s']:.1f} | {p['dynamo tracing']:.1f} / {ours:.1f} / {p['inductor']:.1f} | "
                   f"{c['fx graph cache hit']}/{c['fx graph cache miss']}, {c['aot cache hit']}/{c['aot cache miss']} "
                   f"| {regions} | {cold.get('distinct kernels', '-')} / {cold.get('kernels defined', '-')} "
                   f"| {_seconds(cold.get('first optimizer step_s'))} / {_seconds(warm.get('first optimizer step_s'))} "
                   f"| {warm['loss']:.4f} |")
    return "\n".join(out) + "\n"


def _seconds(s) -> str:
    return "-" if s is None else f"{s:.2f}"


def plot(rows: list[dict], path: str, title: str) -> None:
    plt = compare.pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    for system in dict.fromkeys(r["system"] for r in rows):
        ok = [r for r in rows if r["system"] == system and "error" not in r["cold"] and "error" not in r["warm"]]
        xs = [r["layers"] for r in ok]
        a.plot(xs, [r["cold"]["compile_s"] for r in ok], "o-", label=system)
        b.plot(xs, [r["warm"]["compile_s"] for r in ok], "o-", label=system)
    a.set_title("cold compile (s)")
    b.set_title("warm compile (s)")
    for ax in (a, b):
        ax.set_xlabel("layers")
        ax.set_xscale("log", base=2)
    a.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="2,4,8,16,32")
    ap.add_argument("--systems", default="torch_compile_1proc,fsdp2_compile,zcompile_z3,zcompile_z3_whole_graph")
    ap.add_argument("--whole-graph-up-to", type=int, default=16,
                    help="zcompile_z3_whole_graph only up to this depth (its compile grows with depth)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="", help="suffix of the result files")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile rank 0's first step into OUT/profile-SYSTEM-LAYERS-{cold,warm}.pstats")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for layers in [int(x) for x in args.layers.split(",")]:
        for system in args.systems.split(","):
            if system == "zcompile_z3_whole_graph" and layers > args.whole_graph_up_to:
                continue
            with tempfile.TemporaryDirectory(prefix="zc-inductor-cache-") as cache:
                t0 = time.time()
                row = {"system": system, "layers": layers, "cold": run_one(system, layers, cache, args, "cold")}
                row["cold"].update(kernels_built(cache))
                row["warm"] = run_one(system, layers, cache, args, "warm")
            rows.append(row)
            ok = "error" not in row["cold"] and "error" not in row["warm"]
            print(f"{system} {layers} layers: " + (f"cold {row['cold']['compile_s']:.1f} s, warm "
                  f"{row['warm']['compile_s']:.1f} s, step {row['warm']['step_s'] * 1e3:.0f} ms" if ok else "failed")
                  + f" ({time.time() - t0:.0f} s)", flush=True)
    header = (f"### Compile time vs depth: GPT d=128, world {args.world} (gloo), CPU ({os.cpu_count()} cores), "
              f"{args.micro}x{args.seq} tokens/rank, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    md = markdown(rows, header)
    print(md)
    base = os.path.join(args.out, "compile_time" + (f"-{args.tag}" if args.tag else ""))
    with open(base + ".md", "w") as f:
        f.write(md)
    with open(base + ".json", "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    plot(rows, base + ".png", header[4:])


if __name__ == "__main__":
    main()
