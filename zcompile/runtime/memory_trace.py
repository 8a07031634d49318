"""Measured live tensor bytes of compiled graphs, to hold the planner's liveness against reality.

    with zcompile.measure_memory() as runs:
        loss = model(x); loss.backward()
    for r in runs: print(r.kind, r.planned_peak, r.measured_peak)

While active, every compiled graph runs under a TorchDispatchMode that tracks storages, as
torch.distributed._tools.mem_tracker does: the graph's input storages, then each op's output storages, each counted
once and dropped when its storage is freed (weak references, checked after every op). Both numbers mean the same
thing: bytes of the graph's inputs plus the intermediates alive at the peak. Meaningful for `backend: eager`, which
runs the very graph that was planned; inductor reuses buffers the plan does not know about.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from zcompile.kernels import linear_cross_entropy

_C10D = torch.ops._c10d_functional


@dataclasses.dataclass
class GraphRun:
    graph_id: int
    kind: str
    planned_peak: int
    measured_peak: int
    planned_trace: list[int]    # live bytes after each node of the planned graph (inputs included)
    measured_trace: list[int]   # live bytes after each op the run dispatched (inputs included)


class LiveStorageTracker(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live: dict[StorageWeakRef, int] = {}
        self.bytes = 0
        self.peak = 0
        self.trace: list[int] = []
        self.copies: dict[StorageWeakRef, int] = {}  # a collective's output -> bytes of gloo's copy of its input

    def track(self, tensors) -> None:
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                key = StorageWeakRef(t.untyped_storage())
                if key not in self.live:
                    self.live[key] = t.untyped_storage().nbytes()
                    self.bytes += self.live[key]
        self.peak = max(self.peak, self.bytes)

    def _drop_freed(self) -> None:
        for key in [k for k in self.live if k.expired()]:
            self.bytes -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        body = linear_cross_entropy.BODIES.get(func)
        if body is not None:  # one of zcompile's ops: its own ops (each chunk's temporaries) are tracked too
            with self:
                out = body(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        self._drop_freed()  # what the generated code released since the last op
        self.track(out)
        if func is _C10D.reduce_scatter_tensor.default and args[0].device.type == "cpu":
            # gloo reads a copy of the input that it makes in C++, out of this mode's sight, and holds it until
            # the work completes (the allocator sees it: allocator_peak); counted until the wait
            self.copies[StorageWeakRef(out.untyped_storage())] = args[0].untyped_storage().nbytes()
            self.bytes += self.copies[StorageWeakRef(out.untyped_storage())]
            self.peak = max(self.peak, self.bytes)
        elif func is _C10D.wait_tensor.default:
            self.bytes -= self.copies.pop(StorageWeakRef(args[0].untyped_storage()), 0)
        self.trace.append(self.bytes)
        return out


RUNS: list[GraphRun] | None = None  # set while measure_memory() is active


@contextlib.contextmanager
def measure_memory():
    """Record planned and measured peaks of every compiled graph run inside the block (see module doc)."""
    global RUNS
    previous, RUNS = RUNS, []
    try:
        yield RUNS
    finally:
        RUNS = previous


def run_measured(compiled, args: list, graph_id: int, kind: str, planned) -> object:
    """Run a boxed compiled graph under the tracker; `planned` is its liveness.Liveness."""
    tracker = LiveStorageTracker()
    tracker.track(args)
    with tracker:
        out = compiled(args)
    planned_trace = [planned.input_bytes + b for _, b in planned.live_after]
    RUNS.append(GraphRun(graph_id, kind, planned.input_bytes + planned.peak_bytes, tracker.peak, planned_trace,
                         tracker.trace))
    return out
