#!/usr/bin/env python
"""Memory and start-up of a bundle on the LiteRT GPU delegate, measured (never file sizes).

  probe    one .tflite in a fresh process through pocketdiff.runtime.litert_c: per phase (file opened,
           compiled, first run, steady run, released) host RSS and its peak (the kernel's VmHWM), the
           process's GPU memory (NVML) and the wall time, under a set of the accelerator's GPU options
           (`--options '{"convert_weights_on_gpu": true}'`) and an optional cache folder. One JSON row.
  matrix   `probe` for each named option set, each in its own process, cold then warm where a cache is
           used: which options move the memory and the load time, side by side in one run.
  chain    a UNet's chunk files (export unet_chunks: K) in one process: compiled one after another, run in
           sequence; beside `probe` of each chunk alone and of the whole unet.tflite.
  stream   a UNet's chunks loaded, run once and released in turn, over several rounds, in one environment kept
           throughout or one per load (run-bundle --stream-unet's way): time per load, GPU left after each release.
  parallel a bundle's model files compiled by N threads at once in one process (one environment, or one per model
           with --env-each), or split over P processes started at once (--procs), cold then warm program cache:
           whether LiteRT's per-model load (host work on one core) overlaps.
  runs     `pocketdiff run-bundle` end to end (its own report: per-phase memory, start_s, total_s), plain
           and --pipelined (and --stream-unet, --load-workers N, --overlap-loads [--memory-budget-mb N], --keep-file-pages;
           callorder: --pipelined with a chunked UNet's chunks compiled in call order), cold (empty
           cache folder) then warm (the same folder), per bundle layout.
The committed benchmarks/results/bundle_footprint_*.json hold these rows as they came back (`runs`: layout,
resolution, mode, launch, unet_chunks, host_peak_mb, gpu_peak_mb, start_s, total_s, device, memory.phases (a UNet in
chunks: per chunk, unet.0, unet.1, ...); `probes`: per model file, each chunk alone), each tagged with the device call and the runner version it came from.

  python benchmarks/bundle_footprint.py matrix B/unet.tflite --sets base,gpu_convert --out $OUT/probe_unet.json
  python benchmarks/bundle_footprint.py runs B:student B2:cfg --out $OUT/runs.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# option sets the matrix compares (the accelerator's TOML keys: pocketdiff.runtime.litert_c.GPU_OPTION_KEYS)
OPTION_SETS = {
    "base": {},
    "madvise": {"madvise_original_shared_tensors": True},
    "gpu_convert": {"convert_weights_on_gpu": True, "wait_for_weights_conversion_complete": True},
    "gpu_convert_madvise": {"convert_weights_on_gpu": True, "wait_for_weights_conversion_complete": True,
                            "madvise_original_shared_tensors": True},
    "single_delegate": {"hint_fully_delegated_to_single_delegate": True},
    "lean": {"convert_weights_on_gpu": True, "wait_for_weights_conversion_complete": True,
             "madvise_original_shared_tensors": True, "num_threads_to_upload": 1},
    "upload1": {"num_threads_to_upload": 1, "madvise_original_shared_tensors": True},
    "no_shader_opt": {"disable_shader_optimization": True},
    "fast_compile": {"disable_shader_optimization": True, "num_threads_to_compile": 8},
    "trim": {"allocator": "trim"},
    "tuned": {"allocator": "tuned"},
    "tuned_programs_only": {"allocator": "tuned", "cache_only_compiled_programs": True},
    "fp16": {"allocator": "tuned", "precision": "fp16"},
    "textures": {"allocator": "tuned", "prefer_texture_weights": True},
    "int8_kernels": {"allow_src_quantized_fc_conv_ops": True},  # what run-bundle asks for an int8.storage: direct component
}
CACHED = {"serialize_program_cache": True}
CACHED_WEIGHTS = {"serialize_program_cache": True, "serialize_external_tensors": True}


def _feeds(specs) -> list:
    import numpy as np

    rng = np.random.default_rng(0)
    out = []
    for s in specs:
        if np.issubdtype(s.dtype, np.integer):
            out.append(np.zeros(s.shape, s.dtype))
        else:
            out.append(rng.standard_normal(s.shape).astype(s.dtype) * 0.5)
    return out


def _phase_recorder():
    """(driver, sampler, phases, mark): the delegate set up in this process, a PeakSampler started, and
    `mark(name)` appending {phase, t_s since now, host / GPU memory} to `phases`."""
    from pocketdiff.runtime.delegate import prepare_in_process
    from pocketdiff.runtime.memory import PeakSampler

    t_start = time.perf_counter()
    driver = prepare_in_process()
    sampler, phases = PeakSampler(), []

    def mark(name: str) -> None:
        phases.append({"phase": name, "t_s": round(time.perf_counter() - t_start, 3), **sampler.mark()})

    return driver, sampler, phases, mark


def probe(path: str, options: dict, cache: str | None, key: str) -> dict:
    """One model, one process: the phases with their memory and time. `options` may hold "allocator":
    "trim" (malloc_trim after release) or "tuned" (mmap threshold set first, and trim)."""
    import numpy as np

    from pocketdiff.runtime.litert_c import CompiledModel, Environment
    from pocketdiff.runtime.memory import return_freed_memory, tune_allocator

    options = dict(options)
    allocator = options.pop("allocator", None)
    if allocator == "tuned":
        tune_allocator()
    driver, sampler, phases, mark = _phase_recorder()
    mark("start")
    env = Environment()
    mark("environment")
    opts = dict(options)
    if cache:
        Path(cache).mkdir(parents=True, exist_ok=True)
        opts.update(serialization_dir=str(cache), model_cache_key=key)
    model = CompiledModel(path, env, opts, on_phase=mark)
    fully = model.fully_accelerated()
    feeds = _feeds(model.inputs)
    outs = model.run(feeds)
    mark("first_run")
    times = []
    for _ in range(5):  # steady runs: the median of five
        t0 = time.perf_counter()
        outs = model.run(feeds)
        times.append(time.perf_counter() - t0)
    steady = sorted(times)[2]
    mark("steady_run")
    finite = all(bool(np.isfinite(o).all()) for o in outs)
    model.close()
    if allocator:
        return_freed_memory()
    mark("released")
    env.close()
    mark("environment_released")
    totals = sampler.totals()
    sampler.close()
    load = next(p["t_s"] for p in phases if p["phase"] == "compiled") - next(p["t_s"] for p in phases if p["phase"] == "environment")
    return {"model": Path(path).name, "file_mb": round(Path(path).stat().st_size / 2**20, 1), "options": options,
            "allocator": {None: "glibc default", "trim": "glibc default + malloc_trim after release",
                          "tuned": "mmap threshold 1 MB + malloc_trim"}[allocator],
            "cache": bool(cache), "driver": driver, "fully_accelerated": fully, "finite": finite,
            "load_s": round(load, 2), "steady_run_s": round(steady, 4), "phases": phases, **totals,
            "cache_files": sorted(f"{p.name}:{p.stat().st_size}" for p in Path(cache).iterdir()) if cache else None}


def chain(paths: list[str], options: dict, cache: str | None, key: str, settle: bool = False) -> dict:
    """A UNet's chunk files in one process, as `run-bundle --pipelined` holds them: compiled one after another in
    one environment (the freed heap returned after each compile; `settle`: each chunk also run once right after
    its compile, as the runner does), then run in sequence (each fed random inputs of its own shapes: memory and
    time, not values), released together. Phases per chunk."""
    from pocketdiff.runtime.litert_c import CompiledModel, Environment
    from pocketdiff.runtime.memory import return_freed_memory, tune_allocator

    tune_allocator()
    driver, sampler, phases, mark = _phase_recorder()
    env = Environment()
    mark("environment")
    models = []
    for path in paths:
        stem = Path(path).stem
        opts = dict(options)
        if cache:
            Path(cache).mkdir(parents=True, exist_ok=True)
            opts.update(serialization_dir=str(cache), model_cache_key=f"{key}-{stem}")
        models.append((stem, CompiledModel(path, env, opts, on_phase=lambda ph, stem=stem: mark(f"{stem}.{ph}"))))
        if settle:
            models[-1][1].run(_feeds(models[-1][1].inputs))
            mark(f"{stem}.settled")
        return_freed_memory()
        mark(f"{stem}.trimmed")
    feeds = [_feeds(m.inputs) for _, m in models]
    for (stem, m), f in zip(models, feeds):
        m.run(f)
        mark(f"{stem}.first_run")
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for (_, m), f in zip(models, feeds):
            m.run(f)
        times.append(time.perf_counter() - t0)
    mark("steady_run")
    fully = all(m.fully_accelerated() for _, m in models)
    for _, m in models:
        m.close()
    return_freed_memory()
    mark("released")
    env.close()
    totals = sampler.totals()
    sampler.close()
    return {"models": [Path(p).name for p in paths], "file_mb": [round(Path(p).stat().st_size / 2**20, 1) for p in paths],
            "options": options, "cache": bool(cache), "driver": driver, "fully_accelerated": fully,
            "load_s": round(next(p["t_s"] for p in phases if p["phase"] == f"{models[-1][0]}.trimmed") - phases[0]["t_s"], 2),
            "steady_run_s": round(sorted(times)[2], 4), "phases": phases, **totals}


def stream(paths: list[str], rounds: int, env_each: bool, cache: str, marks: bool = False) -> dict:
    """A UNet's chunks as `run-bundle --stream-unet` uses them, ROUNDS times over: each loaded (program cache in
    CACHE), run once, released, before the next loads; in one environment kept throughout, or (`env_each`, what the
    runner does) an environment per load, destroyed with the model. Per load its seconds; the GPU and host peaks
    (does a kept environment pile up what the released chunks held, or reuse it?). `marks`: a memory mark between
    the file's opening and its compile, as run-bundle's per-phase report makes one."""
    from pocketdiff.runtime.litert_c import CompiledModel, Environment
    from pocketdiff.runtime.memory import return_freed_memory, tune_allocator

    tune_allocator()
    driver, sampler, phases, mark = _phase_recorder()
    Path(cache).mkdir(parents=True, exist_ok=True)
    shared = None if env_each else Environment()
    loads, gpu_after = [], []
    t0 = time.perf_counter()
    for r in range(rounds):
        for path in paths:
            stem = Path(path).stem
            env = Environment() if env_each else shared
            t1 = time.perf_counter()
            on_phase = (lambda ph, stem=stem, r=r: mark(f"{r}.{stem}.{ph}")) if marks else None
            model = CompiledModel(path, env, {**CACHED, "serialization_dir": cache, "model_cache_key": stem}, on_phase=on_phase)
            loads.append(round(time.perf_counter() - t1, 3))
            model.run(_feeds(model.inputs))
            model.close()
            if env_each:
                env.close()
            return_freed_memory()
            mark(f"{r}.{stem}.released")
            gpu_after.append(phases[-1]["gpu_mb"])
    wall = time.perf_counter() - t0
    if shared is not None:
        shared.close()
    mark("end")
    totals = sampler.totals()
    sampler.close()
    return {"models": [Path(p).name for p in paths], "rounds": rounds, "environments": "each" if env_each else "shared", "marks": marks,
            "driver": driver, "wall_s": round(wall, 2), "load_s": loads, "load_sum_s": round(sum(loads), 2),
            "gpu_mb_after_each_release": gpu_after, "phases": phases, **totals}


def load_together(paths: list[str], threads: int, cache: str, env_each: bool = False) -> dict:
    """Every model compiled by THREADS threads at once in one environment (`env_each`: an environment per model, as
    run-bundle --pipelined makes them), the program cache in CACHE (one key per file), each then run once on its
    own random inputs; the wall time of the loads (and their wall-clock window, to line up several processes), each
    load's seconds, the peaks, and where the LiteRT libraries sit in memory (to read a native profile)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from pocketdiff.runtime.litert_c import CompiledModel, Environment
    from pocketdiff.runtime.memory import tune_allocator

    tune_allocator()
    driver, sampler, phases, mark = _phase_recorder()
    env = Environment()
    mark("environment")
    Path(cache).mkdir(parents=True, exist_ok=True)
    envs = [env]

    def load(path: str):
        t0 = time.perf_counter()
        own = env
        if env_each:
            own = Environment()
            envs.append(own)
        model = CompiledModel(path, own, {**CACHED, "serialization_dir": cache, "model_cache_key": Path(path).stem})
        return model, round(time.perf_counter() - t0, 2)

    t0, unix0 = time.perf_counter(), time.time()
    with ThreadPoolExecutor(threads) as pool:
        loaded = list(pool.map(load, paths))
    wall, unix1 = time.perf_counter() - t0, time.time()
    mark("compiled")
    def run_once(model) -> bool | str:
        try:
            return all(bool(np.isfinite(o).all()) for o in model.run(_feeds(model.inputs)))
        except Exception as e:  # noqa: BLE001 - a model that cannot run is a row's finding, not the end of the run
            return f"run failed: {e}"

    finite = [run_once(m) for m, _ in loaded]
    mark("first_run")
    fully = all(m.fully_accelerated() for m, _ in loaded)
    for m, _ in loaded:
        m.close()
    for e in envs:
        e.close()
    mark("released")
    totals = sampler.totals()
    sampler.close()
    maps = sorted({line.split()[-1]: line.split("-")[0] for line in open("/proc/self/maps")
                   if "libLiteRt" in line and " r-xp " in line}.items())
    return {"models": [Path(p).name for p in paths], "threads": threads, "environments": "each" if env_each else "shared",
            "driver": driver, "load_wall_s": round(wall, 2), "load_window_unix": [round(unix0, 3), round(unix1, 3)],
            "load_each_s": [s for _, s in loaded], "load_sum_s": round(sum(s for _, s in loaded), 2), "finite": finite,
            "fully_accelerated": fully, "phases": phases, **totals, "code_at": dict(maps)}


