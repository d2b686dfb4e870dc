"""The block-removal table (issue 48 item 3) from the reports of scripts/gpu/block_removal_openmoji.sh.

    python3 scripts/gpu/block_removal_table.py --runs RUNS --device "one H200" \
        --out benchmarks/results/block_removal_openmoji_h200.json

RUNS: bro_reports.tgz unpacked (outputs/prune-PRESET, outputs/lcm-NAME, outputs/w8-NAME, outputs/eval, logs/). One row
per (preset, variant, steps): `unpruned` is the same chain without block removal; variant float (the consistency
student), w8 (block reconstruction) or w8_rtn; `fd_ratio` is FD over the unpruned student's of the same variant at
the same steps; `gpu_hours` is the recovery's (prune KD) training wall time on the GPU it shared with the other
runs of its call (an upper bound of its own GPU time; 0 for unpruned). The teacher's DDIM at 64 steps is one row.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

PRESETS = ("unpruned", "base", "small", "tiny")
TARGETS = {"small": 1.15, "tiny": 1.25}  # FD at 2 steps, x the unpruned 2-step student's (the chain's end: W8)
VARIANTS = {"float": " float", "w8": " W8", "w8_rtn": " W8 RTN"}  # evaluate model names: PRESET + suffix
COLORS = {"float": "tab:blue", "w8": "tab:orange", "w8_rtn": "tab:green", "bundle": "tab:purple"}  # bundle: sdxl_openmoji_table.py


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def recovery_seconds(log: Path) -> float | None:
    """Training wall seconds of the recovery from logs.jsonl (`wall_s` restarts at 0 in a resumed invocation)."""
    if not log.is_file():
        return None
    total, last = 0.0, 0.0
    for line in log.read_text().splitlines():
        row = json.loads(line)
        if row.get("phase") != "recovery" or "wall_s" not in row:
            continue
        if row["wall_s"] < last:
            total += last
        last = row["wall_s"]
    return total + last


def sizes(runs: Path, presets: tuple = PRESETS) -> dict:
    """{preset: {unet_params, macs, recovery seconds and steps}} from the prune reports (unpruned: their `before`)."""
    out = {}
    for p in presets[1:]:
        rep = _read(runs / "outputs" / f"prune-{p}" / "report.json")
        if not rep:
            continue
        rec = rep.get("recovery") or {}
        out.setdefault("unpruned", {"unet_params": rep["params_before"], "macs": rep["macs"]["total_before"],
                                    "recovery_s": 0.0, "recovery_steps": 0})
        out[p] = {"unet_params": rep["params_after"], "macs": rep["macs"]["total_after"],
                  "recovery_s": recovery_seconds(runs / "outputs" / f"prune-{p}" / "logs.jsonl"),
                  "recovery_steps": rec.get("steps"), "removed": (rep.get("blocks") or {}).get("removed")}
    return out


def student_train(runs: Path, name: str) -> dict:
    """The consistency student's training steps and seconds (its distill report; none when it did not finish)."""
    rounds = _read(runs / "outputs" / f"lcm-{name}" / "report.json").get("rounds") or []
    if not rounds:
        return {"lcm_steps": None, "lcm_train_s": None}
    r = rounds[0]
    return {"lcm_steps": r.get("train_steps", r.get("steps_trained")), "lcm_train_s": r.get("train_seconds")}


def rows_of(results: list[dict], size: dict, train: dict, presets: tuple = PRESETS) -> list[dict]:
    """Rows from the evaluate results: the teacher's, then per preset, variant and steps, with fd_ratio."""
    by = {(r["model"], r["steps"]): r for r in results}
    rows = [{"preset": "teacher", "variant": "ddim", "steps": s, "fd": r["fd"], "clip_score": r["clip_score"],
             "unet_params": (size.get("unpruned") or {}).get("unet_params"), "gpu_hours": None}
            for (m, s), r in sorted(by.items()) if m == "teacher DDIM"]
    ref64 = next((r["fd"] for r in rows if r["steps"] == 64), None)
    for p in presets:
        for variant, suffix in VARIANTS.items():
            for (m, steps), r in sorted(by.items(), key=lambda kv: kv[0][1]):
                if m != f"{p}{suffix}":
                    continue
                base = by.get((f"unpruned{suffix}", steps), {}).get("fd")
                sz, rec = size.get(p, {}), (size.get(p) or {}).get("recovery_s")
                rows.append({"preset": p, "variant": variant, "steps": steps, "fd": r["fd"], "clip_score": r["clip_score"],
                             "fd_ratio": round(r["fd"] / base, 4) if base and r["fd"] is not None else None,
                             "fd_over_teacher64": round(r["fd"] / ref64, 4) if ref64 and r["fd"] is not None else None,
                             "unet_params": sz.get("unet_params"), "macs": sz.get("macs"),
                             "gpu_hours": None if rec is None else round(rec / 3600, 5),
                             "recovery_steps": sz.get("recovery_steps"), "num_samples": r.get("num_samples"),
                             **train.get(p, {})})
    return rows


