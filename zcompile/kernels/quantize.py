"""Block-wise symmetric quantization for ZeRO++ (qwZ int8 weights, qgZ int4 gradients), as torch.library custom ops.

Each op has a Triton kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1) and a pure-torch fallback that
computes the same bits: per block of `block` elements, amax = max |x|, q = clamp(floor(x * (qmax / amax) + 0.5),
-qmax, qmax) (clamped before the cast; round-half-up because libdevice's rint is unavailable in the interpreter),
scale = amax / qmax, and x' = q * scale. A zero block has scale 0 and quantizes to 0. int4 packs two values per
byte, low nibble first, two's complement. Fake implementations let the ops live inside compiled graphs.

    q, scale = torch.ops.zcompile.quantize_int8(x, 2048)        # x: flat fp32/bf16/fp16
    x2 = torch.ops.zcompile.dequantize_int8(q, scale, 2048, torch.bfloat16)
    packed, scale = torch.ops.zcompile.quantize_int4(x, 512)
    total = torch.ops.zcompile.dequantize_sum_int4(packed_rows, scale_rows, 512)   # sum over rows, in fp32
"""
from __future__ import annotations

import os

import torch

from zcompile.kernels import triton_quantize


def _num_blocks(n: int, block: int) -> int:
    return (n + block - 1) // block


def fit_blocks(n: int, block: int, even: bool = False) -> tuple[int, int, int]:
    """Blocks of at most `block` elements that tile n values of one tensor with the least padding: (block size,
    number of blocks, padded length). A tensor's blocks never hold another tensor's values, so a small-magnitude
    tensor is not quantized on the scale of a large neighbour; a short shard is one block, not a padded one."""
    nb = _num_blocks(n, block)
    size = _num_blocks(n, nb)
    if even:
        size += size % 2
    return size, nb, nb * size


def use_triton(x: torch.Tensor) -> bool:
    """Triton on CUDA, or on CPU under TRITON_INTERPRET=1 (tests); the torch fallback otherwise."""
    if not triton_quantize.AVAILABLE:
        return False
    return x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def _check(x: torch.Tensor, block: int, even: bool = False) -> None:
    if x.dim() != 1:
        raise ValueError(f"quantization takes a flat tensor, got shape {tuple(x.shape)}")
    if block <= 0 or (even and block % 2):
        raise ValueError(f"block must be a positive{' even' if even else ''} number of elements, got {block}")
    if not x.is_floating_point():
        raise TypeError(f"quantization takes a floating-point tensor, got {x.dtype}")


# ---------------------------------------------------------------- reference (pure torch) implementations
def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    n = x.numel()
    pad = _num_blocks(n, block) * block - n
    return torch.nn.functional.pad(x.float(), (0, pad)).view(-1, block)


