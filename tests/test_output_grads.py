"""The backward compiled for the usual call, where only the loss gets a gradient (`codegen/output_grads.py`):
autograd hands it no zero-filled gradient for the returned logits, and a backward that does bring one runs the
graph as traced."""
import pytest
import torch

from tests.harness import run_world


@pytest.mark.parametrize("backend,world", [("eager", 2), ("inductor", 1)])
def test_a_gradient_reaching_the_returned_logits_runs_the_graph_as_traced(backend, world):
    """The loss alone runs the loss-only backward; the loss plus a term of the logits compiles and runs the backward
    as traced; the loss alone runs the loss-only one again. Each call's gradients equal the uncompiled model's (the
    logits' term changes them, so dropping it would show)."""
    from tests import workers
    steps = run_world(world, workers.logits_gradients, backend, timeout=600)
    for out in steps:
        assert [s["loss-only backwards"] for s in out] == [1, 1, 1], out
        assert [s["full compiled"] for s in out] == [[False], [True], [True]]
        for s in out:
            for name, g in s["grads"].items():
                torch.testing.assert_close(g, s["reference"][name], rtol=1e-4, atol=1e-6, msg=name)
        moved = max((out[1]["reference"][k] - out[0]["reference"][k]).abs().max().item() for k in out[0]["reference"])
        assert moved > 1e-3, moved
