"""scripts/gpu/block_removal_table.py: rows, fd_ratio, GPU-hours and targets from made-up report folders."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("block_removal_table", ROOT / "scripts" / "gpu" / "block_removal_table.py")
table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(table)

FD = {"unpruned": 30.0, "base": 31.0, "small": 36.0, "tiny": 37.0}  # float, 2 steps; W8 adds 0.5


def _write(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))


def _runs(tmp_path: Path) -> Path:
    out = tmp_path / "outputs"
    params = {"base": 6_000_000, "small": 5_000_000, "tiny": 3_000_000}
    for p, n in params.items():
        _write(out / f"prune-{p}" / "report.json", {"params_before": 10_000_000, "params_after": n,
                                                    "macs": {"total_before": 900, "total_after": n // 10_000},
                                                    "recovery": {"steps": 500}, "blocks": {"removed": ["mid_block"]}})
        # a resumed recovery: wall_s restarts, so 90 + 36 seconds of training in all
        rows = [{"phase": "recovery", "step": s, "wall_s": w} for s, w in ((25, 30.0), (50, 90.0), (75, 12.0), (100, 36.0))]
        _write(out / f"prune-{p}" / "logs.jsonl", "\n".join(json.dumps(r) for r in rows + [{"phase": "other", "wall_s": 999}]))
    for p in FD:
        _write(out / f"lcm-{p}" / "report.json", {"rounds": [{"train_steps": 600, "train_seconds": 200.0}]})
    results = [{"model": "teacher DDIM", "steps": 64, "fd": 28.0, "clip_score": 90.0}]
    for p, fd in FD.items():
        for suffix, extra in ((" float", 0.0), (" W8", 0.5), (" W8 RTN", 0.6)):
            for steps in (1, 2):
                results.append({"model": p + suffix, "steps": steps, "fd": fd + extra + (2 - steps), "clip_score": 80.0})
    _write(out / "eval" / "report.json", {"results": results})
    return tmp_path


def test_rows_ratios_hours_and_targets(tmp_path):
    result = table.build(_runs(tmp_path))
    rows = {(r["preset"], r["variant"], r["steps"]): r for r in result["rows"]}
    small = rows[("small", "w8", 2)]
    assert small["fd_ratio"] == round(36.5 / 30.5, 4)  # W8 against the unpruned W8 student, same steps
    assert rows[("small", "float", 1)]["fd_ratio"] == round(37.0 / 31.0, 4)
    assert small["unet_params"] == 5_000_000 and small["macs"] == 500
    assert small["gpu_hours"] == round(126 / 3600, 5)  # both invocations of the recovery
    assert small["fd_over_teacher64"] == round(36.5 / 28.0, 4)
    assert rows[("unpruned", "w8", 2)]["fd_ratio"] == 1.0 and rows[("unpruned", "w8", 2)]["unet_params"] == 10_000_000
    assert rows[("unpruned", "w8", 2)]["gpu_hours"] == 0.0
    assert rows[("teacher", "ddim", 64)]["fd"] == 28.0
    assert rows[("tiny", "w8", 2)]["lcm_steps"] == 600
    s = result["summary"]
    assert s["small_w8_target_met"] is False  # 1.197 > 1.15
    assert s["tiny_w8_target_met"] is True  # 37.5 / 30.5 = 1.23 <= 1.25
    assert s["tiny_w8_2step_fd_ratio"] == round(37.5 / 30.5, 4)


def test_main_writes_json_and_plot(tmp_path, monkeypatch, capsys):
    runs = _runs(tmp_path / "runs")
    out = tmp_path / "res" / "block_removal_openmoji_test.json"
    monkeypatch.setattr(sys, "argv", ["x", "--runs", str(runs), "--out", str(out), "--conditions", "made up"])
    table.main()
    data = json.loads(out.read_text())
    assert data["plot"] == "block_removal_openmoji_test.png" and out.with_suffix(".png").stat().st_size > 1000
    assert {r["preset"] for r in data["rows"]} == {"teacher", "unpruned", "base", "small", "tiny"}
    assert "small" in capsys.readouterr().out


def test_missing_preset_has_no_rows_and_no_verdict(tmp_path):
    runs = _runs(tmp_path)
    report = json.loads((runs / "outputs" / "eval" / "report.json").read_text())
    report["results"] = [r for r in report["results"] if not r["model"].startswith("tiny")]
    _write(runs / "outputs" / "eval" / "report.json", report)
    result = table.build(runs)
    assert not [r for r in result["rows"] if r["preset"] == "tiny"]
    assert result["summary"]["tiny_w8_target_met"] is None
