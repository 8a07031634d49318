"""A bad config fails fast, before anything is traced or communicated, with a message naming the key and file."""
import pytest
import torch

import zcompile
from zcompile import config


def write(tmp_path, text):
    path = tmp_path / "zero.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, words", [
    ("stage: 3\nstgae: 2\n", ["unknown key 'stgae'"]),
    ("stage: three\n", ["'stage'", "int", "'three'"]),
    ("stage: 4\n", ["'stage'", "0, 1, 2 or 3"]),
    ("stage: true\n", ["'stage'"]),
    ("backend: tvm\n", ["'backend'", "'tvm'"]),
    ("mixed_precision: {param_dtype: fp16}\n", ["mixed_precision.param_dtype", "fp16", "bf16"]),
    ("mixed_precision: {param_dtype: bf16, reduce: bf16}\n", ["unknown key 'mixed_precision.reduce'"]),
    ("mixed_precision: {reduce_dtype: bf16}\n", ["mixed_precision.reduce_dtype", "fp32"]),
    ("mixed_precision: bf16\n", ["'mixed_precision' must be a mapping"]),
    ("collective_timeout_s: -1\n", ["collective_timeout_s", "positive"]),
    ("stage: 3\npipeline: [mixed_precision, reduce_grads]\n", ["pipeline", "shard_params"]),
    ("pipeline: [shard_params, tag_param_recompute, reduce_grads]\n", ["pipeline", "phase order"]),
    ("pipeline: [reduce_grads, magic]\n", ["pipeline", "unknown pass", "magic"]),
    ("stage: [3\n", ["not valid YAML"]),
    ("stage: 3\nbucket_mb: 1\nstage: 2\n", ["key 'stage' is given twice", "lines 1 and 3"]),
    ("offload: {optimizer: cpu, optimizer: nvme}\nstage: 3\n", ["key 'optimizer' is given twice"]),
    ("bucket_mb: .nan\n", ["'bucket_mb'", "finite"]),
    ("collective_timeout_s: .inf\n", ["'collective_timeout_s'", "finite"]),
    ("collective_timeout_s: .nan\n", ["'collective_timeout_s'", "finite"]),
    ("persist_threshold: -64KiB\n", ["'persist_threshold'", "non-negative"]),
    ("memory_budget: -4GiB\n", ["'memory_budget'", "non-negative"]),
    ("memory_budget: infGiB\n", ["'memory_budget'", "finite"]),
    ("memory_budget: .inf\n", ["'memory_budget'", "finite"]),
    ("stage: 3\noffload: {activations: cpu, activation_min_bytes: 1e400MiB}\n",
     ["'offload.activation_min_bytes'", "finite"]),
    ("stage: 3\ntiling: {min_bytes: 1e30GiB}\n", ["'tiling.min_bytes'", "8 EiB"]),
    ("nonfinite: ignore\n", ["'nonfinite'", "'skip'"]),
])
def test_bad_config_names_key_and_file(tmp_path, text, words):
    path = write(tmp_path, text)
    with pytest.raises(config.ConfigError) as e:
        config.load(path)
    msg = str(e.value)
    assert path in msg
    for w in words:
        assert w in msg


@pytest.mark.parametrize("key", ["dump", "nvme_path", "env"])
def test_a_directory_that_cannot_be_made_or_written_names_key_path_and_reason(tmp_path, key, monkeypatch):
    """dump, offload.nvme_path (and ZCOMPILE_DUMP_DIR) are checked when the config is read, as every other key;
    a directory that can be made is made, and takes a file."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    bad = str(blocker / "dumps")  # under a regular file: cannot be created
    text = {"dump": f"dump: {bad}\n", "env": "stage: 3\n",
            "nvme_path": f"stage: 3\noffload: {{optimizer: nvme, nvme_path: {bad}}}\n"}[key]
    if key == "env":
        monkeypatch.setenv("ZCOMPILE_DUMP_DIR", bad)
    path = write(tmp_path, text)
    with pytest.raises(config.ConfigError) as e:
        config.load(path)
    named = {"dump": f"{path}: key 'dump'", "nvme_path": f"{path}: key 'offload.nvme_path'",
             "env": "ZCOMPILE_DUMP_DIR"}[key]
    assert named in str(e.value) and repr(bad) in str(e.value) and "Not a directory" in str(e.value), str(e.value)
    fine = tmp_path / "new" / "dumps"
    monkeypatch.delenv("ZCOMPILE_DUMP_DIR", raising=False)
    assert config.load(write(tmp_path, f"dump: {fine}\n")).dump == str(fine) and fine.is_dir()


def test_missing_file_and_bad_options(tmp_path):
    with pytest.raises(config.ConfigError, match="not found"):
        config.load(tmp_path / "nope.yaml")
    with pytest.raises(config.ConfigError, match="unknown key"):
        config.from_options({"config": {}, "mode": "max-autotune"})
    with pytest.raises(config.ConfigError, match="path or a mapping"):
        config.from_options({"config": 3})


def test_examples_are_valid():
    import glob
    paths = sorted(glob.glob("examples/configs/*.yaml"))
    assert len(paths) >= 4
    stages = {config.load(p).stage for p in paths}
    assert stages >= {0, 1, 2, 3}


def test_defaults():
    cfg = config.from_options(None)
    assert cfg.stage == 3 and cfg.backend == "inductor" and not cfg.mixed_precision.enabled


def test_bad_config_fails_at_first_forward_without_training(tmp_path):
    """Through torch.compile: the first call raises zcompile.ConfigError itself (not dynamo's wrapper, so a user's
    `except zcompile.ConfigError` fires) and the parameters are untouched."""
    path = write(tmp_path, "stage: 5\n")
    model = torch.nn.Linear(4, 4)
    before = model.weight.detach().clone()
    compiled = torch.compile(model, backend="zero", options={"config": path})
    with pytest.raises(zcompile.ConfigError) as e:
        compiled(torch.randn(2, 4))
    assert "stage" in str(e.value) and path in str(e.value)
    assert torch.equal(model.weight.detach(), before)


def test_config_is_frozen_per_options_object():
    from zcompile.config import frozen as frozen_config
    options = {"config": {"stage": 2}}
    first = frozen_config(options)
    options["config"]["stage"] = 3  # a later edit is not seen by recompiles of the same torch.compile call
    assert frozen_config(options) is first and first.stage == 2
    assert frozen_config({"config": {"stage": 3}}).stage == 3  # another torch.compile call reads its own


def test_no_process_group_is_a_clear_error():
    from tests.workers import reset_dynamo
    reset_dynamo()  # with the compile-start hook, which leaves the error to the backend
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="zero", options={"config": {"stage": 3}})
    with pytest.raises(Exception, match="init_distributed"):
        compiled(torch.randn(2, 4))


def test_hpz_partition_size_is_a_count_or_node():
    assert config.from_dict({"hpz_partition_size": "node"}).hpz_partition_size == "node"
    with pytest.raises(config.ConfigError, match="'hpz_partition_size' must be a rank count or 'node'"):
        config.from_dict({"hpz_partition_size": "auto"})
