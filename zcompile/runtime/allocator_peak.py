"""Peak CPU tensor bytes of a training step, measured where a TorchDispatchMode cannot see (inductor's C++ kernels,
collectives, optimizer internals): the CPU allocator's own events under torch.profiler(profile_memory=True).

    peak = zcompile.step_tensor_peak(lambda: train_one_step())["peak"]

    peak = bytes live when the step starts    (every CPU tensor storage the Python heap references, plus
                                                `hidden_bytes` for buffers only C++ holds, e.g. DDP's gradient buckets)
         + the highest rise above that during the step (the step's allocations minus the frees reported in it)

The allocator reports to the profiler only on threads that carry its state. A block allocated in the step and freed
by a communication thread is never seen freed: when its address is handed out again it counts as freed from then on,
and the lowest peak over several steps is kept (a step in which the main thread dropped every last reference is
exact). Frees of blocks allocated before the step are not counted, so a rise is never underestimated.
"""
from __future__ import annotations

import gc
from typing import Callable, Iterable

import torch
from torch._C._profiler import _EventType
from torch._subclasses.fake_tensor import FakeTensor
from torch.profiler import ProfilerActivity, profile



def live_tensor_bytes() -> int:
    """Bytes of CPU memory under the storages of every tensor the Python heap references, each byte once: two
    storage objects may alias one block (a stage-2 shard's storage over its slice of the whole parameter's)."""
    gc.collect()
    # issubclass(type(...)): isinstance would touch __class__ of every object, some of which warn
    spans = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in gc.get_objects()
             if issubclass(type(t), torch.Tensor) and t.device.type == "cpu" and not _owns_no_memory(t)}
    total, end = 0, 0
    for start, nbytes in sorted(spans):  # the union of the address ranges
        total += max(0, start + nbytes - max(start, end))
        end = max(end, start + nbytes)
    return total


def _owns_no_memory(t: torch.Tensor) -> bool:
    # fake tensors (dynamo's caches) and wrapper subclasses such as DTensor; their inner tensors are counted themselves
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return False
    return isinstance(t, FakeTensor) or torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python)


def highest_rise(events: Iterable[tuple[int, int, int]]) -> int:
    """The highest net bytes allocated over (time, address, signed size) allocator events (see module doc)."""
    live: dict[int, int] = {}
    now = peak = 0
    for _, ptr, size in sorted(events):
        if size > 0:
            now += size - live.pop(ptr, 0)  # an address handed out again was freed, reported or not
            live[ptr] = size
        elif ptr in live:
            now -= live.pop(ptr)
        peak = max(peak, now)
    return peak


def allocator_events(step: Callable[[], object]) -> list[tuple[int, int, int]]:
    """(time ns, address, signed bytes) of every CPU allocation and free reported while `step()` ran."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        stack.extend(node.children)
    return events


def step_tensor_peak(step: Callable[[], object], repeats: int = 3, hidden_bytes: int = 0) -> dict:
    """Run `step()` `repeats` times and return the lowest {"start", "rise", "peak"} bytes (see module doc)."""
    if repeats < 1:
        raise ValueError(f"step_tensor_peak: repeats must be >= 1, got {repeats}")
    best = None
    for _ in range(repeats):
        start = live_tensor_bytes() + hidden_bytes
        rise = highest_rise(allocator_events(step))
        if best is None or start + rise < best["peak"]:
            best = {"start": start, "rise": rise, "peak": start + rise}
    return best
