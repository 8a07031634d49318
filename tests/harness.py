"""The tests' multi-process runner (lives in the package so the benchmarks share it)."""
from zcompile.tools.launch import WorkerFailed, run_world

__all__ = ["WorkerFailed", "run_world"]