def quantize_ref(x: torch.Tensor, block: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    xb = _blocks(x, block)
    amax = xb.abs().amax(dim=1, keepdim=True)
    # tensor / tensor: IEEE division (torch computes `scalar / tensor` as reciprocal * scalar, off by an ulp)
    inv = torch.where(amax > 0, torch.full_like(amax, qmax) / amax, torch.zeros_like(amax))
    q = torch.floor(xb * inv + 0.5).clamp_(-qmax, qmax)
    return q.view(-1)[: x.numel()].to(torch.int8), (amax / torch.full_like(amax, qmax)).view(-1)


def dequantize_ref(q: torch.Tensor, scale: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    return (_blocks(q, block) * scale.view(-1, 1)).view(-1)[: q.numel()].to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    q = torch.nn.functional.pad(q, (0, q.numel() % 2)).view(-1, 2).to(torch.int16)
    return ((q[:, 0] & 0xF) | ((q[:, 1] & 0xF) << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    p = packed.to(torch.int16)
    lo, hi = p & 0xF, (p >> 4) & 0xF
    both = torch.stack([lo, hi], dim=1).view(-1)[:n]
    return torch.where(both > 7, both - 16, both).to(torch.int8)


# ---------------------------------------------------------------- custom ops
@torch.library.custom_op("zcompile::quantize_int8", mutates_args=())
def quantize_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, block)
    if use_triton(x):
        return triton_quantize.quantize(x, block, 127, pack=False)
    return quantize_ref(x, block, 127)


@quantize_int8.register_fake
def _(x, block):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(_num_blocks(x.numel(), block), dtype=torch.float32)


@torch.library.custom_op("zcompile::dequantize_int8", mutates_args=())
def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    if use_triton(q):
        return triton_quantize.dequantize(q, scale, block, dtype, packed_n=None)
    return dequantize_ref(q, scale, block, dtype)


@dequantize_int8.register_fake
def _(q, scale, block, dtype):
    return q.new_empty(q.shape, dtype=dtype)


@torch.library.custom_op("zcompile::quantize_int4", mutates_args=())
def quantize_int4(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, block, even=True)
    if use_triton(x):
        return triton_quantize.quantize(x, block, 7, pack=True)
    q, scale = quantize_ref(x, block, 7)
    return pack_int4(q), scale


@quantize_int4.register_fake
def _(x, block):
    return (x.new_empty((x.numel() + 1) // 2, dtype=torch.uint8),
            x.new_empty(_num_blocks(x.numel(), block), dtype=torch.float32))


@torch.library.custom_op("zcompile::dequantize_int4", mutates_args=())
def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, block: int, n: int, dtype: torch.dtype
                    ) -> torch.Tensor:
    if use_triton(packed):
        return triton_quantize.dequantize(packed, scale, block, dtype, packed_n=n)
    return dequantize_ref(unpack_int4(packed, n), scale, block, dtype)


@dequantize_int4.register_fake
def _(packed, scale, block, n, dtype):
    return packed.new_empty(n, dtype=dtype)


@torch.library.custom_op("zcompile::dequantize_sum_int4", mutates_args=())
def dequantize_sum_int4(packed: torch.Tensor, scale: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """Rows of packed int4 values ([k, ceil(n/2)], scales [k, blocks]) dequantized and summed over rows, in fp32,
    row 0 first: the dequantize+reduce step of qgZ."""
    if packed.dim() != 2 or scale.dim() != 2 or packed.shape[0] != scale.shape[0]:
        raise ValueError(f"expected [k, bytes] and [k, blocks], got {tuple(packed.shape)} and {tuple(scale.shape)}")
    if use_triton(packed):
        return triton_quantize.dequantize_sum(packed, scale, block, n)
    total = torch.zeros(n, dtype=torch.float32, device=packed.device)
    for k in range(packed.shape[0]):
        total += dequantize_ref(unpack_int4(packed[k], n), scale[k], block, torch.float32)
    return total


@dequantize_sum_int4.register_fake
def _(packed, scale, block, n):
    return packed.new_empty(n, dtype=torch.float32)


# ---------------------------------------------------------------- qwZ payloads: one op per side of a gather
def int8_payload(n: int, block: int) -> tuple[int, int, int, int]:
    """qwZ's layout of an n-element shard, blocks of at most `block` (fit_blocks): (block size, blocks, padded values,
    payload bytes)."""
    size, nb, padded = fit_blocks(n, block)
    return size, nb, padded, padded + 4 * nb


@torch.library.custom_op("zcompile::quantize_int8_payload", mutates_args=())
def quantize_int8_payload(x: torch.Tensor, block: int) -> torch.Tensor:
    """A flat shard as qwZ gathers it, in blocks of at most `block` (int8_payload): zero-padded to whole blocks, int8
    values then the fp32 block scales' bytes. One op where the graph had a pad, the quantize and a concatenation."""
    _check(x, block)
    size, _, padded, _ = int8_payload(x.numel(), block)
    q, scale = quantize_int8(torch.nn.functional.pad(x, (0, padded - x.numel())), size)
    return torch.cat([q, scale.view(torch.int8)])


@quantize_int8_payload.register_fake
def _(x, block):
    return x.new_empty(int8_payload(x.numel(), block)[3], dtype=torch.int8)


@torch.library.custom_op("zcompile::dequantize_int8_payload", mutates_args=())
def dequantize_int8_payload(rows: torch.Tensor, n: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    """The all-gathered payloads of quantize_int8_payload ([world * payload bytes], rank-major) dequantized to
    `dtype` and unpadded: [world * n]. One op where the graph had a copy of the values, one of the scales, the
    dequantize and a copy dropping the padding."""
    size, _, padded, row = int8_payload(n, block)
    if rows.dim() != 1 or rows.numel() % row:
        raise ValueError(f"expected a flat multiple of {row} payload bytes (n {n}, block {block}), "
                         f"got {tuple(rows.shape)}")
    r = rows.view(-1, row)
    values = r[:, :padded].contiguous().view(-1)
    scales = r[:, padded:].contiguous().view(torch.float32).view(-1)
    full = dequantize_int8(values, scales, size, dtype).view(r.shape[0], padded)
    return full[:, :n].contiguous().view(-1)


@dequantize_int8_payload.register_fake
def _(rows, n, block, dtype):
    return rows.new_empty(rows.numel() // int8_payload(n, block)[3] * n, dtype=dtype)


# ---------------------------------------------------------------- qgZ exchanges: a bucket's segments at once
def _int4_segments(members: list[int], block: int, width: int):
    """Each member's part of a qgZ row: (its length, block size, padded length, packed value bytes, scale bytes)."""
    for m in members:
        size, nb, padded = fit_blocks(m, block, even=True)
        yield m, size, padded, width * padded // 2, 4 * width * nb


def int4_row_bytes(members: list[int], block: int, width: int) -> int:
    """Bytes of one row of quantize_int4_rows' result: per member, its packed values and its fp32 scales."""
    return sum(values + scales for *_, values, scales in _int4_segments(members, block, width))


@torch.library.custom_op("zcompile::quantize_int4_rows", mutates_args=())
def quantize_int4_rows(x: torch.Tensor, members: list[int], block: int) -> torch.Tensor:
    """x: [rows, width, sum(members)], any strides. Each member's columns are zero-padded to their fit_blocks length
    and quantized to int4 in their own blocks (over [rows, width, padded], flat), so no block mixes two members;
    returns uint8 [rows, int4_row_bytes]: per member, its packed values then its scales' bytes. Row j goes to group
    rank j of an all-to-all. One op per exchange, not a few per member: inductor compiles no per-member copies."""
    if x.dim() != 3 or x.shape[2] != sum(members):
        raise ValueError(f"expected [rows, width, {sum(members)}] for members {members}, got {tuple(x.shape)}")
    rows, width, _ = x.shape
    parts, offset = [], 0
    for m, size, padded, values, scales in _int4_segments(members, block, width):
        seg = torch.nn.functional.pad(x[:, :, offset:offset + m], (0, padded - m)).contiguous().view(-1)
        packed, scale = quantize_int4(seg, size)
        parts += [packed.view(rows, values), scale.view(torch.uint8).view(rows, scales)]
        offset += m
    return torch.cat(parts, 1)


@quantize_int4_rows.register_fake
def _(x, members, block):
    return x.new_empty((x.shape[0], int4_row_bytes(members, block, x.shape[1])), dtype=torch.uint8)


@torch.library.custom_op("zcompile::dequantize_sum_int4_rows", mutates_args=())
def dequantize_sum_int4_rows(recv: torch.Tensor, members: list[int], block: int, width: int) -> torch.Tensor:
    """recv: uint8 [rows, int4_row_bytes] laid out by quantize_int4_rows (row j from group rank j). Each member
    dequantized and summed over the rows in fp32 (dequantize_sum_int4), padding dropped: fp32 [width, sum(members)]."""
    if recv.dim() != 2 or recv.shape[1] != int4_row_bytes(members, block, width):
        raise ValueError(f"expected [rows, {int4_row_bytes(members, block, width)}] bytes for members {members}, "
                         f"width {width}, got {tuple(recv.shape)}")
    outs, offset = [], 0
    for m, size, padded, values, scales in _int4_segments(members, block, width):
        packed = recv[:, offset:offset + values].contiguous()
        scale = recv[:, offset + values:offset + values + scales].contiguous().view(torch.float32)
        outs.append(dequantize_sum_int4(packed, scale, size, width * padded).view(width, padded)[:, :m])
        offset += values + scales
    return torch.cat(outs, 1)


@dequantize_sum_int4_rows.register_fake
def _(recv, members, block, width):
    return recv.new_empty((width, sum(members)), dtype=torch.float32)
