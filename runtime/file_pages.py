"""A model file's pages in this process's memory, and giving them back once the GPU accelerator holds the model.

LiteRT maps each .tflite it opens (`LiteRtCreateModelFromFile`: one read-only shared mapping of the whole file, `r--s`
in /proc/self/maps) and reads all of it while it compiles: on lavapipe every page of the file is resident after the
compile (the tiny bundle's files: 100 % of each). Once the GPU accelerator has compiled a fully accelerated model it
holds the weights itself (GPU buffers), and the file's pages stay in our resident set as dead weight: 60-100 MB per
SD-2.1 UNet chunk. They are clean page-cache pages of a file nobody writes, so `madvise(MADV_DONTNEED)` on the mapping
drops them from the resident set at no risk: a later touch (the model's flatbuffer read again) faults the same bytes
back in from the page cache or the file; the outputs cannot change (checked bit for bit in
tests/runtime/test_file_pages.py). The page cache itself keeps them (the next launch reads the file from memory), and
the kernel reclaims it as it needs.

Only mappings that cannot hold data of their own are touched: not writable and with no anonymous page (a private
mapping written before it was made read-only holds copies the file does not have; a shared one's pages are the page
cache's, dirty or not, and stay there), found in /proc/self/maps by the file's device and inode (a bundle reached
through a link is the same file) or, on overlayfs, its path. What is resident is read from /proc/self/pagemap over the
mapping's range alone (present pages; bit 61 tells the file's pages from anonymous copies), not from smaps, which walks
every mapping of the process (~20 ms a read at 2 GB resident). Linux only; elsewhere nothing is done and None is
returned.
"""
from __future__ import annotations

import ctypes as C
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np

MADV_DONTNEED = 4
_MAPS, _PAGEMAP = "/proc/self/maps", "/proc/self/pagemap"
_PRESENT, _FILE_OR_SHARED = np.uint64(1 << 63), np.uint64(1 << 61)


@dataclass
class Mapping:
    """One mapping of a file in this process; its resident and anonymous KB (pagemap)."""

    start: int
    end: int
    perms: str
    rss_kb: int = 0
    anon_kb: int = 0

    @property
    def clean_read_only(self) -> bool:
        """Every resident page is the file's (in the page cache): dropping it loses nothing."""
        return "w" not in self.perms and self.anon_kb == 0


def _identity(path: Union[str, Path]) -> Optional[tuple[str, int, str]]:
    """(maps' device field "MAJ:MIN" in hex, inode, real path) of PATH; None when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}", st.st_ino, os.path.realpath(path)


def _is_file(head: list[str], ident: tuple[str, int, str]) -> bool:
    """A mapping's line names the file: its device and inode, or (overlayfs shows the layer's device) its path."""
    if len(head) < 5 or head[4] == "0":
        return False
    return (head[3], int(head[4])) == ident[:2] or (len(head) > 5 and head[5].rstrip("\n") == ident[2])


def _count(m: Mapping) -> Mapping:
    """M's resident and anonymous KB from pagemap (8 bytes a page over its range)."""
    page = os.sysconf("SC_PAGE_SIZE")
    with open(_PAGEMAP, "rb") as f:
        f.seek(m.start // page * 8)
        entries = np.frombuffer(f.read((m.end - m.start) // page * 8), dtype="<u8")
    present = (entries & _PRESENT) != 0
    m.rss_kb = int(present.sum()) * page // 1024
    m.anon_kb = int((present & ((entries & _FILE_OR_SHARED) == 0)).sum()) * page // 1024
    return m


def file_mappings(path: Union[str, Path], maps: str = _MAPS) -> list[Mapping]:
    """Every mapping of the file PATH in this process, with its resident and anonymous KB ([] when none, or off
    Linux)."""
    ident = _identity(path)
    if ident is None:
        return []
    try:
        with open(maps) as f:
            found = [Mapping(*(int(x, 16) for x in head[0].split("-")), head[1])
                     for head in (line.split(None, 5) for line in f) if _is_file(head, ident)]
        return [_count(m) for m in found]
    except (OSError, ValueError, IndexError):
        return []


def resident_mb(path: Union[str, Path]) -> float:
    """How much of the file PATH is resident in this process's mappings of it (MB)."""
    return sum(m.rss_kb for m in file_mappings(path)) / 1024.0


def _madvise():
    try:
        libc = C.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes, fn.restype = [C.c_void_p, C.c_size_t, C.c_int], C.c_int
    return fn


def release_file_pages(path: Union[str, Path]) -> Optional[dict]:
    """Drop the resident pages of every clean read-only mapping of PATH from this process (MADV_DONTNEED). What was
    resident before and after (MB, this file's mappings only), or None where nothing could be done (no mapping of the
    file, not Linux)."""
    mappings = file_mappings(path)
    madvise = _madvise() if mappings else None
    if madvise is None:
        return None
    before = sum(m.rss_kb for m in mappings) / 1024.0
    skipped, errors = 0, []
    for m in mappings:
        if not m.clean_read_only:
            skipped += 1
            continue
        if m.rss_kb and madvise(m.start, m.end - m.start, MADV_DONTNEED) != 0:
            errors.append(os.strerror(C.get_errno()))
    after = resident_mb(path)
    out = {"file": Path(path).name, "mappings": len(mappings), "file_resident_mb_before": round(before, 1),
           "file_resident_mb_after": round(after, 1), "released_mb": round(max(0.0, before - after), 1)}
    if skipped:
        out["skipped_mappings"] = skipped  # writable or with data of their own: left alone
    if errors:
        out["errors"] = sorted(set(errors))
    return out
