"""Graph dumps show every collective with its bytes; ranks with different schedules fail instead of hanging."""
import os
import re

import pytest

from tests import workers
from tests.harness import WorkerFailed, run_world


def test_dumps_show_collectives_per_rank_and_pass(tmp_path):
    d = str(tmp_path / "dumps")
    files = run_world(2, workers.dump_graphs, d, {"stage": 3, "backend": "eager"})
    for rank, names in enumerate(files):
        assert any("_forward_" in n and n.endswith("_shard_params.py") for n in names), names
        assert any("_backward_" in n and n.endswith("_reduce_grads.py") for n in names), names
        fw = open(os.path.join(d, f"rank{rank}", next(n for n in names if "_forward_" in n and n.endswith("_shard_params.py")))).read()
        bw = open(os.path.join(d, f"rank{rank}", next(n for n in names if "_backward_" in n and n.endswith("_reduce_grads.py")))).read()
        # each all-gather is annotated with its bytes and group, and waited on
        assert re.search(r"all_gather_into_tensor.*# zc: all_gather [\d.]+ (B|KiB|MiB) group=", fw)
        assert "wait_tensor" in fw
        assert re.search(r"# zc: all_gather .* re-gather", bw)  # backward re-gathers what forward released
        assert re.search(r"reduce_scatter_tensor.*# zc: reduce_scatter", bw)
        sched = open(os.path.join(d, f"rank{rank}", "graph0_schedule.txt")).read()
        assert "== forward:" in sched and "== backward:" in sched


def test_stage2_dump_has_no_forward_gather(tmp_path):
    d = str(tmp_path / "dumps")
    run_world(2, workers.dump_graphs, d, {"stage": 2, "backend": "eager"})
    sched = open(os.path.join(d, "rank0", "graph0_schedule.txt")).read()
    assert "== forward: 0 collectives" in sched
    assert "reduce_scatter" in sched


def test_mismatched_schedules_fail_on_every_rank():
    with pytest.raises(WorkerFailed) as e:
        run_world(2, workers.mismatched_models, timeout=300)
    assert set(e.value.errors) == {0, 1}
    for text in e.value.errors.values():
        assert "ScheduleMismatch" in text and "different graphs or collective schedules" in text