def _last_json(stdout: str) -> dict | None:
    """The last JSON object line a child printed (LiteRT's own lines go before it), or None."""
    line = next((l for l in reversed(stdout.splitlines()) if l.startswith("{")), None)
    return None if line is None else json.loads(line)


def _together_processes(groups: list[list[str]], threads: int, env_each: bool, folder: Path, timeout: float) -> dict:
    """One `together` process per group of files, all started at once; each one's row, and the window from the first
    load's start to the last load's end across them (`load_wall_s`), or an error naming the process that failed."""
    env = dict(os.environ, __GL_SHADER_DISK_CACHE_PATH=str(folder / "driver"), MESA_SHADER_CACHE_DIR=str(folder / "driver"))
    cmds = [[sys.executable, __file__, "together", *group, "--threads", str(threads), "--cache", str(folder / "programs")]
            + (["--env-each"] if env_each else []) for group in groups]
    # each child's LiteRT log goes to a file: waited on one at a time, a child writing to a full pipe would stall
    logs = [open(folder / f"together-{i}.log", "w+") for i in range(len(cmds))]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env) for cmd, log in zip(cmds, logs)]
    children = []
    try:
        for i, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                return {"error": f"process {i} timed out after {timeout} s"}
            row = _last_json(out)
            if p.returncode != 0 or row is None:
                logs[i].seek(0)
                return {"error": f"process {i} exit {p.returncode}", "stderr_tail": logs[i].read()[-1500:]}
            children.append(row)
    finally:
        for log in logs:
            log.close()
    if len(children) == 1:
        return children[0]
    t0 = min(c["load_window_unix"][0] for c in children)
    t1 = max(c["load_window_unix"][1] for c in children)
    return {"load_wall_s": round(t1 - t0, 2), "load_sum_s": round(sum(c["load_sum_s"] for c in children), 2),
            "host_peak_mb": round(sum(c["host_peak_mb"] for c in children), 1),
            "gpu_peak_mb": None if all(c.get("gpu_peak_mb") is None for c in children)
            else round(sum(c.get("gpu_peak_mb") or 0 for c in children), 1),
            "finite": [f for c in children for f in c["finite"]], "children": children}


