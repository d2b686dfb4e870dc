"""Kill-and-resume, CI-sized: train-teacher (tiny overrides) as a subprocess, SIGKILLed and
resumed with `--resume latest` in the same folder, must equal the uninterrupted run bit for bit.

The full run (all four training-style stages, >= 20 seeded points, JSON tally) is
`python benchmarks/kill_resume.py --points 20 --out kill_resume.json`; this test drives the
same code on two points (three kills):
1. a kill just after config.yaml appears: no checkpoint yet, the resume starts from scratch;
2. a kill just after the UNet's first checkpoint is committed, then a second kill of the
   resumed run (which continued from that checkpoint) just after it committed the last
   checkpoint, before the pipeline is written; then a final resume from that last checkpoint.
Exact weights alone cannot tell a resume from a restart (training is deterministic), so the
test also checks which checkpoint each resumed run says it continued from.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kr():
    spec = importlib.util.spec_from_file_location("kill_resume", ROOT / "benchmarks" / "kill_resume.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kill_resume"] = module
    spec.loader.exec_module(module)
    return module


def _assert_exact(point):
    assert point["exact"], point.get("problems") or point
    assert point["compared_files"] >= 5  # pipeline components + checkpoints
    assert not point["torn_checkpoints"]


def test_sigkill_then_resume_latest_equals_the_uninterrupted_run(kr, tmp_path):
    ref = kr.run_reference("train-teacher", tmp_path / "ref", "ci", timeout=300)
    assert any(rel.startswith("checkpoints/unet/checkpoint-") for _, rel in ref.timeline)

    early = kr.Trigger("early", "config.yaml", at_s=ref.wall_s)
    p1 = kr.run_point(ref, tmp_path / "early", [early], "ci", timeout=300)
    assert p1["killed"] and p1["kills"][0]["before_first_checkpoint"], p1["kills"]
    _assert_exact(p1)
    assert p1["resumed_from"] == [], p1  # nothing to resume: started from scratch

    after_ckpt = kr.Trigger("path", "checkpoints/unet/checkpoint-2", at_s=ref.wall_s * 2)
    again = kr.Trigger("path", "checkpoints/unet/checkpoint-4", at_s=ref.wall_s * 2)
    p2 = kr.run_point(ref, tmp_path / "twice", [after_ckpt, again], "ci", timeout=300)
    assert p2["killed"] and "checkpoints/unet/checkpoint-2" in p2["kills"][0]["checkpoints_at_kill"], p2["kills"]
    second = p2["kills"][1]
    assert second["delivered"] and second["resumed_run"], p2["kills"]
    assert any("checkpoints/unet/checkpoint-2 " in line for line in second["resumed_from"]), second
    assert "checkpoints/unet/checkpoint-4" in second["checkpoints_at_kill"], second
    assert any("checkpoints/unet/checkpoint-4 " in line for line in p2["resumed_from"]), p2
    _assert_exact(p2)

    result = kr.tally([p1, p2], {"train-teacher": ref})
    assert result["points_tried"] == 2 and result["exact_resumes"] == 2 and not result["failures"]


def test_a_torn_checkpoint_file_is_detected(kr, tmp_path):
    """The harness's own check: a cut safetensors file under a complete checkpoint name is flagged."""
    ckpt = tmp_path / "checkpoints" / "unet" / "checkpoint-2"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    from safetensors.torch import save_file
    import torch

    save_file({"w": torch.arange(64.0)}, str(ckpt / "model.safetensors"))
    assert kr.check_killed_folder(tmp_path)["torn_checkpoints"] == []
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[:-10])
    state = kr.check_killed_folder(tmp_path)
    assert len(state["torn_checkpoints"]) == 1 and "model.safetensors" in state["torn_checkpoints"][0]
    tmp = tmp_path / "checkpoints" / "unet" / ".tmp-checkpoint-4"  # being written: never chosen, never checked
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"xx")
    assert len(kr.check_killed_folder(tmp_path)["torn_checkpoints"]) == 1
