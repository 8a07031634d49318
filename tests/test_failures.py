"""Rank disagreement, faults and bad values fail fast, clearly, on every rank (or are handled as configured)."""
import errno
import multiprocessing as mp
import os
import socket

import pytest
import torch

import zcompile
from tests import fault_workers
from tests.harness import WorkerFailed, run_world
from zcompile.runtime import nvme_files, offload_engine


def test_ranks_taking_different_branches_fail_before_any_update():
    for out in run_world(2, fault_workers.branch_divergence, timeout=300):
        for case in ("compile", "cached"):
            assert out[case].startswith("ScheduleMismatch: "), out[case]
            assert "different graphs or collective schedules" in out[case]
            assert "rank 0:" in out[case] and "rank 1:" in out[case]
        assert out["unchanged"] and out["cached_unchanged"]


def test_one_rank_recompiling_is_a_schedule_mismatch_on_every_rank():
    results = run_world(2, fault_workers.recompile_on_one_rank, timeout=480)
    for rank, out in enumerate(results):
        for case, text in out.items():
            assert text.startswith("ScheduleMismatch: "), (rank, case, text)
        # what each rank was doing is named: rank 1 compiles a new graph for its inputs
        assert "rank 1: compiling a new graph for inputs 2x8 int64" in out["seq_len"], out["seq_len"]
        assert "rank 0: running the forward of graph" in out["seq_len"], out["seq_len"]


def test_frozen_peer_fails_within_collective_timeout(tmp_path):
    result = tmp_path / "rank0.txt"
    with pytest.raises(WorkerFailed) as e:
        run_world(2, fault_workers.frozen_peer, str(result), timeout=120)
    assert set(e.value.errors) == {1}, e.value  # rank 0 returned; rank 1 was stopped, then killed by rank 0
    elapsed, text = result.read_text().split("\n", 1)
    assert text.startswith("PeerTimeout: ") and "collective_timeout_s=4s" in text, text
    assert float(elapsed) < 30, elapsed


def test_peer_with_config_error_does_not_stall_the_others():
    out = run_world(2, fault_workers.peer_with_config_error, timeout=120)
    elapsed0, text0 = out[0].split("\n", 1)
    assert text0.startswith("PeerTimeout: ") and float(elapsed0) < 30, out[0]
    assert out[1].split("\n", 1)[1].startswith("ConfigError: ") and "'stage'" in out[1]


def test_config_is_read_once_per_compiled_model(tmp_path):
    (out,) = run_world(1, fault_workers.frozen_config_file, str(tmp_path / "zero.yaml"), timeout=300)
    assert out["first"] == out["edited"] == out["deleted"] == torch.float32
    assert not out["dumped"]  # the edited file (bf16, dumps) was not read again
    assert out["graphs"] >= 3  # the edited and deleted steps did recompile


def test_bf16_with_float_inputs_and_batchnorm():
    fp32 = run_world(2, fault_workers.bn_train, {"stage": 3, "backend": "eager"}, timeout=300)
    bf16 = run_world(2, fault_workers.bn_train, {"stage": 3, "backend": "eager",
                                                 "mixed_precision": {"param_dtype": "bf16"}}, timeout=300)
    for a, b in zip(fp32, bf16):
        assert b["outcomes"] == ["ok"] * 6
        assert b["losses"] == pytest.approx(a["losses"], rel=5e-2, abs=1e-2)
        assert b["losses"][-1] < b["losses"][0]
        # BatchNorm's running statistics: buffers stay fp32 and the bf16 forward updates them, as the fp32 one does
        # (measured: within 0.016 of fp32's after six steps, having moved 0.11-0.13 (mean) and 0.40 (var) from their
        # initial 0 and 1)
        assert set(b["buffers"]) == {"net.1.running_mean", "net.1.running_var", "net.1.num_batches_tracked"}
        for name, value in a["buffers"].items():
            torch.testing.assert_close(b["buffers"][name], value, rtol=0, atol=3e-2, msg=name)
        assert (b["buffers"]["net.1.running_mean"]).abs().max() > 0.06
        assert (b["buffers"]["net.1.running_var"] - 1).abs().max() > 0.2


@pytest.mark.parametrize("stage", [1, 3])
def test_nan_on_one_rank_stops_every_rank(stage):
    out = run_world(2, fault_workers.bn_train, {"stage": stage, "backend": "eager", "nonfinite": "error"},
                    nan_at=2, timeout=300)
    for o in out:
        assert o["outcomes"][:2] == ["ok", "ok"]
        assert o["outcomes"][2].startswith("NonFiniteGradients: ") and "optimizer step 3" in o["outcomes"][2]
        assert "Ranks whose loss was NaN/inf: [1]" in o["outcomes"][2], o["outcomes"][2]
        for k, v in o["params"].items():  # the failed step changed nothing
            assert torch.equal(v, o["before_nan"][k].float()), k


