"""Start inductor's one-time host setup in the background when the zero backend is first entered.

Before its first C++ kernel, inductor finds the CPU's vector ISA (`cpu_vec_isa.valid_vec_isa_list`): it builds a
test library with g++ for each candidate ISA and loads each in a child Python, once per process (6.2 s of the first
forward's compile with a fresh cache, 1.2 s with a warm one, on the 2-core benchmark VM; docs/compile-time.md).
That is waiting on subprocesses, so it runs beside dynamo's trace, AOTAutograd and the passes, which come first.
The inductor compile joins it (`wait`): the probe's result is functools-cached, and two threads computing it at
once would each build. The candidate ISAs are checked at once (`_check_each`), where inductor checks them in turn.
A probe that fails here is left to inductor, which runs it again and reports as usual.
"""
from __future__ import annotations

import threading

import torch

_started: threading.Thread | None = None
_lock = threading.Lock()


def _probe() -> None:
    try:
        from torch._inductor import cpu_vec_isa
        _check_each(cpu_vec_isa)
        cpu_vec_isa.valid_vec_isa_list()
    except Exception:  # inductor probes again where it needs the result, and raises there
        pass


def _check_each(cpu_vec_isa) -> None:
    """Check the x86 candidates at once, a thread each: inductor checks them one after another, each a g++ build
    and a child process (this VM: AMX, AVX512-VNNI, AVX512, AVX2; 8.9-9.7 s in a row, 5.0-5.1 s at once on 2 idle
    cores). Each check's result is cached on its ISA object, where valid_vec_isa_list reads it; anything missing
    here (another platform, another torch) leaves the checks to valid_vec_isa_list."""
    import platform
    if platform.machine() not in ("x86_64", "AMD64"):
        return
    flags = cpu_vec_isa.x86_isa_checker()
    candidates = [isa for isa in cpu_vec_isa.supported_vec_isa_list
                  if all(flag in flags for flag in str(isa).split())]
    threads = [threading.Thread(target=_check, args=(isa,), daemon=True) for isa in candidates]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _check(isa) -> None:
    try:
        bool(isa)  # a g++ build and a child process; the result is cached on the ISA object
    except Exception:  # not cached: valid_vec_isa_list checks it again where inductor needs it, and raises there
        pass


def start(device: torch.device) -> None:
    """Begin the probe for a CPU compile (once per process); a GPU compile needs no C++ ISA."""
    global _started
    if device.type != "cpu":
        return
    with _lock:
        if _started is None:
            _started = threading.Thread(target=_probe, name="zcompile-inductor-warmup", daemon=True)
            _started.start()


def wait() -> None:
    """Before inductor compiles: let a started probe finish."""
    if _started is not None:
        _started.join()
