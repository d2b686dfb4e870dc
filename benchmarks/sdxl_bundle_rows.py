#!/usr/bin/env python
"""Issue 63 item 3's rows: scripts/gpu/sdxl_bundle.sh's launches (benchmarks/startup_levers.py rows of run-bundle on an
SDXL-family phone bundle) -> benchmarks/results/sdxl_bundle_<preset>_<resolution>_<gpu>.json with the footprint rows'
fields (layout, mode, launch, host / GPU / at-once peaks, start_s, total_s, fully_accelerated, latency_s) plus `preset`,
`resolution`, `steps`, the chunk counts, the per-stage table (both text encoders, UNet chunks, decoder: load and run
seconds) and the targets checked (<= 4 GB host + GPU at once, image <= 30 s cold / <= 15 s warm).

  python benchmarks/sdxl_bundle_rows.py RUNS.json --manifest BUNDLE/manifest.json --preset koala_700m --resolution 768 \
      --out benchmarks/results/sdxl_bundle_koala700m_768_h100.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TARGETS = {"at_once_mb": 4000.0, "cold_s": 30.0, "warm_s": 15.0}
KEEP = ("layout", "mode", "flags", "launch", "start_s", "total_s", "process_wall_s", "host_peak_mb", "gpu_peak_mb",
        "host_plus_gpu_peak_mb", "host_plus_gpu_peak_at_once_mb", "fully_accelerated", "accelerator_by_model", "largest",
        "latency_s", "phases_s", "image_sha256", "same_image_as_baseline")
STAGES = ("text_encoder", "text_encoder_2", "unet", "vae_decoder_head", "vae_up_tile")


def stage_table(latency: dict) -> dict:
    """Seconds per stage from run-bundle's latency_s: load (open + compile + upload; a chunked model's chunks summed, or
    its total where it has no chunk entries) and run (the UNet: all its steps)."""
    table = {}
    for stage in STAGES:
        chunks = [v for k, v in latency.items() if k.startswith(stage + ".") and k.endswith("_load")]
        load = sum(chunks) if chunks else latency.get(f"{stage}_load")
        run = latency.get("unet_steps") if stage == "unet" else \
            latency.get(f"{stage}_run", sum(v for k, v in latency.items() if k.startswith(stage + ".") and k.endswith("_run")) or None)
        if load is not None or run is not None:
            table[stage] = {"load_s": None if load is None else round(load, 3), "run_s": None if run is None else round(run, 3)}
    return table


def rows_of(runs: dict, manifest: dict, preset: str, resolution: int) -> list[dict]:
    out = []
    for r in runs["rows"]:
        row = {k: r[k] for k in KEEP if k in r}
        if r.get("error"):
            row.update(error=r["error"], stderr_tail=r.get("stderr_tail"))
        row.update(preset=preset, resolution=resolution, steps=(manifest.get("scheduler") or {}).get("steps"),
                   unet_chunks=len((manifest.get("unet_chunks") or {}).get("components") or ["unet"]),
                   stages=stage_table(r.get("latency_s") or {}))
        at_once = r.get("host_plus_gpu_peak_at_once_mb")
        limit_s = TARGETS["cold_s"] if r.get("launch") == "cold" else TARGETS["warm_s"]
        row["targets"] = {"at_once_within_4gb": None if at_once is None else at_once <= TARGETS["at_once_mb"],
                          f"image_within_{limit_s:g}s": None if r.get("total_s") is None else r["total_s"] <= limit_s}
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, help="scripts/gpu/sdxl_bundle.sh's sdxl_bundle_runs.json")
    ap.add_argument("--manifest", type=Path, required=True, help="the measured bundle's manifest.json")
    ap.add_argument("--preset", required=True)
    ap.add_argument("--resolution", type=int, required=True)
    ap.add_argument("--command", default="bash scripts/gpu/sdxl_bundle.sh")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    for p in (a.runs, a.manifest):
        if not p.is_file():
            print(f"sdxl_bundle_rows: {p} is not a file", file=sys.stderr)
            return 2
    runs = json.loads(a.runs.read_text())
    manifest = json.loads(a.manifest.read_text())
    doc = {"what": "run-bundle on the SDXL-family phone bundle, kept resident (--pipelined, --overlap-loads), cold then "
                   "warm launches, each a fresh process; random tiled weights (export.synthetic)",
           "device": runs.get("device"), "litert": runs.get("litert"), "prompt": runs.get("prompt"),
           "command": a.command, "targets": TARGETS, "rows": rows_of(runs, manifest, a.preset, a.resolution)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}: {len(doc['rows'])} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
