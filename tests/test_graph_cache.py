"""A second launch loads each graph's transformed forward and backward from AOTAutograd's cache
(compiler/codegen/graph_cache.py) and trains exactly as the first, which compiled them."""
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tests import workers
from tests.harness import run_world
from tests.test_fake_values import _describe, _model
from zcompile.compiler.codegen import graph_cache

ZEROPP = {"stage": 3, "backend": "eager", "quantize_weights": {}, "quantize_gradients": {"block": 64}}
CASES = [
    # first: a launch's first job has the same process group names in every launch (the key holds them), so only
    # the config tells the changed one below apart
    ("gpt", {"stage": 2, "backend": "eager"}),
    ("gpt", {"stage": 3, "backend": "inductor"}),
    # blocks kept as regions through AOTAutograd (their partition settings name the job: not stored)
    ("gpt", {"stage": 3, "backend": "eager", "keep_block_regions": True, "bucket_mb": 0.01}),
    # whole parameters, host optimizer state and activations: decisions outside the graphs
    ("gpt", {"stage": 3, "backend": "eager", "persist_threshold": 4096,
             "offload": {"optimizer": "cpu", "activations": "cpu", "activation_min_bytes": 0}}),
    ("gpt", {"stage": 3, "backend": "eager", "memory_budget": "1GiB", "offload": {"optimizer": "auto"}}),
    ("gpt", dict(ZEROPP, ranks_per_node=2, hpz_partition_size=2)),  # hpZ: secondary partitions
    ("gpt", {"stage": 1, "backend": "eager"}),
    # guarded on the pytree registry, which storing or loading a graph must not touch (else: a recompile)
    ("llama", {"stage": 3, "backend": "eager"}),
]
STEPS = 3


