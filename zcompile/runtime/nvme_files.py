"""Tensor files for the NVMe tier: written atomically, checked on every read.

A file is one 4096-byte header (magic, dtype, element count, payload length, CRC32 of the payload) and the payload
padded to a multiple of 4096, so reads can use O_DIRECT (page cache bypassed, as DeepSpeed's AIO swapper) where the
filesystem allows it; tmpfs and some others refuse O_DIRECT and get buffered I/O. A write goes to a temporary file
in the same directory, is fsync-ed and renamed over the old one: a crash leaves the old file or the new one, never
half of each. A missing, truncated or corrupt file raises OffloadFileError naming the file and what is wrong.
"""
from __future__ import annotations

import json
import mmap
import os
import zlib

import torch

from zcompile.errors import ZeroError

BLOCK = 4096
MAGIC = b"ZCNVME1\n"
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8)}


class OffloadFileError(ZeroError):
    """An NVMe-tier file that is missing, truncated or fails its checksum."""


def _round_up(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def _aligned(nbytes: int) -> mmap.mmap:
    """A page-aligned buffer (anonymous mmap), as O_DIRECT requires."""
    return mmap.mmap(-1, max(BLOCK, _round_up(nbytes)))


def _open(path: str, flags: int, direct: bool) -> tuple[int, bool]:
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError:
            pass  # EINVAL: this filesystem has no O_DIRECT
    return os.open(path, flags, 0o600), False


def write(path: str, tensor: torch.Tensor, direct: bool = True) -> bool:
    """Write `tensor` (CPU) to `path` atomically. Returns whether O_DIRECT was used."""
    t = tensor.detach().contiguous()
    nbytes = t.numel() * t.element_size()
    buf = _aligned(BLOCK + nbytes)
    if nbytes:
        torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=BLOCK).copy_(t.view(torch.uint8).reshape(-1))
    header = json.dumps({"dtype": str(t.dtype), "numel": t.numel(), "nbytes": nbytes,
                         "crc32": zlib.crc32(memoryview(buf)[BLOCK: BLOCK + nbytes])}).encode()
    buf[: len(MAGIC) + len(header)] = MAGIC + header
    tmp = f"{path}.tmp{os.getpid()}"
    fd, used_direct = _open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct)
    try:
        try:
            view = memoryview(buf)[: _round_up(BLOCK + nbytes)]
            while view:  # os.write may write less than asked
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):  # a failed write (disk full, interrupted) leaves the old file and no .tmp
            os.unlink(tmp)
        raise
    return used_direct


def read(path: str, expect_numel: int | None = None, expect_dtype: torch.dtype | None = None,
         direct: bool = True) -> torch.Tensor:
    """Read a tensor written by `write`, checking header, size and checksum."""
    if not os.path.exists(path):
        raise OffloadFileError(f"NVMe offload file {path} is missing (deleted, or offload.nvme_path changed "
                               "between runs)")
    size = os.path.getsize(path)
    fd, _ = _open(path, os.O_RDONLY, direct)
    buf = _aligned(size)
    try:
        got = os.readv(fd, [memoryview(buf)[: _round_up(size)]]) if size else 0
    finally:
        os.close(fd)
    if got < BLOCK or bytes(buf[: len(MAGIC)]) != MAGIC:
        raise OffloadFileError(f"NVMe offload file {path}: not a zcompile tensor file (bad header, {size} bytes)")
    try:
        meta = json.loads(bytes(buf[len(MAGIC): BLOCK]).rstrip(b"\0"))
    except ValueError:
        raise OffloadFileError(f"NVMe offload file {path}: unreadable header") from None
    nbytes, dtype = meta["nbytes"], _DTYPES.get(meta["dtype"])
    if dtype is None or got < BLOCK + nbytes:
        raise OffloadFileError(f"NVMe offload file {path}: truncated ({got} bytes read, header says "
                               f"{BLOCK + nbytes}) or unknown dtype {meta['dtype']}")
    if (expect_numel is not None and meta["numel"] != expect_numel) or (expect_dtype is not None and dtype != expect_dtype):
        raise OffloadFileError(f"NVMe offload file {path} holds {meta['numel']} x {meta['dtype']}, expected "
                               f"{expect_numel} x {expect_dtype}")
    crc = zlib.crc32(memoryview(buf)[BLOCK: BLOCK + nbytes])
    if crc != meta["crc32"]:
        raise OffloadFileError(f"NVMe offload file {path}: checksum mismatch (stored {meta['crc32']:#010x}, "
                               f"read {crc:#010x}): the file is corrupt")
    if not nbytes:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=BLOCK).view(dtype).clone()
