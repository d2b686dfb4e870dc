"""scripts/gpu/lora_openmoji_table.py: the few-step LoRA rows, ratios and the LoRA's entry from made-up report folders."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.script_module import load_script

table = load_script("scripts/gpu/lora_openmoji_table.py", "lora_openmoji_table")


def _write(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _runs(tmp_path: Path) -> Path:
    out = tmp_path / "outputs"
    lora = {"file": "/tmp/runs/lora/outputs/lora/round-0/pytorch_lora_weights.safetensors", "sha256": "ab" * 32, "rank": 8,
            "params": 772608, "bytes": 1_600_000}
    _write(out / "lora" / "report.json", {"lora": lora, "rounds": [{"train_steps": 600, "train_seconds": 250.0}]})
    _write(out / "full" / "report.json", {"rounds": [{"train_steps": 600, "train_seconds": 240.0}]})
    fd = {("teacher DDIM", 64): 10.0, ("full student", 2): 12.0, ("full student", 4): 11.0,
          ("LoRA student", 2): 15.0, ("LoRA student", 4): 13.2}
    _write(out / "eval-openmoji" / "report.json",
           {"results": [{"model": m, "steps": s, "fd": v, "clip_score": 20.0} for (m, s), v in fd.items()]})
    style = {("style teacher DDIM", 2): 40.0, ("style teacher DDIM", 4): 30.0, ("style teacher DDIM", 64): 20.0,
             ("style teacher + LoRA", 2): 25.0, ("style teacher + LoRA", 4): 22.0,
             ("base teacher + LoRA", 2): 35.0, ("base teacher + LoRA", 4): 34.0}
    _write(out / "eval-style" / "report.json",
           {"results": [{"model": m, "steps": s, "fd": v, "clip_score": 18.0, "num_seeds": 2} for (m, s), v in style.items()]})
    return tmp_path


def test_rows_ratios_and_the_loras_entry(tmp_path):
    result = table.build(_runs(tmp_path), "h100", "flags")
    rows = {(r["part"], r["model"], r["steps"]): r for r in result["rows"]}
    assert len(rows) == 12
    assert rows[("openmoji", "LoRA student", 2)]["fd_over_full"] == 1.25
    assert rows[("openmoji", "LoRA student", 4)]["fd_over_teacher64"] == 1.32
    assert rows[("style", "style teacher + LoRA", 4)]["fd_over_style_teacher64"] == 1.1
    s = result["summary"]
    assert (s["lora_over_full_fd_2step"], s["lora_over_full_fd_4step"]) == (1.25, 1.2)
    assert (s["style_lora_over_style_teacher64_fd_2step"], s["style_lora_over_style_ddim_fd_2step"]) == (1.25, 0.625)
    assert result["lora"]["file"] == "pytorch_lora_weights.safetensors" and result["lora"]["rank"] == 8
    assert result["training"]["lora"]["train_seconds"] == 250.0 and result["style_subset"] == "flags"


def test_missing_evaluations_stop_with_one_line(tmp_path):
    runs = _runs(tmp_path)
    (runs / "outputs" / "eval-style" / "report.json").unlink()
    with pytest.raises(SystemExit, match="run the eval phase"):
        table.build(runs)
