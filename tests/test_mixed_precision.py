"""bf16 compute with fp32 master shards: tracks the fp32 run and gathers half the bytes."""
import pytest

from tests import workers
from tests.harness import run_world


def test_bf16_stage3_tracks_fp32_and_halves_gather_bytes(tmp_path):
    fp32 = run_world(2, workers.schedule_and_losses, str(tmp_path / "fp32"), {"stage": 3, "backend": "eager"})
    bf16 = run_world(2, workers.schedule_and_losses, str(tmp_path / "bf16"),
                     {"stage": 3, "backend": "eager", "mixed_precision": {"param_dtype": "bf16"}})
    for a, b in zip(fp32, bf16):
        assert b["losses"] == pytest.approx(a["losses"], rel=2e-2)
        assert b["losses"][-1] < b["losses"][0]  # it trains
        assert b["forward_bytes"] * 2 == a["forward_bytes"]
        assert "bfloat16" in b["forward_code"]
