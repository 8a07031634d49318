"""How fast the host updates offloaded optimizer state, against what its memory can move (issue 57, item 1).

    python bench/cpu_adam_rate.py --sizes 100M,250M

Per size N (fp32 elements, one flat parameter as an offloaded shard is), on the machine it runs on, best of --repeats:
  copy           STREAM copy, b.copy_(a): 8 bytes moved per element
  triad          STREAM triad, a = b + s * c (torch.add(..., out=)): 12 bytes per element
  zcompile.CPUAdam, torch.optim.AdamW(fused=True), torch.optim.AdamW(foreach=True): one step with a gradient present;
                 Adam reads the parameter, gradient and two moments and writes the parameter and moments: 28 bytes
                 per element, the update's bandwidth bound being 28 N / (the triad's bytes per second)
Reported: seconds, elements per second, GB/s by those byte counts, the fraction of the triad's GB/s, and the fraction
of the memory bandwidth with what caches really move: STREAM counts 12 bytes for the triad, but the line written is
first read (write-allocate), 16 bytes; copy 8 -> 12; Adam writes only lines it has read, 28. So an update at "1.33 of
triad" runs at the triad's real bandwidth (1.0 in the last column: the update runs at the speed of memory). torch's
intra-op threads (`--threads`, default torch's) do the work.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zcompile  # noqa: E402

ADAM_BYTES = 28  # read p, g, m, v; write p, m, v (fp32)
MOVED = {"copy": 12, "triad": 16}  # bytes per element with write-allocate; an optimizer's: ADAM_BYTES


def _size(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9}
    return int(float(text[:-1]) * scale[text[-1].upper()]) if text[-1].upper() in scale else int(text)


def _best(fn, repeats: int) -> float:
    fn()  # first touch: page faults are not bandwidth
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(n: int, repeats: int) -> list[dict]:
    rows = []
    a, b, c = torch.rand(n), torch.empty(n), torch.rand(n)
    t = _best(lambda: b.copy_(a), repeats)
    rows.append({"what": "copy", "seconds": t, "bytes": 8 * n})
    t = _best(lambda: torch.add(b, c, alpha=3.0, out=a), repeats)
    rows.append({"what": "triad", "seconds": t, "bytes": 12 * n})
    del a, b, c
    for name, make in (("zcompile.CPUAdam", lambda ps: zcompile.CPUAdam(ps, lr=1e-4)),
                       ("AdamW(fused=True)", lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True)),
                       ("AdamW(foreach=True)", lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True))):
        p = torch.nn.Parameter(torch.rand(n))
        p.grad = torch.rand(n) * 1e-3
        opt = make([p])
        t = _best(opt.step, repeats)
        rows.append({"what": name, "seconds": t, "bytes": ADAM_BYTES * n})
        del opt, p
    triad = rows[1]["bytes"] / rows[1]["seconds"]
    memory = MOVED["triad"] * n / rows[1]["seconds"]
    for r in rows:
        moved = MOVED.get(r["what"], ADAM_BYTES) * n
        r.update(n=n, elements_per_s=n / r["seconds"], gb_per_s=r["bytes"] / r["seconds"] / 1e9,
                 of_triad=(r["bytes"] / r["seconds"]) / triad, of_memory=(moved / r["seconds"]) / memory)
    return rows


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def markdown(rows: list[dict]) -> str:
    out = [f"### CPU update rate against memory bandwidth: {machine()}, torch {torch.__version__}, "
           f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
           "| elements | what | seconds | elements/s | GB/s | of triad | of memory bandwidth |",
           "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['n'] / 1e6:.0f}M | {r['what']} | {r['seconds']:.4f} | {r['elements_per_s'] / 1e6:,.0f}M | "
                   f"{r['gb_per_s']:.1f} | {r['of_triad']:.2f} | {r['of_memory']:.2f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100M,250M", help="fp32 elements per measurement, e.g. 100M,1B")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="cpu_adam_rate")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for n in map(_size, args.sizes.split(",")):
        rows += measure(n, args.repeats)
        print(markdown(rows), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, args.tag + ".md"), "w") as f:
        f.write(markdown(rows))
    with open(os.path.join(args.out, args.tag + ".json"), "w") as f:
        json.dump({"machine": machine(), "args": vars(args), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
