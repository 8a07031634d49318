"""bench/compare.py end to end on a tiny run: every row measured, and the systems agree on the loss."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.harness import bench_module, run_bench


def test_compare_runs_and_systems_agree(tmp_path):
    run_bench("compare", ["--world", "2", "--model", "gpt", "--systems", "ddp,fsdp2,zcompile_z3", "--steps", "3",
                          "--warmup", "1", "--micro", "1", "--seq", "16", "--out", str(tmp_path)])
    data = json.load(open(tmp_path / "gpt-small-cpu-w2.json"))
    rows = {r["system"]: r for r in data["rows"]}
    assert set(rows) == {"ddp", "fsdp2", "zcompile_z3"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["median_step_s"] > 0 and r["peak_rss_mib"] > 0 and r["comm_bytes"] > 0 and r["state_bytes"] > 0
    # same model, data and optimizer: the same training trajectory
    assert rows["zcompile_z3"]["losses"] == pytest.approx(rows["ddp"]["losses"], abs=1e-4)
    assert rows["fsdp2"]["losses"] == pytest.approx(rows["ddp"]["losses"], abs=1e-4)
    # ZeRO-3 holds half the model state of DDP at 2 ranks
    assert rows["zcompile_z3"]["state_bytes"] == pytest.approx(rows["ddp"]["state_bytes"] / 2, rel=0.01)
    # tensor peaks: at a step's start DDP holds whole parameters, moments and its gradient buckets (4P floats),
    # the sharded systems 3P/2 (gradients are freed by zero_grad); activations come on top
    p_bytes = rows["ddp"]["num_params"] * 4
    assert rows["ddp"]["tensor_peak"]["start"] >= 4 * p_bytes
    for name in ("fsdp2", "zcompile_z3"):
        assert 1.4 * p_bytes < rows[name]["tensor_peak"]["start"] < 2 * p_bytes, rows[name]["tensor_peak"]
    for r in rows.values():
        assert r["tensor_peak"]["rise"] > 0 and r["tensor_peak_mib_max"] * 2**20 >= r["tensor_peak"]["peak"]
    md = (tmp_path / "gpt-small-cpu-w2.md").read_text()
    assert "| zcompile_z3 |" in md and "1.00x" in md and "tensor peak / rank (MiB)" in md


def test_offload_bench_reports_tiers_and_keeps_the_loss(tmp_path):
    run_bench("offload", ["--world", "2", "--size", "small", "--backend", "eager", "--steps", "2", "--warmup", "1",
                          "--micro", "1", "--seq", "16", "--systems", "zero3,cpu,nvme",
                          "--nvme-path", str(tmp_path / "nvme"), "--out", str(tmp_path)])
    rows = {r["system"]: r for r in json.load(open(tmp_path / "offload-gpt-small-w2-eager.json"))["rows"]}
    assert rows["cpu"]["losses"] == rows["zero3"]["losses"] == rows["nvme"]["losses"]
    assert rows["cpu"]["planned_peak"] < rows["zero3"]["planned_peak"]
    assert rows["cpu"]["tiers"]["cpu->device"] > 0 and rows["nvme"]["tiers"]["nvme->cpu"] > 0
    assert rows["zero3"]["tiers"] == {} and rows["nvme"]["device_state"] == 0
    assert "| nvme |" in (tmp_path / "offload-gpt-small-w2-eager.md").read_text()


def test_compile_time_counts_each_kernel_inductor_built_once(tmp_path):
    """bench/compile_time.py's kernel count: every kernel of the cached graphs, each distinct source once, and a
    graph two ranks both wrote (two entries under one key) once."""
    kernels_built = bench_module("compile_time").kernels_built
    cache = tmp_path / "cache"
    script = ("import torch\n"
              "f = torch.compile(lambda x: x.sin() + 1)\n"
              "g = torch.compile(lambda x: (x.cos() * 2, (x.cos() * 2).sum()))\n"
              "f(torch.randn(64)); g(torch.randn(64))\n")
    # VEC_ISA_OK: no probe builds of each instruction set in the empty cache (~9 s); the kernels are the same
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TORCHINDUCTOR_VEC_ISA_OK": "1"}
    subprocess.run([sys.executable, "-c", script], check=True, timeout=600, capture_output=True, env=env)
    first = kernels_built(str(cache))
    assert first["distinct kernels"] >= 2 and first["kernels defined"] >= first["distinct kernels"], first
    key = next(p for p in (cache / "fxgraph").glob("*/*") if p.is_dir())
    entry = next(key.iterdir())
    shutil.copy(entry, key / (entry.name + "-rank1"))  # another rank's write of the same graph
    assert kernels_built(str(cache)) == first
    assert kernels_built(str(tmp_path / "empty")) == {"kernels defined": 0, "distinct kernels": 0}


def test_compile_time_reads_cpp_and_triton_kernels_from_generated_code():
    """Both forms inductor writes (torch/_inductor/codegen/cpp.py and triton.py): a Triton kernel's call goes on
    after its source (device_str), a C++ one's does not."""
    cpp = "extern \"C\" void kernel(float* out_ptr0)\n{\n}\n"
    triton = "\nimport triton\n\n@triton.jit\ndef triton_poi_fused_0(in_ptr0, xnumel):\n    pass\n"
    code = (f"cpp_fused_0 = async_compile.cpp_pybinding(['float*'], r'''\n{cpp}''')\n\n"
            f"triton_poi_fused_0 = async_compile.triton('triton_poi_fused_0', '''{triton}''', device_str='cuda')\n"
            "async_compile.wait(globals())\n")
    assert bench_module("compile_time").kernel_sources(code) == ["\n" + cpp, triton]


