"""The backend compiles with Python's garbage collector paused (a full collection rescans every FX node and fake
tensor of the compile) and turns it back on after, also when the compile fails."""
import gc

import pytest

from tests import workers
from tests.harness import run_world
from zcompile.compiler.backend import collector_paused


def test_collector_paused_restores_what_it_found():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():  # nested: the inner one leaves it to the outer
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with collector_paused():
            raise RuntimeError("a compile that fails")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # a user who turned it off keeps it off
    finally:
        gc.enable()


def test_compiles_run_with_the_collector_paused_and_leave_it_on():
    seen = run_world(1, workers.collector_during_compile, timeout=300)[0]
    assert seen["forward"] is False and seen["backward"] is False, seen
    assert seen["after the step"] is True, seen
    assert seen["failed compile"] != "did not fail", seen
    assert seen["after the failed compile"] is True, seen
