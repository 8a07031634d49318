"""Run a function on N local processes joined in one process group (gloo on 127.0.0.1, or NCCL with
ZC_TEST_PG=nccl), under a hard timeout: used by the tests and the benchmarks."""
from __future__ import annotations

import datetime
import faulthandler
import functools
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import traceback

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, fn, args, kwargs, env: dict, caller_env: dict,
            cwd: str) -> None:
    os.environ.clear()  # the caller's environment and directory now, not the fork server's at its start
    os.environ.update(caller_env)
    os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", **env)
    torch.set_num_threads(1)
    faulthandler.enable()  # a crash inside a C++ library (gloo, a kernel) still shows the Python stack
    import torch.distributed as dist
    code = 0
    try:
        backend = os.environ.get("ZC_TEST_PG", "gloo")
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
        result = fn(rank, world, *args, **kwargs)
        torch.save(result, os.path.join(out_dir, f"result{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Skip interpreter teardown: once in a full-suite run a worker aborted with "terminate called without an active
    # exception" and no Python frame of ours on the stack, most likely while C++ destructors ran at exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# Read when torch, triton or inductor's config is imported: a forked worker has imported them already. (Inductor
# reads its cache directory at each use: the benchmarks give every run its own through the fork server.)
_IMPORT_TIME_PREFIXES = ("TORCH", "PYTORCH", "TRITON")
_READ_AT_USE = {"TORCHINDUCTOR_CACHE_DIR"}


# Modules the fork server imports besides torch and zcompile, comma-separated: the tests name
# tests/worker_preload.py (what each worker's first compile would import and work out again), also for the benchmark
# scripts they run; a benchmark of cold compiles run by hand leaves it unset.
PRELOAD_ENV = "ZC_WORKER_PRELOAD"


@functools.cache
def _start_context():
    """Workers fork from a server process that imported torch once (forkserver), instead of each importing it
    (spawn): on 2 cores a world of 4 started in 6.6 s, most of it four imports of torch. The server forks before
    any CUDA or process-group state exists, as spawn would start. Where forkserver is missing: spawn.
    Returns (context, {} to hold the environment the server starts with)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn"), None
    ctx = mp.get_context("forkserver")
    extra = [m for m in os.environ.get(PRELOAD_ENV, "").split(",") if m]
    ctx.set_forkserver_preload(["torch", "torch.distributed", "zcompile", *extra])
    return ctx, {}


def _context_for(env: dict):
    """The fork server, unless the workers' environment differs from the server's in a variable read when torch is
    imported (TORCHINDUCTOR_FX_GRAPH_CACHE, TORCH_LOGS, TRITON_INTERPRET, ...): then fresh interpreters (spawn)
    started with it, so the setting is not silently ignored."""
    ctx, server = _start_context()
    if server is None:
        return ctx
    started_with = server.get("env", os.environ)  # a server not started yet starts now, with this environment
    wanted = {**os.environ, **env}
    changed = {k for k in set(wanted) | set(started_with) if wanted.get(k) != started_with.get(k)}
    if any(k.startswith(_IMPORT_TIME_PREFIXES) and k not in _READ_AT_USE for k in changed):
        return mp.get_context("spawn")
    server.setdefault("env", dict(os.environ))
    return ctx


class WorkerFailed(AssertionError):
    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        super().__init__("\n".join(f"--- rank {r} ---\n{t}" for r, t in sorted(errors.items())))


def run_world(world: int, fn, *args, timeout: float = 600, env: dict | None = None, **kwargs) -> list:
    """fn(rank, world, *args, **kwargs) on `world` processes; returns their results, or raises WorkerFailed with tracebacks.
    The workers see the caller's environment and directory as they are now, `env` over them; a variable torch reads
    at import that differs from the fork server's starts them in fresh interpreters (~3 s each on 2 cores)."""
    env = env or {}
    ctx = _context_for(env)
    with tempfile.TemporaryDirectory() as out_dir:
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, out_dir, fn, args, kwargs, env,
                                                   dict(os.environ), os.getcwd())) for r in range(world)]
        saved = dict(os.environ)
        try:
            if ctx.get_start_method() == "spawn":
                os.environ.update(env)  # a spawned interpreter starts with it, before it imports torch
            for p in procs:
                p.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        for p in procs:
            p.join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = {}
        for r in range(world):
            path = os.path.join(out_dir, f"error{r}.txt")
            if os.path.exists(path):
                errors[r] = open(path).read()
            elif r in hung:
                errors[r] = f"still running after {timeout}s: killed"
            elif procs[r].exitcode != 0:
                errors[r] = f"exit code {procs[r].exitcode}"
        if errors:
            raise WorkerFailed(errors)
        return [torch.load(os.path.join(out_dir, f"result{r}.pt"), weights_only=False) for r in range(world)]
