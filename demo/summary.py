"""The demo's report: what each stage buys, in one line per stage, from the stages' own reports.

`build_report` gathers the stage reports into report.json's dict; `stage_lines` turns that dict
into the summary's per-stage lines (pure: tests feed it a hand-made report); `write_index`
writes the demo's page and `print_summary` the terminal summary (under 40 lines).

What each line compares:
- distill, one line per kept student: UNet passes per image against the teacher's DDIM at the
  reference count (classifier-free guidance runs two passes per step, the guidance-conditioned
  student one), then FD / CLIP score of the student, of the teacher's DDIM at the student's
  count (the better of its own and the trailing grid, so the baseline is never the weak one)
  and of the teacher's DDIM at the reference count;
- quantize: the UNet's float file against its int8 checkpoint, the held-out UNet cosine its
  parity bar checked, FD / CLIP against the float student at the same count;
- prune: UNet parameters and MACs per sample before and after, FD / CLIP against the float student;
- export: bundle bytes, components fully on the GPU delegate, the lowest delegate-vs-PyTorch
  cosine, and run-bundle's latency.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from pocketdiff.report import img, table, write_page

TEACHER = "teacher DDIM"  # the teacher on its folder's own grid (what a stock pipeline samples)
TEACHER_TRAILING = "teacher DDIM trailing"  # the teacher on the students' grid
STAGE_PAGES = ("distill", "calibrate", "prune", "evaluate", "export")


def _files_bytes(path: Optional[str], pattern: str = "*") -> Optional[int]:
    if not path or not Path(path).exists():
        return None
    p = Path(path)
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob(pattern) if f.is_file())


def build_report(chain, students: dict[int, str], calib: dict, prune: dict, evaluation: dict, export: dict,
                 ran: dict, reference_steps: int, teacher: str) -> dict:
    """report.json's dict: paths, sizes and metrics each summary line reads."""
    final = min(students)
    components = export.get("components", {})
    macs = prune.get("macs") or {}
    return {
        "smoke": chain.smoke,
        "teacher": teacher,
        "reference_steps": reference_steps,
        "student": {"pipeline_dir": students[final], "steps": final},
        "students": {str(n): p for n, p in sorted(students.items(), reverse=True)},
        "calibrate": {"checkpoint": calib.get("checkpoint"), "unet_cosine": calib.get("unet_cosine"), "bits": calib.get("bits"),
                      "parity": calib.get("parity"), "checkpoint_bytes": _files_bytes(calib.get("checkpoint")),
                      "float_unet_bytes": _files_bytes(str(Path(students[final]) / "unet"), "*.safetensors")},
        "prune": {"pipeline_dir": prune.get("pipeline_dir"), "params_before": prune.get("params_before"),
                  "params_after": prune.get("params_after"), "macs_before": macs.get("total_before"),
                  "macs_after": macs.get("total_after"), "ratio": prune.get("requested_ratio")},
        "metrics": [{k: r.get(k) for k in ("model", "steps", "guidance_mode", "fd", "clip_score", "features", "num_samples")}
                    for r in evaluation["results"]],
        "bundle": {"dir": export.get("bundle_dir"), "bytes": _files_bytes(export.get("bundle_dir")),
                   "components": {k: {f: v.get(f) for f in ("fully_accelerated", "cosine", "psnr_db", "bytes", "weights")}
                                  for k, v in components.items()}},
        "run_bundle": {k: ran.get(k) for k in ("image", "accelerator", "driver", "fully_accelerated", "latency_s", "peak_rss_mb")},
        "timings_s": chain.timings,
    }


# --------------------------------------------------------------------------------------
# The per-stage lines
# --------------------------------------------------------------------------------------

def _metric(report: dict, model: str, steps: int) -> Optional[dict]:
    return next((m for m in report["metrics"] if m["model"] == model and m["steps"] == steps), None)


