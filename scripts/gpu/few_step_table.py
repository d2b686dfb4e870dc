"""The few-step comparison table (issue 36) from the reports of scripts/gpu/few_step_openmoji.sh.

    python3 scripts/gpu/few_step_table.py --lcm RUNS/lcm --pd RUNS/pd --device "one H100 80GB" \
        --out benchmarks/results/few_step_openmoji_h100.json

RUNS/lcm, RUNS/pd: the distill output folders (unpacked from lcm_reports.tgz, pd_reports.tgz); each
holds report.json with per-round `train_seconds` and FD / CLIP score (`eval`). Rows: method, steps,
fd, clip_score, gpu_hours (training wall time on the one GPU up to that student, metrics excluded;
null for the teacher's DDIM rows, which cost no distillation). A consistency run measured with
`eval.curve_steps` adds its checkpoints' points (`curve`: FD against GPU-hours), from which the summary
reads each method's GPU-hours to the issue's target (a 2-step student within 1.15x of the teacher-64 FD),
and to the same target with PD's 2-step CLIP score as a floor (`*_at_pd_clip`).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

COUNTS = (1, 2, 4, 8)
TARGET = 1.15  # x the teacher's 64-step DDIM FD, at 2 steps
COLORS = {"teacher_ddim": "tab:blue", "pd": "tab:orange", "lcm": "tab:green"}  # one colour per method in every panel


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


def curve_of(report: dict, method: str) -> list[dict]:
    """The checkpoints' points of a run measured with eval.curve_steps (GPU-hours: training seconds up to each)."""
    points, before = [], 0.0
    for r in report["rounds"]:
        for p in r.get("curve") or []:
            m = p["metrics"]
            points.append({"method": method, "steps": p["steps"], "train_step": p["step"], "fd": m.get("fd"),
                           "clip_score": m.get("clip_score"), "gpu_hours": round((before + p["train_seconds"]) / 3600, 5)})
        before += r.get("train_seconds") or 0.0
    return points


def two_step(points, method: str) -> list[dict]:
    """`method`'s 2-step points (rows or curve points) that have an FD and GPU-hours."""
    return [p for p in points if p["method"] == method and p["steps"] == 2 and p["fd"] is not None and p["gpu_hours"] is not None]


def hours_to_target(points: list[dict], target: float, min_clip: float | None = None) -> float | None:
    """The fewest GPU-hours at which a 2-step student of these points met `target` FD, and, with `min_clip`,
    a CLIP score of at least that as well (None: never)."""
    met = [p["gpu_hours"] for p in points
           if p["fd"] <= target and (min_clip is None or (p.get("clip_score") is not None and p["clip_score"] >= min_clip))]
    return min(met) if met else None


def clip_criterion(rows: list[dict], curve: list[dict], target: float) -> dict:
    """The target with PD's 2-step CLIP score as a floor: FD alone rewards an under-guided student (a consistency
    student's early checkpoints sample closer to the unguided teacher's spread, at a CLIP score well below
    the guided ones'), so LCM's GPU-hours to the FD target and to PD's prompt adherence are given side by side."""
    pd_two = [r for r in two_step(rows, "pd") if r.get("clip_score") is not None]
    if not pd_two:
        return {}
    floor = max(pd_two, key=lambda r: r["gpu_hours"])["clip_score"]
    hours = hours_to_target(two_step(rows + curve, "lcm"), target, floor)
    pd = hours_to_target(two_step(rows, "pd"), target, floor)
    out = {"pd_2step_clip_score": floor, "lcm_gpu_hours_to_target_at_pd_clip": hours}
    if hours and pd:
        out["lcm_over_pd_gpu_hours_to_target_at_pd_clip"] = round(hours / pd, 4)
        out["target_met_at_pd_clip"] = hours <= 0.5 * pd
    return out


