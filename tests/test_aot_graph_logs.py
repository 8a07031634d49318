"""AOTAutograd's readable graph strings are made during zcompile's compile only when a log reads them
(compiler/debug/aot_graph_logs.py): off by default, on with TORCH_LOGS=aot_graphs (or a structured trace)."""
import torch

from tests import workers
from tests.harness import run_world
from zcompile.compiler.debug import aot_graph_logs


def _compile_and_count(rank: int, world: int, log: bool) -> dict:
    from torch._functorch._aot_autograd import graph_compile
    real, made = graph_compile._log_fw_bw_graphs, []

    def counted(*args, **kwargs):  # torch's function, counting the strings it returns
        out = real(*args, **kwargs)
        made.append([s is not None for s in out])
        return out
    graph_compile._log_fw_bw_graphs = counted
    if log:
        torch._logging.set_logs(aot_graphs=True)
    x = workers.global_batch(0, 1)
    # compile_cache off: the second launch must partition again, not load the first's graphs
    model = torch.compile(workers.build_model("gpt"), backend="zero",
                          options={"config": {"stage": 3, "backend": "eager", "compile_cache": False}})
    workers.loss_of(model, "gpt", x).backward()
    zero = list(made)
    # another backend's compile in the same process keeps torch's behaviour
    torch.compile(torch.nn.Linear(4, 4), backend="aot_eager")(torch.randn(2, 4, requires_grad=True)).sum().backward()
    return {"zero": zero, "other": made[len(zero):], "restored": graph_compile._log_fw_bw_graphs is counted}


def test_zero_compile_makes_no_graph_strings_unless_a_log_reads_them():
    (quiet,) = run_world(1, _compile_and_count, False, timeout=300)
    assert quiet["zero"] == [], quiet  # not called: torch's function was replaced during the compile
    assert quiet["other"] == [[True, True]] and quiet["restored"], quiet
    (logged,) = run_world(1, _compile_and_count, True, timeout=300)
    assert logged["zero"] == [[True, True]], logged  # TORCH_LOGS=aot_graphs: as without zcompile


def test_wanted_follows_the_logs():
    assert not aot_graph_logs.wanted()
    torch._logging.set_logs(aot_joint_graph=True)
    try:
        assert aot_graph_logs.wanted()
    finally:
        torch._logging.set_logs()
    assert not aot_graph_logs.wanted()
    from torch._logging import _internal
    handler = _internal.LazyTraceHandler("/nonexistent/trace")  # what TORCH_TRACE=<dir> installs
    _internal.trace_log.addHandler(handler)
    try:
        assert aot_graph_logs.wanted()
    finally:
        _internal.trace_log.removeHandler(handler)
    assert not aot_graph_logs.wanted()


def test_torch_trace_set_counts_as_a_reader(monkeypatch):
    monkeypatch.setenv("TORCH_TRACE", "/tmp/trace")
    assert aot_graph_logs.wanted()
