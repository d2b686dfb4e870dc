"""run-bundle --pipelined with a UNet in chunks: the order its chunks compile in, from what they were measured to need
(numpy only).

Pipelined, the chunks compile one after another and stay for every step, so chunk k compiles on top of every chunk
compiled before it, settled. A chunk's compile goes above what it holds once settled (the accelerator's host copies
of its weights, its upload buffers): its `excess`. The peak of host + GPU memory at once over the loads is then
the largest of (what the earlier chunks hold settled + this chunk's compile peak), and compiling the chunks in
decreasing order of excess makes that largest term smallest (swap two neighbours: the order with the larger excess
first never peaks higher). The chunks still run in their call order; only when each compiles changes.

The figures come from the runner's own memory marks of an earlier launch on the same bundle and device
(`chunk_figures.json` in the runner's GPU cache folder, beside the compiled programs): per chunk, the rise of host +
GPU memory from its `opened` mark to the highest host + GPU peak of its compile and settling (`peak_mb`; the host and
GPU peaks are each a window's high-water mark, so their sum is an upper bound), and from `opened` to `settled`
(`resident_mb`). They are the overlap loader's `MemoryFigures` records (runtime/overlap.py): the larger of each kept
across launches, another bundle's or device's ignored with one warning. Without figures for every chunk (a first
launch, no cache folder) the chunks compile in call order.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

from .overlap import MemoryFigures, UnitFigures, read_figures, write_figures

CHUNK_FIGURES = "chunk_figures.json"
MEASURED, CALL_ORDER = "measured", "call order"
_COMPILE_PHASES = ("compiled", "pages_released", "settled")


def compile_order(parts: Sequence[str], figures: Optional[MemoryFigures]) -> tuple[list[str], str]:
    """(the chunks in the order to compile them, where the order came from): decreasing excess (compile peak over
    what the chunk holds settled) where `figures` has every chunk, ties in call order; else the call order."""
    if figures is None or any(p not in figures.units for p in parts):
        return list(parts), CALL_ORDER
    excess = {p: figures.units[p].peak_mb - figures.units[p].resident_mb for p in parts}
    return sorted(parts, key=lambda p: -excess[p]), MEASURED  # a stable sort: ties stay in call order


def _both(phase: dict, now: bool) -> Optional[float]:
    """Host + GPU of a mark: now (`host_rss_mb` + `gpu_mb`) or its window's peaks; None where a figure is missing."""
    host = phase.get("host_rss_mb" if now else "host_peak_mb")
    gpu = phase.get("gpu_mb" if now else "gpu_peak_mb")
    return None if host is None else float(host) + float(gpu or 0.0)


def chunk_figures(phases_by_chunk: dict[str, list[dict]]) -> dict[str, UnitFigures]:
    """Each chunk's figures from its memory marks (a chunk without opened, compiled and settled marks is left out)."""
    out = {}
    for name, phases in phases_by_chunk.items():
        by = {p["phase"]: p for p in phases}
        if not all(k in by for k in ("opened", "compiled", "settled")):
            continue
        base, settled = _both(by["opened"], True), _both(by["settled"], True)
        peaks = [_both(by[k], False) for k in _COMPILE_PHASES if k in by]
        if base is None or settled is None or any(p is None for p in peaks):
            continue
        host_rise = max(float(by[k]["host_peak_mb"]) for k in _COMPILE_PHASES if k in by) - float(by["opened"]["host_rss_mb"])
        gpu = [by[k].get("gpu_peak_mb") for k in _COMPILE_PHASES if k in by]
        gpu_rise = None if any(g is None for g in gpu) else max(gpu) - float(by["opened"].get("gpu_mb") or 0.0)
        out[name] = UnitFigures(round(max(0.0, max(peaks) - base), 1), round(max(0.0, settled - base), 1),
                                round(max(0.0, host_rise), 1), None if gpu_rise is None else round(max(0.0, gpu_rise), 1))
    return out


class ChunkOrder:
    """The compile order of one runner's UNet chunks: read from FOLDER's record (None: no folder, call order), and the
    marks of this launch's compiles written back there."""

    def __init__(self, parts: Sequence[str], folder: Optional[Path], key: tuple[str, str], warn: Callable[[str], None]):
        self.parts, self.key, self.warn = list(parts), key, warn
        self.path = None if folder is None else Path(folder) / CHUNK_FIGURES
        figures = None if self.path is None else read_figures(self.path, *key, warn)
        self.order, self.source = compile_order(self.parts, figures)
        self.recorded = False

    def record(self, phases_by_chunk: dict[str, list[dict]]) -> None:
        """This launch's figures into the record (the larger of each kept), once per launch (a pipelined runner loads
        the chunks again for every prompt); nothing without a folder or figures."""
        if self.recorded or self.path is None:
            return
        units = chunk_figures({p: phases_by_chunk.get(p, []) for p in self.parts})
        if not units:
            return
        self.recorded = True
        try:
            write_figures(self.path, MemoryFigures(self.key[0], self.key[1], 0.0, units))
        except OSError as e:  # a read-only cache folder: the next launch compiles in call order
            self.warn(f"chunk figures {self.path}: not written ({e.strerror or e}); the next launch compiles in call order")

    def report(self) -> dict:
        return {"order": list(self.order), "source": self.source, "figures": None if self.path is None else str(self.path)}
