"""benchmarks/export_sd21.py, delegate stage: every converted variant of a workdir on the LiteRT
GPU delegate (fp16, enforce_f32) and on XNNPACK, each run a child process; needs only numpy,
ai-edge-litert and pocketdiff's export package (scripts/gpu/export_delegate.sh)."""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Optional

import numpy as np

from pocketdiff.outputs import write_json

from export_sd21_convert import MANIFEST, load_arrays, log


def _feeds(meta: dict, arrays: dict):
    f = meta.get("feeds") or {}
    keys = f.get("arrays") or (["sample", "temb", "encoder_hidden_states"] if meta.get("time_input") == "time_embedding"
                               else ["sample", "timestep", "encoder_hidden_states"])
    names = f.get("names")
    if names:
        return {n: arrays[k] for n, k in zip(names, keys)}
    return [arrays[k] for k in keys]


def _log_tail(text: str, n: int = 10) -> list[str]:
    """The first distinct error lines of a delegate log (the cause; later ones echo it) + its tail."""
    import re

    lines = [ln for ln in text.splitlines() if ln.strip() and "Warning" not in ln]
    first: list[str] = []
    seen = set()
    for ln in lines:
        if re.search(r"error|invalid|exceed|fail|not supported", ln, re.I):
            key = re.sub(r"\d+", "N", ln)
            if key not in seen:
                seen.add(key)
                first.append(ln[:300])
        if len(first) >= 6:
            break
    tail = [ln[:300] for ln in lines[-n:] if ln[:300] not in first]
    return first + ["..."] + tail


def _failed_run(accelerator: str, error: str):
    from pocketdiff.runtime.delegate import DelegateRun

    return DelegateRun(accelerator=accelerator, driver="n/a", compiled=False, fully_accelerated=False, rejected=[], ops_split=None,
                       outputs={}, output_names=[], input_names=[], compile_s={}, latency_s={}, adapter="", error=error, log=error)


