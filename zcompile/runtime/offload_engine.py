"""The offload engine: moves tensors between tiers (device, host "cpu", "nvme" files) and counts the bytes.

Graphs move data with three custom ops, so the moves are nodes in the dumps and compile inside inductor graphs:

- `zcompile::to_host(x)`: device -> host copy (pinned host memory on CUDA); a saved activation being offloaded.
- `zcompile::to_device(x, device)`: host -> device copy; a reloaded shard or activation.
- `zcompile::read_shard(like, key, device)`: parameter shard `key` read from its NVMe file onto the device. With
  `offload.overlap` the file was already being read by the engine's thread pool: a graph starts reads of the
  shards it needs, in the order it needs them, up to `READ_AHEAD` files ahead.

On a CPU-only machine "device" and "cpu" are both host memory: the ops still copy (what the planner's budget
counts as device memory is the copy), which keeps the emulation honest about bytes moved.
"""
from __future__ import annotations

import atexit
import collections
import concurrent.futures
import errno
import os
import shutil
import socket
import threading
import weakref

import torch

from zcompile.runtime import nvme_files

READ_AHEAD = 4  # NVMe shard reads in flight ahead of their use

TRAFFIC: collections.Counter = collections.Counter()  # "device->cpu", "cpu->device", "cpu->nvme", "nvme->cpu"
_LOCK = threading.Lock()


def count(direction: str, nbytes: int) -> None:
    with _LOCK:
        TRAFFIC[direction] += nbytes


def offload_traffic() -> dict[str, int]:
    """Bytes moved between tiers since the last reset, by direction."""
    return dict(TRAFFIC)


def reset_offload_traffic() -> None:
    TRAFFIC.clear()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def host_empty(shape, dtype, like: torch.device) -> torch.Tensor:
    """Host memory for a tensor coming from `like`'s device: pinned when that is a GPU (async copies)."""
    return torch.empty(shape, dtype=dtype, pin_memory=like.type == "cuda")


# -- NVMe files: one directory per process (job-unique), removed at a clean exit

_OWNED: dict[str, bool] = {}  # cache: process directories created here -> keep them at exit


def process_dir(root: str, keep: bool = False) -> str:
    """`root`/zcompile-<host>-<pid>: no other process, of this job or another one pointed at the same nvme_path, ever
    writes there (file names alone are only unique within a process). Removed at interpreter exit unless `keep`."""
    path = os.path.join(root, f"zcompile-{socket.gethostname()}-{os.getpid()}")
    if path not in _OWNED:
        os.makedirs(path, exist_ok=True)
        if not _OWNED:
            atexit.register(remove_process_dirs)
    _OWNED[path] = _OWNED.get(path, False) or keep
    return path


def remove_process_dirs() -> None:
    """Delete this process's NVMe directories (not those asked to be kept); runs at a clean exit."""
    for path, keep in list(_OWNED.items()):
        if not keep and os.getpid() == int(path.rsplit("-", 1)[1]):
            shutil.rmtree(path, ignore_errors=True)
            _OWNED.pop(path)


class NvmeDir:
    def __init__(self, root: str, rank: int, keep: bool = False):
        self.root = root
        self.path = os.path.join(process_dir(root, keep), f"rank{rank}")
        os.makedirs(self.path, exist_ok=True)
        self.direct = True
        self.used_direct = None  # whether the last write used O_DIRECT (None: nothing written yet)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name + ".zct")

    def write(self, name: str, t: torch.Tensor) -> None:
        path = self.file(name)
        try:
            self.used_direct = nvme_files.write(path, t, self.direct)
        except OSError as e:
            tier = "offload.params" if name.startswith("param") else "offload.optimizer"
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                free = shutil.disk_usage(self.path).free
                raise nvme_files.OffloadFileError(
                    f"{tier}: no space left writing {path} ({_nbytes(t)} bytes; {free} bytes free under "
                    f"offload.nvme_path {self.root}): free space there or point nvme_path at a larger disk") from None
            raise nvme_files.OffloadFileError(f"{tier}: cannot write {path}: {e.strerror or e}") from None
        count("cpu->nvme", _nbytes(t))

    def read(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = nvme_files.read(self.file(name), numel, dtype, self.direct)
        count("nvme->cpu", _nbytes(t))
        return t


_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="zc-nvme")
    return _POOL


# -- parameter shards on NVMe: registry and read-ahead

SHARDS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # key -> ShardedParam whose shard is on NVMe


class ReadAhead:
    """Reads of NVMe shards in the order a graph uses them, `READ_AHEAD` ahead (one per graph run)."""

    def __init__(self, keys: list[int]):
        self.queue = collections.deque(keys)
        self.pending: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        while self.queue and sum(map(len, self.pending.values())) < READ_AHEAD:
            self._submit()

    def _submit(self) -> None:
        key = self.queue.popleft()
        self.pending[key].append(pool().submit(SHARDS[key].read_nvme))

    def take(self, key: int) -> torch.Tensor:
        futures = self.pending.get(key)
        if futures:
            value = futures.popleft().result()
            if self.queue:
                self._submit()
            return value
        return SHARDS[key].read_nvme()  # used out of the planned order (or overlap off): read now


_ACTIVE: ReadAhead | None = None


def start_reads(keys: list[int]) -> None:
    global _ACTIVE
    _ACTIVE = ReadAhead(keys) if keys else None


def _take(key: int) -> torch.Tensor:
    if _ACTIVE is not None:
        return _ACTIVE.take(key)
    return SHARDS[key].read_nvme()


# -- custom ops

@torch.library.custom_op("zcompile::to_host", mutates_args=())
def to_host(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu", pin_memory=x.device.type == "cuda")
    out.copy_(x, non_blocking=x.device.type == "cuda")
    count("device->cpu", _nbytes(x))
    return out


@to_host.register_fake
def _(x):
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")


@torch.library.custom_op("zcompile::to_device", mutates_args=())
def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
    out.copy_(x, non_blocking=x.is_pinned())
    count("cpu->device", _nbytes(x))
    return out


@to_device.register_fake
def _(x, device):
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)


@torch.library.custom_op("zcompile::read_shard", mutates_args=())
def read_shard(like: torch.Tensor, key: int, device: torch.device) -> torch.Tensor:
    host = _take(key)
    count("cpu->device", _nbytes(host))
    return host.to(device, copy=True).view(like.shape)


@read_shard.register_fake
def _(like, key, device):
    return torch.empty(like.shape, dtype=like.dtype, device=device)
