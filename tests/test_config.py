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
])
def test_bad_config_names_key_and_file(tmp_path, text, words):
    path = write(tmp_path, text)
    with pytest.raises(config.ConfigError) as e:
        config.load(path)
    msg = str(e.value)
    assert path in msg
    for w in words:
        assert w in msg


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
    """Through torch.compile: the first call raises the config error and the parameters are untouched."""
    path = write(tmp_path, "stage: 5\n")
    model = torch.nn.Linear(4, 4)
    before = model.weight.detach().clone()
    compiled = torch.compile(model, backend="zero", options={"config": path})
    with pytest.raises(Exception) as e:
        compiled(torch.randn(2, 4))
    assert "stage" in str(e.value) and path in str(e.value)
    assert torch.equal(model.weight.detach(), before)


def test_no_process_group_is_a_clear_error():
    torch._dynamo.reset()
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="zero", options={"config": {"stage": 3}})
    with pytest.raises(Exception, match="init_distributed"):
        compiled(torch.randn(2, 4))