def _balanced(paths: list[str], n: int) -> list[list[str]]:
    """PATHS in N groups of about equal bytes (largest file first into the lightest group)."""
    groups: list[list] = [[0, []] for _ in range(min(n, len(paths)))]
    for path in sorted(paths, key=lambda q: -Path(q).stat().st_size):
        lightest = min(groups, key=lambda g: g[0])
        lightest[0] += Path(path).stat().st_size
        lightest[1].append(path)
    return [sorted(g[1]) for g in groups]


def parallel(paths: list[str], thread_counts: list[int], cache_root: str, timeout: float, env_each: bool = False,
             proc_counts: tuple = ()) -> list[dict]:
    """Per thread count (one process), then per process count (the files split by bytes over that many processes of
    one thread each, started at once), a fresh cache folder (LiteRT's and the driver's): cold, then warm."""
    rows = []
    configs = [(t, 1) for t in thread_counts] + [(1, n) for n in proc_counts]
    for threads, procs in configs:
        folder = Path(tempfile.mkdtemp(prefix=f"pd-par{threads}x{procs}-", dir=cache_root))
        for launch in ("cold", "warm"):
            row = _together_processes(_balanced(paths, procs), threads, env_each, folder, timeout)
            rows.append({"threads": threads, "processes": procs, "environments": "each" if env_each else "shared",
                         "launch": launch, **row})
            print(json.dumps({k: rows[-1].get(k) for k in ("threads", "processes", "environments", "launch", "load_wall_s",
                                                           "load_sum_s", "host_peak_mb", "gpu_peak_mb", "error")}), flush=True)
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def _child(path: str, options: dict, cache: str | None, key: str, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "probe", path, "--options", json.dumps(options), "--key", key, "--json", "-"]
    if cache:
        cmd += ["--cache", cache]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"model": Path(path).name, "options": options, "error": f"timeout after {timeout} s"}
    wall = round(time.perf_counter() - t0, 2)
    row = _last_json(p.stdout)
    if p.returncode != 0 or row is None:
        return {"model": Path(path).name, "options": options, "error": f"exit {p.returncode}", "stderr_tail": p.stderr[-1500:]}
    row["process_wall_s"] = wall
    return row