def test_nan_skip_keeps_training_on_every_rank():
    out = run_world(2, fault_workers.bn_train, {"stage": 3, "backend": "eager", "nonfinite": "skip"},
                    nan_at=2, timeout=300)
    for o in out:
        assert o["outcomes"] == ["ok"] * 6
        assert any("step skipped on every rank" in w and "[1]" in w for w in o["warnings"]), o["warnings"]
        assert all(torch.isfinite(v).all() for v in o["params"].values())
    assert all(torch.equal(out[0]["params"][k], out[1]["params"][k]) for k in out[0]["params"])
    # BatchNorm statistics are per rank and updated by the forward, before any check: rank 1's took the NaN
    assert torch.isfinite(out[0]["buffers"]["net.1.running_mean"]).all()
    assert torch.isnan(out[1]["buffers"]["net.1.running_mean"]).any()


def test_nan_without_the_check_spreads_to_every_rank():
    """The default (off) is what the docs say: one rank's NaN reaches every rank's parameters."""
    out = run_world(2, fault_workers.bn_train, {"stage": 3, "backend": "eager"}, nan_at=2, timeout=300)
    for o in out:
        assert torch.isnan(o["params"]["net.0.weight"]).all()


def _nvme_job(path: str, seed: int, barrier, port: int, queue) -> None:
    """A 1-rank job on NVMe offload; `barrier` makes two such jobs step in lockstep (their writes interleave)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.set_num_threads(1)
    zcompile.init_distributed("gloo")
    from tests import workers
    torch.manual_seed(seed)
    config = {"stage": 3, "backend": "eager", "offload": {"optimizer": "nvme", "params": "nvme", "nvme_path": path}}
    model = torch.compile(workers.build_model("gpt", seed=seed), backend="zero", options={"config": config})
    opt = zcompile.CPUAdam(model.parameters(), lr=1e-3)
    losses = []
    for step in range(3):
        if barrier is not None:
            barrier.wait(timeout=120)
        x = workers.global_batch(step + 10 * seed, 1)
        loss = workers.loss_of(model, "gpt", x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    queue.put((seed, losses, sorted(os.listdir(path))))
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_jobs(path: str, seeds, together: bool) -> dict:
    ctx = mp.get_context("spawn")
    queue, barrier = ctx.Queue(), ctx.Barrier(len(seeds)) if together else None
    procs = [ctx.Process(target=_nvme_job, args=(path, s, barrier, _free_port(), queue)) for s in seeds]
    results = {}
    for p in procs:
        p.start()
        if not together:
            seed, losses, listing = queue.get(timeout=300)
            results[seed] = (losses, listing)
            p.join(60)
    if together:
        for _ in procs:
            seed, losses, listing = queue.get(timeout=300)
            results[seed] = (losses, listing)
        for p in procs:
            p.join(60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return results


def test_two_jobs_on_one_nvme_path_keep_their_own_files(tmp_path):
    solo = _run_jobs(str(tmp_path / "solo"), (1, 2), together=False)
    shared = _run_jobs(str(tmp_path / "shared"), (1, 2), together=True)
    for seed in (1, 2):
        assert shared[seed][0] == solo[seed][0]  # bit-identical to running alone
        assert len(shared[seed][1]) >= 1 and all(n.startswith("zcompile-") for n in shared[seed][1])
    assert os.listdir(tmp_path / "shared") == []  # both removed their directories at exit


def test_disk_full_names_path_and_tier_and_leaves_no_tmp(tmp_path, monkeypatch):
    d = offload_engine.NvmeDir(str(tmp_path), rank=0)
    d.write("param0", torch.ones(1000))

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(nvme_files.OffloadFileError) as e:
        d.write("param0", torch.zeros(1000))
    msg = str(e.value)
    assert "offload.params" in msg and "no space left" in msg and d.file("param0") in msg and str(tmp_path) in msg
    with pytest.raises(nvme_files.OffloadFileError, match="offload.optimizer"):
        d.write("moments3", torch.zeros(1000))
    monkeypatch.undo()
    assert sorted(os.listdir(d.path)) == ["param0.zct"]  # no .tmp left behind
    assert torch.equal(d.read("param0", 1000, torch.float32), torch.ones(1000))  # the old file is intact
