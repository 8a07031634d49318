"""ZeRO++ quantization kernels: the torch reference's accuracy, the ops inside compiled graphs, and the Triton kernels
bit-exact against the reference under TRITON_INTERPRET=1 (in a subprocess: the flag must precede importing triton)."""
import os
import subprocess
import sys

import pytest
import torch

from zcompile.kernels import quantize as qz

ops = torch.ops.zcompile


@pytest.mark.parametrize("n, block", [(4096, 2048), (5000, 2048), (7, 4)])
def test_reference_error_is_within_half_a_step(n, block):
    x = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 5
    for qmax, quant, deq in ((127, ops.quantize_int8, lambda q, s: ops.dequantize_int8(q, s, block, torch.float32)),
                             (7, ops.quantize_int4, lambda q, s: ops.dequantize_int4(q, s, block, n, torch.float32))):
        q, s = quant(x, block)
        err = (deq(q, s) - x).abs()
        step = s.repeat_interleave(block)[:n]
        assert bool((err <= step / 2 * (1 + 1e-6)).all()), f"qmax {qmax}: error above half a quantization step"
        assert s.shape == ((n + block - 1) // block,)


def test_int4_packs_two_per_byte_twos_complement():
    q = torch.tensor([-7, 7, 0, -1, 3], dtype=torch.int8)
    packed = qz.pack_int4(q)
    assert packed.tolist() == [(9 | (7 << 4)), (0 | (15 << 4)), 3]
    assert torch.equal(qz.unpack_int4(packed, 5), q)


def test_ops_compile_with_fake_impls():
    def roundtrip(x):
        q, s = ops.quantize_int8(x, 64)
        return ops.dequantize_int8(q, s, 64, torch.float32) * 2
    x = torch.randn(1000)
    compiled = torch.compile(roundtrip, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), roundtrip(x))


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="flat tensor"):
        ops.quantize_int8(torch.randn(4, 4), 8)
    with pytest.raises(ValueError, match="even"):
        ops.quantize_int4(torch.randn(16), 5)
    with pytest.raises(TypeError, match="floating-point"):
        ops.quantize_int8(torch.arange(8), 4)


def test_triton_kernels_match_reference_bit_exactly_in_interpreter():
    triton = pytest.importorskip("triton")
    import numpy
    if _version(triton.__version__) < (3, 7) and _version(numpy.__version__) >= (2, 4):
        # triton 3.6's interpreter turns a runtime loop bound into int(1-element array), which numpy 2.4 refuses
        # (seen 2026-11-24 with torch 2.11; numpy 2.3.5 passes). Compiled Triton (tests/test_gpu.py) is unaffected.
        pytest.skip("triton < 3.7's interpreter needs numpy < 2.4 for runtime loop bounds: pip install 'numpy<2.4'")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "tests", "kernel_check.py")], capture_output=True,
                         text=True, timeout=600, env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root), cwd=root)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout[-2000:] + out.stderr[-4000:]


def _version(text: str) -> tuple:
    return tuple(int(x) for x in text.split("+")[0].split(".")[:2])


def test_int4_rows_quantize_each_member_in_its_own_blocks_and_sum_over_rows():
    """qgZ's exchange ops: row j of quantize_int4_rows is rank j's payload alone, each member of the bucket is
    quantized on its own scale (a tiny member next to a large one keeps its precision), and dequantize_sum_int4_rows
    sums the rows per member, bit for bit as the per-member ops do."""
    g = torch.Generator().manual_seed(3)
    members, block, rows, width = [300, 7, 64], 64, 3, 2
    x = torch.randn(rows, width, sum(members), generator=g) * 4
    x[:, :, 300:307] *= 1e-4  # a small-magnitude member between two large ones
    payload = ops.quantize_int4_rows(x.permute(1, 0, 2).contiguous().permute(1, 0, 2), members, block)  # strided in
    assert payload.dtype == torch.uint8 and payload.shape == (rows, qz.int4_row_bytes(members, block, width))
    for j in range(rows):
        assert torch.equal(payload[j:j + 1], ops.quantize_int4_rows(x[j:j + 1], members, block))
    total = ops.dequantize_sum_int4_rows(payload, members, block, width)
    assert total.shape == (width, sum(members)) and total.dtype == torch.float32
    offset = 0
    for m in members:
        size, nb, padded = qz.fit_blocks(m, block, even=True)
        want = torch.zeros(width, padded)
        for j in range(rows):
            seg = torch.nn.functional.pad(x[j, :, offset:offset + m], (0, padded - m)).reshape(-1)
            q, s = ops.quantize_int4(seg, size)
            want += ops.dequantize_int4(q, s, size, width * padded, torch.float32).view(width, padded)
        assert torch.equal(total[:, offset:offset + m], want[:, :m]), m
        exact = x[:, :, offset:offset + m].sum(0)
        assert (total[:, offset:offset + m] - exact).abs().max() <= 0.3 * x[:, :, offset:offset + m].abs().max(), m
        offset += m
    with pytest.raises(ValueError, match="expected"):
        ops.quantize_int4_rows(x[:, :, :10], members, block)
    with pytest.raises(ValueError, match="expected"):
        ops.dequantize_sum_int4_rows(payload[:, 1:], members, block, width)


@pytest.mark.parametrize("n, block", [(300, 64), (64, 64), (7, 2048)])
def test_int8_payloads_are_padded_values_then_scales_per_rank(n, block):
    """qwZ's gather ops: [values (padded to whole blocks) | fp32 scale bytes] per rank, dequantized and unpadded."""
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(n, generator=g) * (k + 1) for k in range(3)]
    size, nb, padded, row = qz.int8_payload(n, block)
    payloads = [ops.quantize_int8_payload(x, block) for x in xs]
    full = ops.dequantize_int8_payload(torch.cat(payloads), n, block, torch.bfloat16)
    assert full.shape == (3 * n,) and full.dtype == torch.bfloat16
    for k, (x, p) in enumerate(zip(xs, payloads)):
        q, s = ops.quantize_int8(torch.nn.functional.pad(x, (0, padded - n)), size)
        assert p.shape == (row,) and torch.equal(p, torch.cat([q, s.view(torch.int8)]))
        assert torch.equal(full[k * n:(k + 1) * n], ops.dequantize_int8(q, s, size, torch.bfloat16)[:n])
    with pytest.raises(ValueError, match="payload bytes"):
        ops.dequantize_int8_payload(torch.cat(payloads)[1:], n, block, torch.float32)