def test_compile_time_counts_the_torch_compile_calls():
    """torch.compile(model) with inductor imports inductor's compiler at the call, where the zero backend imports it
    in the first step: bench/compile_time.py counts the calls' seconds in the compile time of every system."""
    import torch
    bench, real = bench_module("compile_time"), torch.compile
    timed = bench._timed_torch_compile()
    try:
        assert torch.compile is timed
        torch.compile(torch.nn.Linear(2, 2))
    finally:
        torch.compile = timed.real
    assert torch.compile is real and timed.seconds > 0


def test_workload_bench_runs_the_systems_side_by_side(tmp_path):
    """bench/workload.py on a tiny nanoGPT, in bf16 as on a GPU (autocast, FSDP2's MixedPrecisionPolicy, zcompile's
    mixed_precision): each system's row, the same losses for FSDP2 + torch.compile and zcompile (same model, data,
    optimizer groups and clipping; bf16 rounding), the device in the header."""
    run_bench("workload", ["--model", "gpt2-tiny", "--vocab", "512", "--micro", "2", "--seq", "32", "--warmup", "1",
                           "--steps", "2", "--warm", "--dtype", "bf16",
                           "--systems", "torch_compile,fsdp2_compile,zcompile_z3", "--out", str(tmp_path)])
    data = json.load(open(tmp_path / "workload-gpt2-tiny-cpu-w2.json"))
    rows = {r["system"]: r for r in data["rows"]}
    assert set(rows) == {"torch_compile", "fsdp2_compile", "zcompile_z3"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["median_step_s"] > 0 and r["first_step_s"] > r["median_step_s"] and r["peak_bytes_max"] > 0
    assert rows["zcompile_z3"]["losses"] == pytest.approx(rows["fsdp2_compile"]["losses"], abs=2e-2)
    assert "CPU (" in data["header"] and "world 2" in data["header"] and "bf16 compute" in data["header"]
    assert "| zcompile_z3 |" in (tmp_path / "workload-gpt2-tiny-cpu-w2.md").read_text()


def test_host_work_per_parameter_stays_small(tmp_path):
    """Issues 56 and 69 (host-bound step): bench/host_work.py's counts at 4 and 6 layers (bf16, inductor, block
    regions at both depths). The parameters' graph inputs hand their gradients over in one autograd node per graph
    call, not one per parameter, which puts them into p.grad itself (no DTensor detach per parameter), AdamW steps
    the local tensors (no DTensor dispatch per parameter) and torch's clip_grad_norm_ runs its foreach ops on the
    gradients' local tensors (runtime/grad_foreach.py); each added parameter costs at most 8 eager ops and 95
    Python calls a step, its clip at most 27 (2026-12-07, 24 -> 48 layers: 80 and 22.5; torch.compile's own: 64
    and 21.5; before grad_foreach and the one-method gradient hand-over 115 and 44, with AdamW over the DTensors
    153, through AccumulateGrad's DTensor detach 197, with a node per parameter 233). regional_compile 'nested'
    makes one graph call per forward and backward at any depth and runs no glue eagerly (fewer eager ops per
    parameter)."""
    run_bench("host_work", ["--layers", "4,6", "--systems", "zcompile_z3,zcompile_z3_nested", "--warmup", "2",
                            "--steps", "1", "--out", str(tmp_path)])
    rows = json.load(open(tmp_path / "host_work.json"))["rows"]
    assert all("error" not in r for r in rows), rows
    by = {(r["system"], r["layers"]): r for r in rows}
    for system in ("zcompile_z3", "zcompile_z3_nested"):
        small, big = by[system, 4], by[system, 6]
        assert big["tensors"] > small["tensors"] and big["graph_calls"] > 0
        for r in (small, big):
            assert r["accumulate_grad"] == r["tensors"], r  # each parameter's AccumulateGrad ran (given no grad)
            assert sum(r["python_calls_by_phase"].values()) == r["python_calls"]
            assert all(r["python_calls_by_phase"][p] > 0 for p in ("forward", "backward", "clip", "step")), r
        assert big["autograd_nodes"] - big["accumulate_grad"] == small["autograd_nodes"] - small["accumulate_grad"]
        added = big["tensors"] - small["tensors"]
        assert (big["eager_ops"] - small["eager_ops"]) / added <= 8, (small, big)
        assert (big["python_calls"] - small["python_calls"]) / added <= 95, (small, big)
        clip = big["python_calls_by_phase"]["clip"] - small["python_calls_by_phase"]["clip"]
        assert clip / added <= 27, (small, big)
    assert by["zcompile_z3_nested", 4]["graph_calls"] == by["zcompile_z3_nested", 6]["graph_calls"] == 2
    nested = by["zcompile_z3_nested", 6]["eager_ops"] - by["zcompile_z3_nested", 4]["eager_ops"]
    assert nested < by["zcompile_z3", 6]["eager_ops"] - by["zcompile_z3", 4]["eager_ops"]


def test_gpu_busy_time_is_the_union_of_kernel_intervals():
    """bench/workload.py's GPU-busy time per step (issue 56: device time against step time): overlapping kernels
    (two streams) count once, gaps not at all."""
    workload = bench_module("workload")
    assert workload.busy_seconds([]) == 0
    assert workload.busy_seconds([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert workload.busy_seconds([(20, 25), (0, 10)], 1e-6) == pytest.approx(15e-6)
    rows = [{"system": "torch_compile", "median_step_s": 0.1, "tokens_per_s": 1.0, "peak_bytes_max": 2**30,
             "first_step_s": 1.0, "final_loss": 1.0, "gpu_busy_s": 0.035},
            {"system": "zcompile_z3", "median_step_s": 0.2, "tokens_per_s": 1.0, "peak_bytes_max": 2**30,
             "first_step_s": 1.0, "final_loss": 1.0, "gpu_busy_s": None}]
    args = type("A", (), {"device": "cuda", "world": 1, "model": "gpt2-124M", "micro": 1, "seq": 8, "dtype": "bf16"})
    md = workload.markdown(rows, args)
    assert "GPU busy / step (ms) |" in md and "| 35.0 |" in md and "| n/a |" in md
