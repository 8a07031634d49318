"""Triton kernels behind zcompile.kernels.quantize (one program per quantization block). Same arithmetic, in the same
order, as the torch reference there, so the interpreter (TRITON_INTERPRET=1) reproduces it bit for bit."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    AVAILABLE = True
except ImportError:  # CPU machines without triton use the torch reference
    AVAILABLE = False

_DTYPES = ({torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
           if AVAILABLE else {})  # torch dtype -> triton dtype

if AVAILABLE:

    @triton.jit
    def _quantize_int8(x_ptr, q_ptr, scale_ptr, n, BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr,
                       QMAX: tl.constexpr):
        pid = tl.program_id(0)
        idx = tl.arange(0, BLOCK_P2)
        offs = pid * BLOCK + idx
        mask = (idx < BLOCK) & (offs < n)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        inv = tl.where(amax > 0, tl.math.div_rn(tl.full([], QMAX, tl.float32), tl.where(amax > 0, amax, 1.0)), 0.0)
        q = tl.floor(x * inv + 0.5)
        q = tl.minimum(tl.maximum(q, -QMAX), QMAX)  # clamp before the cast
        tl.store(q_ptr + offs, q.to(tl.int8), mask=mask)
        tl.store(scale_ptr + pid, tl.math.div_rn(amax, tl.full([], QMAX, tl.float32)))

    @triton.jit
    def _quantize_int4(x_ptr, p_ptr, scale_ptr, n, BLOCK: tl.constexpr, HALF_P2: tl.constexpr, QMAX: tl.constexpr):
        pid = tl.program_id(0)
        pair = tl.arange(0, HALF_P2)
        even = pid * BLOCK + 2 * pair
        in_block = pair < BLOCK // 2
        xe = tl.load(x_ptr + even, mask=in_block & (even < n), other=0.0).to(tl.float32)
        xo = tl.load(x_ptr + even + 1, mask=in_block & (even + 1 < n), other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(xe), axis=0), tl.max(tl.abs(xo), axis=0))
        inv = tl.where(amax > 0, tl.math.div_rn(tl.full([], QMAX, tl.float32), tl.where(amax > 0, amax, 1.0)), 0.0)
        qe = tl.minimum(tl.maximum(tl.floor(xe * inv + 0.5), -QMAX), QMAX).to(tl.int32)
        qo = tl.minimum(tl.maximum(tl.floor(xo * inv + 0.5), -QMAX), QMAX).to(tl.int32)
        packed = (qe & 0xF) | ((qo & 0xF) << 4)
        tl.store(p_ptr + pid * (BLOCK // 2) + pair, packed.to(tl.uint8), mask=in_block & (even < n))
        tl.store(scale_ptr + pid, tl.math.div_rn(amax, tl.full([], QMAX, tl.float32)))

    @triton.jit
    def _load_q(q_ptr, offs, mask, PACKED: tl.constexpr):
        if PACKED:
            byte = tl.load(q_ptr + offs // 2, mask=mask, other=0).to(tl.int32)
            v = tl.where(offs % 2 == 0, byte & 0xF, (byte >> 4) & 0xF)
            v = tl.where(v > 7, v - 16, v)
        else:
            v = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.int32)
        return v.to(tl.float32)

    @triton.jit
    def _rtne_bf16(x):
        """fp32 -> the nearest bf16 value, ties to even, still as fp32 (exact to cast): the interpreter's own
        fp32->bf16 cast truncates, whatever rounding mode is asked for."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _dequantize(q_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr,
                    PACKED: tl.constexpr, OUT: tl.constexpr):
        pid = tl.program_id(0)
        idx = tl.arange(0, BLOCK_P2)
        offs = pid * BLOCK + idx
        mask = (idx < BLOCK) & (offs < n)
        v = _load_q(q_ptr, offs, mask, PACKED)
        s = tl.load(scale_ptr + pid)
        out = v * s
        if OUT == tl.bfloat16:
            out = _rtne_bf16(out)
        tl.store(out_ptr + offs, out.to(OUT), mask=mask)

    @triton.jit
    def _dequantize_sum(p_ptr, scale_ptr, out_ptr, n, rows, row_bytes, row_blocks, BLOCK: tl.constexpr,
                        BLOCK_P2: tl.constexpr):
        pid = tl.program_id(0)
        idx = tl.arange(0, BLOCK_P2)
        offs = pid * BLOCK + idx
        mask = (idx < BLOCK) & (offs < n)
        acc = tl.zeros([BLOCK_P2], dtype=tl.float32)
        for k in range(0, rows):
            v = _load_q(p_ptr + k * row_bytes, offs, mask, True)
            s = tl.load(scale_ptr + k * row_blocks + pid)
            acc = acc + v * s
        tl.store(out_ptr + offs, acc, mask=mask)


def _grid(n: int, block: int) -> tuple[int]:
    return ((n + block - 1) // block,)


def quantize(x: torch.Tensor, block: int, qmax: int, pack: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    n = x.numel()
    scale = torch.empty(_grid(n, block)[0], dtype=torch.float32, device=x.device)
    if pack:
        out = torch.empty((n + 1) // 2, dtype=torch.uint8, device=x.device)
        # no FMA contraction of x * inv + 0.5: the reference rounds the product first (bf16 ties differed on an H100)
        _quantize_int4[_grid(n, block)](x, out, scale, n, BLOCK=block, HALF_P2=triton.next_power_of_2(block // 2),
                                        QMAX=qmax, enable_fp_fusion=False)
    else:
        out = torch.empty(n, dtype=torch.int8, device=x.device)
        _quantize_int8[_grid(n, block)](x, out, scale, n, BLOCK=block, BLOCK_P2=triton.next_power_of_2(block),
                                        QMAX=qmax, enable_fp_fusion=False)
    return out, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int, dtype: torch.dtype, packed_n: int | None
               ) -> torch.Tensor:
    n = q.numel() if packed_n is None else packed_n
    out = torch.empty(n, dtype=dtype, device=q.device)
    _dequantize[_grid(n, block)](q.contiguous(), scale.contiguous(), out, n, BLOCK=block,
                                 BLOCK_P2=triton.next_power_of_2(block), PACKED=packed_n is not None,
                                 OUT=_DTYPES[dtype])
    return out


def dequantize_sum(packed: torch.Tensor, scale: torch.Tensor, block: int, n: int) -> torch.Tensor:
    packed, scale = packed.contiguous(), scale.contiguous()
    out = torch.empty(n, dtype=torch.float32, device=packed.device)
    _dequantize_sum[_grid(n, block)](packed, scale, out, n, packed.shape[0], packed.shape[1], scale.shape[1],
                                     BLOCK=block, BLOCK_P2=triton.next_power_of_2(block),
                                     enable_fp_fusion=False)  # acc + v * s as two roundings, like the reference
    return out
