"""scripts/gpu/few_step_table.py: rows and GPU-hours from distill reports (made-up numbers)."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _table():
    spec = importlib.util.spec_from_file_location("few_step_table", ROOT / "scripts" / "gpu" / "few_step_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _m(steps, fd):
    return {"steps": steps, "fd": fd, "clip_score": 20.0, "num_samples": 1024}


def _metrics(steps, fd, teacher_fd):
    return {"metrics": {"student": _m(steps, fd), "teacher_same_steps": _m(steps, teacher_fd), "teacher_reference": _m(64, 10.0)}}


def _run_table(tmp_path, monkeypatch, lcm: dict, pd: dict, out) -> dict:
    """few_step_table.py's main on the two reports (each as RUN/report.json); its JSON result."""
    for name, rep in (("lcm", lcm), ("pd", pd)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(rep))
    monkeypatch.setattr(sys, "argv", ["x", "--lcm", str(tmp_path / "lcm"), "--pd", str(tmp_path / "pd"), "--out", str(out)])
    _table().main()
    return json.loads(out.read_text())


def test_rows_gpu_hours_and_summary(tmp_path, monkeypatch):
    lcm = {"rounds": [{"stage": "consistency", "steps": 8, "train_seconds": 360.0,
                       "eval": {str(n): _metrics(n, 12.0 + n, 50.0 / n) for n in (1, 2, 4, 8)}}]}
    pd = {"rounds": [{"stage": "guided", "steps": 16, "train_seconds": 72.0, "eval": _metrics(16, 11.0, 10.5)}]
          + [{"stage": "progressive", "steps": n, "train_seconds": 72.0, "eval": _metrics(n, 11.0 + 1 / n, 99.0)} for n in (8, 4, 2, 1)]}
    out = tmp_path / "t.json"
    result = _run_table(tmp_path, monkeypatch, lcm, pd, out)
    rows = {(r["method"], r["steps"]): r for r in result["rows"]}
    assert rows[("lcm", 2)]["gpu_hours"] == 0.1 and rows[("lcm", 8)]["gpu_hours"] == 0.1
    assert rows[("pd", 16)]["gpu_hours"] == 0.02 and rows[("pd", 2)]["gpu_hours"] == 0.08 and rows[("pd", 1)]["gpu_hours"] == 0.1
    assert rows[("teacher_ddim", 2)]["fd"] == 25.0 and rows[("teacher_ddim", 2)]["run"] == "lcm"  # LCM's teacher rows first
    assert rows[("teacher_ddim", 16)]["run"] == "pd" and rows[("teacher_ddim", 64)]["gpu_hours"] is None
    s = result["summary"]
    assert s["lcm_2step_fd_over_teacher64"] == 1.4 and s["lcm_over_pd_gpu_hours_to_2_steps"] == 1.25


def test_curve_points_give_each_methods_gpu_hours_to_the_target(tmp_path, monkeypatch):
    # teacher-64 FD 10 -> target 11.5 at 2 steps; LCM's checkpoints meet it at 180 s, PD's 2-step round never does
    curve = [{"step": k, "steps": 2, "train_seconds": 90.0 * k / 100, "metrics": _m(2, fd)}
             for k, fd in ((100, 30.0), (200, 11.4), (300, 11.0), (400, 10.9))]
    lcm = {"rounds": [{"stage": "consistency", "steps": 8, "train_seconds": 360.0, "curve": curve,
                       "eval": {str(n): _metrics(n, 10.9, 20.0) for n in (1, 2, 4, 8)}}]}
    pd = {"rounds": [{"stage": "guided", "steps": 4, "train_seconds": 360.0, "eval": _metrics(4, 11.0, 12.0)},
                     {"stage": "progressive", "steps": 2, "train_seconds": 360.0, "eval": _metrics(2, 14.0, 30.0)}]}
    out = tmp_path / "t.json"
    result = _run_table(tmp_path, monkeypatch, lcm, pd, out)
    assert [(p["train_step"], p["gpu_hours"]) for p in result["curve"]] == [(100, 0.025), (200, 0.05), (300, 0.075), (400, 0.1)]
    s = result["summary"]
    assert s["target_fd"] == 11.5 and s["lcm_gpu_hours_to_target"] == 0.05 and s["pd_gpu_hours_to_target"] is None
    assert s["lcm_over_pd_gpu_hours_to_target_at_most"] == 0.25 and s["target_met"] is True  # PD spent 0.2 h to 2 steps
    assert out.with_suffix(".png").is_file()