def _teacher_at(report: dict, steps: int) -> Optional[dict]:
    """The teacher's DDIM at `steps`: the better FD of its own grid and the trailing grid."""
    rows = [m for m in (_metric(report, TEACHER, steps), _metric(report, TEACHER_TRAILING, steps)) if m and m["fd"] is not None]
    return min(rows, key=lambda m: m["fd"]) if rows else None


def _passes(m: dict) -> int:
    return m["steps"] * (2 if m.get("guidance_mode") == "cfg" else 1)


def _num(v: Optional[float], fmt: str = ".2f") -> str:
    return "n/a" if v is None else format(v, fmt)


def _fd_clip(m: Optional[dict]) -> str:
    return "n/a" if m is None else f"{_num(m['fd'])}/{_num(m['clip_score'], '.1f')}"


def _mb(n: Optional[int]) -> str:
    return "n/a" if n is None else f"{n / 1e6:.2f} MB"


def _millions(n: Optional[int]) -> str:
    return "n/a" if n is None else f"{n / 1e6:.3g}M"


def _ratio(before: Optional[float], after: Optional[float]) -> str:
    return "n/a" if not before or not after else f"{before / after:.2f}x"


def distill_line(report: dict, steps: int) -> str:
    ref_steps = report["reference_steps"]
    student, ref = _metric(report, f"student {steps}", steps), _teacher_at(report, ref_steps)
    same = _teacher_at(report, steps)
    if student is None or ref is None:
        return f"distill   {ref_steps} -> {steps} steps: not evaluated"
    grid = "" if same is None or same["model"] == TEACHER else " trailing"
    return (f"distill   {ref_steps} -> {steps} steps: {_passes(ref)} -> {_passes(student)} UNet passes/image "
            f"({_passes(ref) / _passes(student):.0f}x fewer); FD/CLIP {_fd_clip(student)}, teacher "
            f"DDIM-{steps}{grid} {_fd_clip(same)}, DDIM-{ref_steps} {_fd_clip(ref)}")


def quantize_line(report: dict) -> str:
    c, steps = report["calibrate"], report["student"]["steps"]
    quantized, float_student = _metric(report, f"student W{c['bits']} {steps}", steps), _metric(report, f"student {steps}", steps)
    check = ((c.get("parity") or {}).get("checks") or {}).get("min_unet_cosine") or {}
    bar = f" (bar {check['threshold']})" if "threshold" in check else ""
    return (f"quantize  W{c['bits']}: UNet {_mb(c['float_unet_bytes'])} -> {_mb(c['checkpoint_bytes'])} "
            f"({_ratio(c['float_unet_bytes'], c['checkpoint_bytes'])} smaller), held-out cosine "
            f"{_num(c['unet_cosine'], '.5f')}{bar}; FD/CLIP {_fd_clip(quantized)} vs float {_fd_clip(float_student)}")


def prune_line(report: dict) -> str:
    p, steps = report["prune"], report["student"]["steps"]
    pruned, float_student = _metric(report, f"pruned student {steps}", steps), _metric(report, f"student {steps}", steps)
    return (f"prune     {_num(p.get('ratio'), '.0%')} of targeted convs: UNet params {_millions(p['params_before'])} -> "
            f"{_millions(p['params_after'])} ({_ratio(p['params_before'], p['params_after'])} fewer), MACs {_millions(p.get('macs_before'))} -> "
            f"{_millions(p.get('macs_after'))}; FD/CLIP {_fd_clip(pruned)} vs unpruned {_fd_clip(float_student)}")


def export_line(report: dict) -> str:
    comps = report["bundle"]["components"]
    cosines = [v["cosine"] for v in comps.values() if v.get("cosine") is not None]
    on_gpu = sum(1 for v in comps.values() if v.get("fully_accelerated"))
    lat = (report["run_bundle"].get("latency_s") or {})
    step_ms = 1000 * lat["unet_step_mean"] if "unet_step_mean" in lat else None
    return (f"export    bundle {_mb(report['bundle']['bytes'])}, {on_gpu}/{len(comps)} components fully on the GPU delegate, "
            f"cosine vs PyTorch >= {_num(min(cosines) if cosines else None, '.5f')}; run-bundle "
            f"{_num(lat.get('total'))} s (UNet step {_num(step_ms, '.1f')} ms)")


