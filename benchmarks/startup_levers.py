#!/usr/bin/env python
"""Issue 66 items 3 and 4: run-bundle's start-up levers side by side on one machine, and an app's later images.

  run     the steps of --plan in order (DEFAULT_PLAN: the most wanted first; no step starts past --budget-s seconds, so
          a call keeps its limit and a cut one keeps what ran, the JSON being rewritten after every process):
          - a configuration (`CONFIGS`): one `pocketdiff run-bundle` process per launch (the product's own runner and
            report), cold (its own empty folders: program cache, CPU variants, driver shader cache) then warm on them:
            `pipelined` (the baseline), each lever alone (`te_cpu`: --on-cpu text_encoder; `one_env`:
            --one-environment; `overlap`: --overlap-loads, the next model, e.g. the decoder during the UNet's compile and
            steps, compiled in a worker; `compile_ahead`: the decoder's head compiled in a thread during the steps) and
            combined (`te_cpu_ahead`: the UNet compiled in a thread while the text encoder loads and runs on the CPU;
            `overlap_ahead3_te_cpu`: the UNet and every decoder graph compile at once in workers meanwhile); not in
            DEFAULT_PLAN: `weight_cache` (--pipelined --weight-cache) and `weight_cache_overlap_ahead3_te_cpu`;
          - `app:MODE`: benchmarks/app_images.py MODE, --images images in one process, on --app-folder's folders (an
            app's later images; launch "warm" when that configuration ran before);
          - `probe`: `env-probe` in a process of its own, on the baseline's program cache;
          - `repeat`: one more warm baseline launch (the drift over the call).
          Rows: layout, mode, launch, start_s, total_s, per-phase seconds (`phases_s` from run-bundle's phase marks, the
          three `largest`, `latency_s`), host / GPU / at-once peaks (measured: the report's `host_peak_mb`,
          `gpu_peak_mb`, `host_plus_gpu_peak_mb` and polled `host_plus_gpu_peak_at_once_mb`), where each model ran, the
          weight cache's state (off, made, reused) and the LiteRT library, the
          image's sha256 and its PSNR against the baseline's cold image; device, LiteRT version, cores in the head.
  env-probe BUNDLE --cache DIR --models A,B   in one LiteRT environment: each model loaded, run once and released, the
          first again in the live environment, then the environment destroyed, and the first once more in a new one;
          host RSS and this process's GPU memory (NVML) after each step: what a release frees, what only the
          environment's does, and what a load in a live environment costs.
  summary RESULT.json   the summary rows.

  python benchmarks/startup_levers.py run /tmp/sd21_bundles/tiny --out startup_sd21.json --cache-root /tmp/startup_levers
  python benchmarks/startup_levers.py run --smoke --plan pipelined,te_cpu,app:keep_unet_decoder_te_cpu --images 2 \
      --probe-models text_encoder,vae_decoder --out /tmp/sl.json        (tests/web/smoke_bundle_tiny, this machine's Vulkan)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from app_images import litert_version, summarize  # noqa: E402
from runner_before_after import _relative, _sha, intervals, largest  # noqa: E402

PROMPT = "a photograph of an astronaut riding a horse"
CONFIGS = {
    "pipelined": ["--pipelined"],  # the baseline: each model loaded just in time, one at a time
    "te_cpu": ["--pipelined", "--on-cpu", "text_encoder"],  # lever a: no GPU compile for the text encoder
    "one_env": ["--pipelined", "--one-environment"],  # lever c: one LiteRT environment for every model
    "overlap": ["--pipelined", "--overlap-loads"],  # lever b as it was: the next model compiled in a worker
    "overlap_te_cpu": ["--pipelined", "--overlap-loads", "--on-cpu", "text_encoder"],
    "overlap_ahead3_te_cpu": ["--pipelined", "--overlap-loads", "--overlap-ahead", "3", "--on-cpu", "text_encoder"],
    "overlap_ahead2_te_cpu": ["--pipelined", "--overlap-loads", "--overlap-ahead", "2", "--on-cpu", "text_encoder"],
    "te_cpu_one_env": ["--pipelined", "--on-cpu", "text_encoder", "--one-environment"],
    # lever b in the runner's own process: the UNet compiled in a thread while the CPU encoder runs, the decoder's head
    # during the steps (one model more resident than --pipelined, no worker processes)
    "te_cpu_ahead": ["--pipelined", "--on-cpu", "text_encoder", "--compile-ahead"],
    "compile_ahead": ["--pipelined", "--compile-ahead"],
    # the accelerator's weight cache (litert-lm-api's one-build library): converted weights kept with the programs;
    # not in DEFAULT_PLAN: PLAN=weight_cache,weight_cache_overlap_ahead3_te_cpu (after pipelined, for the baseline)
    "weight_cache": ["--pipelined", "--weight-cache"],
    "weight_cache_overlap_ahead3_te_cpu": ["--pipelined", "--overlap-loads", "--overlap-ahead", "3", "--on-cpu", "text_encoder",
                                           "--weight-cache"],
    # SDXL bundles (scripts/gpu/sdxl_bundle.sh PLAN=...): both text encoders on the CPU, the UNet's and the decoder's
    # compiles alone on the GPU; with the weight cache; and with the next model compiled in a worker
    "tes_cpu": ["--pipelined", "--on-cpu", "text_encoder,text_encoder_2"],
    "overlap_tes_cpu": ["--pipelined", "--overlap-loads", "--on-cpu", "text_encoder,text_encoder_2"],
    "tes_cpu_weight_cache": ["--pipelined", "--on-cpu", "text_encoder,text_encoder_2", "--weight-cache"],
    "overlap_tes_cpu_weight_cache": ["--pipelined", "--overlap-loads", "--on-cpu", "text_encoder,text_encoder_2",
                                     "--weight-cache"],
}
# the steps in order of importance (a call cut by --budget-s loses the last): a configuration's cold + warm launches,
# `app:MODE` (app_images.py, warm on --app-folder's folders), `probe` (env-probe), `repeat` (a last warm baseline)
DEFAULT_PLAN = ("pipelined,te_cpu,te_cpu_ahead,overlap_te_cpu,overlap_ahead3_te_cpu,app:keep_unet_decoder_te_cpu,"
                "app:keep_unet_te_cpu,one_env,overlap,probe,compile_ahead,overlap_ahead2_te_cpu,app:plain_te_cpu,te_cpu_one_env,"
                "repeat")
PEAKS = ("host_peak_mb", "gpu_peak_mb", "host_plus_gpu_peak_mb", "host_plus_gpu_peak_at_once_mb")


def device_line() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    p = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                       capture_output=True, text=True)
    return p.stdout.strip() or None if p.returncode == 0 else None


def png_psnr(a: Path, b: Path) -> float | None:
    """PSNR (dB, peak 255) of two PNGs of one size; inf when equal; None when either is missing."""
    import numpy as np
    from PIL import Image

    if not (a.is_file() and b.is_file()):
        return None
    x = np.asarray(Image.open(a), np.float64)
    y = np.asarray(Image.open(b), np.float64)
    mse = float(((x - y) ** 2).mean())
    return float("inf") if mse == 0 else round(10 * np.log10(255.0**2 / mse), 2)


def phases_s(report: dict) -> dict:
    """Seconds per component and item, mark to mark (runner_before_after.intervals: open, compile, first run, ...;
    a CPU model's `cpu_variant` is its variant made or found), chunks summed per kind."""
    out: dict = {}
    for it in intervals(report):
        key = f"{it['component'].split('.')[0]} {it['item']}"
        out[key] = round(out.get(key, 0.0) + it["s"], 3)
    return out


def run_group(cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess | None:
    """CMD in a process group of its own; past `timeout` the whole group is killed (run-bundle's load workers too, which
    would otherwise hold their GPU memory through the next launches) and None returned."""
    import signal

    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            return None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def launch(bundle: str, out: Path, flags: list[str], programs: Path, driver: Path, timeout: float, accelerator: str) -> dict:
    """One run-bundle process; its report (or the error)."""
    cmd = [sys.executable, "-m", "pocketdiff.cli", "run-bundle", bundle, "--prompt", PROMPT, "--output", str(out),
           "--accelerator", accelerator, "--seed", "0", "--overwrite", "--gpu-cache", str(programs), *flags]
    env = dict(os.environ, __GL_SHADER_DISK_CACHE_PATH=str(driver), MESA_SHADER_CACHE_DIR=str(driver))  # cold: empty too
    t0 = time.perf_counter()
    p = run_group(cmd, timeout, env)
    if p is None:
        return {"error": f"timeout after {timeout} s"}
    wall = round(time.perf_counter() - t0, 2)
    report = out / "report.json"
    if p.returncode != 0 or not report.is_file():
        return {"error": f"exit {p.returncode}", "stderr_tail": p.stderr[-1500:], "process_wall_s": wall}
    return {**json.loads(report.read_text()), "process_wall_s": wall}


def row_of(config: str, flags: list[str], when: str, layout: str, r: dict, image: Path, baseline: Path | None) -> dict:
    """The fields a start-up row keeps (the phases' full marks stay in `marks`, without the per-model copies)."""
    if r.get("error"):
        return {"layout": layout, "mode": config, "flags": flags, "launch": when, **r}
    mem = r.get("memory") or {}
    return {"layout": layout, "mode": config, "flags": flags, "launch": when,
            "start_s": r.get("start_s"), "total_s": r.get("total_s"), "process_wall_s": r.get("process_wall_s"),
            "phases_s": phases_s(r), "largest": largest(intervals(r)), "latency_s": r.get("latency_s"),
            **{k: (mem.get(k) if k == "host_plus_gpu_peak_at_once_mb" else r.get(k)) for k in PEAKS},
            "startup_s": mem.get("startup_s"), "accelerator_by_model": r.get("accelerator_by_model"),
            "fully_accelerated": r.get("fully_accelerated"), "loading_policy": r.get("loading_policy"),
            "environments": mem.get("environments"), "overlap": mem.get("overlap"),
            "cpu_variants": sorted({p.get("variant") for p in mem.get("phases") or [] if p.get("phase") == "cpu_variant"}),
            # XNNPACK's packed weights (runtime/xnnpack_cache.py): made at a cold launch, reused at a warm one, off without
            "xnnpack_cache": sorted({p.get("state") for p in mem.get("phases") or [] if p.get("phase") == "xnnpack_cache"}),
            # --weight-cache: off | made | reused | made+reused, per model, and the LiteRT library the launch loaded
            "weight_cache": (r.get("gpu_cache") or {}).get("weight_cache", "off"),
            "weight_cache_by_model": (r.get("gpu_cache") or {}).get("weight_cache_by_model"),
            "litert_library": (r.get("gpu_cache") or {}).get("library"),
            "image_sha256": _sha(image), "same_image_as_baseline": _sha(image) == _sha(baseline) if baseline else None,
            "psnr_vs_baseline_db": _finite(png_psnr(image, baseline)) if baseline else None,  # None: the same image
            "marks": [{k: v for k, v in p.items() if k in ("component", "phase", "t_s", "host_rss_mb", "gpu_mb", "variant", "state")}
                      for p in mem.get("phases") or []]}


def _finite(x: float | None) -> float | None:
    return None if x is None or x == float("inf") else x


class Doc:
    """The result file, rewritten after every process."""

    def __init__(self, path: Path, head: dict):
        self.path, self.doc = path, {**head, "rows": [], "app_rows": [], "app_summary": [], "env_probe": None, "skipped": []}

    def write(self) -> None:
        self.doc["summary"] = summary_rows(self.doc["rows"])
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(_relative(self.doc), indent=1, default=str) + "\n")
        tmp.replace(self.path)


def run_config(a, doc: Doc, bundle: str, layout: str, config: str, whens=("cold", "warm"), fresh: bool = True) -> None:
    """One configuration's launches (cold: its folders emptied first; warm: on them)."""
    root, flags = Path(a.cache_root), CONFIGS[config]
    folder, baseline = root / config, root / "baseline.png"
    if fresh:
        shutil.rmtree(folder, ignore_errors=True)  # cold: nothing kept from an earlier call either
    for when in whens:
        if time.perf_counter() - a.t_start > a.budget_s:
            doc.doc["skipped"].append(f"{config} {when}")
            print(f"skip {config} {when}: past --budget-s {a.budget_s:g}", flush=True)
            continue
        out = root / "out" / f"{config}-{when}".replace(" ", "_")
        r = launch(bundle, out, flags, folder / "programs", folder / "driver", a.timeout, a.accelerator)
        first = config == "pipelined" and when == "cold" and not r.get("error")
        if first:
            shutil.copyfile(out / "image.png", baseline)
        row = row_of(config, flags, when, layout, r, out / "image.png", baseline if baseline.is_file() else None)
        doc.doc["rows"].append(row)
        doc.write()
        print(json.dumps(summary_rows([row])[0]), flush=True)


def run_app(a, doc: Doc, bundle: str, mode: str) -> None:
    """One app_images.py mode in its own process, warm on --app-folder's folders (te_cpu's: its programs and CPU
    variants; a folder no launch filled is filled by the app's first image: its row says so)."""
    folder = Path(a.cache_root) / a.app_folder
    if time.perf_counter() - a.t_start > a.budget_s:
        doc.doc["skipped"].append(f"app:{mode}")
        return
    kind = "warm" if (folder / "programs").is_dir() else "cold"  # measured before the app's process fills it
    rows_file = Path(a.cache_root) / f"app-{mode}.json"
    rows_file.unlink(missing_ok=True)
    cmd = [sys.executable, str(HERE / "app_images.py"), bundle, "--mode", mode, "--images", str(a.images),
           "--accelerator", a.accelerator, "--gpu-cache", str(folder / "programs"), "--launch", kind,
           "--prompt", PROMPT, "--out", str(rows_file)]
    env = dict(os.environ, __GL_SHADER_DISK_CACHE_PATH=str(folder / "driver"), MESA_SHADER_CACHE_DIR=str(folder / "driver"))
    p = run_group(cmd, a.timeout, env)
    err = f"timeout after {a.timeout} s" if p is None else None if p.returncode == 0 else f"exit {p.returncode}: {p.stderr[-1500:]}"
    rows = json.loads(rows_file.read_text())["rows"] if rows_file.is_file() else []
    doc.doc["app_rows"] += [{**r, "layout": Path(bundle).name} for r in rows]
    doc.doc["app_summary"] += summarize(rows) if rows else [{"mode": mode, "error": err}]
    doc.write()
    print(json.dumps(doc.doc["app_summary"][-1], default=str)[:600], flush=True)


def run_env_probe(a, doc: Doc, bundle: str) -> None:
    if time.perf_counter() - a.t_start > a.budget_s:
        doc.doc["skipped"].append("probe")
        return
    folder = Path(a.cache_root) / "pipelined"  # the baseline's program cache: the probe's loads are warm
    cmd = [sys.executable, str(HERE / "startup_levers.py"), "env-probe", bundle, "--cache", str(folder / "programs"),
           "--models", a.probe_models]
    p = run_group(cmd, a.timeout)
    try:
        doc.doc["env_probe"] = ({"error": f"timeout after {a.timeout} s"} if p is None else
                                json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"error": p.stderr[-1500:]})
    except (ValueError, IndexError) as e:
        doc.doc["env_probe"] = {"error": str(e)}
    doc.write()
    print(json.dumps(doc.doc["env_probe"])[:1500], flush=True)