def test_a_consistency_run_that_never_meets_the_target_is_said_so():
    # target 11.5 (teacher-64 FD 10): PD's 2-step student meets it at 0.1 h, LCM's checkpoints come closest at 11.8
    rows = [{"method": "pd", "steps": 2, "fd": 11.0, "gpu_hours": 0.1}, {"method": "lcm", "steps": 2, "fd": 12.5, "gpu_hours": 0.2}]
    curve = [{"method": "lcm", "steps": 2, "fd": fd, "gpu_hours": h} for fd, h in ((20.0, 0.05), (11.8, 0.1), (12.5, 0.2))]
    s = _table().target_summary(rows, curve, 10.0)
    assert s["pd_gpu_hours_to_target"] == 0.1 and s["lcm_gpu_hours_to_target"] is None and s["target_met"] is False
    assert s["lcm_note"].endswith("its best: FD 11.80 (1.180x) at 0.1 GPU-hours")


def test_the_clip_floor_moves_the_consistency_hours_to_the_first_point_as_guided_as_pd():
    # target 11.5: LCM's FD meets it at 0.05 h but under-guided (CLIP 7); PD's 2-step CLIP 9 is first reached at 0.15 h
    rows = [{"method": "pd", "steps": 2, "fd": 11.0, "clip_score": 9.0, "gpu_hours": 0.4}]
    curve = [{"method": "lcm", "steps": 2, "fd": fd, "clip_score": c, "gpu_hours": h}
             for fd, c, h in ((11.2, 7.0, 0.05), (11.4, 8.9, 0.1), (11.3, 9.1, 0.15), (12.0, 9.5, 0.2))]
    s = _table().target_summary(rows, curve, 10.0)
    assert s["lcm_gpu_hours_to_target"] == 0.05 and s["lcm_over_pd_gpu_hours_to_target"] == 0.125
    assert s["pd_2step_clip_score"] == 9.0 and s["lcm_gpu_hours_to_target_at_pd_clip"] == 0.15
    assert s["lcm_over_pd_gpu_hours_to_target_at_pd_clip"] == 0.375 and s["target_met_at_pd_clip"] is True


def test_a_sweep_variant_reads_its_settings_and_curve_files_and_its_first_step_at_the_target(tmp_path):
    folder = tmp_path / "n10"
    (folder / "eval" / "round-0-curve").mkdir(parents=True)
    (folder / "config.yaml").write_text("consistency:\n  solver_steps: 10\n  target_ema_decay: 0.0\n  train:\n    lr: 0.0002\n"
                                        "    warmup_steps: 50\n    ema_decay: 0.99\nguidance:\n  embed_lr_scale: 1.0\n")
    for step, fd in ((300, 11.0), (100, 12.0), (200, 11.6)):  # written out of order: the points come back by step
        (folder / "eval" / "round-0-curve" / f"step{step}-2steps.json").write_text(
            json.dumps({"step": step, "steps": 2, "metrics": {"fd": fd, "clip_score": 9.0}}))
    table = _table()
    sweep = [table.sweep_of(folder)]
    table.first_step_within(sweep, 11.5)
    assert sweep[0]["settings"] == {"solver_steps": 10, "target_ema_decay": 0.0, "lr": 0.0002, "warmup_steps": 50,
                                    "ema_decay": 0.99, "embed_lr_scale": 1.0}
    assert [p["train_step"] for p in sweep[0]["points"]] == [100, 200, 300] and sweep[0]["first_step_within_target"] == 300
    with pytest.raises(SystemExit, match="no eval/round-0-curve"):
        table.sweep_of(tmp_path)
