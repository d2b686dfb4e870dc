"""The SDXL-on-OpenMoji table (issue 63 item 5) from scripts/gpu/sdxl_openmoji.sh's runs, in two steps:

    python3 scripts/gpu/sdxl_openmoji_table.py gpu --runs RUNS --device h100 --out $OUT/sdxl_openmoji_h100.json
    python3 scripts/gpu/sdxl_openmoji_table.py bundle --json $FROM/sdxl_openmoji_h100.json --preset koala_700m \
        --eval outputs/eval-bundle/report.json --export outputs/bundle-koala_700m/report.json \
        --out benchmarks/results/sdxl_openmoji_h100.json

`gpu` (on the GPU machine, the students call): RUNS is the chain's folder (outputs/prune-PRESET, lcm-NAME, w8-NAME, eval,
logs/), read as block_removal_table.py reads its own: one row per (preset, variant, steps) with `preset`, `unet_params`,
`steps`, `fd`, `clip_score`, `fd_ratio` (FD over the unpruned student's of the same variant at the same steps),
`gpu_hours` (the prune KD's training wall time on the GPU it shared: an upper bound of its own; 0 for unpruned), the
teacher's DDIM at 64 steps as one row. The summary: the koala_700m W8 2-step student against the target (FD <= 1.15x the
unpruned 2-step student's: W8 against W8, and against the unpruned float student).

`bundle` (here, after `export` and one `evaluate` on the same captions): the bundle's row (variant `bundle`, 2 steps, its
FD and CLIP score on the LiteRT GPU delegate; `fd_ratio` over the unpruned W8 pipeline's FD on the same captions in the
same evaluate, `fd_vs_w8_pipeline` over its own W8 pipeline's) with the bundle's measured bytes and delegate checks from
the export report, added to the GPU rows; the plot is drawn again beside --out.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from block_removal_table import _read, plot, rows_of, sizes, student_train, summary

PRESETS = ("unpruned", "koala_1b", "koala_700m")
TARGETS = {"koala_700m": 1.15}  # FD at 2 steps, x the unpruned 2-step student's (the chain's end: W8)
WHAT = ("SDXL-shaped OpenMoji teacher (small_xl: two text towers, pooled embedding, time ids) -> KOALA-style block "
        "removal + output/feature KD -> 2-step consistency student -> W8 -> bundle")
FEATURES = "FD on OpenMoji-CLIP image embeddings; CLIP score with the same CLIP"
SCRIPT = "scripts/gpu/sdxl_openmoji.sh (teacher, prune, students on the GPU; bundle here) + scripts/gpu/sdxl_openmoji_table.py"


def xl_summary(rows: list[dict]) -> dict:
    """summary()'s targets, and the koala_700m W8 2-step FD over the unpruned float 2-step student's."""
    out = summary(rows, TARGETS)
    two = {(r["preset"], r["variant"]): r for r in rows if r["steps"] == 2}
    for p, limit in TARGETS.items():
        w8, base = two.get((p, "w8"), {}).get("fd"), two.get(("unpruned", "float"), {}).get("fd")
        ratio = round(w8 / base, 4) if w8 is not None and base else None
        out[f"{p}_w8_2step_fd_over_unpruned_float"] = ratio
        out[f"{p}_w8_vs_float_target_met"] = None if ratio is None else ratio <= limit
    return out


def build_gpu(runs: Path, device: str = "", conditions: str = "") -> dict:
    results = _read(runs / "outputs" / "eval" / "report.json").get("results") or []
    if not results:
        raise SystemExit(f"{runs}/outputs/eval/report.json has no results: run the students phase to its end")
    rows = rows_of(results, sizes(runs, PRESETS), {p: student_train(runs, p) for p in PRESETS}, PRESETS)
    teacher = _read(runs / "outputs" / "teacher-openmoji" / "pipeline" / "unet" / "config.json")
    return {"what": WHAT, "device": device, "features": FEATURES, "script": SCRIPT, "conditions": conditions,
            "teacher": {"arch": "small_xl", "addition_embed_type": teacher.get("addition_embed_type"),
                        "transformer_layers_per_block": teacher.get("transformer_layers_per_block")},
            "presets": "pocketdiff/unet_blocks.py XL_PRESETS on small_xl: koala_1b = base + the lowest attention stage's "
                       "transformers 2 -> 1 block; koala_700m = small (no mid block) + the same cut",
            "gpu_hours": "the recovery's training wall time (prune KD) on a GPU shared with the other runs of its call: "
                         "an upper bound of its own GPU time", "rows": rows, "summary": xl_summary(rows)}


def _component_checks(export: dict) -> dict:
    comps = export.get("components") or {}
    return {name: {k: c.get(k) for k in ("weights", "fully_accelerated", "cosine", "psnr_db", "bytes")}
            for name, c in comps.items() if isinstance(c, dict)}


def bundle_rows(table: dict, preset: str, results: list[dict], export: dict) -> list[dict]:
    """The bundle's row from the evaluate results (PRESET bundle, PRESET W8, unpruned W8 at 2 steps) and the export report."""
    by = {r["model"]: r for r in results if r.get("steps") == 2}
    b, own, base = by.get(f"{preset} bundle"), by.get(f"{preset} W8"), by.get("unpruned W8")
    if b is None:
        raise SystemExit(f"the evaluate report has no '{preset} bundle' at 2 steps")
    gpu = next((r for r in table["rows"] if r["preset"] == preset and r["variant"] == "w8" and r["steps"] == 2), {})
    checks = _component_checks(export)
    ratio = lambda a, c: round(a["fd"] / c["fd"], 4) if a and c and a.get("fd") is not None and c.get("fd") else None  # noqa: E731
    return [{"preset": preset, "variant": "bundle", "steps": 2, "fd": b["fd"], "clip_score": b["clip_score"],
             "fd_ratio": ratio(b, base), "fd_vs_w8_pipeline": ratio(b, own),
             "w8_pipeline_fd": (own or {}).get("fd"), "w8_pipeline_clip_score": (own or {}).get("clip_score"),
             "unpruned_w8_pipeline_fd": (base or {}).get("fd"), "num_samples": b.get("num_samples"),
             "unet_params": gpu.get("unet_params"), "gpu_hours": gpu.get("gpu_hours"),
             "bundle_bytes": export.get("bundle_bytes"), "unet_tflite_bytes": (checks.get("unet") or {}).get("bytes"),
             "fully_accelerated": bool(checks) and all(c.get("fully_accelerated") for c in checks.values()),
             "seconds_per_image": b.get("seconds_per_image"),
             "where": "the bundle on the LiteRT GPU delegate over lavapipe (2-core box); the W8 pipelines on its CPU"}]


