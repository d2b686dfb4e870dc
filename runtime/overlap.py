"""run-bundle --pipelined --overlap-loads [--memory-budget-mb M]: the next model compiled in a worker process while
the current one loads and runs, within a memory budget checked before anything loads, from measured figures.

Why processes: LiteRT's GPU accelerator compiles one model at a time per process (`compiled_model_create_mutex`),
so a load overlaps another model's load or run only in another process (runtime/load_workers.py). Choi et al. load
the text encoder and decoder in a child thread while the UNet works; here each *unit* -- each part of the text
encoder, the UNet (its chunks together, each run once on zeros after its compile), each part of the decoder -- is
compiled and run in a worker process of its own, in the order of use, and that worker exits as soon as the
pipeline is done with the unit (its GPU memory goes with it). Each pair of consecutive units (A, B) gets a level:

- `load`: B's worker starts as soon as A is the current unit (B compiles while A compiles and runs);
- `run`: B's worker starts once A's models are compiled (B compiles while A runs);
- `none`: B's worker starts when A's has exited (as --pipelined).

At most two workers live at once (the current unit's and the next one's), unless `--overlap-ahead N` (no budget) lets
the N units after the current one compile at once: N + 1 workers, e.g. with the text encoder on the CPU (`--on-cpu
text_encoder`) the UNet and every decoder graph compile together while the text encoder runs. Without a budget every
pair is `load`.

The figures: `memory_figures.json` in the runner's GPU cache folder, written after every overlapped prompt. Each
worker measures itself (memory.SelfMeter): `peak_mb`, its lifetime host high-water mark (the kernel's VmHWM) plus
its polled GPU peak (NVML; none on lavapipe, whose GPU memory is host memory, already in the RSS): an upper bound of
what it held at one moment, from its start through its last run; `resident_mb`, the largest host RSS plus GPU
polled while its models ran, i.e. what it holds while the next unit compiles; and `runner_mb`, the runner's own
process (its host high-water mark, plus its GPU at the end). The interpreter and LiteRT that each worker loads are
in its figures, as they are in its memory; never file sizes. A record with the same key keeps the larger of each
figure over launches (cold and warm alike). The key: the bundle (its components' sha256) and the device identity of
the program cache (LiteRT's version, the Vulkan driver, the GPU and its driver, the accelerator options).

`--memory-budget-mb M` (MB of host + GPU memory at once) reads those figures: none there is an error that names the
run that makes them, a record of another bundle or device one warning and then that error. Then, before anything
loads: a unit with runner + peak > M is refused, naming the unit and the MB (exit 2); a pair is `load` when runner +
peak(A) + peak(B) <= M, else `run` when runner + resident(A) + peak(B) <= M, else `none` (one line says so).
"""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

from pocketdiff.errors import PocketdiffError

from .chunks import UNET
from .load_workers import LoadWorkers

FIGURES = "memory_figures.json"
LOAD, RUN, NONE = "load", "run", "none"
MEASURING_RUN = ("`pocketdiff run-bundle BUNDLE --pipelined --overlap-loads ...` without --memory-budget-mb (the same "
                 "--gpu-cache and --gpu-option)")


