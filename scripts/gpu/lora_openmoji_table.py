"""The few-step LoRA table (issue 65 item 2) from the runs of scripts/gpu/lora_openmoji.sh.

    python3 scripts/gpu/lora_openmoji_table.py --runs RUNS --device h100 --out benchmarks/results/lora_openmoji_h100.json

RUNS: the script's working folder (or lora_reports.tgz unpacked): outputs/{lora,full}/report.json (the two distill
runs), outputs/eval-openmoji/report.json and outputs/eval-style/report.json (the two evaluates). Rows:

- `openmoji`: the base teacher's DDIM at 64 steps, the full student and the LoRA student at 2 and 4 steps (FD and CLIP
  score on OpenMoji-CLIP against OpenMoji), with `fd_over_full` (the LoRA's FD over the full student's at the same count);
- `style`: on the style subset's captions and images, the style teacher's DDIM at 2, 4 and 64, the style teacher with the
  LoRA (fused by `model.lora`, the LoRA student's LCMScheduler) at 2 and 4, and the base teacher with the LoRA at 2 and 4,
  with `fd_over_style_teacher64` (FD over the style teacher's own 64 steps);
- `lora`: the LoRA's file name, sha256, rank, alpha, targets, parameters (and their share of the UNet), bytes;
- `training`: each student's steps and training seconds (both ran at once on one GPU: upper bounds of their own time).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

OPENMOJI_MODELS = ("teacher DDIM", "full student", "LoRA student")
STYLE_MODELS = ("style teacher DDIM", "style teacher + LoRA", "base teacher + LoRA")


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _rows(results: list[dict], models: tuple, part: str) -> list[dict]:
    rows = []
    for name in models:
        for r in sorted((r for r in results if r["model"] == name), key=lambda r: r["steps"]):
            rows.append({"part": part, "model": name, "steps": r["steps"], "fd": r["fd"], "fd_std": r.get("fd_std"),
                         "clip_score": r["clip_score"], "guidance_scale": r.get("guidance_scale"),
                         "num_samples": r.get("num_samples"), "num_seeds": r.get("num_seeds"),
                         "seconds_per_image": r.get("seconds_per_image")})
    return rows


def _ratio(rows: list[dict], model: str, steps: int, ref_model: str, ref_steps: int) -> float | None:
    a = next((r["fd"] for r in rows if r["model"] == model and r["steps"] == steps), None)
    b = next((r["fd"] for r in rows if r["model"] == ref_model and r["steps"] == ref_steps), None)
    return round(a / b, 4) if a is not None and b else None


def _training(runs: Path, name: str) -> dict:
    rounds = _read(runs / "outputs" / name / "report.json").get("rounds") or []
    if not rounds:
        return {"train_steps": None, "train_seconds": None}
    r = rounds[0]
    return {"train_steps": r.get("train_steps"), "train_seconds": r.get("train_seconds"),
            "peak_gpu_mem_gib": (r.get("timing") or {}).get("peak_gpu_mem_gib")}


def _lora(runs: Path) -> dict:
    entry = dict(_read(runs / "outputs" / "lora" / "report.json").get("lora") or {})
    if entry.get("file"):
        entry["file"] = Path(entry["file"]).name  # the machine's path means nothing here
    return entry


def build(runs: Path, device: str = "", style: str = "", conditions: str = "") -> dict:
    ev1 = _read(runs / "outputs" / "eval-openmoji" / "report.json").get("results") or []
    ev2 = _read(runs / "outputs" / "eval-style" / "report.json").get("results") or []
    if not ev1 or not ev2:
        raise SystemExit(f"{runs}/outputs/eval-openmoji or eval-style has no results: run the eval phase to its end")
    rows = _rows(ev1, OPENMOJI_MODELS, "openmoji")
    for r in rows:
        if r["model"] == "LoRA student":
            r["fd_over_full"] = _ratio(rows, "LoRA student", r["steps"], "full student", r["steps"])
        r["fd_over_teacher64"] = _ratio(rows, r["model"], r["steps"], "teacher DDIM", 64)
    srows = _rows(ev2, STYLE_MODELS, "style")
    for r in srows:
        r["fd_over_style_teacher64"] = _ratio(srows, r["model"], r["steps"], "style teacher DDIM", 64)
    summary = {f"lora_over_full_fd_{n}step": _ratio(rows, "LoRA student", n, "full student", n) for n in (2, 4)}
    summary.update({f"style_lora_over_style_teacher64_fd_{n}step": _ratio(srows, "style teacher + LoRA", n, "style teacher DDIM", 64)
                    for n in (2, 4)})
    summary.update({f"style_lora_over_style_ddim_fd_{n}step": _ratio(srows, "style teacher + LoRA", n, "style teacher DDIM", n)
                    for n in (2, 4)})
    return {"what": "OpenMoji: few steps as a LoRA (consistency distillation of a LoRA over the teacher, LCM-LoRA's recipe) "
                    "against the full consistency student, and the same LoRA on a second teacher fine-tuned on a style subset",
            "device": device, "style_subset": style, "conditions": conditions,
            "features": "FD on OpenMoji-CLIP image embeddings; CLIP score with the same CLIP",
            "script": "scripts/gpu/lora_openmoji.sh (teacher, students, eval) + scripts/gpu/lora_openmoji_table.py",
            "lora": _lora(runs), "training": {"lora": _training(runs, "lora"), "full": _training(runs, "full")},
            "rows": rows + srows, "summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="h100")
    ap.add_argument("--style", default="flags", help="the OpenMoji groups of the style subset (kept in the JSON)")
    ap.add_argument("--conditions", default="", help="a line on how the runs were cut (kept in the JSON)")
    args = ap.parse_args()
    result = build(args.runs, args.device, args.style, args.conditions)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    lora = result["lora"]
    print(f"LoRA {lora.get('file')}: rank {lora.get('rank')}, {lora.get('params')} parameters, {lora.get('bytes')} bytes, "
          f"sha256 {lora.get('sha256')}")
    for r in result["rows"]:
        print(f"{r['part']:>8} {r['model']:>22} {r['steps']:>2} steps  FD {r['fd']}  CLIP {r['clip_score']}")
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
