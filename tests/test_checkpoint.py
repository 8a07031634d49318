"""zcompile.save_checkpoint / load_checkpoint: resume bit for bit (RNG included), load at another world size,
survive a killed save, name a damaged or foreign file; the consolidated export loads into a plain model."""
import os

import pytest
import torch

from tests import workers
from tests.harness import WorkerFailed, run_world


@pytest.mark.parametrize("name,stage", [("gpt", 1), ("gpt_dropout", 3)])
def test_resume_is_bit_identical(tmp_path, name, stage):
    """Through torch.distributed.checkpoint; the dropout model resumes its RNG stream too."""
    results = run_world(2, workers.checkpoint_resume, name, stage, str(tmp_path / "ckpt"))
    for res in results:
        assert res["kind"] == "dcp"
        assert res["resumed"] == res["continued"]  # exact float equality of the losses
        assert res["extra_rng_restored"]  # a host generator's state in `extra` restores
        for k in res["full"]:
            assert torch.equal(res["full"][k], res["resumed_full"][k]), k
    files = sorted(os.listdir(tmp_path / "ckpt"))
    assert {"zcompile.json", ".metadata", "rank0-of-2.pt", "rank1-of-2.pt"} <= set(files), files
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no .partial or .old left
    if stage == 3:
        plain = workers.build_model(name, seed=7)  # the consolidated export loads into the plain model
        plain.load_state_dict(results[0]["full"])
        assert plain.lm_head.weight is plain.wte.weight
        # ... and the checkpoint at another world size (one rank holds every row), without compiling
        (one,) = run_world(1, workers.load_plain, str(tmp_path / "ckpt"))
        assert one["extra"]["step"] == 3 and one["extra"]["data_rng"].device.type == "cpu"
        for k, v in results[0]["saved"].items():
            assert torch.equal(one["params"][k], v), k


@pytest.mark.parametrize("kind", ["cpu", "nvme", "tiled"])
def test_resume_with_offload_or_tiling_is_bit_identical(tmp_path, kind):
    """Shards on the host or in files, the optimizer's master and moments off the device (CPUAdam's moments in
    files), or row-sharded tiled weights: save, continue, and resume into a fresh model loaded before its first
    forward (load_checkpoint(config=...)) give the same losses and parameters. Tiled and NVMe parameters are not
    DTensors: their checkpoint is one file of shards per rank, which names the world size it needs."""
    extra = {"cpu": {"offload": {"optimizer": "cpu", "params": "cpu", "activations": "cpu"}},
             "nvme": {"offload": {"optimizer": "nvme", "params": "nvme", "nvme_path": str(tmp_path / "nvme")}},
             "tiled": {"tiling": {"min_bytes": "32KiB", "tiles": 2}}}[kind]
    optimizer = "cpu_adam" if kind == "nvme" else "adamw"
    for res in run_world(2, workers.checkpoint_resume, "gpt", 3, str(tmp_path / "ckpt"), extra, optimizer):
        assert res["kind"] == ("dcp" if kind == "cpu" else "sharded")
        assert res["resumed"] == res["continued"]
        for k in res["full"]:
            assert torch.equal(res["full"][k], res["resumed_full"][k]), k
    if kind == "tiled":
        with pytest.raises(WorkerFailed) as e:
            run_world(1, workers.load_only, "gpt", 3, str(tmp_path / "ckpt"), extra)
        assert "world size" in e.value.errors[0] and "CheckpointError" in e.value.errors[0]


@pytest.mark.parametrize("where", ["payload", "publish"])
def test_a_killed_save_leaves_the_previous_checkpoint(tmp_path, where):
    """Rank 0 is SIGKILLed inside the second save (its payload written; or the old checkpoint already moved aside):
    the step-1 checkpoint loads whole, never a mix of steps, and the next save cleans up."""
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(WorkerFailed):
        run_world(2, workers.killed_save, ckpt, where)
    assert os.path.isdir(ckpt + ".partial")
    expected = torch.load(ckpt + "-expected.pt")
    for res in run_world(2, workers.load_plain, ckpt, True):
        assert res["extra"] == {"step": 1} and res["steps"] == [1]
        for k, v in expected.items():
            assert torch.equal(res["params"][k], v), k
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt-expected.pt"]


def test_damaged_or_foreign_checkpoints_are_errors_naming_the_file(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_world(2, workers.save_plain, str(ckpt))
    payload = sorted(ckpt.glob("*.distcp"))[0]
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern in the middle: DCP itself would load it silently
    payload.write_bytes(bytes(data))
    with pytest.raises(WorkerFailed) as e:
        run_world(2, workers.load_plain, str(ckpt))
    assert len(e.value.errors) == 2
    for err in e.value.errors.values():
        assert "CheckpointError" in err and f"{payload} is damaged" in err

    (ckpt / "zcompile.json").write_text("{not json")
    with pytest.raises(WorkerFailed) as e:
        run_world(1, workers.load_plain, str(ckpt))
    assert "zcompile.json is not a readable zcompile manifest" in e.value.errors[0]

    (ckpt / "zcompile.json").unlink()
    with pytest.raises(WorkerFailed) as e:
        run_world(1, workers.load_plain, str(ckpt))
    assert f"{ckpt} is not a zcompile checkpoint" in e.value.errors[0]


def test_rank_files_load_host_tensors_on_the_host():
    """load_checkpoint's map_location: tensors saved on the host (RNG states, a generator's state in `extra`) stay
    there, as torch.load gives them; ones saved on any accelerator come to this rank's device (test_gpu runs it)."""
    from zcompile.runtime.checkpoint import _HostStaysHost
    where = _HostStaysHost(torch.device("cuda", 1))
    assert where.get("cpu") == "cpu" and str(where.get(torch.device("cpu"))) == "cpu"
    assert where.get("cuda:0") == "cuda:1" and where.get(torch.device("cuda", 3)) == "cuda:1"
    assert _HostStaysHost(torch.device("cpu")).get("cuda:0") == "cpu"  # a GPU checkpoint loads on a host
