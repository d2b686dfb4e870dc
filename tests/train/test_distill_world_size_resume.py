"""`pocketdiff distill` under `accelerate launch` with 2 processes (gloo on the CPU), resumed
mid-round on 1 process and back on 2: the result matches the uninterrupted 2-process run.

Every random draw of a step is made for the global batch and sliced per process, so the
process count changes only the order of floating-point sums (the all-reduce); the resumed
runs must match to that order's rounding, not bit for bit."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cpu_launch import accelerate_cpu

OVERRIDES = [
    "data.source=shapes", "data.shapes_count=16", "data.resolution=32",
    "guidance.embed_dim=16", "guidance.w_min=1", "guidance.w_max=3", "guidance.scale=2",
    "guided.train.max_steps=2", "guided.train.batch_size=4", "guided.train.checkpoint_every=1",
    "progressive.start_steps=4", "progressive.final_steps=2",
    "progressive.train.max_steps=4", "progressive.train.batch_size=4", "progressive.train.checkpoint_every=1",
    "progressive.train.checkpoints_total_limit=10", "guided.train.checkpoints_total_limit=10",
    "progressive.train.ema_decay=0.5", "progressive.train.log_every=1", "progressive.train.lr=1e-3",
    "keep_round_checkpoints=true", "eval.enabled=false",
]


def _distill(n: int, out: Path, teacher: Path, *extra: str) -> str:
    """The verb under `accelerate launch` on the CPU: one process or two (gloo)."""
    proc = accelerate_cpu(n, "-m", "pocketdiff", "distill", "--output", str(out), f"model.pretrained={teacher}", *OVERRIDES, *extra)
    return proc.stdout + proc.stderr


def _interrupt(src: Path, dst: Path, keep_step: int) -> None:
    """A copy of run `src` as if killed after step `keep_step` of its last round."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "round-1")
    for ckpt in (dst / "checkpoints" / "round-1").glob("checkpoint-*"):
        if int(ckpt.name.split("-")[1]) > keep_step:
            shutil.rmtree(ckpt)
    (dst / "report.json").unlink(missing_ok=True)


def _unet(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "round-1" / "unet" / "diffusion_pytorch_model.safetensors"))


def _losses(run: Path) -> list:
    return [r["losses"] for r in json.loads((run / "report.json").read_text())["rounds"]]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    from pocketdiff.config import DataConfig
    from pocketdiff.data import load_captions
    from pocketdiff.models import ModelConfig, build_pipeline, save_pipeline

    captions = load_captions(DataConfig(source="shapes", shapes_count=16, resolution=32))
    pipe = build_pipeline(ModelConfig(arch="tiny"), captions=captions, resolution=32)
    return save_pipeline(pipe, tmp_path_factory.mktemp("teacher") / "pipeline")


def test_two_process_run_resumes_on_one_and_back(teacher, tmp_path):
    two = tmp_path / "two"
    _distill(2, two, teacher)
    assert (two / "round-1" / "unet").is_dir()

    two_to_one = tmp_path / "two_to_one"  # killed after step 2 of 4 of the progressive round
    _interrupt(two, two_to_one, keep_step=2)
    log = _distill(1, two_to_one, teacher, "--resume", "latest")
    assert "round-1] resumed from" in log and "checkpoint-2 at step 2" in log, log[-2000:]

    one_to_two = tmp_path / "one_to_two"  # the 1-process continuation, killed again, back on 2
    _interrupt(two_to_one, one_to_two, keep_step=3)
    log = _distill(2, one_to_two, teacher, "--resume", "latest")
    assert "round-1] resumed from" in log and "checkpoint-3 at step 3" in log, log[-2000:]

    ref, ref_losses = _unet(two), _losses(two)
    for run in (two_to_one, one_to_two):
        got = _unet(run)
        assert got.keys() == ref.keys()
        worst = max(float((got[k] - ref[k]).abs().max()) for k in ref)
        assert worst < 1e-4, (run.name, worst)
        for a, b in zip(_losses(run), ref_losses):
            assert [s for s, _ in a] == [s for s, _ in b]
            assert all(abs(x - y) <= 1e-4 * max(1.0, abs(y)) for (_, x), (_, y) in zip(a, b)), (run.name, a, b)
    # the round really trained: its UNet moved away from the guided stage's
    from safetensors.torch import load_file

    start = load_file(str(two / "round-0" / "unet" / "diffusion_pytorch_model.safetensors"))
    assert max(float((ref[k] - start[k]).abs().max()) for k in ref if k in start) > 1e-4
    assert torch.isfinite(torch.cat([v.flatten() for v in ref.values()])).all()


def test_a_live_target_consistency_run_on_two_processes_matches_one(teacher, tmp_path):
    # target decay 0: each process's target is its own (DDP-equal) student, no copy to keep in step
    lcm = ["method=consistency", "student_prediction_type=teacher", "consistency.solver_steps=10", "consistency.sample_steps=[2]",
           "consistency.target_ema_decay=0", "consistency.train.max_steps=3", "consistency.train.batch_size=4",
           "consistency.train.lr=1e-3", "consistency.train.log_every=1", "consistency.train.checkpoint_every=10"]
    _distill(1, tmp_path / "one", teacher, *lcm)
    _distill(2, tmp_path / "two", teacher, *lcm)
    from safetensors.torch import load_file

    one, two = (load_file(str(tmp_path / r / "round-0" / "unet" / "diffusion_pytorch_model.safetensors")) for r in ("one", "two"))
    # the losses agree to the all-reduce's rounding; a few weights differ by up to ~lr: Adam's first updates are
    # about lr * g / |g|, so a gradient element near 0 whose rounding differs moves by a fraction of lr either way
    worst = max(float((one[k] - two[k]).abs().max()) for k in one)
    mean = sum(float((one[k] - two[k]).abs().sum()) for k in one) / sum(v.numel() for v in one.values())
    assert one.keys() == two.keys() and worst <= 2e-3 and mean < 1e-5, (worst, mean)
    start = load_file(str(teacher / "unet" / "diffusion_pytorch_model.safetensors"))
    assert max(float((one[k] - start[k]).abs().max()) for k in one if k in start) > 1e-4  # it trained
    a, b = _losses(tmp_path / "one")[0], _losses(tmp_path / "two")[0]
    assert [s for s, _ in a] == [1, 2, 3] and all(abs(x - y) <= 1e-4 * max(1.0, abs(y)) for (_, x), (_, y) in zip(a, b))
