"""Where captured block inputs and targets live: on the compute device, in host memory, or in files.

`HostCache` is the walk's plan for the host side (`host_memory.plan_host_cache` makes it from the
host cap): the bytes one capture group may take, and a folder when the caches go to disk. Host
caches are pageable memory: torch's pinned allocator rounds every buffer up to a power of two and
keeps freed buffers for reuse, so a pinned cache took up to twice its bytes and did not shrink
between groups (SD-2.1: 79 GB of host RSS for 66 GB of float32 caches).

`DiskRows` is an [N, ...] array in a file under that folder, written and read by rows with
pwrite / preadv: nothing is memory-mapped, so the process holds only the rows it reads (the
kernel's page cache may keep more, and gives it back under pressure). It answers the tensor
calls the reconstruction makes on a cache (`shape`, `numel`, `element_size`, row indexing by a
slice or index tensor, `to(device)`), so a block reconstructs from it unchanged.
"""
from __future__ import annotations

import dataclasses
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from pocketdiff.errors import PocketdiffError

FP16_MAX = 65504.0
READ_CHUNK_BYTES = 64 * 2 ** 20  # DiskRows.to(device): rows are staged through host buffers of at most this


@dataclasses.dataclass
class HostCache:
    """The host side of the block caches: `budget_bytes` per capture group (None: 40 % of the memory
    the OS reports available), in memory or, with `folder`, in files there (removed by `cleanup`)."""

    budget_bytes: Optional[float] = None
    folder: Optional[Path] = None

    def budget(self) -> float:
        return self.budget_bytes if self.budget_bytes is not None else available_host_bytes()

    def cleanup(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def available_host_bytes(fraction: float = 0.4) -> float:
    """`fraction` of the memory the OS reports available (4 GiB when it does not say)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            return fraction * next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 4 * 2 ** 30


def _as_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's storage (any dtype, bfloat16 included)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class DiskRows:
    """An [N, ...] tensor of `dtype` in the file `path` (created sparse, removed by `close`)."""

    device = torch.device("cpu")

    def __init__(self, path: Path, shape, dtype: torch.dtype):
        self.path, self.shape, self.dtype = Path(path), torch.Size(shape), dtype
        self.row_numel = math.prod(self.shape[1:])
        self.row_bytes = self.row_numel * self.element_size()
        self.fd: Optional[int] = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self.fd, self.shape[0] * self.row_bytes)

    # the tensor calls a cache answers
    def numel(self) -> int:
        return self.shape[0] * self.row_numel

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def dim(self) -> int:
        return len(self.shape)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes

    def write(self, start: int, x: torch.Tensor) -> None:
        x = x.detach().to("cpu", self.dtype).contiguous()
        view, offset = _as_bytes(x), start * self.row_bytes
        while len(view):
            n = os.pwrite(self.fd, view, offset)
            view, offset = view[n:], offset + n

    def _read_into(self, out: torch.Tensor, start: int) -> None:
        view, offset = _as_bytes(out), start * self.row_bytes
        while len(view):
            n = os.preadv(self.fd, [view], offset)
            if n <= 0:
                raise PocketdiffError(f"{self.path}: the block cache file ended early")
            view, offset = view[n:], offset + n

    def __getitem__(self, idx) -> torch.Tensor:
        if isinstance(idx, slice):
            rows = list(range(*idx.indices(self.shape[0])))
        else:
            rows = torch.as_tensor(idx).reshape(-1).tolist()
        out = torch.empty((len(rows), *self.shape[1:]), dtype=self.dtype)
        i = 0
        while i < len(rows):  # one read per run of consecutive rows
            j = i + 1
            while j < len(rows) and rows[j] == rows[j - 1] + 1:
                j += 1
            self._read_into(out[i:j], rows[i])
            i = j
        return out

    def to(self, device=None, dtype: Optional[torch.dtype] = None, non_blocking: bool = False) -> torch.Tensor:
        """The whole array as a tensor on `device`, read in chunks of at most READ_CHUNK_BYTES."""
        device = torch.device(device or "cpu")
        out = torch.empty(self.shape, dtype=dtype or self.dtype, device=device)
        step = max(1, READ_CHUNK_BYTES // max(1, self.row_bytes))
        for s in range(0, self.shape[0], step):
            out[s:s + step].copy_(self[s:s + step])
        return out

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            self.path.unlink(missing_ok=True)

    def __del__(self):
        self.close()


class Store:
    """Preallocated [N, ...] storage of one captured tensor, filled batch by batch: a tensor on `device`,
    or `DiskRows` in a file under `folder`. A float16 store that meets a value beyond float16's range
    is widened to float32 (what it holds so far is copied), so a cache never holds an inf that the
    model did not produce; `widened` says so."""

    def __init__(self, n_total: int, device, dtype: torch.dtype, folder: Optional[Path] = None):
        self.n_total, self.device, self.dtype, self.folder = n_total, torch.device(device), dtype, folder
        self.buf = None
        self.widened = False

    def _alloc(self, shape, dtype):
        if self.folder is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        fd, path = tempfile.mkstemp(suffix=".bin", dir=self.folder)
        os.close(fd)
        return DiskRows(Path(path), shape, dtype)

    def _widen(self, upto: int) -> None:
        old = self.buf
        self.buf = self._alloc(old.shape, torch.float32)
        if upto:
            self._write(0, old[0:upto])
        if isinstance(old, DiskRows):
            old.close()
        self.widened = True

    def _write(self, start: int, x: torch.Tensor) -> None:
        if isinstance(self.buf, DiskRows):
            self.buf.write(start, x)
        else:
            self.buf[start:start + x.shape[0]].copy_(x, non_blocking=self.device.type == "cuda")

    def put(self, start: int, x: torch.Tensor) -> None:
        x = x.detach()
        if self.buf is None:
            self.buf = self._alloc((self.n_total, *x.shape[1:]), self.dtype if x.is_floating_point() else x.dtype)
        if self.buf.dtype == torch.float16 and x.is_floating_point() and x.numel() and float(x.abs().amax()) > FP16_MAX:
            self._widen(start)
        self._write(start, x)


def release(tensors) -> None:
    """Close the files of the disk-backed caches among `tensors` (others go with their last reference)."""
    for t in tensors:
        if isinstance(t, DiskRows):
            t.close()
