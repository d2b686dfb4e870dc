"""The bundle's web page in headless Chromium: page load, LiteRT.js start, per-component
fetch / compile / first run (GPU pipeline build), UNet step time and total, on WebGPU
(SwiftShader when there is no GPU) and on the wasm CPU path. Medians over --repeat runs of
the page's check mode (fresh browser each run). Writes JSON.

    .venv/bin/python benchmarks/web_page.py --repeat 3
    .venv/bin/python benchmarks/web_page.py --bundle runs/bundle --accelerators webgpu
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from _proc_tree import TreePeak

ROOT = Path(__file__).resolve().parents[1]


def _median(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 1) if xs else None


def summarize(runs: list[dict]) -> dict:
    comps = runs[0]["components"].keys()
    out = {
        "ok": all(r.get("ok") for r in runs),
        "page_load_ms": _median([r["latency_ms"]["page_load"] for r in runs]),
        "litertjs_ready_ms": _median([r["latency_ms"]["runtime_ready"] for r in runs]),
        "unet_step_ms": _median([r["latency_ms"]["unet_step_mean_ms"] for r in runs]),
        "unet_steps": len(runs[0]["latency_ms"]["unet_steps_ms"]),
        "total_ms": _median([r["latency_ms"]["total_ms"] for r in runs]),
        "host_peak_mb": _median([(r.get("memory") or {}).get("peak_pss_mb") for r in runs]),
        "webgpu_ledger_peak_mb": _median([(r.get("gpu_memory") or {}).get("peak_mb") for r in runs]),
        "components": {},
    }
    for c in comps:
        out["components"][c] = {
            k: _median([r["components"][c].get(k) for r in runs]) for k in ("fetch_ms", "compile_ms", "run_ms")
        }
        out["components"][c]["first_run_ms"] = _median([r["components"][c]["golden"].get("first_run_ms") for r in runs])
        out["components"][c]["fully_accelerated"] = all(r["components"][c]["fully_accelerated"] for r in runs)
        out["components"][c]["golden_cosine_min"] = min(r["components"][c]["golden"]["cosine"] for r in runs)
    out["image_psnr_db_min"] = min(r["image"].get("psnr_db", float("nan")) for r in runs)
    out["adapter"] = runs[0]["webgpu"].get("adapter")
    if all("memory" in r for r in runs):
        out["peak_pss_mb"] = _median([r["memory"]["peak_pss_mb"] for r in runs])
    return out


def main() -> int:
    from pocketdiff.web.headless import check_page, find_chromium
    from pocketdiff.web.page import PageConfig, write_page

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default=str(ROOT / "tests/web/smoke_bundle"), help="bundle folder (copied; its page is written in the copy)")
    ap.add_argument("--accelerators", default="webgpu,wasm")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/web_page_cpu.json"))
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds the page may take to report, per run")
    ap.add_argument("--unet", choices=("resident", "streamed"), default="resident",
                    help="the page's unet option: a chunked UNet's chunks kept compiled, or compiled for each step")
    ap.add_argument("--gpu-device", choices=("per-model", "shared"), default="per-model",
                    help="the page's gpu_device option: each model's WebGPU device destroyed on release, or LiteRT.js's one device")
    ap.add_argument("--echo", action="store_true", help="print the page's console lines (its status included) as they arrive")
    args = ap.parse_args()
    exe = find_chromium()
    if exe is None:
        raise SystemExit("no Chromium (bash scripts/setup.sh installs it)")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="pocketdiff-webbench-") as tmp:
        bundle = Path(tmp) / "bundle"
        shutil.copytree(args.bundle, bundle, ignore=shutil.ignore_patterns("web", "_export"))
        write_page(PageConfig(bundle=str(bundle)))
        ref = json.loads((bundle / "web/reference/reference.json").read_text())
        results = {}
        for acc in args.accelerators.split(","):
            runs = []
            for i in range(args.repeat):
                t0 = time.perf_counter()
                sampler = TreePeak()  # this process (the page's server) + Chromium's processes
                try:
                    echo = (lambda line, t=t0: print(f"[{time.perf_counter() - t:7.1f} s] {line[:300]}", flush=True)) if args.echo else None
                    r = check_page(bundle, prompt=ref["prompt"], seed=ref["seed"], timeout_s=args.timeout, accelerator=acc,
                                   unet=args.unet, gpu_device=args.gpu_device, echo=echo)
                finally:
                    memory = sampler.stop()
                console = r.pop("chromium_console", None) or []
                r["memory"] = {**memory, "what": "peak of the summed PSS of this process (the page's server) and every "
                                                 "process it started (Chromium's); SwiftShader's GPU buffers are host memory"}
                r["wall_s"] = round(time.perf_counter() - t0, 1)
                if "latency_ms" not in r:  # the page reported a failure: keep it (and the console's tail), and stop here
                    r["console_tail"] = console[-40:]
                    print(f"{acc} run {i + 1}: the page failed: {json.dumps(r)[:2000]}", flush=True)
                    Path(args.out).write_text(json.dumps({"ok": False, "accelerator": acc, "report": r}, indent=1))
                    return 1
                runs.append(r)
                print(f"{acc} run {i + 1}/{args.repeat}: ok={r.get('ok')} UNet {r['latency_ms']['unet_step_mean_ms']:.0f} ms/step, "
                      f"total {r['latency_ms']['total_ms']:.0f} ms ({time.perf_counter() - t0:.1f} s with goldens and startup)", flush=True)
            results[acc] = {"median": summarize(runs), "runs": runs}
    man = json.loads((Path(args.bundle) / "manifest.json").read_text())
    report = {
        "what": "pocketdiff web page check mode in headless Chromium, medians over repeats",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "chromium": version, "load_avg": os.getloadavg()},
        "bundle": {"path": args.bundle, "resolution": man["image"]["width"], "steps": len(man["scheduler"]["timesteps"]),
                   "weights": {k: v["weights"] for k, v in man["components"].items()},
                   "bytes": {k: v["bytes"] for k, v in man["components"].items()}},
        "repeat": args.repeat,
        "unet": args.unet, "gpu_device": args.gpu_device,
        "gpu": "SwiftShader" if any("swiftshader" in json.dumps((r.get("webgpu") or {}).get("adapter") or {}).lower()
                                    for v in results.values() for r in v["runs"]) else "real",
        "results": results,
    }
    for dest in [Path(args.out)] + ([Path(os.environ["OUT"]) / Path(args.out).name] if os.environ.get("OUT") else []):
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(json.dumps(report, indent=1))
        print(f"wrote {dest}")
    for acc, res in results.items():
        m = res["median"]
        print(f"{acc}: page load {m['page_load_ms']} ms, LiteRT.js ready {m['litertjs_ready_ms']} ms, UNet {m['unet_step_ms']} ms/step, "
              f"total {m['total_ms']} ms; compile " + ", ".join(f"{c} {v['compile_ms']}" for c, v in m["components"].items())
              + "; first run " + ", ".join(f"{c} {v['first_run_ms']}" for c, v in m["components"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
