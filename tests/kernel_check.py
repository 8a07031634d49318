"""Run under TRITON_INTERPRET=1 (set before triton is imported): the Triton kernels of zcompile.kernels.quantize
against the torch reference, bit for bit. Prints OK or raises."""
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from zcompile.kernels import quantize as qz  # noqa: E402

assert qz.use_triton(torch.empty(1)), "the interpreter path is not taken"
g = torch.Generator().manual_seed(0)
ops = torch.ops.zcompile
for n, block in [(4096, 2048), (5000, 2048), (1000, 96), (7, 4), (64, 64)]:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = (torch.randn(n, generator=g) * 3).to(dtype)
        x[: min(block, n) // 2] = 0  # a half-zero first block; with block 4 and n 7 a whole zero block
        if n == 7:
            x[:4] = 0
        q, s = ops.quantize_int8(x, block)
        rq, rs = qz.quantize_ref(x, block, 127)
        assert torch.equal(q, rq) and torch.equal(s, rs), ("int8", n, block, dtype)
        for out in (torch.float32, torch.bfloat16, torch.float16):
            assert torch.equal(ops.dequantize_int8(q, s, block, out), qz.dequantize_ref(rq, rs, block, out)), \
                ("deq8", n, block, dtype, out)
        p, s4 = ops.quantize_int4(x, block)
        rq4, rs4 = qz.quantize_ref(x, block, 7)
        assert torch.equal(p, qz.pack_int4(rq4)) and torch.equal(s4, rs4), ("int4", n, block, dtype)
        assert torch.equal(ops.dequantize_int4(p, s4, block, n, torch.float32),
                           qz.dequantize_ref(rq4, rs4, block, torch.float32)), ("deq4", n, block, dtype)
    rows = [ops.quantize_int4(torch.randn(n, generator=g), block) for _ in range(3)]
    packed, scales = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    want = sum(qz.dequantize_ref(qz.unpack_int4(p, n), s, block, torch.float32) for p, s in rows)
    assert torch.equal(ops.dequantize_sum_int4(packed, scales, block, n), want), ("sum4", n, block)
print("OK")
