"""A bundle's models, loaded, kept and released as a loading policy says: the loading half of run-bundle.

`ModelPool` owns everything about when and where a model lives, and nothing about what it computes (that is the
pipeline's, runtime/pipeline.py): the loading policy (runtime/managed_model.py: plain, pipelined, streamed, workers,
overlapped), the LiteRT environments (plain: one shared; pipelined: one per model, a chunked model's chunks together,
destroyed with it, since LiteRT frees a model's GPU memory only with its environment), the accelerator's options and
compiled-program cache (runtime/gpu_cache.py), the load workers (runtime/load_workers.py) and the overlapped loader
(runtime/overlap.py), a chunked model's compile order (runtime/compile_order.py) and the memory marks of every phase
(runtime/memory.py). The pipeline asks for a model by name (`load`), says when its use is over (`done`: the policy
decides whether it goes), and marks its runs (`ran`).
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence, Union

from .chunks import StreamedPart, base_of
from .compile_ahead import CompileAhead
from .compile_order import ChunkOrder
from .components import whole_of
from .gpu_cache import bundle_digest
from .load_workers import LoadWorkers, settle
from .loaded_model import LoadedModel
from .managed_model import PIPELINED, LoadingPolicy, ManagedModel
from .memory import PeakSampler, process_age_s, return_freed_memory, tune_allocator
from .overlap import overlap_loader

_env_group = base_of  # the LiteRT environment a model shares when pipelined: a chunk's is its model's


class ModelPool:
    """The models `names` (every model the pipeline may use, in the order of use) of one bundle.

    `units`: (unit, its models) in the order of use, for the overlapped loader (a chunked denoiser's chunks are one
    unit); `chunk_group`: the chunks whose compile order is learnt between launches (pipelined, GPU). `on_cpu`: whole
    components whose models run on the CPU (XNNPACK, in this process, their int8 files' CPU variants kept in the program
    cache's folder) while the others use `accelerator` gpu: the workers and the overlapped loader compile only the GPU
    models, so a CPU text encoder loads and runs while they compile. `overlap_ahead`: how many units after the current
    one the overlapped loader compiles at once (runtime/overlap.py). `compile_ahead` (pipelined): the first GPU unit
    compiles in a thread while the CPU units before it load and run, and the unit after the denoiser's during its steps
    (runtime/compile_ahead.py)."""

    def __init__(self, bundle: Union[str, Path], man: dict, names: Sequence[str], units: list, policy: LoadingPolicy,
                 accelerator: str, gpu_cache: Union[str, Path, None, bool] = None, gpu_options: Optional[dict] = None,
                 release_file_pages: bool = True, budget=None, chunk_group: Sequence[str] = (), on_cpu: Sequence[str] = (),
                 overlap_ahead: int = 1, compile_ahead: bool = False, weight_cache: bool = False):
        self.bundle, self.man, self.comps, self.policy, self.accelerator = bundle, man, man["components"], policy, accelerator
        self.on_cpu = tuple(on_cpu) if accelerator == "gpu" else ()
        self.placed: dict[str, str] = {}  # every model loaded so far: the accelerator it ran on (cpu | gpu)
        tune_allocator()  # large buffers the accelerator frees go back to the system at once (runtime/memory.py)
        self.sampler = PeakSampler()
        self.phases: list[dict] = []
        self.runs_seen: dict[str, int] = {}
        self.driver, self.env, self.cache, self.gpu_identity = "n/a", None, None, ""
        self.weight_cache, self.library = bool(weight_cache) and accelerator == "gpu", None  # library: litert_c's, GPU runs
        self.own_envs: dict = {}  # pipelined: one environment per loaded model
        self.gpu_options = dict(gpu_options or {})  # the accelerator's options (runtime/litert_c.py: GPU_OPTION_KEYS)
        self.release_file_pages = bool(release_file_pages) and accelerator == "gpu"
        if accelerator == "gpu":
            self._prepare_gpu(gpu_cache)
        # every model the pipeline may use, loaded on use and released on request (runtime/managed_model.py)
        self.models = {n: ManagedModel(n, functools.partial(self._open, n), functools.partial(self._close, n)) for n in names}
        self.accelerated: dict[str, bool] = {}  # every model loaded so far on the run's accelerator: fully on it
        self.workers = self.overlap = None
        self.units = [(u, tuple(parts)) for u, parts in units]
        self.ahead = CompileAhead() if compile_ahead else None  # pipelined: the next GPU model compiled in a thread
        cache_folder = self.cache.folder if self.cache is not None and self.cache.enabled else None
        self.cpu_variants = None if cache_folder is None else Path(cache_folder) / "cpu"  # int8 files' CPU variants, kept
        self.xnnpack = None  # CPU models' packed weights, kept beside them (runtime/xnnpack_cache.py)
        if cache_folder is not None and self.on_cpu:
            from .xnnpack_cache import SUBFOLDER, XnnpackWeightCache

            self.xnnpack = XnnpackWeightCache(Path(cache_folder) / SUBFOLDER)
        if policy.overlap:  # the budget checked from measured figures before anything loads (runtime/overlap.py)
            gpu_units = [(u, tuple(p for p in parts if self.accelerator_of(p) == "gpu")) for u, parts in units]
            self.overlap = overlap_loader([(u, parts) for u, parts in gpu_units if parts], cache_folder,
                                          (bundle_digest(self.comps), self.gpu_identity), budget,
                                          lambda n: (self.comps[n], self.options_for(n)), self.sampler,
                                          release_file_pages=self.release_file_pages, ahead=overlap_ahead,
                                          library=self.library_name)
        self.chunk_order = None  # pipelined, chunks kept: the order they compile in (runtime/compile_order.py)
        if policy.name == PIPELINED and accelerator == "gpu" and len(chunk_group) > 1:
            self.chunk_order = ChunkOrder(tuple(chunk_group), cache_folder, (bundle_digest(self.comps), self.gpu_identity),
                                          lambda msg: print(f"warning: {msg}", file=sys.stderr))
        if policy.load_workers:  # last: nothing after this can fail and leave them running
            self.workers = LoadWorkers(policy.load_workers, on_start=self.sampler.add_process,
                                       release_file_pages=self.release_file_pages, library=self.library_name)

    @property
    def library_name(self) -> Optional[str]:
        """The LiteRT library this process loaded (runtime/litert_c.py), for the workers to load the same one."""
        return self.library.which if self.library is not None else None

    def _prepare_gpu(self, gpu_cache) -> None:
        """The Vulkan driver, the LiteRT library (the single build with the weight cache), the cache folder, and the
        identity its keys hold: the library's, the GPU's and driver's, the options."""
        from .delegate import prepare_in_process
        from .gpu_cache import GpuProgramCache, bundle_cache_folder, library_identity, litert_version, write_error
        from .litert_c import DEFAULT_LIBRARY, SINGLE_BUILD, Environment, LiteRtLibrary

        self.driver = prepare_in_process()
        self.library = LiteRtLibrary.shared(SINGLE_BUILD if self.weight_cache else None)  # None: the loaded one, else the default
        self.env = None if self.policy.own_environments or self.policy.overlap else Environment()
        folder = None
        if gpu_cache is not False:
            folder = Path(gpu_cache) if gpu_cache not in (None, True) else bundle_cache_folder(self.bundle, self.comps)
        version = litert_version()
        if self.library.which != DEFAULT_LIBRARY:  # remembered in the folder when it can be written (its warning: below)
            version = library_identity(self.library.path, folder,  # a read-only folder's record is read, not written
                                       lambda msg: print(f"warning: {msg}", file=sys.stderr),
                                       write=folder is not None and write_error(folder) is None)
        gpu = self.sampler.gpu  # what compiled programs and measured memory figures depend on besides the bundle
        self.gpu_identity = "|".join([version, self.driver, str(gpu.name), str(gpu.driver_version()),
                                      os.environ.get("VK_ICD_FILENAMES", ""), json.dumps(self.gpu_options, sort_keys=True)])
        if folder is not None:
            self.cache = GpuProgramCache(folder, self.gpu_identity, weight_cache=self.weight_cache)

    # ------------------------------------------------------------------ state and marks

    @property
    def loaded(self) -> dict:
        """The models resident now, by name."""
        return {n: m.model for n, m in self.models.items() if m.loaded}

    def mark(self, component: str, phase: str, **extra) -> None:
        """A memory mark of one phase (runtime/memory.py), kept in the run's phases and the model's own."""
        age = process_age_s()
        self.phases.append({"component": component, "phase": phase, "t_s": None if age is None else round(age, 3), **self.sampler.mark(),
                            **extra})
        if component in self.models:
            self.models[component].phases.append(self.phases[-1])

    def ran(self, name: str) -> None:
        """Mark a model's first run and its second (steady) one."""
        n = self.runs_seen[name] = self.runs_seen.get(name, 0) + 1
        if n <= 2:
            self.mark(name, "first_run" if n == 1 else "steady_run")

    def accelerator_of(self, name: str) -> str:
        """Where model NAME runs: cpu for a model of an `on_cpu` component, else the runner's accelerator."""
        return "cpu" if whole_of(name) in self.on_cpu else self.accelerator

    def options_for(self, name: str) -> dict:
        """The accelerator's options for one model: the user's, int8 kept int8 where exported so, the program cache."""
        options = dict(self.gpu_options)
        if (self.comps[name].get("int8") or {}).get("storage") == "direct":  # export int8.gpu_weights: direct
            options.setdefault("allow_src_quantized_fc_conv_ops", True)  # the accelerator's int8 kernels: weights kept int8
        if self.cache is not None:
            options.update(self.cache.options_for(name, self.comps[name]))
        return options

    # ------------------------------------------------------------------ loading and release

    def begin(self) -> None:
        """A prompt starts: the overlapped loader's first worker starts (and the next one's, as the budget lets)."""
        if self.overlap is not None:
            self.overlap.begin()
        if self.ahead is not None:  # the first GPU unit, when CPU units come before it (a text encoder on the CPU)
            first = next((i for i, (_, parts) in enumerate(self.units) if any(self.accelerator_of(p) == "gpu" for p in parts)), 0)
            if first > 0:
                self._compile_ahead(first)

    def _compile_ahead(self, i: int) -> None:
        """Unit I's GPU models not resident, compiled in the thread (a chunked one's in its compile order, each settled)."""
        parts = self.units[i][1] if i < len(self.units) else ()
        if self.chunk_order is not None and set(parts) == set(self.chunk_order.order):
            parts = self.chunk_order.order
        names = [p for p in parts if self.accelerator_of(p) == "gpu" and not self.models[p].loaded]
        if names:
            self.ahead.submit(names, functools.partial(self._load_ahead, len(parts) > 1))

    def _load_ahead(self, settled: bool, names) -> None:
        """In the thread: each model loaded (a chunk run once on zeros and the freed heap returned before the next)."""
        for name in names:
            m = self.models[name].get()
            if settled:
                settle(m)
                self.mark(name, "settled")
                return_freed_memory()

    def load_up_front(self, names: Sequence[str], latency: dict) -> None:
        """Plain and workers: every model loaded now (workers: all submitted at once, spread in the order of use)."""
        if not self.policy.up_front:
            return
        if self.workers is not None:
            self.workers.submit([(n, self.comps[n], self.options_for(n)) for n in names
                                 if n not in self.loaded and self.accelerator_of(n) == "gpu"])
        for name in names:
            self.load(name, latency)

    def load(self, name: str, latency: dict) -> LoadedModel:
        """The managed model NAME, loaded now if it is not resident (its load's seconds into `latency`)."""
        managed = self.models[name]
        waited = self.ahead.wait(name) if self.ahead is not None else None  # compiled in the thread: wait for it
        fresh, t0 = not managed.loaded or waited is not None, time.perf_counter()
        m = managed.get()
        if waited is not None:
            latency[f"{name}_wait"] = waited  # the part of its load the stage before did not hide
        if fresh:
            self.placed[name] = getattr(m, "accelerator", None) or self.accelerator_of(name)  # the loaded model's own word
            if self.cache is not None and self.placed[name] == "gpu":
                self.cache.record(name)
            if self.placed[name] == "gpu" or self.accelerator == "cpu":  # a GPU run's --on-cpu models are not counted
                self.accelerated[name] = m.fully_accelerated
            latency[f"{name}_load"] = m.load_s
            if self.overlap is not None:  # compiled in its worker: how long the pipeline waited (the load time not hidden)
                latency[f"{name}_wait"] = time.perf_counter() - t0
        return m

    def load_group(self, parts: Sequence[str], latency: dict) -> list:
        """A chunked model's parts, loaded one after another and kept for every step. Each fresh chunk runs once on
        zeros before the next compiles (the accelerator lets a model's host weight copies go at its first run);
        pipelined, the heap its compile freed goes back to the system first (one compile transient at a time)."""
        order = self.chunk_order.order if self.chunk_order is not None else tuple(parts)
        fresh = [n for n in order if not self.models[n].loaded and not (self.ahead and self.ahead.in_flight(n))]  # the thread settles its own
        loaded = {}
        for name in order:
            loaded[name] = self.load(name, latency)
            if name in fresh and self.accelerator_of(name) == "gpu" and len(parts) > 1 and self.overlap is None:  # its worker settles it
                settle(loaded[name])  # not a step: the latency report counts the sampling runs only
                self.mark(name, "settled")
                if self.policy.release_after_use:
                    return_freed_memory()
        if fresh and self.chunk_order is not None:  # what each compile needed, for the next launch's order
            self.chunk_order.record({n: self.models[n].phases for n in fresh})
        if self.ahead is not None:  # the unit after this group compiles in the thread during its runs (the UNet's steps)
            self._compile_ahead(1 + next((i for i, (_, ps) in enumerate(self.units) if parts[0] in ps), len(self.units)))
        return [loaded[n] for n in parts]

    def streamed(self, parts: Sequence[str], latency: dict) -> list:
        """A chunked model's chunks as StreamedParts: each loaded for each run and released after it (one chunk in
        memory at a time; `<base>_streamed_loads` sums their load seconds)."""
        key = f"{base_of(parts[0])}_streamed_loads"
        latency[key] = 0.0

        def load(name: str) -> LoadedModel:
            model = self.load(name, latency)
            latency[key] += model.load_s
            return model

        return [StreamedPart([i["name"] for i in self.comps[name]["inputs"]], functools.partial(load, name),
                             functools.partial(self.ran, name), functools.partial(self.release, name)) for name in parts]

    def done(self, name: str) -> None:
        """NAME's use is over: the policy says whether it goes now (pipelined) or stays (plain, workers)."""
        if self.policy.releases(whole_of(name)):  # a kept component keeps all its models (chunks, tiled parts)
            self.release(name)

    def release(self, name: str) -> None:
        self.models[name].release()

    def _open(self, name: str):
        """Compile NAME: in its load worker (`workers`, `overlapped`), else here, in the environment the policy gives it;
        a model on the CPU here, always."""
        mark = lambda phase, **extra: self.mark(name, phase, **extra)  # noqa: E731
        if self.accelerator_of(name) == "cpu" and self.accelerator == "gpu":
            return LoadedModel(name, self.comps[name], "cpu", on_phase=mark, cpu_variant_dir=self.cpu_variants,
                               cpu_threads=len(os.sched_getaffinity(0)),  # every core this process may use
                               xnnpack_cache=self.xnnpack)
        if self.workers is not None or self.overlap is not None:
            m = (self.workers or self.overlap).get(name)
            self.mark(name, "compiled")
            if m.pages_released is not None:  # given back in its worker, before it answered
                self.mark(name, "pages_released", **m.pages_released)
            return m
        return LoadedModel(name, self.comps[name], self.accelerator, env=self._environment_for(name),
                           gpu_options=self.options_for(name), on_phase=mark, release_file_pages=self.release_file_pages)

    def _environment_for(self, name: str):
        """Plain: the one shared environment. Pipelined: an environment of the model's own (a chunked model's chunks
        share one), destroyed with it: LiteRT gives a model's GPU memory back only when its environment goes."""
        if self.accelerator != "gpu":
            return None
        if not self.policy.own_environments:
            return self.env
        from .litert_c import Environment

        group = _env_group(name)
        if group not in self.own_envs:
            self.own_envs[group] = Environment()
        return self.own_envs[group]

    def _close(self, name: str, m) -> None:
        """Free a released model, and its environment when no other resident model shares it (overlapped: its worker
        goes with its unit's last model)."""
        if self.overlap is not None and self.accelerator_of(name) == "gpu":
            self.overlap.release(name, m)
        else:
            m.close()
        group = _env_group(name)
        env = None if any(_env_group(n) == group for n in self.loaded) else self.own_envs.pop(group, None)
        if env is not None:
            env.close()
        return_freed_memory()
        self.mark(name, "released")

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()  # what it was loading is resident then, and released below
        for name in list(self.loaded):
            self.release(name)
        for pool in (self.workers, self.overlap):
            if pool is not None:
                pool.close()
        self.workers = None
        if self.env is not None:
            self.env.close()
            self.env = None
        self.sampler.close()

    # ------------------------------------------------------------------ reports

    def record_overlap(self, host_peak_now_mb: float) -> None:
        """Each model's measured memory after a prompt, for --memory-budget-mb (runtime/overlap.py)."""
        if self.overlap is not None:
            own_gpu = self.sampler.gpu.pid_mb(os.getpid()) if self.sampler.gpu.available else None
            self.overlap.record(max(self.sampler.host_peak_total_mb, host_peak_now_mb) + (own_gpu or 0.0))

    def memory_report(self) -> dict:
        """Measured: the whole run's peaks (host, GPU, host + GPU) and every phase; the cache's state."""
        released = [p["released_mb"] for p in self.phases if p["phase"] == "pages_released"]
        return {**self.sampler.totals(), "phases": list(self.phases),
                "release_file_pages": self.release_file_pages, "pages_released_mb": round(sum(released), 1),
                "gpu_cache": self.cache.summary() if self.cache is not None else None,
                "litert_library": f"{self.library.which} ({self.library.path.name})" if self.library is not None else None,
                "loading_policy": self.policy.name, "models": {n: m.memory() for n, m in self.models.items() if m.loads},
                "accelerator_by_model": dict(self.placed), "environments": "own" if self.policy.own_environments else "workers" if self.policy.overlap or self.policy.load_workers else "one",
                **({"overlap": self.overlap.report()} if self.overlap is not None else {}),
                **({"compiled_ahead": list(self.ahead.asked)} if self.ahead is not None else {}),
                **({"unet_compile_order": self.chunk_order.report()} if self.chunk_order is not None else {})}
