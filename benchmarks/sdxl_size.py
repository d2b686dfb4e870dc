"""Issue 63 item 3 at SDXL size on one GPU (scripts/gpu/sdxl_size.sh): the SDXL folder calibrate loads, and the
result rows of the distill step and of calibrate W8.

    python benchmarks/sdxl_size.py build DIR [--arch sdxl]
        an SDXL-family pipeline built from its config (random weights; norm affines perturbed as calibrate's
        `perturb_norms: 0.1` perturbs a built model's; SDXL base's force_zeros_for_empty_prompt) saved as a stock
        StableDiffusionXLPipeline folder: `pocketdiff calibrate model.pretrained=DIR` loads it through the real path
        (model_index.json, both text encoders and tokenizers, safetensors). Writes DIR.json (seconds, bytes, params).
    python benchmarks/sdxl_size.py summary --distill STEP.json [--distill STEP_B1.json] --calibrate RUN \\
        [--time-v TIME_V.txt] [--smi SMI.txt] [--meta META.json] --out-distill A.json --out-calibrate B.json
        rows with the device, torch version, settings and measured bytes, checked against the issue's targets
        (distill: >= 1.5x diffusers' default eager step's samples/s at the same batch; calibrate: <= 48 GiB host,
        <= 40 GiB GPU); prints a short summary.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from _checkout import use_checkout  # noqa: E402

use_checkout()

from pocketdiff.outputs import write_json  # noqa: E402

DISTILL_TARGET_RATIO = 1.5
HOST_TARGET_GIB, GPU_TARGET_GIB = 48.0, 40.0
NORM_SCALE = 0.1  # as configs/sd21/calibrate_smoke.yaml's perturb_norms (a built model's norms, not identities)
ROW_KEYS = ("variant", "batch", "oom", "samples_per_s", "step_s", "first_step_s", "peak_mem_bytes", "peak_mem_gib",
            "peak_reserved_bytes", "levers", "teacher_passes_per_step", "target_network_passes_per_step", "loss")
REPORT_KEYS = ("bits", "mode", "iters", "wall_time_s", "timings", "peak_gpu_memory_gb", "memory", "host_peak_rss_gb",
               "host_memory", "unet_cosine", "unet_cosine_rtn", "unet_nmse", "unet_nmse_rtn", "blocks_improved",
               "blocks_evaluated", "calibration", "parity", "source")


def build(args) -> int:
    import torch

    from pocketdiff.models import ModelConfig, build_pipeline, count_params, perturb_norm_affines, save_pipeline

    out = Path(args.dir)
    if (out / "model_index.json").is_file():
        print(f"[sdxl_size] {out} exists")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    pipe = build_pipeline(ModelConfig(arch=args.arch))
    for i, name in enumerate(("unet", "vae", "text_encoder", "text_encoder_2")):
        perturb_norm_affines(getattr(pipe, name), i, scale=NORM_SCALE)
    pipe.register_to_config(force_zeros_for_empty_prompt=True)  # SDXL base's setting
    built = time.time() - t0
    tmp = out.with_name(out.name + ".tmp")
    save_pipeline(pipe, tmp)
    tmp.rename(out)
    info = {"arch": args.arch, "build_s": round(built, 2), "save_s": round(time.time() - t0 - built, 2),
            "bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file()),
            "params": {n: count_params(getattr(pipe, n)) for n in ("unet", "text_encoder", "text_encoder_2", "vae")}}
    write_json(out.with_name(out.name + ".json"), info)
    print(f"[sdxl_size] {out}: UNet {info['params']['unet'] / 1e6:.0f} M params, {info['bytes'] / 2 ** 30:.1f} GiB on disk, "
          f"built in {info['build_s']} s, saved in {info['save_s']} s")
    return 0


def _read(path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def distill_rows(results: list[dict]) -> dict:
    """One row per (variant, batch) of distill_step.py results, each with its ratios to the eager row of its batch."""
    rows = []
    for res in results:
        for name, v in res.get("variants", {}).items():
            row = {k: v.get(k) for k in ROW_KEYS}
            row["batch"] = row["batch"] or res.get("batch")
            row["oom"] = bool(v.get("oom"))
            rows.append(row)
    eager = {r["batch"]: r for r in rows if r["variant"] == "eager" and not r["oom"]}
    for r in rows:
        ref = eager.get(r["batch"])
        if ref and not r["oom"]:
            r["samples_per_s_vs_eager"] = r["samples_per_s"] / ref["samples_per_s"]
            if ref.get("peak_mem_bytes") and r.get("peak_mem_bytes"):
                r["peak_mem_vs_eager"] = r["peak_mem_bytes"] / ref["peak_mem_bytes"]
    ours = [r for r in rows if r.get("samples_per_s_vs_eager") and r["variant"] != "eager"]
    best = max(ours, key=lambda r: r["samples_per_s_vs_eager"], default=None)
    return {"rows": rows, "best": None if best is None else {"variant": best["variant"], "batch": best["batch"],
                                                              "ratio": best["samples_per_s_vs_eager"]},
            "target_ratio": DISTILL_TARGET_RATIO,
            "meets_target": None if best is None else best["samples_per_s_vs_eager"] >= DISTILL_TARGET_RATIO}


def distill_summary(paths: list[str], meta: dict) -> dict:
    results = [r for r in (_read(p) for p in paths) if r]
    if not results:
        return {"benchmark": "sdxl_distill_step", "error": "no distill_step.py result", "meta": meta}
    head = results[0]
    out = {"benchmark": "sdxl_distill_step", "device": head.get("device"), "torch": head.get("torch"),
           "diffusers": head.get("diffusers"), "arch": head.get("arch"), "latent": head.get("latent"),
           "unet_params": head.get("params"), "dtype": head.get("dtype"), "attention_processor": head.get("attention_processor"),
           "settings": [r.get("settings") for r in results], "meta": meta}
    out.update(distill_rows(results))
    return out


def time_v_kb(path) -> int | None:
    """/usr/bin/time -v's maximum resident set size (kbytes, i.e. KiB) of the whole process."""
    try:
        for line in Path(path).read_text().splitlines():
            if "Maximum resident set size" in line:
                return int(line.split(":")[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def smi_peak_mib(path) -> int | None:
    try:
        vals = [int(v) for v in Path(path).read_text().split() if v.strip().isdigit()]
    except OSError:
        return None
    return max(vals) if vals else None


def calibrate_summary(run: str, time_v: str | None, smi: str | None, meta: dict) -> dict:
    report = _read(Path(run) / "report.json")
    out = {"benchmark": "sdxl_calibrate", "meta": meta, **{k: report[k] for k in REPORT_KEYS if k in report}}
    out["blocks"] = [{k: b.get(k) for k in ("name", "kind", "chosen", "iters", "time_s", "peak_gpu_gib", "cache_on_device")}
                     for b in report.get("blocks", [])]
    kb = time_v_kb(time_v) if time_v else None
    if kb:
        out["time_v_max_rss_bytes"] = kb * 1024
        out["time_v_max_rss_gib"] = round(kb / 2 ** 20, 3)
    mib = smi_peak_mib(smi) if smi else None
    if mib:
        out["nvidia_smi_peak_bytes"] = mib * 2 ** 20
    host = max([v for v in (out.get("time_v_max_rss_gib"), report.get("host_peak_rss_gb")) if v is not None], default=None)
    gpu = report.get("peak_gpu_memory_gb")
    out["targets"] = {"host_gib": HOST_TARGET_GIB, "gpu_gib": GPU_TARGET_GIB, "host_peak_gib": host, "gpu_peak_gib": gpu,
                      "host_ok": None if host is None else host <= HOST_TARGET_GIB,
                      "gpu_ok": None if gpu is None else gpu <= GPU_TARGET_GIB}
    if not report:
        out["error"] = f"no report.json in {run} (see the log)"
    return out


def _fmt(v, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def print_summary(d: dict, c: dict) -> None:
    if d.get("rows") is not None:
        print_distill(d)
    if c:
        print_calibrate(c)


def print_distill(d: dict) -> None:
    print(f"== SDXL distill step ({d.get('device')}, torch {d.get('torch')}, latent {d.get('latent')}) ==")
    for r in d.get("rows", []):
        if r["oom"]:
            print(f"  {r['variant']:11s} batch {r['batch']}: out of memory")
            continue
        print(f"  {r['variant']:11s} batch {r['batch']}: {_fmt(r['samples_per_s'])} samples/s, peak "
              f"{_fmt(r.get('peak_mem_gib'), '.1f')} GiB, x{_fmt(r.get('samples_per_s_vs_eager'))} vs eager")
    best = d.get("best")
    if best:
        print(f"  best: {best['variant']} at batch {best['batch']}: x{best['ratio']:.2f} (target >= {DISTILL_TARGET_RATIO})")


def print_calibrate(c: dict) -> None:
    t = c.get("targets", {})
    print(f"== SDXL calibrate W8 ({c.get('meta', {}).get('device')}) ==")
    print(f"  exit {c.get('meta', {}).get('calibrate_exit')}, wall {c.get('wall_time_s')} s, iters {c.get('iters')}, "
          f"host peak {_fmt(t.get('host_peak_gib'))} GiB (<= {HOST_TARGET_GIB:g}: {t.get('host_ok')}), GPU peak "
          f"{_fmt(t.get('gpu_peak_gib'))} GiB (<= {GPU_TARGET_GIB:g}: {t.get('gpu_ok')}), cosine {c.get('unet_cosine')} "
          f"(RTN {c.get('unet_cosine_rtn')})")
    if c.get("timings"):
        print(f"  timings {c['timings']}")


def summary(args) -> int:
    meta = _read(args.meta) if args.meta else {}
    d = distill_summary(args.distill or [], meta) if args.distill else {}
    c = calibrate_summary(args.calibrate, args.time_v, args.smi, meta) if args.calibrate else {}
    if args.out_distill and d:
        write_json(args.out_distill, d)
    if args.out_calibrate and c:
        write_json(args.out_calibrate, c)
    print_summary(d, c)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="an SDXL-family folder built from its config")
    b.add_argument("dir")
    b.add_argument("--arch", default="sdxl", choices=("sdxl", "small_xl", "tiny_xl"))
    b.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    s = sub.add_parser("summary", help="the result rows")
    s.add_argument("--distill", action="append", help="distill_step.py result JSON (repeat: e.g. a batch-1 fallback)")
    s.add_argument("--calibrate", help="the calibrate run folder (its report.json)")
    s.add_argument("--time-v", help="/usr/bin/time -v output of the calibrate process")
    s.add_argument("--smi", help="nvidia-smi memory.used samples (MiB) during calibrate")
    s.add_argument("--meta", help="the script's meta JSON (exit codes, wall times, device)")
    s.add_argument("--out-distill")
    s.add_argument("--out-calibrate")
    args = p.parse_args(argv)
    return build(args) if args.cmd == "build" else summary(args)


if __name__ == "__main__":
    sys.exit(main())
