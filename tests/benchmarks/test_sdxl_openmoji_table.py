"""scripts/gpu/sdxl_openmoji_table.py: the GPU rows (KOALA presets against the unpruned student, the target on the W8
2-step koala_700m) and the bundle's row added here, from made-up report folders."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_module import load_script  # tests/script_module.py

FD = {"unpruned": 30.0, "koala_1b": 31.0, "koala_700m": 33.0}  # float, 2 steps; W8 adds 0.5
PARAMS = {"koala_1b": 6_800_000, "koala_700m": 5_800_000}


@pytest.fixture(scope="module")
def table():
    return load_script("scripts/gpu/sdxl_openmoji_table.py", "sdxl_openmoji_table")


def _write(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))


def _runs(root: Path) -> Path:
    out = root / "outputs"
    for p, n in PARAMS.items():
        _write(out / f"prune-{p}" / "report.json", {"params_before": 12_000_000, "params_after": n,
                                                    "macs": {"total_before": 900, "total_after": n // 10_000},
                                                    "recovery": {"steps": 400}, "blocks": {"removed": ["mid_block"]}})
        _write(out / f"prune-{p}" / "logs.jsonl", json.dumps({"phase": "recovery", "step": 400, "wall_s": 180.0}))
    for p in FD:
        _write(out / f"lcm-{p}" / "report.json", {"rounds": [{"train_steps": 600, "train_seconds": 200.0}]})
    _write(out / "teacher-openmoji" / "pipeline" / "unet" / "config.json",
           {"addition_embed_type": "text_time", "transformer_layers_per_block": [1, 1, 2]})
    results = [{"model": "teacher DDIM", "steps": 64, "fd": 28.0, "clip_score": 20.0}]
    for p, fd in FD.items():
        for suffix, extra in ((" float", 0.0), (" W8", 0.5), (" W8 RTN", 0.6)):
            results.append({"model": p + suffix, "steps": 2, "fd": fd + extra, "clip_score": 19.0, "num_samples": 1024})
    _write(out / "eval" / "report.json", {"results": results})
    return root


def test_gpu_rows_and_the_koala_700m_target(table, tmp_path):
    result = table.build_gpu(_runs(tmp_path), device="h100")
    rows = {(r["preset"], r["variant"], r["steps"]): r for r in result["rows"]}
    k = rows[("koala_700m", "w8", 2)]
    assert k["fd_ratio"] == round(33.5 / 30.5, 4) and k["unet_params"] == 5_800_000 and k["gpu_hours"] == 0.05
    assert {"preset", "unet_params", "steps", "fd", "clip_score", "fd_ratio", "gpu_hours"} <= set(k)
    s = result["summary"]
    assert s["koala_700m_w8_2step_fd_ratio"] == round(33.5 / 30.5, 4) and s["koala_700m_w8_target_met"] is True
    assert s["koala_700m_w8_2step_fd_over_unpruned_float"] == round(33.5 / 30.0, 4)
    assert "koala_1b_w8_target_met" not in s  # the issue sets the target on the ~0.7 B-class preset only
    assert result["teacher"]["addition_embed_type"] == "text_time"


def test_the_bundle_row_is_added_against_the_pipelines_of_the_same_captions(table, tmp_path):
    gpu = table.build_gpu(_runs(tmp_path / "runs"), device="h100")
    ev = {"results": [{"model": "unpruned W8", "steps": 2, "fd": 40.0, "clip_score": 18.0},
                      {"model": "koala_700m W8", "steps": 2, "fd": 44.0, "clip_score": 17.5},
                      {"model": "koala_700m bundle", "steps": 2, "fd": 44.2, "clip_score": 17.4, "num_samples": 128,
                       "seconds_per_image": 6.5}]}
    export = {"bundle_bytes": 14_000_000, "weights": "int8", "resolution": 64, "guidance": "embedded",
              "components": {"unet": {"weights": "int8", "fully_accelerated": True, "cosine": 0.9999, "bytes": 7_000_000},
                             "vae_decoder": {"weights": "fp16", "fully_accelerated": True, "cosine": 1.0, "bytes": 3_000_000}}}
    paths = {}
    for name, data in (("gpu.json", gpu), ("eval.json", ev), ("export.json", export)):
        _write(tmp_path / name, data)
        paths[name] = str(tmp_path / name)
    out = tmp_path / "res" / "sdxl_openmoji_h100.json"
    table.main(["bundle", "--json", paths["gpu.json"], "--eval", paths["eval.json"], "--export", paths["export.json"],
                "--out", str(out)])
    data = json.loads(out.read_text())
    b = data["rows"][-1]
    assert (b["preset"], b["variant"], b["steps"]) == ("koala_700m", "bundle", 2)
    assert b["fd_ratio"] == round(44.2 / 40.0, 4) and b["fd_vs_w8_pipeline"] == round(44.2 / 44.0, 4)
    assert b["unet_params"] == 5_800_000 and b["fully_accelerated"] is True and b["unet_tflite_bytes"] == 7_000_000
    assert data["summary"]["koala_700m_bundle_2step_fd_ratio"] == b["fd_ratio"]
    assert data["plot"] == "sdxl_openmoji_h100.png" and out.with_suffix(".png").stat().st_size > 1000
    assert len([r for r in data["rows"] if r["variant"] == "bundle"]) == 1  # a second run replaces the row
    table.main(["bundle", "--json", str(out), "--eval", paths["eval.json"], "--export", paths["export.json"], "--out", str(out)])
    assert len([r for r in json.loads(out.read_text())["rows"] if r["variant"] == "bundle"]) == 1
