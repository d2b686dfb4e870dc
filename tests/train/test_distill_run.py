"""`pocketdiff distill` end to end on a tiny saved teacher: folders, resume mid-round, stock pipeline loading."""
import dataclasses
import json
import shutil

import pytest
import torch

from pocketdiff.config import load_config
from pocketdiff.errors import PocketdiffError
from pocketdiff.train import distill


class Interrupted(Exception):
    pass


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def teacher_dir(save_shapes_teacher):
    return save_shapes_teacher(arch="tiny")  # tests/train/conftest.py


def _cfg(teacher_dir, *extra):
    return load_config(distill.Config, None, [
        f"model.pretrained={teacher_dir}", "data.source=shapes", "data.shapes_count=16", "data.resolution=32",
        "guidance.embed_dim=16", "guidance.w_min=1", "guidance.w_max=3", "guidance.scale=2",
        "guided.train.max_steps=2", "guided.train.batch_size=2", "guided.train.checkpoint_every=1",
        "progressive.start_steps=4", "progressive.final_steps=2",
        "progressive.train.max_steps=4", "progressive.train.batch_size=2", "progressive.train.checkpoint_every=1",
        "progressive.train.ema_decay=0.5", "progressive.train.log_every=1",
        "eval.enabled=false", *extra])


@pytest.fixture(scope="module")
def full_run(teacher_dir, clip_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    cfg = _cfg(teacher_dir, "eval.enabled=true", "eval.prompts=[a red circle]", "eval.metrics=true", f"eval.clip={clip_dir}",
               "eval.num_images=4")
    mp = pytest.MonkeyPatch()
    mp.setenv("POCKETDIFF_CACHE", str(out / "metric-cache"))
    try:
        return out, distill.run(cfg, out)
    finally:
        mp.undo()


def test_report_and_round_folders(full_run):
    out, report = full_run
    assert [(r["round"], r["stage"], r["steps"]) for r in report["rounds"]] == [(0, "guided", 4), (1, "progressive", 2)]
    assert report["final_steps"] == 2 and report["pipeline_dir"] == str(out / "round-1")
    for r in report["rounds"]:
        assert set(r) >= {"steps", "final_loss", "pipeline_dir"} and torch.isfinite(torch.tensor(r["final_loss"]))
        meta = json.loads((out / f"round-{r['round']}" / "distill.json").read_text())
        assert meta["num_inference_steps"] == r["steps"]
        assert (out / r["eval"]["grid"]).is_file()
        m = r["eval"]["metrics"]
        assert m is not None, r["eval"].get("metrics_error")
        assert m["student"]["steps"] == r["steps"] and m["teacher_same_steps"]["steps"] == r["steps"]
        assert m["teacher_reference"]["steps"] == 4
        assert all(isinstance(m[k]["fd"], float) and isinstance(m[k]["clip_score"], float) for k in m)
        assert m["student"]["guidance_mode"] == "embedded" and m["teacher_same_steps"]["guidance_mode"] == "cfg"
    assert not list(out.glob(".round-*"))  # no temporary folders left
    sched = json.loads((out / "round-1" / "scheduler" / "scheduler_config.json").read_text())
    assert sched["prediction_type"] == "v_prediction" and sched["timestep_spacing"] == "trailing"
    assert (out / "index.html").is_file()


def test_saved_student_samples_in_stock_pipeline_with_its_step_count(full_run):
    from diffusers import StableDiffusionPipeline

    from pocketdiff.sampling import ddim_sample, encode_prompts

    out, report = full_run
    folder = out / "round-1"
    pipe = StableDiffusionPipeline.from_pretrained(str(folder), safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.unet.config.time_cond_proj_dim == 16
    noise = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    img = pipe("a red circle", num_inference_steps=2, guidance_scale=2.0, latents=noise.clone(), output_type="np").images
    assert img.shape == (1, 32, 32, 3) and img.min() >= 0 and img.max() <= 1
    latents = pipe("a red circle", num_inference_steps=2, guidance_scale=2.0, latents=noise.clone(), output_type="latent").images
    # the same student through pocketdiff's sampler with the documented w helper
    ours = ddim_sample(pipe.unet, pipe.scheduler, encode_prompts(pipe, ["a red circle"]), steps=2, guidance_scale=2.0,
                       latents=noise.clone(), w_embedding_fn=distill.w_embedding_fn(pipe.unet))
    assert torch.allclose(latents, ours, atol=1e-5)
    other = pipe("a red circle", num_inference_steps=2, guidance_scale=3.0, latents=noise.clone(), output_type="latent").images
    assert other.shape == latents.shape


def test_resume_mid_round_is_bit_exact(teacher_dir, full_run, tmp_path, monkeypatch):
    full_out, full_report = full_run
    cfg = _cfg(teacher_dir)
    real_loop = distill.train_loop

    def interrupted_loop(loop_cfg, **kw):
        if kw["desc"] == "round-1":  # "killed" after step 2 of 4 of the progressive round
            real_loop(dataclasses.replace(loop_cfg, max_steps=2), **kw)
            raise Interrupted
        return real_loop(loop_cfg, **kw)

    monkeypatch.setattr(distill, "train_loop", interrupted_loop)
    with pytest.raises(Interrupted):
        distill.run(cfg, tmp_path)
    assert (tmp_path / "round-0" / "distill.json").is_file() and not (tmp_path / "round-1").exists()
    monkeypatch.setattr(distill, "train_loop", real_loop)
    with pytest.raises(PocketdiffError, match="--resume latest"):
        distill.run(cfg, tmp_path)  # not without --resume
    report = distill.run(cfg, tmp_path, resume="latest")

    from safetensors.torch import load_file

    for k in (0, 1):
        a = load_file(str(full_out / f"round-{k}" / "unet" / "diffusion_pytorch_model.safetensors"))
        b = load_file(str(tmp_path / f"round-{k}" / "unet" / "diffusion_pytorch_model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), k
    assert [r["losses"] for r in report["rounds"]] == [r["losses"] for r in full_report["rounds"]]

    changed = _cfg(teacher_dir, "guidance.w_max=5")
    shutil.rmtree(tmp_path / "round-1")
    with pytest.raises(PocketdiffError, match="recipe changed"):
        distill.run(changed, tmp_path, resume="latest")


def test_teacher_folder_without_unet_fails_before_training(teacher_dir, tmp_path):
    broken = tmp_path / "teacher"
    shutil.copytree(teacher_dir, broken)
    shutil.rmtree(broken / "unet")
    out = tmp_path / "out"
    with pytest.raises(PocketdiffError, match="unet"):
        distill.run(_cfg(broken), out)
    assert not (out / "checkpoints").exists()


class FakeClock:
    """The loop's clock: every reading is 10^4 s after the previous one."""

    def __init__(self):
        self.now = 0.0

    def time(self):
        self.now += 1e4
        return self.now


def test_time_budget_stops_a_round_without_committing_it(teacher_dir, tmp_path, monkeypatch):
    import pocketdiff.train.loop as loop_module

    folded = "guidance.conditioned=false"  # and a student that folds a fixed w (no w embedding)
    cfg = _cfg(teacher_dir, folded, "guided.enabled=false", "progressive.start_steps=4", "progressive.final_steps=2",
               "progressive.train.max_steps=3", "max_time_s=3600")
    monkeypatch.setattr(loop_module, "time", FakeClock())
    report = distill.run(cfg, tmp_path)
    monkeypatch.undo()
    assert report["complete"] is False and "round-1" in report["stopped_early"] and report["rounds"] == []
    assert not (tmp_path / "round-1").exists() and (tmp_path / "checkpoints" / "round-1" / "checkpoint-1").is_dir()
    cfg = _cfg(teacher_dir, folded, "guided.enabled=false", "progressive.start_steps=4", "progressive.final_steps=2",
               "progressive.train.max_steps=3")
    with pytest.raises(PocketdiffError, match="recipe changed"):  # the round plan (optimizer steps) changed
        distill.run(_cfg(teacher_dir, folded, "guided.enabled=false", "progressive.train.max_steps=5"), tmp_path, resume="latest")
    report = distill.run(cfg, tmp_path, resume="latest")
    assert report["complete"] is True and report["rounds"][0]["train_steps"] == 3
    assert [s for s, _ in report["rounds"][0]["losses"]] == [1, 2, 3]
    unet_cfg = json.loads((tmp_path / "round-1" / "unet" / "config.json").read_text())
    assert unet_cfg.get("time_cond_proj_dim") is None
    assert "guidance_scale=1.0" in (tmp_path / "round-1" / "README.md").read_text()


def test_rounds_share_the_teachers_unchanged_files_and_drop_finished_checkpoints(teacher_dir, full_run):
    import os

    out, report = full_run
    vae = "vae/diffusion_pytorch_model.safetensors"
    for r in report["rounds"]:
        folder = out / f"round-{r['round']}"
        assert os.stat(folder / vae).st_ino == os.stat(teacher_dir / vae).st_ino  # hardlinked, not copied
        assert sorted(r["folder_files"]["linked"]) == ["text_encoder", "tokenizer", "vae"]
        assert not (out / "checkpoints" / f"round-{r['round']}").exists()  # resume never needs them once the folder exists
        assert r["timing"]["steps_run"] == r["train_steps"] and r["timing"]["first_step_s"] is not None
    rows = [json.loads(line) for line in (out / "logs.jsonl").read_text().splitlines()]
    assert {"wall_s", "samples_per_s", "peak_gpu_mem_gib"} <= set(next(r for r in rows if r.get("step") == 2 and "loss" in r))