def build_bundle(table: dict, preset: str, evaluate: dict, export: dict) -> dict:
    rows = [r for r in table["rows"] if r.get("variant") != "bundle"] + bundle_rows(table, preset, evaluate.get("results") or [], export)
    b = rows[-1]
    out = dict(table, rows=rows, summary={**(table.get("summary") or {}), f"{preset}_bundle_2step_fd_ratio": b["fd_ratio"],
                                         f"{preset}_bundle_fd_vs_w8_pipeline": b["fd_vs_w8_pipeline"]})
    out["bundle"] = {"export": f"pocketdiff export --config configs/export/calibrated_int8.yaml int8.checkpoint=<w8-{preset}> steps=2",
                     "weights": export.get("weights"), "resolution": export.get("resolution"), "guidance": export.get("guidance"),
                     "bundle_bytes": export.get("bundle_bytes"), "peak_rss_mb": export.get("peak_rss_mb"),
                     "export_s": export.get("export_s"), "components": _component_checks(export),
                     "captions": b["num_samples"], "carried": "the W8 students came back from the GPU as scripts/gpu/w8_carry.py "
                     "slims them: the UNet rebuilt bit for bit from its int8 checkpoint, the text encoders and VAE in "
                     "float16 (the bundle's own precision for them)"}
    return out


def _write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    result["plot"] = plot(result["rows"], out.with_suffix(".png"), TARGETS).name
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    for r in result["rows"]:
        fd = "-" if r["fd"] is None else f"{r['fd']:.3f}"
        print(f"{r['preset']:>10} {r['variant']:>6} {r['steps']:>2} steps  params {r.get('unet_params')}  FD {fd}  "
              f"CLIP {r['clip_score']:.2f}  fd_ratio {r.get('fd_ratio')}  gpu_hours {r.get('gpu_hours')}")
    print(json.dumps(result["summary"], indent=2))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gpu", help="the GPU calls' rows")
    g.add_argument("--runs", type=Path, required=True)
    g.add_argument("--device", default="h100")
    g.add_argument("--conditions", default="", help="a line on how the runs were cut (kept in the JSON)")
    g.add_argument("--out", type=Path, required=True)
    b = sub.add_parser("bundle", help="add the bundle's row to the GPU rows")
    b.add_argument("--json", type=Path, required=True, help="the gpu step's JSON")
    b.add_argument("--preset", default="koala_700m")
    b.add_argument("--eval", type=Path, required=True, help="the evaluate report of the bundle and the W8 pipelines")
    b.add_argument("--export", type=Path, required=True, help="the bundle's export report.json")
    b.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.cmd == "gpu":
        _write(build_gpu(args.runs, args.device, args.conditions), args.out)
    else:
        for p in (args.json, args.eval, args.export):
            if not p.is_file():
                raise SystemExit(f"{p}: no such file")
        _write(build_bundle(json.loads(args.json.read_text()), args.preset, json.loads(args.eval.read_text()),
                            json.loads(args.export.read_text())), args.out)


if __name__ == "__main__":
    main()
