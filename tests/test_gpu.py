"""On a CUDA machine: NCCL, inductor's Triton codegen, stages 0-3 against an eager CUDA reference; the quantization
kernels on CUDA against the CPU reference; ZeRO++ and the offload tiers with CUDA parameters."""
import pytest
import torch

from tests import workers
from tests.harness import run_world
from tests.test_parity import TOL, max_diff
from zcompile.kernels import quantize as qz

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NCCL = {"ZC_TEST_PG": "nccl"}
FULL_CPU = {"optimizer": "cpu", "params": "cpu", "activations": "cpu", "activation_min_bytes": 0}


def _world() -> int:
    return min(2, torch.cuda.device_count())


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_cuda_nccl_inductor_matches_reference(name):
    world = _world()
    ref_params, _ = workers.reference(name, world, steps=5, device="cuda")
    ref_params = {k: v.cpu() for k, v in ref_params.items()}
    results = run_world(world, workers.parity, name, [0, 1, 2, 3], "inductor", env=NCCL)
    for res in results:
        for stage in range(4):
            assert max_diff(res[stage]["params"], ref_params) < TOL, f"stage {stage}"


def test_quantize_kernels_on_cuda_match_the_cpu_reference():
    """The Triton kernels (CUDA tensors) against the torch reference (CPU tensors), bit for bit, qwZ's payload and
    qgZ's row ops included."""
    ops, g = torch.ops.zcompile, torch.Generator().manual_seed(0)
    for n, block in [(4096, 2048), (5000, 2048), (1000, 96), (7, 4)]:
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(n, generator=g) * 3).to(dtype)
            x[: min(block, n) // 2] = 0
            payload = ops.quantize_int8_payload(x.cuda(), block)
            assert torch.equal(payload.cpu(), ops.quantize_int8_payload(x, block)), ("payload", n, block, dtype)
            rows = torch.cat([payload, payload])
            assert torch.equal(ops.dequantize_int8_payload(rows, n, block, dtype).cpu(),
                               ops.dequantize_int8_payload(rows.cpu(), n, block, dtype)), ("deq payload", n, block)
    members, block = [300, 7, 1000], 64
    for dtype in (torch.float32, torch.bfloat16):  # bf16 int4 ties differed on an H100 before FMA was turned off
        x = torch.randn(2, 3, sum(members), generator=g).to(dtype)
        recv = ops.quantize_int4_rows(x.cuda(), members, block)
        assert torch.equal(recv.cpu(), ops.quantize_int4_rows(x, members, block)), dtype
        assert torch.equal(ops.dequantize_sum_int4_rows(recv, members, block, 3).cpu(),
                           ops.dequantize_sum_int4_rows(recv.cpu(), members, block, 3))
    assert qz.use_triton(x.cuda())


def test_zeropp_on_cuda_trains_like_zero3():
    """qwZ + qgZ under inductor with CUDA parameters (Triton quantization kernels inside compiled graphs): losses
    within quantization error of plain ZeRO-3 and the forward really ran on dequantized weights."""
    world, steps = _world(), 5
    plain = run_world(world, workers.losses_and_traffic, "gpt", {"stage": 3}, steps, env=NCCL)[0]
    zpp = run_world(world, workers.losses_and_traffic, "gpt",
                    {"stage": 3, "quantize_weights": {"block": 256}, "quantize_gradients": {}}, steps, env=NCCL)[0]
    assert zpp["losses"] != plain["losses"]
    assert max(abs(a - b) / b for a, b in zip(zpp["losses"], plain["losses"])) < 0.02


def _close(a: list, b: list) -> bool:
    return all(abs(x - y) <= 1e-6 * abs(y) for x, y in zip(a, b)) and len(a) == len(b)


def test_offload_tiers_on_cuda():
    """CUDA parameters with the optimizer on the host, then also parameter shards and saved activations: the same
    training within rounding, gradient clipping and the `nonfinite` check over host gradients, bytes both ways across
    PCIe, no parameter or gradient bytes left on the device, an eager forward of the module (host shards gathered on
    the host mesh, computed on the GPU). Not bit for bit as on CPU: the clipping norm of host gradients is summed on
    the host, the others' on the GPU (seen 2026-11-26: 4e-7), and the graphs with offload ops compile to other
    kernels; a stale or half-copied tensor would be off by orders of magnitude more."""
    world, steps = _world(), 3
    base = {"stage": 3, "nonfinite": "error"}
    opt_cpu = run_world(world, workers.offload_run, "gpt", dict(base, offload={"optimizer": "cpu"}), steps,
                        clip=1.0, eager_forward=True, env=NCCL)[0]
    full = run_world(world, workers.offload_run, "gpt", dict(base, offload=FULL_CPU), steps, clip=1.0,
                     eager_forward=True, env=NCCL)[0]
    assert _close(full["losses"] + [full["eager_loss"]], opt_cpu["losses"] + [opt_cpu["eager_loss"]])
    assert max_diff(full["params"], opt_cpu["params"]) < TOL
    assert full["tiers"]["device->cpu"] > 0 and full["tiers"]["cpu->device"] > 0
    assert full["report"].param_bytes == 0 and full["report"].grad_bytes == 0
    plain = run_world(world, workers.offload_run, "gpt", base, steps, clip=1.0, env=NCCL)[0]
    assert max_diff(full["params"], plain["params"]) < TOL  # host AdamW vs CUDA AdamW: rounding only


def test_update_in_backward_on_cuda():
    """offload.update_in_backward with CUDA gradients: each bucket's shards leave on a side stream into pinned host
    buffers and CPUAdam updates them while the backward runs (a bucket update starts before its end); the same
    training as stepping in optimizer.step() (within rounding: the hand-over call can change inductor's fusion)."""
    for out in run_world(_world(), workers.update_in_backward, {"stage": 3}, 3, "gpt3", env=NCCL):
        assert _close(out["losses"], out["ref_losses"]) and out["max_diff"] < TOL, out["max_diff"]
        ends = {s: t for e, s, t in out["timeline"] if e == "backward done"}
        starts = [(s, t) for e, s, t in out["timeline"] if e == "bucket update started"]
        assert ends and any(t < ends[s] for s, t in starts), out["timeline"]


def test_nvme_tier_on_cuda(tmp_path):
    """Parameter shards and Adam moments in files against CPUAdam in memory with CUDA parameters (within rounding,
    as above); bytes flow nvme -> cpu -> device."""
    world, steps = _world(), 3
    mem = run_world(world, workers.offload_run, "gpt", {"stage": 3, "offload": {"optimizer": "cpu"}}, steps, 1,
                    "cpu_adam", clip=1.0, env=NCCL)[0]
    nvme = {"stage": 3, "offload": {"optimizer": "nvme", "params": "nvme", "nvme_path": str(tmp_path)}}
    res = run_world(world, workers.offload_run, "gpt", nvme, steps, 1, "cpu_adam", clip=1.0, env=NCCL)[0]
    assert _close(res["losses"], mem["losses"])
    assert max_diff(res["params"], mem["params"]) < TOL
    assert res["tiers"]["nvme->cpu"] > 0 and res["tiers"]["cpu->device"] > 0


@pytest.mark.parametrize("name,extra", [("gpt_dropout", {}), ("gpt", {"offload": FULL_CPU})], ids=["dropout", "offload"])
def test_checkpoint_resume_on_cuda(tmp_path, name, extra):
    """torch.distributed.checkpoint with CUDA DTensors (and host-mesh ones under offload): save, continue, resume
    into a fresh model with other weights and RNG state; the same losses bit for bit (the CUDA RNG stream of the
    dropout model included) and parameters; host tensors in `extra` (a generator's state) come back on the host."""
    config = dict(extra, backend="inductor")
    res = run_world(_world(), workers.checkpoint_resume, name, 3, str(tmp_path / "ckpt"), config, env=NCCL)[0]
    assert res["kind"] == "dcp" and res["resumed"] == res["continued"]
    assert res["extra_rng_restored"]  # a host generator's state in `extra` comes back on the host
    for k in res["full"]:
        assert torch.equal(res["full"][k], res["resumed_full"][k]), k


def test_bf16_on_cuda_tracks_fp32():
    """mixed_precision bf16 (fp32 master shards, bf16 gathers and compute) under inductor on CUDA: within 2% of the
    fp32 losses, and it trains."""
    fp32 = run_world(_world(), workers.losses_and_traffic, "gpt", {"stage": 3}, 8, env=NCCL)[0]
    bf16 = run_world(_world(), workers.losses_and_traffic, "gpt",
                     {"stage": 3, "mixed_precision": {"param_dtype": "bf16"}}, 8, env=NCCL)[0]
    assert bf16["losses"] == pytest.approx(fp32["losses"], rel=2e-2) and bf16["losses"] != fp32["losses"]
    assert bf16["traffic"]["all_gather"] * 2 == pytest.approx(fp32["traffic"]["all_gather"], rel=0.05)
