"""The local launcher (zcompile/tools/launch.py): workers fork from a server that imported torch once, yet each
world sees the caller's environment and working directory as they are when it starts, as spawned processes would."""
import os

from tests.harness import WorkerFailed, run_world


def _where(rank, world):
    return os.environ.get("ZC_LAUNCH_PROBE"), os.environ.get("ZC_LAUNCH_GONE"), os.getcwd(), os.environ["RANK"]


def _fail_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("rank 1 fails")
    return rank


def test_workers_see_the_callers_environment_and_directory_now(tmp_path, monkeypatch):
    monkeypatch.setenv("ZC_LAUNCH_GONE", "set before the first world")
    first = run_world(2, _where)  # starts the fork server with this environment
    assert [r[1] for r in first] == ["set before the first world"] * 2
    monkeypatch.delenv("ZC_LAUNCH_GONE")
    monkeypatch.setenv("ZC_LAUNCH_PROBE", "set later")
    monkeypatch.chdir(tmp_path)
    later = run_world(2, _where, env={"ZC_LAUNCH_PROBE": "given to run_world"})
    assert later == [("given to run_world", None, str(tmp_path), str(r)) for r in range(2)]


def test_a_failing_rank_is_reported_with_its_traceback():
    try:
        run_world(2, _fail_on_rank_1)
    except WorkerFailed as e:
        assert list(e.errors) == [1] and "ValueError: rank 1 fails" in e.errors[1]
    else:
        raise AssertionError("run_world returned although rank 1 failed")


def _inductor_fx_graph_cache(rank, world):
    from torch._inductor import config
    return config.fx_graph_cache, os.environ.get("TORCHINDUCTOR_FX_GRAPH_CACHE")


def test_a_variable_torch_reads_at_import_is_not_ignored(monkeypatch):
    """Inductor reads TORCHINDUCTOR_FX_GRAPH_CACHE when its config is imported, which the fork server has done: such
    a variable, given to run_world or set by the caller, makes the world start in fresh interpreters instead."""
    monkeypatch.delenv("TORCHINDUCTOR_FX_GRAPH_CACHE", raising=False)
    assert run_world(1, _inductor_fx_graph_cache) == [(True, None)]  # the fork server is up
    assert run_world(1, _inductor_fx_graph_cache, env={"TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}) == [(False, "0")]
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    assert run_world(2, _inductor_fx_graph_cache) == [(False, "0")] * 2
    monkeypatch.delenv("TORCHINDUCTOR_FX_GRAPH_CACHE")
    assert run_world(1, _inductor_fx_graph_cache) == [(True, None)]


def _preloaded(rank, world):
    import sys
    return "tests.worker_preload" in sys.modules and "transformers" in sys.modules


def test_the_tests_workers_start_with_the_first_compiles_imports_done():
    """tests/conftest.py names tests/worker_preload.py for the fork server: each worker starts with inductor's code
    generators and transformers imported (~4 s of every world's start on 2 cores)."""
    assert run_world(2, _preloaded) == [True, True]