def matrix(path: str, sets: list[str], timeout: float, cache_root: str | None) -> list[dict]:
    rows = []
    for name in sets:
        if name.startswith("cached"):
            extra = {**CACHED, **OPTION_SETS.get(name[len("cached_"):], {})} if name != "cached_weights" else CACHED_WEIGHTS
            folder = tempfile.mkdtemp(prefix=f"pd-cache-{name}-", dir=cache_root)
            for launch in ("cold", "warm"):
                row = _child(path, extra, folder, "probe", timeout)
                rows.append({"set": name, "launch": launch, **row})
                print(json.dumps({k: row.get(k) for k in ("model", "load_s", "host_peak_mb", "gpu_peak_mb", "error")}), flush=True)
            shutil.rmtree(folder, ignore_errors=True)
            continue
        row = _child(path, OPTION_SETS[name], None, "probe", timeout)
        rows.append({"set": name, "launch": "cold", **row})
        print(name, json.dumps({k: row.get(k) for k in ("model", "load_s", "host_peak_mb", "gpu_peak_mb", "error")}), flush=True)
    return rows


def _run_bundle(bundle: str, out: str, pipelined: bool, cache: str, driver_cache: str, timeout: float, extra: list) -> dict:
    """One `pocketdiff run-bundle` process; its report's measured fields."""
    cmd = [sys.executable, "-m", "pocketdiff.cli", "run-bundle", bundle, "--prompt", "a photograph of an astronaut riding a horse",
           "--output", out, "--accelerator", "gpu", "--seed", "0", "--overwrite", "--gpu-cache", cache]
    if pipelined:
        cmd.append("--pipelined")
    cmd += extra
    if "--no-gpu-cache" in extra:
        cmd = [c for i, c in enumerate(cmd) if c != "--gpu-cache" and (i == 0 or cmd[i - 1] != "--gpu-cache")]
    env = dict(os.environ, __GL_SHADER_DISK_CACHE_PATH=driver_cache, MESA_SHADER_CACHE_DIR=driver_cache)  # the drivers' own caches: cold means empty
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout} s"}
    wall = round(time.perf_counter() - t0, 2)
    report = Path(out) / "report.json"
    if p.returncode != 0 or not report.exists():
        return {"error": f"exit {p.returncode}", "stderr_tail": p.stderr[-2000:]}
    r = json.loads(report.read_text())
    keep = ("host_peak_mb", "gpu_peak_mb", "host_plus_gpu_peak_mb", "start_s", "total_s", "fully_accelerated", "latency_s", "memory")
    return {**{k: r.get(k) for k in keep}, "process_wall_s": wall, "unet_step_s": (r.get("latency_s") or {}).get("unet_step_mean"),
            "host_plus_gpu_peak_at_once_mb": (r.get("memory") or {}).get("host_plus_gpu_peak_at_once_mb"),  # polled, one moment
            "overlap_levels": [p["level"] for p in ((r.get("memory") or {}).get("overlap") or {}).get("plan", [])] or None}


