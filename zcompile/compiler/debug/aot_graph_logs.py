"""AOTAutograd prints its graphs as readable code (strides, devices) for its logs and cache entries whether or not a
log is on: the joint graph, then the partitioned forward and backward (`_log_fw_bw_graphs`, `print_readable` on
each), or an inference graph. zcompile's are the whole model's (bench/results/compile-time-log.md: with the
passes' lint once per phase, 24.0-24.5 -> 21.9-22.7 s of a 32-layer GPT's cold compile on the 2-core VM).
`aot_module_simplified` has no switch for it (its AOTConfig's `enable_log` is always on), so during zcompile's own AOTAutograd call
`quiet()` makes those functions return what they return with logging off, unless the `aot_graphs` log
(TORCH_LOGS=aot_graphs) or a structured trace (TORCH_TRACE, for tlparse) would read the strings. A cache entry then
holds no graph strings (tlparse of a warm launch shows none).
"""
from __future__ import annotations

import contextlib
import logging
import os
from unittest import mock


def wanted() -> bool:
    """Whether a log would read AOTAutograd's graph strings: the aot_graphs or aot_joint_graph artifact logs, or a
    structured trace."""
    from torch._functorch._aot_autograd import graph_compile
    from torch._logging import _internal
    logs = [getattr(graph_compile, name, None) for name in ("aot_graphs_log", "aot_joint_log")]
    if any(log is None or log.isEnabledFor(logging.INFO) for log in logs):
        return True
    if os.getenv("TORCH_TRACE") or os.getenv("MAST_HPC_JOB_NAME"):  # where torch's trace handler writes
        return True
    # torch always installs a LazyTraceHandler; without a directory (TORCH_TRACE unset) it writes nothing. Other
    # handlers there do not count: under pytest on torch 2.11 its capture handlers sit on torch's trace log too
    return any(isinstance(h, _internal.LazyTraceHandler) and h.root_dir is not None
               for h in _internal.trace_log.handlers)


# torch's functions (torch >= 2.11) and what each returns with logging off: its graphs' strings
_LOGGERS = {"_log_joint_graph": None, "_log_fw_bw_graphs": (None, None), "_log_inference_graph": None}


@contextlib.contextmanager
def quiet():
    """Around zcompile's AOTAutograd call: torch's graph-logging functions return their logging-off results."""
    from torch._functorch._aot_autograd import graph_compile
    with contextlib.ExitStack() as stack:
        if not wanted():
            for name, off in _LOGGERS.items():
                if hasattr(graph_compile, name):
                    stack.enter_context(mock.patch.object(graph_compile, name, lambda *a, _off=off, **k: _off))
        yield