def target_summary(rows: list[dict], curve: list[dict], ref: float) -> dict:
    """GPU-hours of each method to the target, and LCM's share of PD's; where PD never met it, its hours
    spent to 2 steps bound its hours to the target from below, so LCM's share is at most the bound."""
    target = TARGET * ref
    out = {"target_fd": round(target, 4)}
    for method in ("lcm", "pd"):
        out[f"{method}_gpu_hours_to_target"] = hours_to_target(two_step(rows + curve, method), target)
    lcm, pd = out["lcm_gpu_hours_to_target"], out["pd_gpu_hours_to_target"]
    pd_spent = max((r["gpu_hours"] for r in two_step(rows, "pd")), default=None)
    if lcm and pd:
        out["lcm_over_pd_gpu_hours_to_target"] = round(lcm / pd, 4)
        out["target_met"] = lcm <= 0.5 * pd
    elif lcm and pd_spent:
        out["lcm_over_pd_gpu_hours_to_target_at_most"] = round(lcm / pd_spent, 4)
        out["pd_note"] = f"PD's 2-step student did not meet the target after {pd_spent} GPU-hours"
        out["target_met"] = lcm <= 0.5 * pd_spent
    elif not lcm:
        two = two_step(rows + curve, "lcm")
        best = min(two, key=lambda p: p["fd"]) if two else None
        out["target_met"] = False
        out["lcm_note"] = ("LCM's 2-step student did not meet the target" + (
            f"; its best: FD {best['fd']:.2f} ({best['fd'] / ref:.3f}x) at {best['gpu_hours']} GPU-hours" if best else ""))
    out.update(clip_criterion(rows, curve, target))
    return out


def summary(rows: list[dict], curve: list[dict] = ()) -> dict:
    """The issue's target: a 2-step student within 1.15x of the teacher-64 FD, in at most half of PD's GPU-hours."""
    get = {(r["method"], r["steps"]): r for r in rows}
    ref = get.get(("teacher_ddim", 64), {}).get("fd")
    out = {"teacher_ddim_64_fd": ref}
    if ref:
        out.update(target_summary(rows, list(curve), ref))
    for method in ("lcm", "pd"):
        two = get.get((method, 2))
        if two and ref and two["fd"] is not None:
            out[f"{method}_2step_fd_over_teacher64"] = round(two["fd"] / ref, 4)
            out[f"{method}_2step_gpu_hours"] = two["gpu_hours"]
    if out.get("lcm_2step_gpu_hours") and out.get("pd_2step_gpu_hours"):
        out["lcm_over_pd_gpu_hours_to_2_steps"] = round(out["lcm_2step_gpu_hours"] / out["pd_2step_gpu_hours"], 4)
    return out


SWEPT = {"solver_steps": ("consistency", "solver_steps"), "target_ema_decay": ("consistency", "target_ema_decay"),
         "lr": ("consistency", "train", "lr"), "warmup_steps": ("consistency", "train", "warmup_steps"),
         "ema_decay": ("consistency", "train", "ema_decay"), "embed_lr_scale": ("guidance", "embed_lr_scale")}


def sweep_of(folder: Path) -> dict:
    """One variant of `few_step_openmoji.sh sweep`: its consistency settings (from the run's config.yaml) and its
    2-step checkpoints by training step (the curve's files: a variant cut by the call's time has no final report).
    Its seconds are not GPU-hours: the variants shared one GPU."""
    import yaml

    found = [json.loads(p.read_text()) for p in sorted(folder.glob("eval/round-0-curve/step*-2steps.json"))]
    if not found:
        raise SystemExit(f"{folder}: no eval/round-0-curve/step*-2steps.json (run the sweep with eval.curve_steps=[2])")
    config = yaml.safe_load((folder / "config.yaml").read_text())
    settings = {}
    for key, path in SWEPT.items():
        value = config
        for part in path:
            value = value[part]
        settings[key] = value
    points = [{"train_step": p["step"], "fd": p["metrics"]["fd"], "clip_score": p["metrics"]["clip_score"]} for p in found]
    return {"run": folder.name, "settings": settings, "points": sorted(points, key=lambda p: p["train_step"])}


def first_step_within(sweep: list[dict], target: float) -> None:
    """Each variant's first checkpoint whose 2-step FD met `target` (None: none did), kept beside its points."""
    for v in sweep:
        v["first_step_within_target"] = next((p["train_step"] for p in v["points"] if p["fd"] <= target), None)


