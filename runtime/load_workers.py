"""A bundle's models compiled in worker processes, so that their loads overlap (run-bundle --load-workers N).

Why: LiteRT's GPU accelerator compiles one model at a time per process. Measured on one H200 (ai-edge-litert
2.3.0 and the 2.4 nightly alike; `benchmarks/bundle_footprint.py parallel`): 4 threads of one process, with one
environment or one per model, take as long as 1, while 4 processes started at once load the same 15 files in
2-3x less wall time. Most of a warm load is per-weight host work on one core (docs/MEASUREMENTS.md, the load
profile), so separate processes are the way to several cores.

Each worker owns one LiteRT environment and the models given to it, compiles them in the order they were
submitted, and runs them on request; inputs and outputs cross as numpy arrays over a pipe (our own processes:
nothing from a user's file is unpickled). The runner holds `RemoteModel`s, which answer like its local models
(`in_names`, `out_names`, `run_all`, `run_s`, `load_s`). The cost is memory: every worker is a process with its
own runtime and GPU context, and what it holds is measured with the runner's (`PeakSampler.add_process`).

With `measure` (run-bundle --overlap-loads: one worker per model, runtime/overlap.py), a worker measures itself
(memory.SelfMeter): each load's answer carries its memory, and `measure` gives its lifetime peaks and what it held
while its models ran; a model loaded with `settle` is run once on zeros at once (its host weight copies go before
the next model of that worker compiles, as the runner settles a UNet's chunks).

The workers are spawned (a fresh interpreter each, no inherited GPU state), so a script of yours that makes a
`BundleRunner(..., load_workers=N)` must guard its entry point with `if __name__ == "__main__":`, as any
multiprocessing program must: each worker imports the main module.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from typing import Optional

import numpy as np

from pocketdiff.errors import PocketdiffError

from .loaded_model import LoadedModel


def check_count(n) -> int:
    """N as a worker count, or a PocketdiffError naming the option."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise PocketdiffError(f"--load-workers must be a positive integer, got {n!r}")
    return n


def settle(model) -> None:
    """One run of a fresh model on zeros (its output discarded, not counted as a run): LiteRT's GPU accelerator
    keeps its host copies of a model's weights until the model's first run."""
    model.run_all({n: np.zeros(d["shape"], np.dtype(d["dtype"])) for n, d in model.in_details.items()})
    model.run_s.pop()


def _serve(conn, measure: bool = False, release_file_pages: bool = False, library: Optional[str] = None) -> None:
    """A worker: one environment (of `library`, the parent's LiteRT library: runtime/litert_c.py); ("load", name, entry,
    options[, settle]) compiles (`release_file_pages`: a fully accelerated model's file pages given back,
    runtime/file_pages.py), ("run", name, arrays) runs, ("close", name) frees one model, ("measure", None) its memory (`measure`), ("stop",) all of them and the environment."""
    from .delegate import prepare_in_process
    from .litert_c import Environment
    from .memory import SelfMeter, return_freed_memory, tune_allocator

    prepare_in_process()
    tune_allocator()
    meter = SelfMeter() if measure else None
    env = Environment(library=library)
    models: dict = {}
    while True:
        msg = conn.recv()
        op, name = msg[0], msg[1] if len(msg) > 1 else None
        try:
            if op == "load":
                m = models[name] = LoadedModel(name, msg[2], "gpu", env=env, gpu_options=msg[3], release_file_pages=release_file_pages)
                if len(msg) > 4 and msg[4]:
                    settle(m)
                    return_freed_memory()
                conn.send(("loaded", name, {"load_s": m.load_s, "fully_accelerated": m.fully_accelerated, "in_names": m.in_names,
                                            "out_names": m.out_names, "in_details": m.in_details, "out_details": m.out_details,
                                            "pages_released": m.pages_released, "memory": meter.window() if meter else None}))
            elif op == "measure":
                conn.send(("measured", name, meter.window() if meter else None))
            elif op == "run":
                t0 = time.perf_counter()
                outs = models[name].model.run(msg[2])
                conn.send(("ran", name, outs, time.perf_counter() - t0))
            elif op == "close":
                models.pop(name).close()
                conn.send(("closed", name))
            elif op == "stop":
                break
        except Exception as e:  # noqa: BLE001 - the runner raises it, naming the model
            conn.send(("error", name, f"{type(e).__name__}: {e}"))
    for m in models.values():
        m.close()
    env.close()
    if meter is not None:
        meter.close()


