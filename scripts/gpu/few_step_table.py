"""The few-step comparison table (issue 36) from the reports of scripts/gpu/few_step_openmoji.sh.

    python3 scripts/gpu/few_step_table.py --lcm RUNS/lcm --pd RUNS/pd --device "one H100 80GB" \
        --out benchmarks/results/few_step_openmoji_h100.json

RUNS/lcm, RUNS/pd: the distill output folders (unpacked from lcm_reports.tgz, pd_reports.tgz); each
holds report.json with per-round `train_seconds` and FD / CLIP score (`eval`). Rows: method, steps,
fd, clip_score, gpu_hours (training wall time on the one GPU up to that student, metrics excluded;
null for the teacher's DDIM rows, which cost no distillation).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

COUNTS = (1, 2, 4, 8)


def _metrics_by_count(round_report: dict) -> dict:
    """{steps: metrics} of one round (a consistency stage has one entry per measured count)."""
    ev = round_report.get("eval") or {}
    if round_report["stage"] == "consistency":
        return {int(n): e.get("metrics") for n, e in ev.items() if e.get("metrics")}
    return {round_report["steps"]: ev["metrics"]} if ev.get("metrics") else {}


def _row(method: str, steps: int, m: dict, seconds, run: str) -> dict:
    return {"method": method, "steps": steps, "fd": m.get("fd"), "clip_score": m.get("clip_score"),
            "gpu_hours": None if seconds is None else round(seconds / 3600, 5), "num_samples": m.get("num_samples"), "run": run}


def rows_of(report: dict, method: str, run: str) -> tuple[list[dict], dict]:
    """(student rows, teacher DDIM metrics by step count) of one distill report; PD's GPU time is cumulative."""
    rows, teacher, seconds = [], {}, 0.0
    for r in report["rounds"]:
        seconds += r.get("train_seconds") or 0.0
        for steps, m in sorted(_metrics_by_count(r).items()):
            rows.append(_row(method, steps, m["student"], seconds, run))
            teacher.setdefault(steps, m["teacher_same_steps"])
            teacher.setdefault(m["teacher_reference"]["steps"], m["teacher_reference"])
    return rows, teacher


def summary(rows: list[dict]) -> dict:
    """The issue's target: a 2-step student within 1.15x of the teacher-64 FD, in at most half of PD's GPU-hours."""
    get = {(r["method"], r["steps"]): r for r in rows}
    ref = get.get(("teacher_ddim", 64), {}).get("fd")
    out = {"teacher_ddim_64_fd": ref}
    for method in ("lcm", "pd"):
        two = get.get((method, 2))
        if two and ref and two["fd"] is not None:
            out[f"{method}_2step_fd_over_teacher64"] = round(two["fd"] / ref, 4)
            out[f"{method}_2step_gpu_hours"] = two["gpu_hours"]
    if out.get("lcm_2step_gpu_hours") and out.get("pd_2step_gpu_hours"):
        out["lcm_over_pd_gpu_hours_to_2_steps"] = round(out["lcm_2step_gpu_hours"] / out["pd_2step_gpu_hours"], 4)
    return out


def plot(rows: list[dict], path: Path) -> Path:
    """FD and CLIP score against steps, one line per method (log2 step axis), side by side in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "fd", "FD (OpenMoji-CLIP), lower is better"), (axes[1], "clip_score", "CLIP score, higher is better")):
        for method in ("teacher_ddim", "pd", "lcm"):
            pts = sorted((r["steps"], r[key]) for r in rows if r["method"] == method and r[key] is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", label={"teacher_ddim": "teacher DDIM", "pd": "progressive", "lcm": "consistency"}[method])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sampling steps")
        ax.set_title(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lcm", type=Path, required=True)
    ap.add_argument("--pd", type=Path, required=True)
    ap.add_argument("--device", default="one H100 80GB")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--conditions", default="", help="a line on how the runs were cut (kept in the JSON)")
    args = ap.parse_args()
    rows, teacher = [], {}
    for method, folder in (("lcm", args.lcm), ("pd", args.pd)):
        report = json.loads((folder / "report.json").read_text())
        got, t = rows_of(report, method, folder.name)
        rows += got
        for steps, m in t.items():
            teacher.setdefault(steps, (m, folder.name))  # the LCM run's teacher rows first, PD's for other counts
    rows += [_row("teacher_ddim", steps, m, None, run) for steps, (m, run) in sorted(teacher.items())]
    result = {"what": "OpenMoji few-step students: progressive distillation (pd) vs consistency distillation (lcm) vs the teacher's DDIM",
              "device": args.device, "features": "FD on OpenMoji-CLIP image embeddings; CLIP score with the same CLIP",
              "script": "scripts/gpu/few_step_openmoji.sh (teacher, lcm, pd) + scripts/gpu/few_step_table.py",
              "conditions": args.conditions, "rows": rows, "summary": summary(rows),
              "plot": args.out.with_suffix(".png").name}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, args.out.with_suffix(".png"))
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
