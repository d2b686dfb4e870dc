"""Memory of this process and every process it started (a browser's renderer, GPU and utility
processes), polled from /proc: the sum of PSS (shared pages split between the processes that map
them, so a page shared by ten renderers counts once in total) and its peak. Linux only."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(d.name))
    return kids


def tree_pids(root: int) -> list[int]:
    kids, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def pss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


class TreePeak:
    """Polls the PSS of the process tree under `root` (default: this process) every `every_s`; `.stop()` ->
    {peak_pss_mb, peak_processes, samples}."""

    def __init__(self, root: int | None = None, every_s: float = 0.5):
        self.root, self.every_s = root or os.getpid(), every_s
        self.peak, self.peak_n, self.samples = 0.0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            pids = tree_pids(self.root)
            total = sum(pss_mb(p) for p in pids)
            if total > self.peak:
                self.peak, self.peak_n = total, len(pids)
            self.samples += 1
            self._stop.wait(self.every_s)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"peak_pss_mb": round(self.peak, 1), "peak_processes": self.peak_n, "samples": self.samples}
