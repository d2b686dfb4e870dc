#!/usr/bin/env python
"""The web page's pipeline through `node web/node_runner.mjs` (LiteRT.js on WebGPU through Dawn's Node bindings,
so on a GPU machine's real GPU, no browser): its report, with the memory of the node process measured from outside
(peak PSS of its process tree, and its GPU memory through NVML where there is an NVIDIA driver).

  python benchmarks/web_node.py --bundle B --unet streamed --out benchmarks/results/web_sd21_node_h100.json

The bundle is copied and run-bundle's reference is written in the copy (`pocketdiff web`, made on
--reference-accelerator), or taken from --reference (a `pocketdiff web` page's web/reference/ folder, made elsewhere:
a machine without ai-edge-litert then runs this with node alone); nothing of B changes.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _proc_tree import TreePeak

ROOT = Path(__file__).resolve().parents[1]


def run_node(bundle: Path, unet: str, timeout: float, out: Path) -> dict:
    from pocketdiff.runtime.delegate import delegate_env
    from pocketdiff.runtime.memory import GpuMemory, PeakSampler

    env, driver = delegate_env()  # the system's Vulkan driver where there is one, else the lavapipe of setup
    cmd = ["node", str(ROOT / "web/node_runner.mjs"), str(bundle), "--unet", unet, "--out", str(out / "report.json"),
           "--image", str(out / "image.png")]
    t0 = time.perf_counter()
    with open(out / "node.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        tree, gpu = TreePeak(proc.pid), PeakSampler(GpuMemory(proc.pid), every_s=0.2)  # the node process's GPU
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        gpu_totals = gpu.totals()
        gpu.close()
        memory = {**tree.stop(), **{k: gpu_totals[k] for k in ("gpu_peak_mb", "gpu_source", "gpu_name")}}
    wall = round(time.perf_counter() - t0, 1)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else None
    tail = (out / "node.log").read_text().splitlines()
    return {"exit": code, "wall_s": wall, "driver": driver, "memory": memory, "report": report,
            "log_tail": [l for l in tail if not l.startswith(("INFO:", "I1", "I0"))][-25:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--unet", choices=("resident", "streamed"), default="resident")
    ap.add_argument("--reference-accelerator", choices=("cpu", "gpu"), default="gpu")
    ap.add_argument("--reference", help="a web/reference/ folder written by `pocketdiff web` for this bundle (else made here)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if shutil.which("node") is None:
        raise SystemExit("no node on PATH (Node.js >= 20)")
    if args.reference and not (Path(args.reference) / "reference.json").is_file():
        raise SystemExit(f"--reference: {args.reference} has no reference.json (a `pocketdiff web` page's web/reference/)")
    with tempfile.TemporaryDirectory(prefix="pocketdiff-webnode-") as tmp:
        bundle = Path(tmp) / "bundle"
        shutil.copytree(args.bundle, bundle, ignore=shutil.ignore_patterns("web", "_export"))
        t0 = time.perf_counter()
        if args.reference:
            shutil.copytree(args.reference, bundle / "web" / "reference")
        else:
            from pocketdiff.web.page import PageConfig, write_page

            write_page(PageConfig(bundle=str(bundle), reference_accelerator=args.reference_accelerator))
        page_s = round(time.perf_counter() - t0, 1)
        keep = Path(args.out).with_suffix("")
        keep.mkdir(parents=True, exist_ok=True)
        r = run_node(bundle, args.unet, args.timeout, keep)
    man = json.loads((Path(args.bundle) / "manifest.json").read_text())
    rep = r["report"] or {}
    out = {
        "what": "the web page's pipeline (web/static/generate.js) in Node.js through web/node_runner.mjs: LiteRT.js on "
                "WebGPU through Dawn's Node bindings (npm webgpu), no browser; checks as the page's check mode",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python benchmarks/web_node.py " + " ".join(sys.argv[1:]),
        "ok": bool(rep.get("ok")), "failures": rep.get("failures"),
        "total_s": round(rep["latency_ms"]["total_ms"] / 1000, 2) if rep.get("latency_ms") else None,
        "resolution": man["image"]["width"], "unet": args.unet,
        "gpu": "real" if (rep.get("adapter") or {}).get("architecture") not in (None, "software", "swiftshader") else "software",
        "adapter": rep.get("adapter"), "image_psnr_db": (rep.get("image") or {}).get("psnr_db"),
        "host_peak_mb": r["memory"].get("peak_pss_mb"), "gpu_peak_mb": r["memory"].get("gpu_peak_mb"),
        "memory": {**r["memory"], "what": "peak summed PSS of the node process tree (polled every 0.5 s); GPU: NVML for that process"},
        "process_wall_s": r["wall_s"], "page_and_reference_s": page_s, "reference": args.reference or f"made here ({args.reference_accelerator})", "exit": r["exit"], "driver": r["driver"],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "node": subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()},
        "bundle": {"path": args.bundle, "weights": {k: v.get("weights") for k, v in man["components"].items()},
                   "bytes": {k: v.get("bytes") for k, v in man["components"].items()}},
        "report": rep, "log_tail": r["log_tail"],
    }
    for dest in [Path(args.out)] + ([Path(os.environ["OUT"]) / Path(args.out).name] if os.environ.get("OUT") else []):
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(json.dumps(out, indent=1))
        print(f"wrote {dest}")
    print(json.dumps({k: out[k] for k in ("ok", "total_s", "gpu", "image_psnr_db", "host_peak_mb", "gpu_peak_mb", "failures")}))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