def env_probe(bundle: str, cache: str, models: list[str]) -> dict:
    """In one LiteRT environment: each model loaded, run once, released; then a second load of the first in the live
    environment; then the environment destroyed. Host RSS and this process's GPU memory (NVML) after each step."""
    from pocketdiff.runtime.litert_c import Environment
    from pocketdiff.runtime.loaded_model import LoadedModel
    from pocketdiff.runtime.memory import GpuMemory, host_rss_mb, return_freed_memory
    from pocketdiff.runtime.run_bundle import BundleRunner

    import numpy as np

    runner = BundleRunner(bundle, "gpu", pipelined=True, gpu_cache=cache)  # the runner's own options and program cache
    gpu, steps = GpuMemory(), []

    def step(what: str, **extra) -> None:
        return_freed_memory()
        steps.append({"step": what, "host_rss_mb": round(host_rss_mb() or 0.0, 1),
                      "gpu_mb": round(gpu.pid_mb(os.getpid()), 1) if gpu.available else None, **extra})

    def load(name: str, env) -> object:
        t0 = time.perf_counter()
        m = LoadedModel(name, runner.man["components"][name], "gpu", env=env, gpu_options=runner.pool.options_for(name))
        m.run_all({i: np.zeros(d["shape"], d["dtype"]) for i, d in m.in_details.items()})
        return m, round(time.perf_counter() - t0, 3)

    step("start")
    env = Environment()
    step("environment made")
    for name in models + models[:1]:
        m, s = load(name, env)
        step(f"{name} loaded and run", load_and_run_s=s)
        m.close()
        step(f"{name} released (environment alive)")
    env.close()
    step("environment destroyed")
    fresh = Environment()
    m, s = load(models[0], fresh)
    step(f"{models[0]} loaded and run in a new environment", load_and_run_s=s)
    m.close()
    fresh.close()
    step("that environment destroyed")
    runner.close()
    return {"models": models, "gpu": gpu.name, "steps": steps}


