"""Sharded checkpoints resume bit for bit; the consolidated export loads into a plain model."""
import pytest
import torch

from tests import workers
from tests.harness import run_world


@pytest.mark.parametrize("stage", [1, 3])
def test_resume_is_bit_identical(tmp_path, stage):
    results = run_world(2, workers.checkpoint_resume, "gpt", stage, str(tmp_path / "ckpt"))
    for res in results:
        assert res["resumed"] == res["continued"]  # exact float equality of the losses
        for k in res["full"]:
            assert torch.equal(res["full"][k], res["resumed_full"][k]), k
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == ["rank0-of-2.pt", "rank1-of-2.pt"]


@pytest.mark.parametrize("kind", ["cpu", "nvme", "tiled"])
def test_resume_with_offload_or_tiling_is_bit_identical(tmp_path, kind):
    """Shards on the host or in files, the optimizer's master and moments off the device (CPUAdam's moments in
    files), or row-sharded tiled weights: save, continue, and resume into a fresh model loaded before its first
    forward (load_checkpoint(config=...)) give the same losses and parameters."""
    extra = {"cpu": {"offload": {"optimizer": "cpu", "params": "cpu", "activations": "cpu"}},
             "nvme": {"offload": {"optimizer": "nvme", "params": "nvme", "nvme_path": str(tmp_path / "nvme")}},
             "tiled": {"tiling": {"min_bytes": "32KiB", "tiles": 2}}}[kind]
    optimizer = "cpu_adam" if kind == "nvme" else "adamw"
    for res in run_world(2, workers.checkpoint_resume, "gpt", 3, str(tmp_path / "ckpt"), extra, optimizer):
        assert res["resumed"] == res["continued"]
        for k in res["full"]:
            assert torch.equal(res["full"][k], res["resumed_full"][k]), k


def test_full_state_dict_loads_into_uncompiled_model(tmp_path):
    results = run_world(2, workers.checkpoint_resume, "gpt", 3, str(tmp_path / "ckpt"))
    plain = workers.build_model("gpt", seed=7)
    plain.load_state_dict(results[0]["full"])
    assert plain.lm_head.weight is plain.wte.weight
    x = workers.global_batch(0, 1)
    assert torch.isfinite(workers.loss_of(plain, "gpt", x))


def test_wrong_world_size_is_a_clear_error(tmp_path):
    from tests.harness import WorkerFailed
    run_world(2, workers.checkpoint_resume, "gpt", 3, str(tmp_path / "ckpt"))
    with pytest.raises(WorkerFailed) as e:
        run_world(1, workers.load_only, "gpt", 3, str(tmp_path / "ckpt"))
    assert "world size" in e.value.errors[0]
