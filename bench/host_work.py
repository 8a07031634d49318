"""Host work per training step, what bounds a GPU step when the device waits for the host: counted on the CPU
beside plain torch.compile and FSDP2 + torch.compile, at two depths (work that grows with the parameter count shows
as a column that doubles).

    python bench/host_work.py                      # nanoGPT, 8 and 24 layers x 64, vocabulary 256, 2 x 64 tokens, bf16
    python bench/host_work.py --device cuda        # the same model on a GPU: the host's work for a GPU step

Per system (bench/workload.py's setups, world 1, gloo) and depth, one training step after --warmup steps
(forward, backward, clip_grad_norm_(1.0), AdamW in nanoGPT's groups, foreach or with --fused fused, zero_grad),
counted on the host:
  python calls      sys.setprofile "call" and "c_call" events (Python functions and builtins entered); the JSON
                    also has them per phase (forward, backward, clip, step, zero_grad)
  eager ops         ATen / prims / c10d ops the profiler sees at the top of the dispatcher stack (not inside another
                    op) and outside every compiled graph call: what the host dispatches one by one
  graph calls       inductor graph calls ("## Call CompiledFxGraph" events) and, for zcompile's eager backend or
                    its regions run as FX code, none: the count of compiled kernels' launches is the GPU's concern
  autograd nodes    backward nodes the autograd engine evaluated
and the median step time over --steps (noisy on a shared VM; the counts repeat exactly). With --alternate N, the
systems are also built side by side in one process and stepped in turn, N rounds (A B C A B C ...), for step times
whose ratios mean something on a shared machine: `step_ms_alternating` and, in the table, the ratio to the first
system's (plain torch.compile). FSDP2 + torch.compile is not among them (see main).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import nanogpt  # noqa: E402
import workload  # noqa: E402
from zcompile.tools.launch import WorkerFailed, run_world  # noqa: E402

SYSTEMS = ["torch_compile", "fsdp2_compile", "zcompile_z3"]
_OP_PREFIXES = ("aten::", "prims::", "c10d::", "_c10d_functional::", "zcompile::")
_GRAPH_CALL = "## Call CompiledFxGraph"
_AUTOGRAD = "autograd::engine::evaluate_function: "


def _under(e, prefixes) -> bool:
    """Some enclosing profiler event's name starts with one of `prefixes`."""
    parent = e.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefixes):
            return True
        parent = parent.cpu_parent
    return False


def counts(events) -> dict:
    """The profiler's counts of one step (see the module doc)."""
    eager = graphs = autograd = accumulate = 0
    for e in events:
        name = e.name
        if name.startswith(_GRAPH_CALL):
            graphs += not _under(e, ("zcompile::",))  # (not the chunked loss op's own inductor kernels)
        elif name.startswith(_AUTOGRAD):
            autograd += 1
            accumulate += name.endswith("AccumulateGrad")
        elif name.startswith(_OP_PREFIXES):
            eager += not _under(e, _OP_PREFIXES + (_GRAPH_CALL,))
    return {"eager_ops": eager, "graph_calls": graphs, "autograd_nodes": autograd, "accumulate_grad": accumulate}


PHASES = ("forward", "backward", "clip", "step", "zero_grad")


def python_calls(step) -> dict:
    """sys.setprofile call + c_call events of one `step(mark)`, per phase: `step` calls mark(name) as it enters
    each of PHASES."""
    seen = dict.fromkeys(PHASES, 0)
    phase = [PHASES[0]]

    def tracer(frame, event, arg):
        if event in ("call", "c_call"):
            seen[phase[0]] += 1

    def mark(name):
        phase[0] = name
    sys.setprofile(tracer)
    try:
        step(mark)
    finally:
        sys.setprofile(None)
    return seen


def _stepper(system: str, layers: int, world: int, args):
    """`step(i, mark)`: one training step of `system` on nanoGPT (see the module doc), and its model."""
    device = torch.device(args.device)
    bf16 = args.dtype == "bf16"
    torch.manual_seed(0)
    model = nanogpt.GPT(nanogpt.GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=layers,
                                          n_head=args.heads, n_embd=args.width)).to(device)
    run, opt, autocast = workload.SETUP[system](model, world, device, bf16)
    if args.fused:  # what nanoGPT's configure_optimizers picks on CUDA
        opt = torch.optim.AdamW([{k: v for k, v in g.items() if k not in ("foreach", "fused")}
                                 for g in opt.param_groups], fused=True)

    def step(i, mark=lambda name: None):
        g = torch.Generator().manual_seed(i)
        xy = torch.randint(0, args.vocab, (args.micro, args.seq + 1), generator=g).to(device)
        mark("forward")
        with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            loss = run(xy[:, :-1].contiguous(), xy[:, 1:].contiguous())[1]
        mark("backward")
        loss.backward()
        mark("clip")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        mark("step")
        opt.step()
        mark("zero_grad")
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":  # step times: until the device is done
            torch.cuda.synchronize(device)
        return loss

    return step, model