def summary_rows(rows: list[dict]) -> list[dict]:
    keep = ("mode", "launch", "start_s", "total_s", *PEAKS, "weight_cache", "same_image_as_baseline", "psnr_vs_baseline_db",
            "error")
    return [{k: r.get(k) for k in keep} for r in rows]


def smoke_bundle(tmp: Path) -> str:
    from runner_images import WEB, assemble

    return str(assemble(WEB / "smoke_bundle_tiny", tmp / "smoke_bundle_tiny"))


def run(a) -> int:
    plan = [s for s in a.plan.split(",") if s]
    unknown = [s for s in plan if s not in CONFIGS and s not in ("probe", "repeat") and not s.startswith("app:")]
    if unknown:
        print(f"startup_levers: --plan {','.join(unknown)}: unknown (configurations: {', '.join(CONFIGS)}; app:MODE, probe, "
              "repeat)", file=sys.stderr)
        return 2
    a.t_start = time.perf_counter()
    Path(a.cache_root).mkdir(parents=True, exist_ok=True)
    bundle = smoke_bundle(Path(a.cache_root)) if a.smoke else a.bundle
    layout = Path(bundle).name
    doc = Doc(Path(a.out), {"what": "run-bundle start-up levers side by side (issue 66 items 3 and 4)", "device": device_line(),
                            "litert": litert_version(), "layout": layout, "prompt": PROMPT, "seed": 0,
                            "plan": plan, "configs": {c: CONFIGS[c] for c in plan if c in CONFIGS}, "images": a.images,
                            "budget_s": a.budget_s, "cores": os.cpu_count()})
    doc.write()
    for s in plan:
        if s in CONFIGS:
            run_config(a, doc, bundle, layout, s)
        elif s.startswith("app:"):
            run_app(a, doc, bundle, s[len("app:"):])
        elif s == "probe":
            run_env_probe(a, doc, bundle)
        elif s == "repeat" and (Path(a.cache_root) / "pipelined").is_dir():  # a last warm baseline launch: the drift
            run_config(a, doc, bundle, layout, "pipelined", ("warm again",), fresh=False)
        elif s == "repeat":
            doc.doc["skipped"].append("repeat: no pipelined launch ran before it")
    doc.doc["elapsed_s"] = round(time.perf_counter() - a.t_start, 1)
    doc.write()
    for s in doc.doc["summary"]:
        print(json.dumps(s))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("bundle", nargs="?")
    r.add_argument("--smoke", action="store_true", help="tests/web/smoke_bundle_tiny, assembled under --cache-root")
    r.add_argument("--out", required=True)
    r.add_argument("--cache-root", default="/tmp/startup_levers")
    r.add_argument("--plan", default=DEFAULT_PLAN, help="the steps in order: configurations, app:MODE, probe, repeat")
    r.add_argument("--app-folder", default="te_cpu", help="the configuration whose warm folders the app modes use")
    r.add_argument("--images", type=int, default=6)
    r.add_argument("--probe-models", default="text_encoder.0,text_encoder.1,text_encoder.2",
                   help="the probe's models, in order")
    r.add_argument("--accelerator", default="gpu", choices=("gpu",))
    r.add_argument("--timeout", type=float, default=80.0, help="seconds per process (a launch, an app mode, the probe)")
    r.add_argument("--budget-s", type=float, default=420.0, help="no launch starts past this many seconds")
    p = sub.add_parser("env-probe")
    p.add_argument("bundle")
    p.add_argument("--cache", required=True)
    p.add_argument("--models", required=True)
    s = sub.add_parser("summary")
    s.add_argument("rows")
    a = ap.parse_args(argv)
    if a.cmd == "env-probe":
        print(json.dumps(env_probe(a.bundle, a.cache, [m for m in a.models.split(",") if m])))
        return 0
    if a.cmd == "summary":
        doc = json.loads(Path(a.rows).read_text())
        for row in doc["summary"] + doc.get("app_summary", []):
            print(json.dumps(row, default=str))
        return 0
    if bool(a.bundle) == a.smoke:
        print("startup_levers: give a BUNDLE or --smoke (not both)", file=sys.stderr)
        return 2
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