def plot_sweep(sweep: list[dict], path: Path, target: float | None) -> Path:
    """FD and CLIP score at 2 steps against training steps, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for v in sweep:
        s = v["settings"]
        label = f"{v['run']}: N={s['solver_steps']} lr={s['lr']:g} target={s['target_ema_decay']:g}"
        for ax, key in zip(axes, ("fd", "clip_score")):
            ax.plot([p["train_step"] for p in v["points"]], [p[key] for p in v["points"]], marker=".", label=label)
    if target:
        axes[0].axhline(target, color="grey", linestyle="--", label=f"target ({TARGET}x teacher DDIM-64)")
    for ax, title in zip(axes, ("FD at 2 steps (lower is better)", "CLIP score at 2 steps (higher is better)")):
        ax.set_xlabel("training step")
        ax.set_title(title)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_hours(ax, rows: list[dict], curve: list[dict], target: float | None) -> None:
    """FD of the 2-step students against GPU-hours: LCM's checkpoints and PD's 2-step round."""
    for method, label, marker in (("lcm", "consistency (checkpoints)", "o"), ("pd", "progressive", "s")):
        pts = sorted((p["gpu_hours"], p["fd"]) for p in two_step(list(curve) + rows, method))
        if pts:
            ax.plot(*zip(*pts), marker=marker, label=label, color=COLORS[method])
    if target:
        ax.axhline(target, color="grey", linestyle="--", label=f"target ({TARGET}x teacher DDIM-64)")
    ax.set_xlabel("GPU-hours (training)")
    ax.set_title("FD at 2 steps against GPU-hours")
    ax.legend()


def plot(rows: list[dict], path: Path, curve: list[dict] = (), target: float | None = None) -> Path:
    """FD and CLIP score against steps, one line per method (log2 step axis), and FD at 2 steps against
    GPU-hours, side by side in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    plot_hours(axes[2], rows, list(curve), target)
    for ax, key, label in ((axes[0], "fd", "FD (OpenMoji-CLIP), lower is better"), (axes[1], "clip_score", "CLIP score, higher is better")):
        for method in ("teacher_ddim", "pd", "lcm"):
            pts = sorted((r["steps"], r[key]) for r in rows if r["method"] == method and r[key] is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", color=COLORS[method], label={"teacher_ddim": "teacher DDIM", "pd": "progressive", "lcm": "consistency"}[method])
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
    ap.add_argument("--sweep", type=Path, nargs="*", default=[],
                    help="run folders of `few_step_openmoji.sh sweep` (variants side by side on one GPU): their curves by training step")
    args = ap.parse_args()
    rows, teacher, curve = [], {}, []
    for method, folder in (("lcm", args.lcm), ("pd", args.pd)):
        report = json.loads((folder / "report.json").read_text())
        got, t = rows_of(report, method, folder.name)
        rows += got
        curve += curve_of(report, method)
        for steps, m in t.items():
            teacher.setdefault(steps, (m, folder.name))  # the LCM run's teacher rows first, PD's for other counts
    rows += [_row("teacher_ddim", steps, m, None, run) for steps, (m, run) in sorted(teacher.items())]
    result = {"what": "OpenMoji few-step students: progressive distillation (pd) vs consistency distillation (lcm) vs the teacher's DDIM",
              "device": args.device, "features": "FD on OpenMoji-CLIP image embeddings; CLIP score with the same CLIP",
              "script": "scripts/gpu/few_step_openmoji.sh (teacher, lcm, pd) + scripts/gpu/few_step_table.py",
              "conditions": args.conditions, "rows": rows, "curve": curve, "summary": summary(rows, curve),
              "plot": args.out.with_suffix(".png").name}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, args.out.with_suffix(".png"), curve, result["summary"].get("target_fd"))
    if args.sweep:
        result["sweep"] = [sweep_of(folder) for folder in args.sweep]
        if result["summary"].get("target_fd"):
            first_step_within(result["sweep"], result["summary"]["target_fd"])
        result["sweep_plot"] = plot_sweep(result["sweep"], args.out.with_name(args.out.stem + "_sweep.png"),
                                          result["summary"].get("target_fd")).name
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
