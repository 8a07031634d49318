"""The memory planner: selective persistence, planned vs measured peaks, and the `zcompile plan` CLI."""
import os
import re

import pytest

from tests import workers
from tests.harness import run_world
from tests.test_parity import TOL, max_diff


def _forward_gathers(dump_dir) -> int:
    sched = open(os.path.join(dump_dir, "rank0", "graph0_schedule.txt")).read()
    return int(re.search(r"== forward: (\d+) collectives", sched).group(1))


def test_small_params_persist_below_threshold(tmp_path):
    ref_params, _ = workers.reference("gpt", 2, steps=5)
    config = {"stage": 3, "backend": "eager", "bucket_mb": 0, "persist_threshold": "1KiB", "dump": str(tmp_path)}
    results = run_world(2, workers.train_and_report, "gpt", config)
    for res in results:
        assert max_diff(res["params"], ref_params) < TOL
        # layer norm weights and biases (64 floats) stay whole; matrices (>= 16 KiB) are sharded
        assert res["persistent"] and all(len(s) == 1 and s[0] * 4 <= 1024 for s in res["persistent"])
        report = res["report"]
        assert report.total == pytest.approx(report.expected, rel=0.01), str(report)
    n_persistent = len(results[0]["persistent"])
    plain = tmp_path / "plain"
    run_world(2, workers.parity_with_config, "gpt", dict(config, persist_threshold=0, dump=str(plain)), steps=1)
    assert _forward_gathers(tmp_path) == _forward_gathers(plain) - n_persistent
    fw = next(f for f in os.listdir(tmp_path / "rank0") if "_forward_" in f and f.endswith("_shard_params.py"))
    assert f"persist: kept {n_persistent} param(s) whole" in open(tmp_path / "rank0" / fw).read()


def test_memory_budget_decides_persistence(tmp_path):
    """A roomy budget keeps every parameter whole (no forward gathers); a tight one keeps none."""
    roomy = {"stage": 3, "backend": "eager", "memory_budget": "4GiB", "dump": str(tmp_path / "roomy")}
    res = run_world(2, workers.train_and_report, "gpt", roomy, steps=1)
    assert len(res[0]["persistent"]) == 26 and _forward_gathers(tmp_path / "roomy") == 0
    tight = dict(roomy, memory_budget="1KiB", dump=str(tmp_path / "tight"))
    res = run_world(2, workers.train_and_report, "gpt", tight, steps=1)
    assert res[0]["persistent"] == [] and _forward_gathers(tmp_path / "tight") > 0


@pytest.mark.parametrize("stage, bucket_mb", [(2, 25), (3, 25), (3, 0.02)])
def test_planned_peak_matches_measured(stage, bucket_mb):
    config = {"stage": stage, "backend": "eager", "bucket_mb": bucket_mb}
    runs = run_world(2, workers.planned_vs_measured, "gpt", config)[0]
    assert {r.kind for r in runs} == {"forward", "backward"}
    for r in runs:
        err = abs(r.planned_peak - r.measured_peak) / r.measured_peak
        assert err < 0.05, f"{r.kind}: planned {r.planned_peak} B, measured {r.measured_peak} B ({err:.1%} off)"
