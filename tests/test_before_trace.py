"""zcompile shards a model when dynamo starts compiling it for the zero backend, so the first trace reads the
DTensor parameters and is not thrown away (compiler/tracing/before_trace.py); the backend's restart path stays for what
the hook cannot see. The collector is off from the start of each zero-backend compile."""
import gc

import pytest
import torch

from tests import workers
from tests.harness import run_world
from zcompile.compiler.tracing import before_trace
from zcompile.runtime import dtensor_params

needs_trace_once = pytest.mark.skipif(not dtensor_params.trace_once_supported(),
                                      reason="torch 2.11 shards after the first trace (restart path)")


@needs_trace_once
def test_first_trace_reads_dtensors_and_matches_the_restart_path():
    outs = run_world(2, workers.traces_before_sharding, timeout=600)
    for out in outs:
        # only the model compiled right after a bare reset (hook dropped) restarts; the backend reinstalls the hook
        assert out["restarts"] == ["after reset"], out["restarts"]
        for case in ("hook", "after reset", "hook again", "step function", "Module.compile"):
            assert out[case]["dtensors"], (case, out[case])
        # a deep copy (an EMA) computes with its own copy of the weights, equal to the model's here
        assert out["deep copy"][0] == out["deep copy"][1], out["deep copy"]
        # the hook shards as the backend does: the same losses, bit for bit, as the restart path
        assert (out["hook"]["losses"] == out["after reset"]["losses"] == out["hook again"]["losses"]
                == out["Module.compile"]["losses"])
        assert out["step function"]["losses"][0] == out["hook"]["losses"][0]
        assert out["step function"]["losses"] == pytest.approx(out["hook"]["losses"], rel=1e-5)
        # the collector is off when dynamo starts a zero-backend compile (without the hook, after the bare reset,
        # it is not), on for another backend, on after
        others = [on for case, on in out["collector"] if case != "after reset"]
        assert len(others) >= 4 and not any(others), out["collector"]
        assert [on for case, on in out["collector"] if case == "after reset"] == [True], out["collector"]
        assert out["other backend"] == {"collector": [True], "plain": True}, out["other backend"]
        assert out["collector after"] is True


def test_hook_ignores_other_backends_and_keeps_callbacks_paired(monkeypatch):
    """Also where dynamo's registry holds "zero" only as an entry point (not loaded: how a process that imported
    zcompile after torch listed the backends sees it) and the backend is not torch.compile's wrapper
    (torch._dynamo.optimize with a function): a first version took such a compile for zcompile's and sharded
    FSDP2's model (NaN losses in bench/compile_time.py's fsdp2_compile)."""
    from torch._dynamo.backends import registry
    monkeypatch.delitem(registry._COMPILER_FNS, "zero", raising=False)
    torch._dynamo.reset()
    before_trace.register()
    before_trace.register()  # once only
    assert torch._dynamo.callback_handler.start_callbacks.count(before_trace._on_start) == 1
    seen = []

    def backend(gm, example_inputs):
        seen.append(gc.isenabled())
        return gm.forward
    for compile_ in (lambda m: torch.compile(m, backend="eager"), torch._dynamo.optimize(backend)):
        net = torch.nn.Linear(4, 4)
        compile_(net)(torch.randn(2, 4))
        assert type(net.weight) is torch.nn.Parameter and before_trace._compiles == [] and gc.isenabled()
    assert seen == [True]  # the collector stays on for another backend
    torch._dynamo.reset()


@needs_trace_once
def test_a_skipped_top_level_forward_is_named_with_the_way_out():
    """dynamo gives up LoopBreakGPT's forward (a graph break in its loop over blocks) and marks its code skipped, so
    a second model of the class compiled in the process never has its forward traced: only its blocks compile, and
    its forward runs eagerly on parameters nobody sharded (under bf16, its head failed with "expected m1 and m2 to
    have the same dtype"). zcompile names that at the first call; sharded before the first forward
    (zcompile.shard_parameters), the model trains as the first one did, also inside a wrapper that holds no
    parameter of its own and whose forward dynamo skips as well."""
    for rank, out in enumerate(run_world(2, workers.skipped_top_frame, timeout=300)):
        first, second, sharded = out["first"], out["second"], out["sharded first"]
        assert out["a wrapper of one sharded first"] == first, (rank, out["a wrapper of one sharded first"], first)
        assert isinstance(first, list) and len(first) == 2, (rank, first)
        assert isinstance(second, tuple) and second[0] == "ZCompileError", (rank, second)
        assert "never started to compile LoopBreakGPT's own forward" in second[1], second
        assert "zcompile.shard_parameters(model, config)" in second[1], second
        assert sharded == first, (rank, sharded, first)
