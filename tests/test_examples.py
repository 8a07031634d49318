"""Every config in examples/configs runs with the README's example (examples/train_gpt.py) on 2 CPU ranks: a
shipped config that stops at once on the command shipped beside it is a defect (zeropp.yaml's hpZ partition of 8
did, at 2 ranks)."""
import glob
import importlib.util
import os

from tests.harness import run_world

CONFIGS = sorted(glob.glob("examples/configs/*.yaml"))


def run_each_config(rank: int, world: int, configs: list) -> dict:
    """examples/train_gpt.py's main, one short run per config, in one process group."""
    from tests.workers import reset_dynamo
    spec = importlib.util.spec_from_file_location("train_gpt", "examples/train_gpt.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = {}
    for path in configs:
        reset_dynamo()
        losses[path] = example.main(["--config", path, "--steps", "2", "--layers", "2", "--batch", "2",
                                     "--block", "32"])
    return losses


def test_every_example_config_runs_on_two_ranks():
    assert len(CONFIGS) >= 9 and "examples/configs/zeropp.yaml" in CONFIGS
    for losses in run_world(2, run_each_config, CONFIGS, timeout=900):
        assert set(losses) == set(CONFIGS)
        for path, values in losses.items():
            assert len(values) == 2 and all(v == v and 0 < v < 10 for v in values), (os.path.basename(path), values)