def worker(rank: int, world: int, system: str, layers: int, args) -> dict:
    from torch.profiler import ProfilerActivity, profile
    step, model = _stepper(system, layers, world, args)
    for i in range(args.warmup):
        step(i)
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        step(100 + i)
        times.append(time.perf_counter() - t0)
    calls = python_calls(lambda mark: step(200, mark))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(300)
    return {"system": system, "layers": layers, "python_calls": sum(calls.values()), "python_calls_by_phase": calls,
            **counts(prof.events()),
            "step_ms": statistics.median(times) * 1e3, "params": sum(p.numel() for p in model.parameters()),
            "tensors": len(list(model.parameters()))}


def alternating(rank: int, world: int, systems: list[str], layers: int, args) -> dict:
    """Median step time (ms) of each system, built side by side in this process and stepped in turn."""
    steps = {system: _stepper(system, layers, world, args)[0] for system in systems}
    for i in range(args.warmup):
        for step in steps.values():
            step(i)
    times = {system: [] for system in systems}
    for i in range(args.alternate):
        for system, step in steps.items():
            t0 = time.perf_counter()
            step(100 + i)
            times[system].append(time.perf_counter() - t0)
    return {system: statistics.median(t) * 1e3 for system, t in times.items()}


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(torch.device(device))} (counts are the host's)"
    return f"CPU ({os.cpu_count()} cores)"


def markdown(rows: list[dict], args) -> str:
    out = [f"### nanoGPT {args.width} wide, vocabulary {args.vocab}, {args.micro} x {args.seq} tokens, {args.dtype}, "
           f"{'fused' if args.fused else 'foreach'} AdamW, world 1, {_device_name(args.device)}, torch {torch.__version__}, "
           f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
           "| system | layers | python calls | eager ops | graph calls | autograd nodes | step (ms) | "
           "step, alternating (ms) | vs first system |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    first = {}
    for r in rows:
        if "error" in r:
            out.append(f"| {r['system']} | {r['layers']} | failed: {r['error'][:120]} |")
            continue
        alt = r.get("step_ms_alternating")
        first.setdefault(r["layers"], alt)
        ratio = f"{alt / first[r['layers']]:.2f}x" if alt and first[r["layers"]] else "-"
        out.append(f"| {r['system']} | {r['layers']} | {r['python_calls']:,} | {r['eager_ops']:,} | "
                   f"{r['graph_calls']} | {r['autograd_nodes']} | {r['step_ms']:.1f} | "
                   f"{f'{alt:.1f}' if alt else '-'} | {ratio} |")
    return "\n".join(out) + "\n"


def _write(base: str, rows: list[dict], args) -> None:
    """The table and the JSON so far (rewritten as each run finishes: a timeout keeps what ran)."""
    with open(base + ".md", "w") as f:
        f.write(markdown(rows, args))
    with open(base + ".json", "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="8,24")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--device", default="cpu", help="where the model runs (cuda: the host's work for a GPU step, with "
                    "NCCL)")
    ap.add_argument("--fused", action="store_true", help="fused AdamW, as nanoGPT on CUDA (default: foreach, its "
                    "choice on the CPU)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--alternate", type=int, default=0, help="rounds of the systems stepped in turn in one process "
                    "(0: none)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--timeout", type=float, default=900, help="seconds per system and depth")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="host_work")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, args.tag)
    rows = []
    systems = args.systems.split(",")
    env = {"ZC_TEST_PG": "nccl"} if args.device.startswith("cuda") else {}
    for layers in map(int, args.layers.split(",")):
        for system in systems:
            try:
                rows.append(run_world(1, worker, system, layers, args, timeout=args.timeout, env=env)[0])
            except WorkerFailed as e:
                rows.append({"system": system, "layers": layers, "error": e.errors[0].strip().splitlines()[-1]})
            print(rows[-1], flush=True)
            _write(base, rows, args)
        # not FSDP2 + torch.compile: dynamo skips nanoGPT's forward frame for it (a graph break in a loop, in
        # FSDP2's hooks), and a skipped frame is skipped for every model in the process
        side_by_side = [s for s in systems if not s.startswith("fsdp2")]
        if args.alternate and side_by_side:
            try:
                alt = run_world(1, alternating, side_by_side, layers, args, env=env,
                                timeout=args.timeout * len(side_by_side))[0]
            except WorkerFailed as e:
                alt = {}
                print("alternating run failed:", e.errors[0].strip().splitlines()[-1], flush=True)
            for r in rows:
                if r["layers"] == layers and r["system"] in alt:
                    r["step_ms_alternating"] = alt[r["system"]]
            _write(base, rows, args)
    print(markdown(rows, args))
    return rows


if __name__ == "__main__":
    main()
