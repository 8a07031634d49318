"""ZeRO++ passes on real gloo groups: qwZ (int8 forward all-gathers)."""
import os

import pytest

from tests import workers
from tests.harness import run_world
from zcompile.config import ConfigError, from_dict


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_qwz_trains_like_zero3_and_moves_a_quarter_of_the_forward_bytes(dtype, tmp_path):
    base = {"stage": 3, "backend": "eager", "mixed_precision": {"param_dtype": dtype}}
    if dtype == "bf16":
        base["mixed_precision"]["reduce_dtype"] = "bf16"
    steps = 30
    plain = run_world(2, workers.losses_and_traffic, "gpt", base, steps)[0]
    qwz = run_world(2, workers.losses_and_traffic, "gpt",
                    dict(base, quantize_weights={"bits": 8, "block": 256}, dump=str(tmp_path)), steps)[0]
    final_plain, final_qwz = plain["losses"][-1], qwz["losses"][-1]
    assert abs(final_qwz - final_plain) / final_plain < 0.02, (final_plain, final_qwz)
    assert qwz["losses"][1:] != plain["losses"][1:]  # the forward really ran on dequantized weights
    # forward gathers: int8 + one fp32 scale per 256 values instead of 4 (fp32) or 2 (bf16) bytes per value;
    # the backward re-gathers stay in the compute dtype
    itemsize = 4 if dtype == "fp32" else 2
    fw_plain = plain["traffic"]["all_gather"] / 2
    fw_qwz = qwz["traffic"]["all_gather"] - fw_plain
    assert fw_qwz / fw_plain == pytest.approx((1 + 4 / 256) / itemsize, rel=0.1)
    fw = next(f for f in os.listdir(tmp_path / "rank0") if "_forward_" in f and f.endswith("_quantize_weights.py"))
    text = open(tmp_path / "rank0" / fw).read()
    assert "qwZ int8, blocks of 256" in text and "zcompile.dequantize_int8" in text


def test_qwz_config_errors():
    with pytest.raises(ConfigError, match="needs stage 3"):
        from_dict({"stage": 2, "quantize_weights": {"bits": 8}})
    with pytest.raises(ConfigError, match="must be 8"):
        from_dict({"quantize_weights": {"bits": 4}})
    with pytest.raises(ConfigError, match="lacks the quantize_weights pass"):
        from_dict({"quantize_weights": {}, "pipeline": ["tag_param_recompute", "shard_params", "reduce_grads"]})


def test_qwz_under_inductor_matches_eager():
    """The quantize/dequantize custom ops and int8 payload views compile with inductor (C++ on CPU)."""
    base = {"stage": 3, "backend": "inductor", "quantize_weights": {"bits": 8, "block": 256}}
    compiled = run_world(2, workers.losses_and_traffic, "gpt", base, 3)[0]
    eager = run_world(2, workers.losses_and_traffic, "gpt", dict(base, backend="eager"), 3)[0]
    assert compiled["losses"] == pytest.approx(eager["losses"], abs=1e-4)
    assert compiled["traffic"] == eager["traffic"]


def test_topology_accounts_cross_node_bytes(tmp_path):
    """4 ranks as 2 nodes x 2: every ZeRO-3 collective spans the world, so all its bytes cross nodes; as 1 node x 4,
    none do. A world that does not split into equal nodes is a config error."""
    base = {"stage": 3, "backend": "eager", "dump": str(tmp_path)}
    two_nodes = run_world(4, workers.losses_and_traffic, "gpt", dict(base, ranks_per_node=2), 2)[0]
    assert two_nodes["cross_node"] == two_nodes["traffic"] and sum(two_nodes["traffic"].values()) > 0
    sched = open(tmp_path / "rank0" / "graph0_schedule.txt").read()
    assert "cross-node" in sched and "intra-node" not in sched
    one_node = run_world(4, workers.losses_and_traffic, "gpt", dict(base, ranks_per_node=4, dump=None), 2)[0]
    assert one_node["cross_node"] == {} and one_node["traffic"] == two_nodes["traffic"]
    with pytest.raises(Exception, match="nodes must hold the same number of ranks"):
        run_world(4, workers.losses_and_traffic, "gpt", dict(base, ranks_per_node=3, dump=None), 1)