def stage_lines(report: dict) -> list[str]:
    """One line per stage: what it buys (UNet passes, bytes, MACs) and the quality it keeps."""
    steps = sorted((int(n) for n in report["students"]), reverse=True)
    return ([distill_line(report, n) for n in steps]
            + [quantize_line(report), prune_line(report), export_line(report)])


# --------------------------------------------------------------------------------------
# Page and terminal
# --------------------------------------------------------------------------------------

def write_index(out: Path, report: dict) -> None:
    sections = [
        ("What each stage buys", "<ul>" + "".join(f"<li><code>{line}</code></li>" for line in stage_lines(report)) + "</ul>"),
        ("Timings (s)", table(["stage", "seconds"], report["timings_s"].items())),
        ("Quality (same prompts and seeds)", table(["model", "steps", "FD", "CLIP score", "features", "samples"],
                                                   [[m["model"], m["steps"], m["fd"], m["clip_score"], m["features"], m["num_samples"]]
                                                    for m in report["metrics"]])),
        ("Bundle", table(["component", "fully on GPU delegate", "cosine", "PSNR dB", "bytes"],
                         [[k, v["fully_accelerated"], v["cosine"], v["psnr_db"], v["bytes"]] for k, v in report["bundle"]["components"].items()])
         + f"<p>total {_mb(report['bundle']['bytes'])} in {report['bundle']['dir']}</p>"),
    ]
    for name in STAGE_PAGES:
        if (out / name / "index.html").is_file():
            sections.append((f"Stage page: {name}", f"<a href='{name}/index.html'>{name}/index.html</a>"))
    grids = sorted((out / "evaluate").glob("*.png"))
    if grids:
        sections.append(("Grids (evaluate)", "".join(img(str(g.relative_to(out))) for g in grids)))
    ran = report["run_bundle"]
    image = Path(ran.get("image") or "")
    if image.is_file():
        sections.append((f"run-bundle on the {ran.get('accelerator')} delegate ({ran.get('driver')})",
                         img(str(image.relative_to(out.resolve())))))
    write_page(out / "index.html", "pocketdiff demo", sections, report)


def print_summary(report: dict, out: Path) -> None:
    print("\npocketdiff demo summary")
    print(f"  teacher {report['teacher']}: DDIM with classifier-free guidance (2 UNet passes per step); "
          f"students: guidance-conditioned, 1 pass per step")
    print("  what each stage buys (FD lower is better, CLIP score higher; "
          f"{report['metrics'][0]['num_samples']} prompts, seed 0, {report['metrics'][0]['features']}):")
    for line in stage_lines(report):
        print(f"  {line}")
    print("  all scores:")
    for m in report["metrics"]:
        print(f"    {m['model']:<22} {m['steps']:>2} steps  FD {_num(m['fd']):>6}  CLIP {_num(m['clip_score'], '.1f'):>5}")
    comps = report["bundle"]["components"]
    print("  bundle: " + ", ".join(f"{k} {v.get('weights') or '?'} {_mb(v.get('bytes'))}" for k, v in comps.items()))
    rb = report["run_bundle"]
    print(f"  run-bundle ({rb['accelerator']}, {rb['driver']}, fully on the delegate: {rb['fully_accelerated']}) -> {rb['image']}")
    print("  seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in report["timings_s"].items())
          + f" (total {sum(report['timings_s'].values()):.0f})")
    print(f"  report: {out / 'index.html'}")
    print(f"  third-party logs: {out / 'logs' / 'native.log'} (shown with --verbose)")