class RemoteModel:
    """A model compiled in a worker, used like the runner's local `LoadedModel` (same attributes and calls)."""

    def __init__(self, workers: "LoadWorkers", worker: int, name: str, entry: dict, info: dict):
        self.workers, self.worker, self.name, self.entry = workers, worker, name, entry
        self.accelerator = "gpu"
        self.load_s = info["load_s"]
        self.fully_accelerated = info["fully_accelerated"]
        self.in_names, self.out_names = info["in_names"], info["out_names"]
        self.in_details, self.out_details = info["in_details"], info["out_details"]
        self.memory = info.get("memory")  # the worker's own measure at the end of this load (`measure` workers)
        self.pages_released = info.get("pages_released")  # its file's pages given back in the worker (runtime/file_pages.py)
        self.run_s: list[float] = []

    _ordered = LoadedModel._ordered  # the same input checks and dtype casts as a local model
    __call__ = LoadedModel.__call__

    def run_all(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        outs, seconds = self.workers.call(self.worker, ("run", self.name, self._ordered(feeds)), "ran")
        self.run_s.append(seconds)  # the worker's run, as a local model counts it (the pipe's copies are not in it)
        return outs

    def close(self) -> None:
        if self.workers is not None:
            self.workers.call(self.worker, ("close", self.name), "closed")
            self.workers = None


class LoadWorkers:
    """N worker processes (spawned: a fresh interpreter each, no inherited GPU state). `submit` hands every model
    to a worker at once, round-robin in the order given (the order they are first used), so each worker compiles
    its share while the others compile theirs; `get` waits for one. `release_file_pages`: each worker gives back a
    fully accelerated model's file pages once it is compiled (runtime/file_pages.py). `library`: the LiteRT library the
    workers load (the parent's: runtime/litert_c.py; None: the default)."""

    def __init__(self, n: int, on_start=None, measure: bool = False, release_file_pages: bool = False,
                 library: Optional[str] = None):
        check_count(n)
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for i in range(n):
            here, there = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(there, measure, release_file_pages, library), name=f"pocketdiff-load-worker-{i}", daemon=True)
            p.start()
            there.close()
            self.conns.append(here)
            self.procs.append(p)
            if on_start is not None:
                on_start(p.pid)
        self.where: dict[str, int] = {}
        self.ready: dict[str, RemoteModel] = {}
        self.entries: dict[str, dict] = {}

    def submit(self, models: list[tuple]) -> None:
        """(name, manifest entry, accelerator options[, settle]) for each model, in the order of first use; `settle`:
        run it once on zeros right after its compile (`settle`)."""
        for k, (name, entry, options, *settle) in enumerate(models):
            if name in self.where:
                continue
            w = k % len(self.conns)
            self.where[name], self.entries[name] = w, entry
            self.conns[w].send(("load", name, entry, options, bool(settle and settle[0])))

    def measure(self, w: int = 0) -> Optional[dict]:
        """Worker W's own measure (memory.SelfMeter.window; None unless made with `measure`)."""
        return self.call(w, ("measure", None), "measured")[0]

    def get(self, name: str) -> RemoteModel:
        """The compiled model NAME (waiting for its worker to reach it); a PocketdiffError naming it if it failed."""
        if name not in self.ready:
            if name not in self.where:
                raise PocketdiffError(f"{name}: not submitted to a load worker")
            w = self.where[name]
            while name not in self.ready:
                got = self._recv(w)
                if got[0] != "loaded":
                    raise PocketdiffError(f"load worker {w}: expected a compiled model, got {got[0]}")
                self._keep(w, got)
        return self.ready[name]

    def _keep(self, w: int, got: tuple) -> None:
        """A ("loaded", name, info) answer of worker W: the model, ready to run there."""
        self.ready[got[1]] = RemoteModel(self, w, got[1], self.entries[got[1]], got[2])

    def call(self, w: int, msg: tuple, want: str):
        """Send MSG to worker W and wait for its answer (any pending load answers before it are kept)."""
        self.conns[w].send(msg)
        while True:
            got = self._recv(w)
            if got[0] == "loaded":
                self._keep(w, got)
                continue
            if got[0] != want:
                raise PocketdiffError(f"load worker {w}: expected {want}, got {got[0]}")
            return got[2:]

    def _recv(self, w: int) -> tuple:
        try:
            got = self.conns[w].recv()
        except EOFError:
            raise PocketdiffError(f"load worker {w} (pid {self.procs[w].pid}) exited (exit code {self.procs[w].exitcode})") from None
        if got[0] == "error":
            raise PocketdiffError(f"{got[1]}: in load worker {w}: {got[2]}")
        return got

    def close(self, timeout: Optional[float] = 30.0) -> None:
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
