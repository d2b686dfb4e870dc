"""An app keeps its models (issue 66 item 4): one process, one `BundleRunner` of a given mode, N images in a row (one
prompt, seeds 0..N-1); per image the wall seconds, run-bundle's latency phases, each model's loads during it, the run's
host / GPU / host + GPU peaks so far and those of the image's own phases, and the image's sha256 (its PNG as run-bundle
writes it). Rows appended to --out (a JSON file of {"rows": [...]}, made when absent), so several processes, one per
mode, fill one file.

Modes: plain (every model loaded at the first image and kept), pipelined (each model loaded just before its use and
released after it), keep_unet (pipelined, the UNet kept from image to image: `keep=("unet",)`), keep_unet_text
(the UNet and text encoder kept), keep_unet_decoder (the UNet and decoder kept); with the text encoder on the CPU
(`on_cpu=("text_encoder",)`, issue 66's lever: no GPU compile or memory for it, reloaded from its kept CPU variant each
image where not kept): keep_unet_te_cpu, keep_unet_decoder_te_cpu, plain_te_cpu (every model kept, the encoder on the CPU).

    python benchmarks/app_images.py BUNDLE --mode keep_unet [--images 10] [--accelerator gpu] [--gpu-cache DIR]
        [--launch warm] --out rows.json
    python benchmarks/app_images.py --smoke --accelerator cpu --mode keep_unet --images 3 --out /tmp/rows.json
        (tests/web/smoke_bundle_tiny, assembled with smoke_bundle's shared files)
    python benchmarks/app_images.py --summarize rows.json [--device-file device.txt] --out result.json
        (a summary per mode and launch beside the rows: later images' seconds, peaks, where a later image's seconds go)
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"plain": (False, ()), "pipelined": (True, ()), "keep_unet": (True, ("unet",)),
         "keep_unet_text": (True, ("unet", "text_encoder")), "keep_unet_decoder": (True, ("unet", "vae_decoder")),
         # (pipelined, keep, other BundleRunner options)
         "keep_unet_te_cpu": (True, ("unet",), {"on_cpu": ("text_encoder",)}),
         "keep_unet_decoder_te_cpu": (True, ("unet", "vae_decoder"), {"on_cpu": ("text_encoder",)}),
         # the same in one LiteRT environment (one GPU device) for every model: no per-model device's own memory
         "keep_unet_decoder_te_cpu_one_env": (True, ("unet", "vae_decoder"), {"on_cpu": ("text_encoder",),
                                                                              "one_environment": True}),
         "plain_te_cpu": (False, (), {"on_cpu": ("text_encoder",)})}
PEAKS = ("host_peak_mb", "gpu_peak_mb", "host_plus_gpu_peak_mb", "host_plus_gpu_peak_at_once_mb")


def litert_version():
    try:
        import ai_edge_litert as a

        version = getattr(a, "__version__", None)
        if version:
            return version
        from importlib.metadata import version as dist_version

        return dist_version("ai-edge-litert")
    except Exception:  # a slimmed copy without metadata, or none at all
        return None


def png_sha256(image) -> str:
    """The sha256 of the PNG run-bundle would write for this image (runtime/run_bundle.main's rounding)."""
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((image * 255).round().astype(np.uint8)).save(buf, format="PNG")
    return hashlib.sha256(buf.getvalue()).hexdigest()


def window(phases: list) -> dict:
    """The largest host / GPU window peaks of some phases, and their largest sum within one phase (an upper bound of
    what was held at once in that image: each phase's host and GPU peaks may come at different moments)."""
    def top(key):
        vals = [p[key] for p in phases if p.get(key) is not None]
        return round(max(vals), 1) if vals else None
    both = [p["host_peak_mb"] + p["gpu_peak_mb"] for p in phases
            if p.get("host_peak_mb") is not None and p.get("gpu_peak_mb") is not None]
    return {"host_peak_mb": top("host_peak_mb"), "gpu_peak_mb": top("gpu_peak_mb"),
            "host_plus_gpu_peak_mb": round(max(both), 1) if both else None, "phases": len(phases)}


def loads_of(runner) -> dict:
    return {n: m.loads for n, m in runner.pool.models.items()}


def draw(bundle: Path, mode: str, images: int, prompt: str, accelerator: str, gpu_cache, launch: str) -> list[dict]:
    """`images` images from one runner of `mode`; one row each."""
    from pocketdiff.runtime.memory import process_age_s
    from pocketdiff.runtime.run_bundle import BundleRunner

    pipelined, keep, *more = MODES[mode]
    options = more[0] if more else {}
    common = {"mode": mode, "keep": list(keep), "on_cpu": list(options.get("on_cpu", ())), "launch": launch, "accelerator": accelerator, "bundle": bundle.name,
              "prompt": prompt, "litert": litert_version(), "pid": os.getpid()}
    t0 = time.perf_counter()
    runner = BundleRunner(bundle, accelerator, pipelined, gpu_cache=gpu_cache, keep=keep, **options)
    ready_s = time.perf_counter() - t0
    rows = []
    try:
        for i in range(images):
            seen, before = len(runner.pool.phases), loads_of(runner)
            t = time.perf_counter()
            image, stats = runner.run(prompt, seed=i)
            seconds = time.perf_counter() - t
            after = loads_of(runner)
            mem = stats["memory"]
            rows.append({**common, "image": i, "seed": i, "seconds": round(seconds, 4),
                         "runner_ready_s": round(ready_s, 4) if i == 0 else None,
                         "process_age_s": None if process_age_s() is None else round(process_age_s(), 3),
                         "latency_s": {k: round(v, 4) for k, v in stats["latency_s"].items()},
                         "loads": {n: c - before.get(n, 0) for n, c in after.items() if c - before.get(n, 0)},
                         **{k: mem.get(k) for k in PEAKS},
                         "image_window": window(runner.pool.phases[seen:]),
                         "xnnpack_cache": sorted({p.get("state") for p in runner.pool.phases[seen:] if p["phase"] == "xnnpack_cache"}),
                         "device": mem.get("gpu_name"), "gpu_source": mem.get("gpu_source"), "driver": stats["driver"],
                         "loading_policy": runner.policy.name, "fully_accelerated": stats["fully_accelerated"],
                         "accelerator_by_model": stats.get("accelerator_by_model"),
                         "finite": stats["finite"], "image_sha256": png_sha256(image)})
            r = rows[-1]
            print(json.dumps({k: r[k] for k in ("mode", "launch", "image", "seconds", "loads", *PEAKS)}), flush=True)
    finally:
        runner.close()
    return rows


def append_rows(out: Path, rows: list[dict]) -> None:
    data = json.loads(out.read_text()) if out.is_file() else {"rows": []}
    data["rows"].extend(rows)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(out)


def load_s(latency: dict, base: str) -> float:
    """A component's load seconds in one image: its chunks' (`unet.2_load`) where chunked, else `<base>_load`."""
    parts = [v for k, v in latency.items() if re.fullmatch(rf"{base}\.\d+_load", k)]
    return float(sum(parts)) if parts else float(latency.get(f"{base}_load", 0.0))


def decoder_load_s(latency: dict) -> float:
    """The decoder's load seconds: a whole one's, or a tiled one's head and up-path graphs together."""
    return float(sum(v for k, v in latency.items() if re.fullmatch(r"vae_[\w.]+_load", k)))


def _later_phases(later: list[dict]) -> dict:
    """Mean seconds of the later images' text encoder, UNet and decoder loads, the runs (encoder, steps, decoder
    graphs), and the rest (releases, LiteRT environments, tokenizer)."""
    def parts(L):
        runs = sum(L.get(k, 0.0) for k in ("text_encoder_run", "unet_steps", "vae_decoder_run", "vae_decoder_head_run",
                                           "vae_up_tiles_run"))
        te, unet, dec = load_s(L, "text_encoder"), load_s(L, "unet"), decoder_load_s(L)
        return {"text_encoder_load": te, "unet_load": unet, "decoder_load": dec, "runs": runs,
                "rest": L["total"] - te - unet - dec - runs, "total": L["total"]}
    each = [parts(r["latency_s"]) for r in later]
    return {k: round(sum(e[k] for e in each) / len(each), 3) for k in each[0]}


def summarize(rows: list[dict], budget_mb: float = 4000.0, later_s: float = 1.0) -> list[dict]:
    """Per mode and launch (in run order): first, second and last image seconds, the later images' range, the
    whole run's peaks (its last row), where a later image's seconds go, and whether it meets the issue's targets."""
    out = []
    for key in dict.fromkeys((r["mode"], r["launch"]) for r in rows):
        rs = sorted((r for r in rows if (r["mode"], r["launch"]) == key), key=lambda r: r["image"])
        later = [r for r in rs if r["image"] > 0]
        last = rs[-1]
        once = last["host_plus_gpu_peak_at_once_mb"]
        out.append({"mode": key[0], "keep": last["keep"], "launch": key[1], "images": len(rs),
                    "runner_ready_s": rs[0]["runner_ready_s"], "first_s": rs[0]["seconds"],
                    "second_s": rs[1]["seconds"] if len(rs) > 1 else None, "last_s": last["seconds"],
                    "later_min_s": min((r["seconds"] for r in later), default=None),
                    "later_max_s": max((r["seconds"] for r in later), default=None),
                    "later_mean_s": round(sum(r["seconds"] for r in later) / len(later), 3) if later else None,
                    **{k: last[k] for k in PEAKS},
                    "later_phases_mean_s": _later_phases(later) if later else None,
                    "later_loads": later[-1]["loads"] if later else None,
                    "later_within_1s": bool(later) and max(r["seconds"] for r in later) <= later_s,
                    "at_once_within_4gb": None if once is None else once <= budget_mb})
    return out


def write_summary(raw: Path, out: Path, device_file) -> None:
    rows = json.loads(raw.read_text())["rows"]
    seeds = {}
    for r in rows:
        seeds.setdefault(r["seed"], set()).add(r["image_sha256"])
    device = Path(device_file).read_text().strip() if device_file else None
    out.write_text(json.dumps({"device": device, "litert": rows[0]["litert"], "prompt": rows[0]["prompt"],
                               "same_image_per_seed_in_every_mode": all(len(v) == 1 for v in seeds.values()),
                               "summary": summarize(rows), "rows": rows}, indent=1) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?")
    ap.add_argument("--smoke", action="store_true", help="tests/web/smoke_bundle_tiny, assembled in a temporary folder")
    ap.add_argument("--images", type=int, default=10)
    ap.add_argument("--prompt", default="a photo of a red fox in the snow")
    ap.add_argument("--accelerator", default="gpu", choices=("cpu", "gpu"))
    ap.add_argument("--gpu-cache", default=None, help="the program cache folder (default: the bundle's own)")
    ap.add_argument("--launch", default="warm", help="a label: cold (empty caches) or warm")
    ap.add_argument("--out", required=True)
    ap.add_argument("--summarize", metavar="ROWS", help="write ROWS' summary and rows to --out (nothing runs)")
    ap.add_argument("--device-file", help="--summarize: nvidia-smi's name, driver, memory line")
    ap.add_argument("--mode", choices=sorted(MODES))
    args = ap.parse_args(argv)
    if args.summarize:
        write_summary(Path(args.summarize), Path(args.out), args.device_file)
        return 0
    if not args.mode:
        print("app_images: --mode is needed to draw images", file=sys.stderr)
        return 2
    if bool(args.bundle) == args.smoke:
        print("app_images: give a BUNDLE or --smoke (not both)", file=sys.stderr)
        return 2
    if args.images < 1:
        print(f"app_images: --images {args.images}: at least 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            sys.path.insert(0, str(ROOT / "benchmarks"))
            from runner_images import WEB, assemble

            bundle = assemble(WEB / "smoke_bundle_tiny", Path(tmp) / "smoke_bundle_tiny")
        else:
            bundle = Path(args.bundle)
        rows = draw(bundle, args.mode, args.images, args.prompt, args.accelerator, args.gpu_cache, args.launch)
    append_rows(Path(args.out), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