def _same(a: dict, b: dict) -> bool:
    return (a["losses"] == b["losses"] and a["eval"] == b["eval"] and a["decisions"] == b["decisions"]
            and all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"]))


def test_a_second_launch_loads_the_graphs_and_trains_bit_identically(tmp_path):
    """Launch 1 compiles and stores every graph (forward+backward and the evaluation's inference graph); launch 2,
    on the same cache, loads them all (no trace, no passes) and gives the same losses, parameters and decisions bit
    for bit. A rank that finds the cache while the other does not (rank 1 on an empty directory) meets the other at
    the same collectives: same results. A changed config or `compile_cache: false` does not load."""
    dirs = [str(tmp_path / "rank0"), str(tmp_path / "rank1")]
    first = run_world(2, workers.cached_launch, CASES, STEPS, dirs, timeout=900)
    second = run_world(2, workers.cached_launch, CASES, STEPS, dirs, timeout=900)
    for rank in range(2):
        for case, a, b in zip(CASES, first[rank], second[rank]):
            graphs = a["graphs"]  # the training and the inference graph: nothing recompiled
            assert graphs == b["graphs"] == 2, (case, a["graphs"], b["graphs"])
            assert a["aot"].get("autograd_cache_hit", 0) == 0 and a["aot"].get("autograd_cache_saved", 0) == graphs, \
                (case, a["aot"])
            assert b["aot"].get("autograd_cache_hit", 0) == graphs and b["aot"].get("autograd_cache_miss", 0) == 0, \
                (case, b["aot"])
            assert _same(a, b), case
            assert a["loss-only"] == b["loss-only"] == [(False, False), (True, True)], (case, b["loss-only"])
    # rank 0 loads, rank 1 compiles: the schedule check and the subgroups meet in the same order. Rank 1's directory
    # holds no graph, only the C++ kernels its first launch built (inductor lowers again; g++ is not what is tested)
    mixed_cases = CASES[:2] + [("gpt", dict(ZEROPP, ranks_per_node=1))]  # qgZ over 2 nodes: subgroups
    fresh = _kernels_only(dirs[1], tmp_path / "fresh")
    mixed = run_world(2, workers.cached_launch, mixed_cases, STEPS, [dirs[0], fresh], timeout=900)
    for rank in range(2):
        for case in range(2):
            aot = mixed[rank][case]["aot"]
            assert aot.get("autograd_cache_hit", 0) == (2 if rank == 0 else 0), (rank, case, aot)
            assert rank == 0 or aot.get("autograd_cache_miss", 0) == 2, (case, aot)
            assert _same(mixed[rank][case], first[rank][case]), (rank, case)
    # a changed config (other buckets) and `compile_cache: false` (under inductor) load nothing
    changed = [("gpt", dict(CASES[0][1], bucket_mb=0.01)), ("gpt", dict(CASES[1][1], compile_cache=False))]
    for out in run_world(2, workers.cached_launch, changed, STEPS, dirs, timeout=900):
        assert [o["aot"].get("autograd_cache_hit", 0) for o in out] == [0, 0], [o["aot"] for o in out]
        assert out[0]["aot"].get("autograd_cache_miss", 0) == 2, out[0]["aot"]
        assert out[1]["aot"].get("autograd_cache_saved", 0) == 0


def _kernels_only(cache: str, to) -> str:
    """A copy of an inductor cache directory without its graphs (AOTAutograd's and inductor's FX graph entries)."""
    import shutil
    shutil.copytree(cache, to, ignore=lambda folder, names: [n for n in names if folder == cache and n in
                                                              ("aotautograd", "fxgraph", "locks")])
    return str(to)


def test_an_entry_that_does_not_load_is_compiled_again_or_stops_every_rank(tmp_path):
    """A damaged entry on one rank: read before the job communicated (AOTAutograd's file, or zcompile's forward
    record), the rank compiles the graph instead and meets the others, which loaded theirs, at the same schedule
    check (same losses); read after its forward was loaded and announced (the backward's record), it cannot compile
    any more without the others: it raises, naming the cache, and the others raise PeerFailed with its reason at
    their next check, not after collective_timeout_s. A schedule mismatch met while loading is raised as such."""
    import glob
    import os
    case = [("gpt", {"stage": 3, "backend": "eager", "collective_timeout_s": 600})]
    dirs = [str(tmp_path / "rank0"), str(tmp_path / "rank1")]
    first = run_world(2, workers.cached_launch, case, STEPS, dirs, timeout=900)
    for path in glob.glob(os.path.join(dirs[1], "aotautograd", "**"), recursive=True):
        if os.path.isfile(path):
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
    for fail_at in (None, 1):  # AOTAutograd's file truncated; then zcompile's forward record unreadable
        out = run_world(2, workers.cached_launch_failing, case, STEPS, dirs, fail_at, timeout=900)
        assert [o[0] for o in out] == ["ok", "ok"], out
        hits = [o[1][0]["aot"].get("autograd_cache_hit", 0) for o in out]
        assert hits == [2, 1 if fail_at else 0], [o[1][0]["aot"] for o in out]  # rank 1: the inference graph's
        for rank in range(2):
            assert out[rank][1][0]["losses"] == first[rank][0]["losses"]
        assert (len(out[1][2]) == 1 and "did not load from the compile cache" in out[1][2][0]) == bool(fail_at), out
    (s0, t0, m0), (s1, t1, m1) = run_world(2, workers.cached_launch_failing, case, STEPS, dirs, 2, timeout=900)
    assert (s0, t0, s1, t1) == ("raised", "PeerFailed", "raised", "ZCompileError"), (m0, m1)
    assert "rank 1 failed: graph" in m0 and "backward did not load from the compile cache (EOFError" in m0, m0
    assert "backward did not load from the compile cache" in m1 and dirs[1] in m1, m1
    # rank 0 loads its entry, rank 1 compiles another schedule (other code): both raise ScheduleMismatch at the
    # schedule exchange (rank 0 inside its load, where AOTAutograd took errors for a cache bypass and compiled again)
    fresh = [dirs[0], str(tmp_path / "fresh")]
    out = run_world(2, workers.cached_launch_failing, case, STEPS, fresh, "schedule", timeout=900)
    assert [o[:2] for o in out] == [("raised", "ScheduleMismatch")] * 2, out
    assert "rank 0: compiled graph" in out[0][2] and "rank 1: compiled graph" in out[0][2], out[0][2]


def test_a_stored_graph_loads_with_its_fake_values_and_their_storage_sharing():
    """Each node's fake value comes back with its layout, dtype, storage size and the storages it shares with
    other nodes' (views, split outputs, in-place results, a view as another dtype, resize_, t_): what liveness
    and the region compiles read. Not whether it was a view (nothing reads that)."""
    gm = make_fx(_model, tracing_mode="fake")(torch.randn(8, 8), torch.randn(8, 8))
    mode = torch._guards.detect_fake_mode([n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")])
    loaded = graph_cache._loads(graph_cache._dumps(gm), mode)

    def described(g):
        return [(name, kind, [r[:7] + r[8:] if isinstance(r, tuple) else r for r in row])
                for name, kind, row in _describe(g)]
    assert described(loaded) == described(gm)
    assert len({v.untyped_storage()._cdata for n in loaded.graph.nodes
                for v in [n.meta.get("val")] if isinstance(v, torch.Tensor)}) < len(loaded.graph.nodes) - 20


def test_the_key_covers_all_of_zcompiles_code():
    """The cache key hashes the whole package (a changed kernel or runtime module must not load graphs an older one
    produced), wherever graph_cache.py sits in it: it hashed only compiler/ once the file moved down a folder."""
    import pathlib

    import zcompile
    assert pathlib.Path(graph_cache.package_root()) == pathlib.Path(zcompile.__file__).resolve().parent
