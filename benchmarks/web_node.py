#!/usr/bin/env python
"""The web page's pipeline through `node web/node_runner.mjs` (LiteRT.js on WebGPU through Dawn's Node bindings,
so on a GPU machine's real GPU, no browser), beside `pocketdiff run-bundle --pipelined` on the same bundle in the
same call: one row per UNet mode (resident | streamed) and device mode (per-model: each model's WebGPU device
destroyed on release; shared: LiteRT.js's one device), with the memory of each node process measured from outside
(peak PSS of its process tree; its GPU memory through NVML where there is an NVIDIA driver) and the runner's own
WebGPU ledger (bytes of buffers and textures alive, static/gpu_device.js).

  python benchmarks/web_node.py --bundle B --unet resident,streamed --out benchmarks/results/web_sd21_node_h200.json

The bundle is copied and run-bundle's reference is written in the copy (`pocketdiff web`, made on
--reference-accelerator), or taken from --reference (a `pocketdiff web` page's web/reference/ folder, made elsewhere:
a machine without ai-edge-litert then runs this with node alone and --no-run-bundle); nothing of B changes. Rows:
ok, total_s, unet, gpu_device, gpu (real | SwiftShader | lavapipe), gpu_peak_mb, host_peak_mb, webgpu_ledger_peak_mb,
run_bundle_gpu_peak_mb, run_bundle_host_peak_mb, and where the GPU's memory went (NVML polled every 0.1 s, matched with the
runner's memory events: each model's open, compiled and close): gpu_peak_phase (the span between two events that holds
the peak), gpu_at_close_max_mb (the most held right after a model was released), gpu_at_end_mb,
gpu_beyond_ledger_at_compiled_max (the most held beyond the ledger's buffers and textures, and by which model), devices_uncollected;
each event gets gpu_mb and gpu_peak_since_previous_mb in the run's report, and the whole series is written beside it
(gpu_series.json in the row's folder).
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _proc_tree import TreePeak

ROOT = Path(__file__).resolve().parents[1]


class GpuSeries:
    """The GPU memory of process `pid` (GpuMemory's figure) polled every `every_s` in a thread: `samples`, a list of
    [epoch seconds, MB]; empty where there is no NVML."""

    def __init__(self, pid: int, every_s: float = 0.1):
        from pocketdiff.runtime.memory import GpuMemory

        self.gpu, self.every_s, self.samples = GpuMemory(pid), every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        if self.gpu.available:
            self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            used = self.gpu.used_mb()
            if used is not None:
                self.samples.append([round(time.time(), 3), round(used, 1)])
            self._stop.wait(self.every_s)

    def stop(self) -> list:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        return self.samples


def gpu_by_event(events: list[dict], samples: list) -> dict:
    """The GPU series matched with the runner's memory events (each with epoch_s): every event gets gpu_mb (the first
    sample at or after it; None when none came) and gpu_peak_since_previous_mb (the largest sample between the previous
    event and this one, both included); -> {gpu_peak_phase: the span holding the largest sample ({from, to, peak_mb}, an
    event named "kind model"; before the first event: "start", after the last: "end"), gpu_at_close_max_mb (the most
    held right after a release), gpu_at_end_mb (the last sample), gpu_beyond_ledger_at_compiled_max (the most GPU
    memory beyond the WebGPU ledger's live bytes right after a model compiled: {model, mb})}."""
    if not samples or not events or "epoch_s" not in events[0]:
        return {"gpu_peak_phase": None, "gpu_at_close_max_mb": None, "gpu_at_end_mb": samples[-1][1] if samples else None,
                "gpu_beyond_ledger_at_compiled_max": None, "gpu_beyond_rounded_at_compiled_max": None}
    marks = [float(e["epoch_s"]) for e in events]
    names = ["start"] + [f"{e['event']} {e['model']}" for e in events] + ["end"]
    spans = [[] for _ in range(len(events) + 1)]  # samples before event 0, between events i-1 and i, after the last
    for t, mb in samples:
        spans[bisect.bisect_right(marks, t)].append(mb)
    for i, e in enumerate(events):
        after = spans[i + 1][:1]
        e["gpu_mb"] = after[0] if after else None
        window = spans[i] + after
        e["gpu_peak_since_previous_mb"] = max(window) if window else None
    peaks = [max(s) if s else None for s in spans]
    best = max((i for i, p in enumerate(peaks) if p is not None), key=lambda i: peaks[i])
    closes = [e["gpu_mb"] for e in events if e["event"] == "close" and e.get("gpu_mb") is not None]
    # beyond the ledger once a model is compiled: what the WebGPU implementation and the driver hold besides the
    # buffers and textures (staging, pipelines, the device itself), the model named
    beyond = [(e["gpu_mb"] - e["webgpu_live_mb"], e["model"]) for e in events
              if e["event"] == "compiled" and e.get("gpu_mb") is not None and e.get("webgpu_live_mb") is not None]
    top = max(beyond) if beyond else None
    # the same against the ledger's bytes as a 64 KiB-granular buddy sub-allocator would round them (gpu_device.js)
    rounded = [(e["gpu_mb"] - e["webgpu_live_rounded_mb"], e["model"]) for e in events
               if e["event"] == "compiled" and e.get("gpu_mb") is not None and e.get("webgpu_live_rounded_mb") is not None]
    top_r = max(rounded) if rounded else None
    return {"gpu_peak_phase": {"from": names[best], "to": names[best + 1], "peak_mb": peaks[best]},
            "gpu_at_close_max_mb": max(closes) if closes else None, "gpu_at_end_mb": samples[-1][1],
            "gpu_beyond_ledger_at_compiled_max": {"model": top[1], "mb": round(top[0], 1)} if top else None,
            "gpu_beyond_rounded_at_compiled_max": {"model": top_r[1], "mb": round(top_r[0], 1)} if top_r else None}


def sample_process(cmd: list[str], env: dict, log: Path, timeout: float, cwd: str | None = None) -> dict:
    """Runs `cmd`, polling its process tree's PSS and its GPU memory (NVML: the process's own figure where the driver
    lists it, else the device's used memory minus its value at start) -> {exit, wall_s, memory, gpu_series}."""
    from pocketdiff.runtime.memory import GpuMemory, PeakSampler

    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        tree, gpu, series = TreePeak(proc.pid), PeakSampler(GpuMemory(proc.pid), every_s=0.2), GpuSeries(proc.pid)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        gpu_totals = gpu.totals()
        gpu.close()
        memory = {**tree.stop(), **{k: gpu_totals[k] for k in ("gpu_peak_mb", "gpu_source", "gpu_name")}}
    return {"exit": code, "wall_s": round(time.perf_counter() - t0, 1), "memory": memory, "gpu_series": series.stop()}


# the runner's memory experiments (web/node_runner.mjs), a row each
VARIANTS = {"plain": [], "nosettle": ["--no-settle-uploads"], "nosuballoc": ["--dawn-toggle", "disable_resource_suballocation"],
            "fp16": ["--precision", "fp16"], "fp16all": ["--precision", "fp16", "--decoder-precision", "fp16"]}


def run_node(bundle: Path, unet: str, device: str, timeout: float, out: Path, variant: str = "plain") -> dict:
    from pocketdiff.runtime.delegate import delegate_env

    env, driver = delegate_env()  # the system's Vulkan driver where there is one, else the lavapipe of setup
    out.mkdir(parents=True, exist_ok=True)
    cmd = ["node", str(ROOT / "web/node_runner.mjs"), str(bundle), "--unet", unet, "--gpu-device", device,
           "--out", str(out / "report.json"), "--image", str(out / "image.png"), *VARIANTS[variant]]
    r = sample_process(cmd, env, out / "node.log", timeout)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else None
    series = r.pop("gpu_series")
    r["gpu_phases"] = gpu_by_event((report or {}).get("memory_events") or [], series)  # fills each event's gpu_mb
    (out / "gpu_series.json").write_text(json.dumps({"what": "[epoch s, GPU MB (NVML, as gpu_peak_mb)] every 0.1 s, and "
                                                     "the runner's memory events with the GPU at each",
                                                     "samples": series, "events": (report or {}).get("memory_events")}))
    tail = (out / "node.log").read_text().splitlines()
    return {**r, "driver": driver, "report": report,
            "log_tail": [l for l in tail if not l.startswith(("INFO:", "I1", "I0", "Warning: maxDynamic"))][-25:]}


def run_bundle_pipelined(bundle: Path, prompt: str, seed: int, timeout: float, out: Path) -> dict:
    """`pocketdiff run-bundle --pipelined --accelerator gpu` on the same bundle (from a folder outside the repo, whose
    pocketdiff/ would shadow the installed package) -> its report's peaks, and the same measured from outside."""
    from pocketdiff.runtime.delegate import delegate_env

    env, _ = delegate_env()
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pocketdiff.cli", "run-bundle", str(bundle), "--accelerator", "gpu", "--pipelined",
           "--prompt", prompt, "--seed", str(seed), "--output", str(out / "run"), "--overwrite"]
    r = sample_process(cmd, env, out / "run_bundle.log", timeout, cwd=tempfile.gettempdir())
    rep_path = out / "run" / "report.json"
    rep = json.loads(rep_path.read_text()) if rep_path.exists() else {}
    return {"exit": r["exit"], "wall_s": r["wall_s"], "gpu_peak_mb": rep.get("gpu_peak_mb"), "host_peak_mb": rep.get("host_peak_mb"),
            "total_s": rep.get("total_s"), "measured_outside": r["memory"],
            "log_tail": (out / "run_bundle.log").read_text().splitlines()[-10:] if r["exit"] else []}


def gpu_kind(adapter: dict | None) -> str | None:
    if not adapter:
        return None
    text = " ".join(str(adapter.get(k) or "") for k in ("vendor", "architecture", "description", "device")).lower()
    if "swiftshader" in text:
        return "SwiftShader"
    if "llvmpipe" in text or "lavapipe" in text:
        return "lavapipe"
    return "software" if adapter.get("architecture") == "software" else "real"


def row(unet: str, device: str, r: dict, rb: dict | None, variant: str = "plain") -> dict:
    rep = r["report"] or {}
    ledger = rep.get("gpu_memory") or {}
    return {
        "ok": bool(rep.get("ok")), "failures": rep.get("failures") if rep else [f"node exit {r['exit']}: " + " | ".join(r["log_tail"][-3:])],
        "unet": unet, "gpu_device": device, "variant": variant, "gpu": gpu_kind(rep.get("adapter")),
        "total_s": round(rep["latency_ms"]["total_ms"] / 1000, 2) if rep.get("latency_ms") else None,
        "gpu_peak_mb": r["memory"].get("gpu_peak_mb"), "gpu_source": r["memory"].get("gpu_source"),
        "host_peak_mb": r["memory"].get("peak_pss_mb"),
        "webgpu_ledger_peak_mb": ledger.get("peak_mb"), "webgpu_ledger_live_at_end_mb": ledger.get("live_mb"),
        "run_bundle_gpu_peak_mb": rb.get("gpu_peak_mb") if rb else None,
        "run_bundle_host_peak_mb": rb.get("host_peak_mb") if rb else None,
        "image_psnr_db": (rep.get("image") or {}).get("psnr_db"), "process_wall_s": r["wall_s"], "exit": r["exit"],
        **(r.get("gpu_phases") or {}), "devices_uncollected": _uncollected(rep),
    }


def _uncollected(rep: dict) -> int | None:
    """Devices made and never garbage-collected by the end (the runner's report)."""
    d = rep.get("devices") or {}
    return d["created"] - d["collected"] if "created" in d and "collected" in d else None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--unet", default="resident", help="comma list of resident, streamed (a row each)")
    ap.add_argument("--gpu-device", default="per-model", help="comma list of per-model, shared (a row each)")
    ap.add_argument("--variant", default="plain", help=f"comma list of {', '.join(VARIANTS)} (the runner's memory "
                    "experiments: plain (uploads settled after each compile, the default), nosettle (--no-settle-uploads), "
                    "nosuballoc (the Dawn toggle disable_resource_suballocation), fp16 (--precision fp16: LiteRT.js at half "
                    "precision for the text encoder and UNet), fp16all (the decoder too: --decoder-precision fp16, for a "
                    "decoder with its 3x3 convs lowered); a row each)")
    ap.add_argument("--reference-accelerator", choices=("cpu", "gpu"), default="gpu")
    ap.add_argument("--reference", help="a web/reference/ folder written by `pocketdiff web` for this bundle (else made here)")
    ap.add_argument("--no-run-bundle", action="store_true", help="skip run-bundle --pipelined (a machine without ai-edge-litert)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    args.unets, args.devices, args.variants = args.unet.split(","), args.gpu_device.split(","), args.variant.split(",")
    if any(v not in VARIANTS for v in args.variants):
        ap.error(f"--variant: {args.variant!r}, expected a comma list of {', '.join(VARIANTS)}")
    if any(u not in ("resident", "streamed") for u in args.unets):
        ap.error(f"--unet: {args.unet!r}, expected a comma list of resident, streamed")
    if any(d not in ("per-model", "shared") for d in args.devices):
        ap.error(f"--gpu-device: {args.gpu_device!r}, expected a comma list of per-model, shared")
    if shutil.which("node") is None:
        ap.error("no node on PATH (Node.js >= 20)")
    if args.reference and not (Path(args.reference) / "reference.json").is_file():
        ap.error(f"--reference: {args.reference} has no reference.json (a `pocketdiff web` page's web/reference/)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    keep = Path(args.out).with_suffix("").resolve()  # run-bundle runs from another folder
    keep.mkdir(parents=True, exist_ok=True)
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
        ref = json.loads((bundle / "web/reference/reference.json").read_text())
        rb = None if args.no_run_bundle else run_bundle_pipelined(bundle, ref["prompt"], int(ref["seed"]), args.timeout, keep / "run_bundle")
        runs = {}
        for unet in args.unets:
            for device in args.devices:
                for variant in args.variants:
                    key = (unet, device, variant)
                    runs[key] = run_node(bundle, unet, device, args.timeout, keep / "_".join(key), variant)
                    print(json.dumps(row(*key[:2], runs[key], rb, variant)), flush=True)
                    write_result(args, runs, rb, page_s)  # after every row: a call cut at its budget keeps what ran
    return 0 if all((r["report"] or {}).get("ok") for r in runs.values()) else 1


def write_result(args, runs: dict, rb: dict | None, page_s: float) -> None:
    """The result file (args.out, and $OUT/<its name> where OUT is set), rewritten after every row."""
    from pocketdiff.outputs import atomic_write_text

    man = json.loads((Path(args.bundle) / "manifest.json").read_text())
    rows = [row(u, d, r, rb, v) for (u, d, v), r in runs.items()]
    out = {
        "what": "the web page's pipeline (web/static/) in Node.js through web/node_runner.mjs: LiteRT.js on WebGPU through "
                "Dawn's Node bindings (npm webgpu), no browser; checks as the page's check mode; beside run-bundle --pipelined",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python benchmarks/web_node.py " + " ".join(sys.argv[1:]),
        "rows": rows, "resolution": man["image"]["width"],
        "memory_what": "host_peak_mb: peak summed PSS of the node process tree (polled every 0.5 s); gpu_peak_mb: NVML for "
                       "that process (gpu_source says which figure); webgpu_ledger_*: bytes of WebGPU buffers and textures "
                       "alive, counted by the runner (static/gpu_device.js); run_bundle_*: run-bundle --pipelined's own report; "
                       "gpu_peak_phase, gpu_at_close_max_mb, gpu_at_end_mb: NVML polled every 0.1 s against the runner's "
                       "memory events (runs.*.report.memory_events[*].gpu_mb; the series in each row's gpu_series.json)",
        "run_bundle": rb, "page_and_reference_s": page_s, "reference": args.reference or f"made here ({args.reference_accelerator})",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "node": subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()},
        "bundle": {"path": args.bundle, "weights": {k: v.get("weights") for k, v in man["components"].items()},
                   "bytes": {k: v.get("bytes") for k, v in man["components"].items()}},
        "runs": {"_".join(key): dict(r) for key, r in runs.items()},
    }
    for dest in [Path(args.out)] + ([Path(os.environ["OUT"]) / Path(args.out).name] if os.environ.get("OUT") else []):
        atomic_write_text(dest, json.dumps(out, indent=1))  # a call stopped mid-write keeps the previous rows
        print(f"wrote {dest} ({len(rows)} of {len(args.unets) * len(args.devices) * len(args.variants)} rows)")


if __name__ == "__main__":
    raise SystemExit(main())