def stage_delegate(args, work: Path, variants: Optional[list[str]], out: Path) -> dict:
    """Every converted variant in `work` on the LiteRT GPU delegate (fp16 default, then
    enforce_f32) and on XNNPACK, each run in its own child process with a timeout; a crash or
    timeout is recorded, not fatal. Runs go phase by phase (all fp16 first), and the JSON is
    rewritten after each, so a cut-off run keeps what it measured."""
    from pocketdiff.runtime.delegate import delegate_available, run_on_delegate
    from pocketdiff.runtime.parity import metrics

    t_start = time.monotonic()
    manifest = json.loads((work / MANIFEST).read_text())
    arrays = load_arrays(work)
    ref = arrays["reference"]
    result: dict = {}
    if args.append and out.is_file():
        result = json.loads(out.read_text())
        if result.get("key") not in (None, manifest.get("key")):
            raise SystemExit(f"--append: {out} holds another run ({result.get('key')} != {manifest.get('key')})")
    ok, driver = delegate_available()
    for k in ("key", "arch", "resolution", "batch", "init", "weights", "seed", "residual_scale", "params", "latent",
              "torch_forward_s", "weights_info", "activations", "fp16_scan", "converted_on"):
        if k in manifest:
            result[k] = manifest[k]
    result.update(host=platform.node(), cpu_count=os.cpu_count(), delegate_driver=driver, started=time.strftime("%Y-%m-%d %H:%M:%S"))
    result.setdefault("variants", {})
    todo = variants or list(manifest.get("variants", {}))
    for v in todo:
        meta = manifest.get("variants", {}).get(v)
        if meta is None:
            result["variants"][v] = {"error": "not in the manifest (not converted)"}
            continue
        entry = result["variants"].setdefault(v, {})
        entry.update({k: val for k, val in meta.items() if k not in ("gpu", "cpu")})
        if "error" in meta:
            continue
        path = work / meta.get("file", f"{v}.tflite")
        if not path.is_file():
            entry["error"] = f"{path.name} missing"
        elif path.stat().st_size != meta.get("bytes", path.stat().st_size):
            entry["error"] = f"{path.name}: {path.stat().st_size} bytes, manifest says {meta['bytes']} (truncated?)"
        else:
            entry["bytes_per_param"] = meta["bytes"] / manifest["params"]
    runnable = [v for v in todo if v in result["variants"] and "error" not in result["variants"][v]]
    jobs = []
    if not args.skip_gpu:
        jobs += [("gpu", "fp16", v) for v in runnable]
        if not args.skip_f32:
            jobs += [("gpu", "fp32", v) for v in runnable]
    if not args.skip_cpu:
        jobs += [("cpu", "fp32", v) for v in runnable]

    def save() -> None:
        result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        result["wall_s"] = round(time.monotonic() - t_start, 1)
        write_json(out, _summarize(result))

    save()
    for acc, prec, v in jobs:
        entry = result["variants"][v]
        meta = manifest["variants"][v]
        timeout = args.timeout
        if args.budget_s:
            left = args.budget_s - (time.monotonic() - t_start) - 10
            if left < 30:
                entry.setdefault("skipped", []).append(f"{acc} {prec}: time budget spent")
                log(f"{v}: {acc} {prec} skipped (time budget)")
                save()
                continue
            timeout = min(timeout, left)
        label = "CPU (XNNPACK)" if acc == "cpu" else f"GPU delegate {prec}"
        t0 = time.perf_counter()
        repeats, warmup = (args.repeats, args.warmup) if acc == "gpu" else (max(1, args.repeats // 2), min(1, args.warmup))
        log(f"{v}: {label}, {repeats} runs after {warmup} warm-up, timeout {timeout:.0f} s")
        try:
            run = run_on_delegate(work / meta.get("file", f"{v}.tflite"), _feeds(meta, arrays), precisions=[prec], accelerator=acc,
                                  repeats=repeats, warmup=warmup, timeout_s=timeout, num_threads=args.cpu_threads if acc == "cpu" else 0)
        except Exception as e:  # noqa: BLE001 - e.g. no Vulkan driver: recorded, the other runs go on
            run = _failed_run(acc, f"{type(e).__name__}: {e}")
        wall = time.perf_counter() - t0
        par = metrics(ref, run.outputs[prec][0]) if prec in run.outputs else None
        own = meta.get("reference_own")
        if par is not None and own and (work / own).is_file():
            par["vs_own_reference"] = metrics(np.load(work / own), run.outputs[prec][0])
        if acc == "gpu":
            g = entry.setdefault("gpu", {"compile_s": {}, "step_latency_s": {}, "parity": {}, "errors": {}, "wall_s": {},
                                         "fully_accelerated_at": {}})
            g.update(driver=run.driver)
            if run.adapter:
                g["adapter"] = run.adapter
            if run.compiled:
                g["compiled"] = True
                g["fully_accelerated"] = bool(g.get("fully_accelerated", True) and run.fully_accelerated)
                g["fully_accelerated_at"][prec] = run.fully_accelerated
            else:
                g.setdefault("compiled", False)
            if run.rejected:
                g["rejected"] = [r.describe() for r in run.rejected][:20]
            if run.ops_split:
                g["ops_split"] = run.ops_split
            g["compile_s"].update(run.compile_s)
            g["step_latency_s"].update(run.latency_s)
            g["wall_s"][prec] = round(wall, 1)
            if par is not None:
                g["parity"][prec] = par
            if run.error:
                g["errors"][prec] = run.error
                g["log_tail"] = _log_tail(run.log)
                g.setdefault("error", run.error)
        else:
            entry["cpu"] = {"compiled": run.compiled, "error": run.error, "compile_s": run.compile_s.get("fp32"),
                            "step_latency_s": run.latency_s.get("fp32"), "parity": par, "threads": args.cpu_threads,
                            "wall_s": round(wall, 1)}
            if run.error:
                entry["cpu"]["log_tail"] = _log_tail(run.log)
        lat = run.latency_s.get(prec)
        log(f"{v}: {label}: " + (f"error {run.error}; " if run.error else "")
            + (f"fully accelerated {run.fully_accelerated}, " if acc == "gpu" and run.compiled else "")
            + (f"{1000 * lat:.1f} ms/step, " if lat is not None else "")
            + (f"finite {par['finite']}, cosine {par['cosine']:.6f}, PSNR {par['psnr_db']:.1f} dB" if par else "no output")
            + f" ({wall:.0f} s)")
        save()
    save()
    log(f"wrote {out}")
    return result


def _summarize(result: dict) -> dict:
    """A side-by-side table of the variants measured so far."""
    rows = {}
    for v, r in result.get("variants", {}).items():
        if "error" in r:
            rows[v] = {"error": r["error"]}
            continue
        gpu = r.get("gpu", {})
        cpu = r.get("cpu") or {}
        par = gpu.get("parity", {})
        fp16 = par.get("fp16") or {}
        rows[v] = {
            "convert_s": _round(r.get("convert_s"), 1),
            "convert_peak_rss_gb": _round((r.get("convert_peak_rss_mb") or 0) / 1024, 2),
            "mib": _round(r.get("bytes", 0) / 2**20, 1),
            "bytes_per_param": _round(r.get("bytes_per_param"), 3),
            "transposes": r.get("transposes"),
            "fully_accelerated": gpu.get("fully_accelerated"),
            "gpu_compile_s": {k: _round(x, 1) for k, x in gpu.get("compile_s", {}).items()},
            "gpu_fp16_ms": _ms(gpu.get("step_latency_s", {}).get("fp16")),
            "gpu_fp32_ms": _ms(gpu.get("step_latency_s", {}).get("fp32")),
            "cpu_ms": _ms(cpu.get("step_latency_s")),
            "fp16_finite": fp16.get("finite"),
            "fp16_cosine": fp16.get("cosine"),
            "fp16_psnr_db": fp16.get("psnr_db"),
            "fp32_cosine": (par.get("fp32") or {}).get("cosine"),
            "cpu_cosine": (cpu.get("parity") or {}).get("cosine"),
            "gpu_errors": gpu.get("errors") or None,
        }
        # the claim under test: every op on the delegate, finite and accurate at its default fp16
        if "fp16" in par:
            rows[v]["fp16_ok"] = bool(gpu.get("fully_accelerated") and fp16.get("finite") and fp16.get("cosine", 0) >= 0.999)
    result["summary"] = rows
    return result


def _round(x, n):
    return None if x is None else round(float(x), n)


def _ms(x):
    return None if x is None else round(1000 * x, 2)