def _mode_flags(mode: str, cache_root: Path, layout: str, tag: str) -> list[str]:
    """run-bundle's flags beyond --pipelined for MODE. overlapN: --overlap-loads --memory-budget-mb N, with the figures the
    `overlap` mode of this layout measured (list it before) copied into the mode's fresh folder."""
    if mode == "streamed":
        return ["--stream-unet"]
    if mode == "keeppages":  # --pipelined with each model file's pages kept resident (before run-bundle gave them back)
        return ["--keep-file-pages"]
    if mode.startswith("workers"):
        return ["--load-workers", mode[len("workers"):]]
    if mode.startswith("overlap"):
        budget = mode[len("overlap"):]
        if budget:
            measured = cache_root / f"{layout}-overlap-{tag}" / "programs" / "memory_figures.json"
            (cache_root / f"{layout}-{mode}-{tag}" / "programs").mkdir(parents=True, exist_ok=True)
            if measured.is_file():
                shutil.copyfile(measured, cache_root / f"{layout}-{mode}-{tag}" / "programs" / measured.name)
        return ["--overlap-loads"] + (["--memory-budget-mb", budget] if budget else [])
    return []


def runs(bundles: list[tuple[str, str]], cache_root: str, timeout: float, modes: list[str], gpu_options: list[str], tag: str) -> list[dict]:
    """Per layout: plain then pipelined, each cold (empty caches) then warm (the same caches)."""
    from pocketdiff.runtime.chunks import TEXT_ENCODER, UNET, parts_of
    from pocketdiff.runtime.compile_order import CHUNK_FIGURES
    from pocketdiff.runtime.memory import GpuMemory

    device = GpuMemory().name
    rows = []
    for bundle, layout in bundles:
        man = json.loads((Path(bundle) / "manifest.json").read_text())
        resolution = int(man["latent"]["height"]) * int(man["latent"]["vae_factor"])
        chunks, te_chunks = len(parts_of(man, UNET)), len(parts_of(man, TEXT_ENCODER))  # 1: a whole model
        extra = [a for o in gpu_options if o != "no-gpu-cache" for a in ("--gpu-option", o)]
        extra += ["--no-gpu-cache"] if "no-gpu-cache" in gpu_options else []
        for mode in modes:
            folder = Path(cache_root) / f"{layout}-{mode}-{tag}"
            shutil.rmtree(folder, ignore_errors=True)
            workers = int(mode[len("workers"):]) if mode.startswith("workers") else 0  # plain, its loads in N processes
            flags = _mode_flags(mode, Path(cache_root), layout, tag)
            for launch in ("cold", "warm"):
                if mode == "callorder":  # --pipelined, the chunks compiled in call order: no earlier launch's chunk figures
                    (folder / "programs" / CHUNK_FIGURES).unlink(missing_ok=True)
                r = _run_bundle(bundle, f"/tmp/footprint-{layout}-{mode}-{launch}", mode in ("pipelined", "streamed", "keeppages", "callorder") or mode.startswith("overlap"),
                                str(folder / "programs"), str(folder / "driver"), timeout, extra + flags)
                rows.append({"layout": layout, "resolution": resolution, "mode": mode, "launch": launch, "device": device,
                             "load_workers": workers,
                             "variant": tag, "gpu_options": gpu_options, "unet_chunks": chunks, "text_encoder_chunks": te_chunks,
                             "steps": len(man["scheduler"]["timesteps"]), **r})
                print(json.dumps({k: rows[-1].get(k) for k in ("layout", "mode", "launch", "host_peak_mb", "gpu_peak_mb",
                                                               "start_s", "total_s", "error")}), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("probe")
    p.add_argument("model")
    p.add_argument("--options", default="{}")
    p.add_argument("--cache")
    p.add_argument("--key", default="probe")
    p.add_argument("--json", default="-")
    c = sub.add_parser("chain", help="a UNet's chunk files compiled one after another in one process, then run in sequence")
    c.add_argument("models", nargs="+")
    c.add_argument("--options", default="{}")
    c.add_argument("--cache")
    c.add_argument("--key", default="chain")
    c.add_argument("--settle", action="store_true", help="run each chunk once right after its compile (the runner does)")
    c.add_argument("--out", required=True)
    m = sub.add_parser("matrix")
    m.add_argument("model")
    m.add_argument("--sets", default="base,madvise,gpu_convert,cached")
    m.add_argument("--timeout", type=float, default=180)
    m.add_argument("--cache-root")
    m.add_argument("--out", required=True)
    t = sub.add_parser("together", help="one process: MODELS compiled by --threads threads at once (parallel's child)")
    t.add_argument("models", nargs="+")
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--cache", required=True)
    t.add_argument("--env-each", action="store_true", help="an environment per model (run-bundle --pipelined's way)")
    st = sub.add_parser("stream", help="chunks loaded, run once and released in turn, ROUNDS times: one environment or one each")
    st.add_argument("models", nargs="+")
    st.add_argument("--rounds", type=int, default=2)
    st.add_argument("--env-each", action="store_true")
    st.add_argument("--marks", action="store_true", help="a memory mark between opening and compiling each file (run-bundle's phases)")
    st.add_argument("--cache", required=True)
    st.add_argument("--out", required=True)
    q = sub.add_parser("parallel", help="`together` per thread count, cold then warm, each in its own process")
    q.add_argument("models", nargs="+")
    q.add_argument("--threads", default="1,4,8", help="comma list of thread counts (one process each)")
    q.add_argument("--procs", default="", help="comma list of process counts (the files split over them, one thread each)")
    q.add_argument("--env-each", action="store_true", help="an environment per model")
    q.add_argument("--timeout", type=float, default=600)
    q.add_argument("--cache-root")
    q.add_argument("--out", required=True)
    r = sub.add_parser("runs")
    r.add_argument("bundles", nargs="+", help="FOLDER:LAYOUT")
    r.add_argument("--cache-root", default="/tmp/pd-cache")
    r.add_argument("--timeout", type=float, default=240)
    r.add_argument("--modes", default="plain,pipelined", help="of plain, pipelined, streamed (--pipelined --stream-unet: a "
                   "chunked UNet), workersN (plain with --load-workers N), overlap (--pipelined --overlap-loads), overlapN (and "
                   "--memory-budget-mb N, with the figures the overlap mode measured: list overlap first), keeppages (--pipelined "
                   "--keep-file-pages), callorder (--pipelined, a chunked UNet compiled in call order: no chunk figures)")
    r.add_argument("--gpu-option", action="append", default=[], help="KEY=VALUE passed to run-bundle")
    r.add_argument("--tag", default="default", help="names this variant in the rows")
    r.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "runs":
        pairs = [tuple(b.rsplit(":", 1)) for b in a.bundles]
        modes = a.modes.split(",")
        if any(m not in ("plain", "pipelined", "streamed", "keeppages", "callorder") and not re.fullmatch(r"workers[1-9][0-9]*|overlap([1-9][0-9]*)?", m)
               for m in modes):
            ap.error(f"--modes: {a.modes!r}, expected a comma list of plain, pipelined, streamed, keeppages, callorder, workersN, overlap, overlapN")
        rows = runs(pairs, a.cache_root, a.timeout, modes, a.gpu_option, a.tag)
        Path(a.out).write_text(json.dumps({"rows": rows}, indent=1))
        return 0
    if a.cmd == "chain":
        row = chain(a.models, json.loads(a.options), a.cache, a.key, settle=a.settle)
        Path(a.out).write_text(json.dumps({"device": os.environ.get("DEVICE_NAME"), "rows": [row]}, indent=1))
        print(json.dumps({k: row.get(k) for k in ("models", "load_s", "host_peak_mb", "gpu_peak_mb", "steady_run_s")}))
        return 0
    if a.cmd == "together":
        print(json.dumps(load_together(a.models, a.threads, a.cache, a.env_each)))
        return 0
    if a.cmd == "stream":
        row = stream(a.models, a.rounds, a.env_each, a.cache, a.marks)
        Path(a.out).write_text(json.dumps(row))
        print(json.dumps({k: row[k] for k in ("environments", "marks", "wall_s", "load_sum_s", "load_s", "host_peak_mb",
                                              "gpu_peak_mb", "gpu_mb_after_each_release")}))
        return 0
    if a.cmd == "parallel":
        rows = parallel(a.models, [int(t) for t in a.threads.split(",") if t], a.cache_root, a.timeout, a.env_each,
                        tuple(int(n) for n in a.procs.split(",") if n))
        Path(a.out).write_text(json.dumps({"device": os.environ.get("DEVICE_NAME"), "rows": rows}, indent=1))
        return 0
    if a.cmd == "probe":
        row = probe(a.model, json.loads(a.options), a.cache, a.key)
        print(json.dumps(row))
        return 0
    rows = matrix(a.model, a.sets.split(","), a.timeout, a.cache_root)
    Path(a.out).write_text(json.dumps({"model": a.model, "device": os.environ.get("DEVICE_NAME"), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