def _mb(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a non-negative number of MB, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class UnitFigures:
    """One unit's memory, measured by its worker (MB; module docstring)."""

    peak_mb: float  # host high-water mark + GPU peak, from the worker's start through its last run
    resident_mb: float  # largest host RSS + GPU while its models ran
    host_peak_mb: float
    gpu_peak_mb: Optional[float] = None  # None: no NVML (lavapipe: in the host figure)
    gpu_source: Optional[str] = None

    def __post_init__(self):
        for key in ("peak_mb", "resident_mb", "host_peak_mb", *(["gpu_peak_mb"] if self.gpu_peak_mb is not None else [])):
            _mb(getattr(self, key), key)

    @classmethod
    def measured(cls, m: dict) -> "UnitFigures":
        """From a worker's last SelfMeter window (its run window). The kernel's RSS counters are synchronised lazily, so
        a polled RSS may pass the high-water mark read just before by a few pages: the peak is the larger."""
        run_host, run_gpu = m["window_host_mb"], m.get("window_gpu_mb")
        host = max(m["host_peak_mb"], run_host)
        gpu = None if m.get("gpu_peak_mb") is None else max(m["gpu_peak_mb"], run_gpu or 0.0)
        return cls(round(host + (gpu or 0.0), 1), round(run_host + (run_gpu or 0.0), 1), host, gpu, m.get("gpu_source"))

    def larger(self, other: "UnitFigures") -> "UnitFigures":
        gpu = [g for g in (self.gpu_peak_mb, other.gpu_peak_mb) if g is not None]
        return UnitFigures(max(self.peak_mb, other.peak_mb), max(self.resident_mb, other.resident_mb),
                           max(self.host_peak_mb, other.host_peak_mb), max(gpu) if gpu else None, self.gpu_source or other.gpu_source)


@dataclass(frozen=True)
class MemoryFigures:
    """A bundle's measured memory on one device: the runner's and each unit's (module docstring)."""

    bundle: str  # bundle_digest of its components
    device: str  # the program cache's identity: LiteRT version, driver, GPU, options
    runner_mb: float
    units: dict  # unit name -> UnitFigures
    launches: int = 1  # how many launches' figures were kept (the larger of each)

    def __post_init__(self):
        if not (isinstance(self.bundle, str) and self.bundle and isinstance(self.device, str) and self.device):
            raise ValueError("bundle and device must be non-empty strings")
        _mb(self.runner_mb, "runner_mb")
        if not self.units or not all(isinstance(k, str) and isinstance(v, UnitFigures) for k, v in self.units.items()):
            raise ValueError("units must map unit names to their figures")
        if isinstance(self.launches, bool) or not isinstance(self.launches, int) or self.launches < 1:
            raise ValueError(f"launches must be a positive integer, got {self.launches!r}")

    def to_json(self) -> dict:
        return {"bundle": self.bundle, "device": self.device, "runner_mb": self.runner_mb, "launches": self.launches,
                "units": {k: asdict(v) for k, v in self.units.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "MemoryFigures":
        if not isinstance(data, dict) or not isinstance(data.get("units"), dict):
            raise ValueError("not a memory figures record")
        return cls(data["bundle"], data["device"], data["runner_mb"], {k: UnitFigures(**v) for k, v in data["units"].items()},
                   data.get("launches", 1))

    def merged(self, older: Optional["MemoryFigures"]) -> "MemoryFigures":
        """These figures and an older record of the same key: the larger of each."""
        if older is None or (older.bundle, older.device) != (self.bundle, self.device):
            return self
        units = dict(older.units)
        for name, f in self.units.items():
            units[name] = f.larger(units[name]) if name in units else f
        return MemoryFigures(self.bundle, self.device, max(self.runner_mb, older.runner_mb), units, older.launches + 1)


def _load_record(path: Path) -> MemoryFigures:
    return MemoryFigures.from_json(json.loads(path.read_text()))


def read_figures(path: Path, bundle: str, device: str, warn: Callable[[str], None]) -> Optional[MemoryFigures]:
    """The record at PATH when it belongs to this bundle and device; else None (one warning when there is one)."""
    if not path.is_file():
        return None
    try:
        figures = _load_record(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        warn(f"memory figures {path}: unreadable ({e}); ignored")
        return None
    if figures.bundle != bundle:
        warn(f"memory figures {path}: measured for another bundle; ignored")
        return None
    if figures.device != device:
        warn(f"memory figures {path}: measured with another device, driver, LiteRT version or GPU options; ignored")
        return None
    return figures


def write_figures(path: Path, figures: MemoryFigures) -> MemoryFigures:
    """Write FIGURES to PATH, kept together with a record of the same key already there (the larger of each)."""
    try:
        older = _load_record(path) if path.is_file() else None
    except (OSError, ValueError, KeyError, TypeError):
        older = None  # replaced by what was measured now
    record = figures.merged(older)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record.to_json(), indent=1, sort_keys=True))
    os.replace(tmp, path)
    return record


@dataclass(frozen=True)
class MemoryBudget:
    """--memory-budget-mb: host + GPU memory at once, MB."""

    mb: float

    def __post_init__(self):
        if isinstance(self.mb, bool) or not isinstance(self.mb, (int, float)) or not math.isfinite(self.mb) or self.mb <= 0:
            raise PocketdiffError(f"--memory-budget-mb must be a positive number of MB, got {self.mb!r}")


def check_budget(budget_mb, overlap: bool) -> Optional[MemoryBudget]:
    """The budget run-bundle's flags give (None: none), refused without --overlap-loads."""
    if budget_mb is None:
        return None
    budget = MemoryBudget(budget_mb)
    if not overlap:
        raise PocketdiffError("--memory-budget-mb decides which loads of --overlap-loads overlap: it needs --pipelined "
                              "--overlap-loads")
    return budget


def plan_levels(units: list[str], figures: Optional[MemoryFigures], budget: Optional[MemoryBudget], where: str) -> list[dict]:
    """Per pair of consecutive units: {first, then, level, at_once_mb}; a unit that cannot fit is refused."""
    pairs = list(zip(units, units[1:]))
    if budget is None:
        return [{"first": a, "then": b, "level": LOAD, "at_once_mb": None} for a, b in pairs]
    M = budget.mb
    if figures is None:
        raise PocketdiffError(f"--memory-budget-mb {M:g}: no measured memory figures for this bundle on this device ({where}): "
                              f"run {MEASURING_RUN} once first; it measures every model in its worker and writes them there")
    missing = [u for u in units if u not in figures.units]
    if missing:
        raise PocketdiffError(f"--memory-budget-mb {M:g}: the measured figures ({where}) have none for {', '.join(missing)}: "
                              f"run {MEASURING_RUN} again")
    runner, f = figures.runner_mb, figures.units
    for u in units:
        if runner + f[u].peak_mb > M:
            raise PocketdiffError(f"--memory-budget-mb {M:g}: {u} alone needs {runner + f[u].peak_mb:.0f} MB ({f[u].peak_mb:.0f} MB "
                                  f"measured at its peak + the runner's {runner:.0f} MB; {where}): the bundle cannot run within the budget")
    plan = []
    for a, b in pairs:
        both, during = runner + f[a].peak_mb + f[b].peak_mb, runner + f[a].resident_mb + f[b].peak_mb
        level, at_once = (LOAD, both) if both <= M else (RUN, during) if during <= M else (NONE, runner + max(f[a].peak_mb, f[b].peak_mb))
        plan.append({"first": a, "then": b, "level": level, "at_once_mb": round(at_once, 1), "overlapped_mb": round(during, 1)})
    return plan


class OverlapLoader:
    """The units' worker processes (LoadWorkers(1, measure=True) each), started as the plan lets: `begin()` at each
    prompt, `get(model)` the compiled model (waiting for its worker), `release(model, remote)` after its use (the
    worker exits with its unit's last model, measured first), `record(runner_mb)` the figures after the prompt."""

    def __init__(self, units: list[tuple[str, tuple[str, ...]]], plan: list[dict], load_args: Callable[[str], tuple], sampler,
                 figures_path: Optional[Path], key: tuple[str, str], release_file_pages: bool = False, ahead: int = 1,
                 library: Optional[str] = None):
        self.units, self.plan, self.ahead = units, plan, ahead
        self.library = library  # the runner's LiteRT library: each worker loads the same (runtime/litert_c.py)
        self.release_file_pages = release_file_pages  # each worker gives back its models' file pages (runtime/file_pages.py)
        self.levels = [p["level"] for p in plan]
        self.unit_of = {part: i for i, (_, parts) in enumerate(units) for part in parts}
        self.load_args, self.sampler = load_args, sampler
        self.figures_path, self.key = figures_path, key
        self.workers: dict[int, LoadWorkers] = {}
        self.compiled: set[int] = set()
        self.done: set[int] = set()
        self.released: dict[int, set] = {}
        self.measured: dict[str, UnitFigures] = {}
        self.timeline: list[tuple[str, str]] = []  # (start | compiled | end, unit), in order: what overlapped

    def begin(self) -> None:
        """A prompt starts: every unit loads again; the first one's worker (and the next one's, where the plan lets) starts."""
        self.close()
        self.compiled, self.done, self.released, self.measured, self.timeline = set(), set(), {}, {}, []
        self._advance()

    def _start(self, i: int) -> None:
        name, parts = self.units[i]
        self.timeline.append(("start", name))
        worker = self.workers[i] = LoadWorkers(1, on_start=lambda pid: self.sampler.add_process(pid, own_peak=True), measure=True,
                                               release_file_pages=self.release_file_pages, library=self.library)
        settle = name == UNET and len(parts) > 1  # each chunk's host weight copies go before the next chunk compiles
        worker.submit([(p, *self.load_args(p), settle) for p in parts])

    def _advance(self) -> None:
        current = next((i for i in range(len(self.units)) if i not in self.done), None)
        if current is None:
            return
        if current not in self.workers:
            self._start(current)
        for nxt in range(current + 1, min(current + 1 + self.ahead, len(self.units))):
            level = self.levels[nxt - 1]
            if nxt not in self.workers and nxt not in self.done and (level == LOAD or (level == RUN and current in self.compiled)):
                self._start(nxt)

    def get(self, part: str):
        i = self.unit_of[part]
        if i not in self.workers:
            self._start(i)
        worker = self.workers[i]
        model = worker.get(part)
        if i not in self.compiled and all(p in worker.ready for p in self.units[i][1]):
            self.compiled.add(i)
            self.timeline.append(("compiled", self.units[i][0]))
            self._advance()
        return model

    def release(self, part: str, model) -> None:
        model.close()
        i = self.unit_of[part]
        released = self.released.setdefault(i, set())
        released.add(part)
        if i in self.workers and released >= set(self.units[i][1]):
            self._finish(i)

    def _finish(self, i: int) -> None:
        """Unit I is done: its worker measured, retired from the sampler and stopped; the next units may start."""
        worker = self.workers.pop(i)
        try:
            measured = worker.measure(0)
            self.sampler.retire_process(worker.procs[0].pid)
        finally:
            worker.close()
        if measured:
            self.measured[self.units[i][0]] = UnitFigures.measured(measured)
        self.done.add(i)
        self.timeline.append(("end", self.units[i][0]))
        self._advance()

    def record(self, runner_mb: float) -> Optional[MemoryFigures]:
        """This prompt's figures into the record (when every unit was measured and there is a cache folder)."""
        if self.figures_path is None or set(self.measured) != {u for u, _ in self.units}:
            return None
        try:
            return write_figures(self.figures_path, MemoryFigures(*self.key, round(runner_mb, 1), dict(self.measured)))
        except OSError as e:
            print(f"warning: memory figures {self.figures_path}: not written ({e.strerror or e})", file=sys.stderr)
            return None

    def report(self) -> dict:
        return {"plan": self.plan, "ahead": self.ahead, "timeline": [list(e) for e in self.timeline],
                "figures": str(self.figures_path) if self.figures_path else None,
                "measured": {k: asdict(v) for k, v in self.measured.items()}}

    def close(self) -> None:
        for worker in self.workers.values():
            if worker.procs:
                self.sampler.retire_process(worker.procs[0].pid)
            worker.close()
        self.workers = {}


def check_ahead(ahead, overlap: bool, budget) -> int:
    """--overlap-ahead N: an integer >= 1; above 1 it needs --overlap-loads and no --memory-budget-mb (whose plan is
    made pair by pair)."""
    if ahead is None:
        return 1
    if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 1:
        raise PocketdiffError(f"--overlap-ahead {ahead}: must be a whole number of models, 1 or more")
    if ahead > 1 and (not overlap or budget is not None):
        raise PocketdiffError(f"--overlap-ahead {ahead} compiles that many models ahead in worker processes: it needs "
                              "--pipelined --overlap-loads and no --memory-budget-mb (the budget's plan keeps pairs)")
    return ahead


def overlap_loader(units, cache_folder: Optional[Path], key: tuple[str, str], budget: Optional[MemoryBudget],
                   load_args: Callable[[str], tuple], sampler, warn: Optional[Callable[[str], None]] = None,
                   release_file_pages: bool = False, ahead: int = 1, library: Optional[str] = None) -> OverlapLoader:
    """The loader of an overlapped runner: the budget checked against the measured figures before anything loads (a
    refusal raises; a pair that does not fit overlapped is said in one line)."""
    warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
    path = None if cache_folder is None else Path(cache_folder) / FIGURES
    if budget is not None and path is None:
        raise PocketdiffError("--memory-budget-mb reads the measured figures kept in the GPU cache folder, and this run has "
                              "none (--no-gpu-cache, or the folder is not writable)")
    figures = read_figures(path, *key, warn) if budget is not None else None
    plan = plan_levels([u for u, _ in units], figures, budget, str(path))
    for p in plan:
        if p["level"] == NONE:
            print(f"--memory-budget-mb {budget.mb:g}: {p['first']} and {p['then']} would hold {p['overlapped_mb']:.0f} MB at "
                  f"once (measured); {p['then']} loads after {p['first']} is released", file=sys.stderr)
    return OverlapLoader(units, plan, load_args, sampler, path, key, release_file_pages, ahead, library)