def summary(rows: list[dict], targets: dict = TARGETS) -> dict:
    """The issue's targets on the chain's end (W8, 2 steps), and the same on the float students."""
    out = {}
    for variant in ("w8", "float"):
        for p, limit in targets.items():
            r = next((r for r in rows if r["preset"] == p and r["variant"] == variant and r["steps"] == 2), None)
            ratio = r and r.get("fd_ratio")
            out[f"{p}_{variant}_2step_fd_ratio"] = ratio
            out[f"{p}_{variant}_target_met"] = None if ratio is None else ratio <= limit
    return out


def plot(rows: list[dict], path: Path, targets: dict = TARGETS) -> Path:
    """FD and CLIP score at 2 steps against UNet parameters, one line per variant; the targets as marks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    two = [r for r in rows if r["steps"] == 2 and r.get("unet_params") and r["fd"] is not None]
    for ax, key, title in ((axes[0], "fd", "FD (OpenMoji-CLIP) at 2 steps, lower is better"),
                           (axes[1], "clip_score", "CLIP score at 2 steps, higher is better")):
        for variant in COLORS:
            pts = sorted((r["unet_params"] / 1e6, r[key], r["preset"]) for r in two if r["variant"] == variant)
            if pts:
                ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], marker="o", color=COLORS[variant], label=variant)
                for x, y, name in pts:
                    ax.annotate(name, (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
        teacher = next((r for r in rows if r["preset"] == "teacher" and r["steps"] == 64), None)
        if teacher and teacher[key] is not None:
            ax.axhline(teacher[key], color="grey", linestyle=":", label="teacher DDIM 64")
        ax.set_xlabel("UNet parameters (M)")
        ax.set_title(title, fontsize=10)
    base = next((r["fd"] for r in two if r["preset"] == "unpruned" and r["variant"] == "w8"), None)
    for p, limit in targets.items():
        if base:
            axes[0].axhline(base * limit, color="tab:red", linestyle="--", linewidth=0.8)
            axes[0].annotate(f"{p} target ({limit}x unpruned W8)", (0, base * limit), xycoords=("axes fraction", "data"), fontsize=7)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def build(runs: Path, device: str = "", conditions: str = "") -> dict:
    results = _read(runs / "outputs" / "eval" / "report.json").get("results") or []
    if not results:
        raise SystemExit(f"{runs}/outputs/eval/report.json has no results: run the students phase to its end")
    rows = rows_of(results, sizes(runs), {p: student_train(runs, p) for p in PRESETS})
    return {"what": "OpenMoji block removal (BK-SDM presets): teacher -> block removal + KD -> 2-step consistency student -> W8",
            "device": device, "features": "FD on OpenMoji-CLIP image embeddings; CLIP score with the same CLIP",
            "script": "scripts/gpu/block_removal_openmoji.sh (teacher, prune, students) + scripts/gpu/block_removal_table.py",
            "conditions": conditions, "gpu_hours": "the recovery's training wall time (prune KD) on a GPU shared with the "
            "other runs of its call: an upper bound of its own GPU time", "rows": rows, "summary": summary(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="one H200")
    ap.add_argument("--conditions", default="", help="a line on how the runs were cut (kept in the JSON)")
    args = ap.parse_args()
    result = build(args.runs, args.device, args.conditions)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result["plot"] = plot(result["rows"], args.out.with_suffix(".png")).name
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    for r in result["rows"]:
        print(f"{r['preset']:>8} {r['variant']:>6} {r['steps']:>2} steps  params {r.get('unet_params')}  FD {r['fd']:.3f}  "
              f"CLIP {r['clip_score']:.2f}  fd_ratio {r.get('fd_ratio')}  gpu_hours {r.get('gpu_hours')}")
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
