"""Start inductor's one-time host setup in the background when the zero backend is first entered.

Before its first C++ kernel, inductor finds the CPU's vector ISA (`cpu_vec_isa.valid_vec_isa_list`): it builds a test
library with g++ for each candidate ISA the CPU's flags allow and loads each in a child Python, once per process,
each build compiling ATen's vector headers (on the benchmark VM 2.7, 2.3, 1.9 and 1.6 s of CPU for AMX, AVX512-VNNI,
AVX512 and AVX2: 8.5 s per cold cache, on 2 cores; bench/results/compile-time-log.md). It uses one of them: the first
in that list (or the one ATEN_CPU_CAPABILITY / cpp.simdlen names, `_chosen`). So the warmup checks only that one
(`_probe`); once it builds and loads, the first inductor compile (`wait`) fills inductor's list from the CPU's
flags without building the others (`cpp.vec_isa_ok` for that one call): x86 ISAs nest, so a compiler and OS that
build and load the chosen one build the smaller ones too. Should the chosen one fail, the warmup checks the other
candidates at once (`_check_each`), where inductor checks them in turn, and inductor's list comes from those
checks as without zcompile. A user's own `cpp.vec_isa_ok` (TORCHINDUCTOR_VEC_ISA_OK) is left to inductor. The
probe runs beside dynamo's trace, AOTAutograd and the passes, which come first; the inductor compile joins it: the
probe's result is functools-cached, and two threads computing it at once would each build. A probe that fails
here is left to inductor, which runs it again and reports as usual.
"""
from __future__ import annotations

import threading

import torch

_started: threading.Thread | None = None
_lock = threading.Lock()
_verified = None  # the ISA inductor will pick, once it built and loaded (`_probe`); wait() fills the list from it


def _probe() -> None:
    global _verified
    try:
        from torch._inductor import config, cpu_vec_isa
        _verified = _verify(cpu_vec_isa, config)
    except Exception:  # inductor probes again where it needs the result, and raises there
        pass


def _verify(cpu_vec_isa, config):
    """The ISA inductor will use, if it builds and loads; else None, after checking the other candidates at once
    and making inductor's list from those checks (or nothing, where the user set cpp.vec_isa_ok)."""
    if config.cpp.vec_isa_ok is not None:  # the user's answer: inductor builds nothing
        return None
    chosen = _chosen(cpu_vec_isa, config)
    if chosen is not None and bool(chosen):  # a g++ build and a child process; cached on the ISA object
        return chosen
    _check_each(cpu_vec_isa)
    cpu_vec_isa.valid_vec_isa_list()
    return None


def _chosen(cpu_vec_isa, config):
    """The x86 ISA inductor's pick_vec_isa will take from its list, chosen from the CPU's flags alone (None: another
    platform, or none to pick)."""
    import os
    candidates = _candidates(cpu_vec_isa)
    if not candidates:
        return None
    if config.cpp.simdlen is not None:
        return next((isa for isa in candidates if isa.bit_width() == config.cpp.simdlen), None)
    capability = os.getenv("ATEN_CPU_CAPABILITY")
    if not capability:
        return candidates[0]
    isa = cpu_vec_isa.get_isa_from_cpu_capability(capability, candidates, cpu_vec_isa.invalid_vec_isa)
    return isa if isa in candidates else None


def _check_each(cpu_vec_isa) -> None:
    """Check the x86 candidates at once, a thread each: inductor checks them one after another, each a g++ build
    and a child process (this VM: AMX, AVX512-VNNI, AVX512, AVX2; 8.9-9.7 s in a row, 5.0-5.1 s at once on 2 idle
    cores). Each check's result is cached on its ISA object, where valid_vec_isa_list reads it; anything missing
    here (another platform, another torch) leaves the checks to valid_vec_isa_list."""
    threads = [threading.Thread(target=_check, args=(isa,), daemon=True) for isa in _candidates(cpu_vec_isa)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _candidates(cpu_vec_isa) -> list:
    """The x86 ISAs of inductor's list whose flags this CPU has, in its order (none on another platform)."""
    import platform
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_vec_isa.x86_isa_checker()
    return [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(flag in flags for flag in str(isa).split())]


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
    """Before inductor compiles: let a started probe finish; with the chosen ISA verified, inductor's list of valid
    ISAs is made (and cached for the process) from the CPU's flags, without building the others."""
    global _verified
    if _started is None:
        return
    _started.join()
    if _verified is not None:
        from torch._inductor import config, cpu_vec_isa
        verified, _verified = _verified, None
        with config.patch({"cpp.vec_isa_ok": True}):  # here, in the compiling thread: no other reads it meanwhile
            cpu_vec_isa.valid_vec_isa_list()
        if cpu_vec_isa.pick_vec_isa() != verified:  # inductor would use one not built here (another pick rule)
            cpu_vec_isa.valid_vec_isa_list.cache_clear()  # so it checks them all itself, as without zcompile
