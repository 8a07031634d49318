"""On a CUDA machine: NCCL, inductor's Triton codegen, stages 0-3 against an eager CUDA reference."""
import pytest
import torch

from tests import workers
from tests.harness import run_world
from tests.test_parity import TOL, max_diff

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_cuda_nccl_inductor_matches_reference(name):
    world = min(2, torch.cuda.device_count())
    ref_params, _ = workers.reference(name, world, steps=5, device="cuda")
    ref_params = {k: v.cpu() for k, v in ref_params.items()}
    results = run_world(world, workers.parity, name, [0, 1, 2, 3], "inductor", env={"ZC_TEST_PG": "nccl"})
    for res in results:
        for stage in range(4):
            assert max_diff(res[stage]["params"], ref_params) < TOL, f"stage {stage}"
