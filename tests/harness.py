"""The tests' multi-process runner (lives in the package so the benchmarks share it), and the benchmark scripts run
in the test process."""
import contextlib
import importlib
import os
import sys

from zcompile.tools.launch import WorkerFailed, run_world

__all__ = ["WorkerFailed", "bench_module", "run_bench", "run_world"]

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@contextlib.contextmanager
def _bench_on_path():
    sys.path.insert(0, _BENCH)
    try:
        yield
    finally:
        sys.path.remove(_BENCH)


def bench_module(script: str):
    """bench/<script>.py as a module, for the tests of its helpers."""
    with _bench_on_path():
        return importlib.import_module(script)


def run_bench(script: str, argv: list[str]):
    """bench/<script>.py's `main(argv)`, called here: its worlds fork from the tests' fork server instead of a fresh
    interpreter importing torch and starting a server of its own (15-25 s a script on 2 cores). bench/ stays on the
    path while it runs: the workers unpickle the script's functions by its module name."""
    with _bench_on_path():
        return importlib.import_module(script).main(argv)
