"""`pocketdiff distill` with method consistency, and progressive distillation down to 1 step, end to
end on a tiny saved teacher: folders, stock pipeline loading, sampling at 1..8 steps, resume equality."""
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from pocketdiff.conditioning import Conditioning
from pocketdiff.config import load_config
from pocketdiff.errors import PocketdiffError
from pocketdiff.train import distill


class Interrupted(Exception):
    pass


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

UNET = "unet/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    from pocketdiff.config import DataConfig
    from pocketdiff.data import load_captions
    from pocketdiff.models import ModelConfig, build_pipeline, save_pipeline

    captions = load_captions(DataConfig(source="shapes", shapes_count=16, resolution=32))
    pipe = build_pipeline(ModelConfig(arch="tiny", prediction_type="v_prediction"), captions=captions, resolution=32)
    return save_pipeline(pipe, tmp_path_factory.mktemp("teacher") / "pipeline")


def _cfg(teacher_dir, *extra):
    return load_config(distill.Config, None, [
        f"model.pretrained={teacher_dir}", "data.source=shapes", "data.shapes_count=16", "data.resolution=32",
        "method=consistency", "student_prediction_type=teacher",
        "guidance.embed_dim=16", "guidance.w_min=1", "guidance.w_max=3", "guidance.scale=2",
        "consistency.solver_steps=10", "consistency.sample_steps=[1,2,8]",
        "consistency.train.max_steps=4", "consistency.train.batch_size=2", "consistency.train.checkpoint_every=1",
        "consistency.train.log_every=1", "consistency.target_ema_decay=0.5",
        "eval.prompts=[a red circle]", "eval.reference_steps=8", *extra])


def _run_interrupted(cfg, out, monkeypatch, steps: int, after=None) -> None:
    """`distill.run` whose training loop stops after `steps` steps (`after(kw)` then sees the loop's arguments),
    as a killed run would; the real loop is back in place for the resume."""
    real_loop = distill.train_loop

    def interrupted_loop(loop_cfg, **kw):
        real_loop(dataclasses.replace(loop_cfg, max_steps=steps), **kw)
        if after is not None:
            after(kw)
        raise Interrupted

    monkeypatch.setattr(distill, "train_loop", interrupted_loop)
    with pytest.raises(Interrupted):
        distill.run(cfg, out)
    monkeypatch.setattr(distill, "train_loop", real_loop)


@pytest.fixture(scope="module")
def lcm_run(teacher_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lcm")
    return out, distill.run(_cfg(teacher_dir), out)


def test_consistency_run_writes_an_lcm_student_folder(lcm_run):
    out, report = lcm_run
    assert report["method"] == "consistency" and report["complete"] is True
    [r] = report["rounds"]
    assert (r["round"], r["stage"], r["steps"], r["teacher_steps"], r["train_steps"]) == (0, "consistency", 8, 10, 4)
    assert [s for s, _ in r["losses"]] == [1, 2, 3, 4] and all(torch.isfinite(torch.tensor(v)) for _, v in r["losses"])
    sched = json.loads((out / "round-0" / "scheduler" / "scheduler_config.json").read_text())
    assert sched["_class_name"] == "LCMScheduler" and sched["original_inference_steps"] == 10 and sched["timestep_scaling"] == 10.0
    assert sched["prediction_type"] == "v_prediction"
    meta = json.loads((out / "round-0" / "distill.json").read_text())
    assert meta["sampling_steps"] == [1, 2, 8] and meta["num_inference_steps"] == 8 and meta["guidance"]["conditioned"]
    assert set(r["eval"]) == {"1", "2", "8"} and all((out / e["grid"]).is_file() for e in r["eval"].values())
    assert "LCMScheduler" in (out / "round-0" / "README.md").read_text()
    assert not (out / "checkpoints" / "round-0").exists()  # the folder is the result


def test_lcm_student_samples_in_a_stock_pipeline_as_in_ours(lcm_run):
    from diffusers import LCMScheduler, StableDiffusionPipeline

    from pocketdiff.models import load_pipeline
    from pocketdiff.sampling import generate

    out, _ = lcm_run
    pipe = StableDiffusionPipeline.from_pretrained(str(out / "round-0"), safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    assert isinstance(pipe.scheduler, LCMScheduler) and pipe.unet.config.time_cond_proj_dim == 16
    noise = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    ours_pipe = load_pipeline(str(out / "round-0"))
    for steps in (1, 2):
        # a stock pipeline at guidance_scale 2 passes w through timestep_cond (one pass) under the LCMScheduler
        theirs = pipe("a red circle", num_inference_steps=steps, guidance_scale=2.0, latents=noise.clone(), output_type="pt",
                      generator=torch.Generator().manual_seed(0)).images
        ours = generate(ours_pipe, ["a red circle"], steps=steps, guidance_scale=2.0, seed=0)
        assert ours.shape == theirs.shape == (1, 3, 32, 32)
        if steps == 1:  # no noise injected: the same image
            assert torch.allclose(ours, theirs, atol=1e-4)
    a = generate(ours_pipe, ["a red circle", "a blue square"], steps=8, guidance_scale=2.0, seed=0, batch_size=1)
    b = generate(ours_pipe, ["a red circle", "a blue square"], steps=8, guidance_scale=2.0, seed=0, batch_size=2)
    assert torch.allclose(a, b, atol=1e-5)  # the re-noising draws are per image, not per batch


def test_evaluate_samples_the_lcm_student_at_every_measured_count(lcm_run):
    from pocketdiff.evaluate.generation import resolve_model

    out, _ = lcm_run
    loaded = resolve_model(str(out / "round-0"))
    assert loaded.default_steps == [1, 2, 8] and loaded.guidance_mode == "embedded"


def test_consistency_resume_mid_stage_equals_the_uninterrupted_run(teacher_dir, lcm_run, tmp_path, monkeypatch):
    full_out, full_report = lcm_run
    cfg = _cfg(teacher_dir, "eval.enabled=false", "keep_round_checkpoints=true")
    seen = {}
    _run_interrupted(cfg, tmp_path, monkeypatch, 2,
                     after=lambda kw: seen.update(target={k: v.clone() for k, v in kw["companion"].state_dict().items()}))
    saved = load_file(str(tmp_path / "checkpoints" / "round-0" / "checkpoint-2" / "companion.safetensors"))
    assert all(torch.equal(saved[k], seen["target"][k].cpu()) for k in saved)
    report = distill.run(cfg, tmp_path, resume="latest")
    a, b = load_file(str(full_out / "round-0" / UNET)), load_file(str(tmp_path / "round-0" / UNET))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert report["rounds"][0]["losses"] == full_report["rounds"][0]["losses"]
    with pytest.raises(PocketdiffError, match="recipe changed"):
        distill.run(_cfg(teacher_dir, "eval.enabled=false", "keep_round_checkpoints=true", "consistency.solver_steps=20"),
                    tmp_path, resume="latest")


def test_curve_steps_measure_each_checkpoint_and_resume_keeps_the_training_seconds(teacher_dir, clip_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("POCKETDIFF_CACHE", str(tmp_path / "metric-cache"))
    cfg = _cfg(teacher_dir, "eval.metrics=true", f"eval.clip={clip_dir}", "eval.num_images=4", "eval.curve_steps=[2]",
               "consistency.train.checkpoint_every=2", "consistency.sample_steps=[2]")
    _run_interrupted(cfg, tmp_path, monkeypatch, 2)
    first_s = json.loads((tmp_path / "checkpoints" / "round-0" / "checkpoint-2" / "trainer_state.json").read_text())["train_s"]
    [r] = distill.run(cfg, tmp_path, resume="latest")["rounds"]
    assert first_s > 0 and r["train_seconds"] > first_s  # the first invocation's seconds count in the round's
    assert [(p["step"], p["steps"]) for p in r["curve"]] == [(2, 2), (4, 2)]
    assert 0 < r["curve"][0]["train_seconds"] <= first_s < r["curve"][1]["train_seconds"] <= r["train_seconds"]
    # the last checkpoint's weights are the folder's: its curve point is the round's own measurement at 2 steps
    last, final = r["curve"][1]["metrics"], r["eval"]["2"]["metrics"]["student"]
    assert last["fd"] == pytest.approx(final["fd"], rel=1e-4) and last["clip_score"] == pytest.approx(final["clip_score"], rel=1e-4)
    assert (tmp_path / "curve.png").is_file() and "curve.png" in (tmp_path / "index.html").read_text()


def test_curve_steps_are_refused_where_they_cannot_apply(teacher_dir):
    with pytest.raises(PocketdiffError, match="eval.curve_steps: needs eval.metrics"):
        _cfg(teacher_dir, "eval.curve_steps=[2]")
    with pytest.raises(PocketdiffError, match="eval.curve_steps: 20 is more than consistency.solver_steps"):
        _cfg(teacher_dir, "eval.metrics=true", "eval.curve_steps=[20]")
    with pytest.raises(PocketdiffError, match="eval.curve_steps: is for method: consistency"):
        _cfg(teacher_dir, "method=progressive", "eval.metrics=true", "eval.curve_steps=[2]")


def test_a_resume_without_the_target_network_is_refused(teacher_dir, tmp_path, monkeypatch):
    cfg = _cfg(teacher_dir, "eval.enabled=false")
    _run_interrupted(cfg, tmp_path, monkeypatch, 1)
    (tmp_path / "checkpoints" / "round-0" / "checkpoint-1" / "companion.safetensors").unlink()
    with pytest.raises(PocketdiffError, match="companion.safetensors"):
        distill.run(cfg, tmp_path, resume="latest")


def test_a_live_target_checkpoints_no_copy_and_resumes_to_the_uninterrupted_run(teacher_dir, tmp_path, monkeypatch):
    cfg = _cfg(teacher_dir, "eval.enabled=false", "consistency.target_ema_decay=0")
    full = distill.run(cfg, tmp_path / "full")
    _run_interrupted(cfg, tmp_path / "cut", monkeypatch, 2)
    assert not (tmp_path / "cut" / "checkpoints" / "round-0" / "checkpoint-2" / "companion.safetensors").exists()
    resumed = distill.run(cfg, tmp_path / "cut", resume="latest")
    a, b = load_file(str(tmp_path / "full" / "round-0" / UNET)), load_file(str(tmp_path / "cut" / "round-0" / UNET))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert resumed["rounds"][0]["losses"] == full["rounds"][0]["losses"]


def test_solver_steps_above_the_teachers_timesteps_fail_before_training(teacher_dir, tmp_path):
    with pytest.raises(PocketdiffError, match="consistency.solver_steps: 2000"):
        distill.run(_cfg(teacher_dir, "consistency.solver_steps=2000"), tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def test_progressive_distillation_runs_down_to_one_step(teacher_dir, tmp_path):
    from pocketdiff.models import load_pipeline
    from pocketdiff.sampling import final_alpha_cumprod, generate

    cfg = load_config(distill.Config, None, [
        f"model.pretrained={teacher_dir}", "data.source=shapes", "data.shapes_count=16", "data.resolution=32",
        "guidance.embed_dim=16", "guidance.w_min=1", "guidance.w_max=3", "guidance.scale=2", "guided.train.max_steps=1",
        "guided.train.batch_size=2", "progressive.start_steps=4", "progressive.final_steps=1", "progressive.train.max_steps=2",
        "progressive.train.batch_size=2", "eval.enabled=false"])
    report = distill.run(cfg, tmp_path)
    assert [r["steps"] for r in report["rounds"]] == [4, 2, 1] and report["final_steps"] == 1
    last = report["rounds"][-1]
    # the 1-step student's one transition: trailing t = 999 straight to the end, the teacher's midpoint its 2-step grid's 499
    student = load_pipeline(str(tmp_path / "round-2"))
    [(t, mid, _, _, a_prev)] = last["transitions"]
    assert (t, mid) == (999, 499) and a_prev == pytest.approx(float(final_alpha_cumprod(student.scheduler)))
    assert all(torch.isfinite(torch.tensor(v)) for _, v in last["losses"])
    images = generate(student, ["a red circle"], steps=1, guidance_scale=2.0)
    assert images.shape == (1, 3, 32, 32) and torch.isfinite(images).all()


def test_leading_spacing_cannot_serve_a_two_step_student(teacher_dir, tmp_path):
    cfg = load_config(distill.Config, None, [
        f"model.pretrained={teacher_dir}", "data.source=shapes", "data.shapes_count=16", "data.resolution=32",
        "progressive.start_steps=8", "progressive.final_steps=2", "timestep_spacing=leading", "eval.enabled=false"])
    with pytest.raises(PocketdiffError, match=r"^timestep_spacing: 'leading' starts the 2-step student at t=501"):
        distill.run(cfg, tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def test_top_step_input_noise_feeds_pure_noise_at_the_top_transition(teacher_dir, monkeypatch):
    """The student's input at k = 0 (t = 999) is the batch's noise draw itself; other rows stay z_t."""
    from pocketdiff.train import distill_loss

    cfg = load_config(distill.Config, None, [
        f"model.pretrained={teacher_dir}", "data.source=shapes", "data.shapes_count=16", "data.resolution=32",
        "guided.enabled=false", "progressive.start_steps=4", "progressive.final_steps=2", "progressive.top_step_input=noise"])
    seen = {}

    def fake_student_forward(model, z_t, t, *args, **kw):
        seen["z"], seen["t"] = z_t, t
        return torch.zeros_like(z_t)

    monkeypatch.setattr(distill_loss, "student_forward", fake_student_forward)
    monkeypatch.setattr(distill_loss, "two_step_x_target", lambda *a, **k: torch.zeros(8, 4, 8, 8))
    monkeypatch.setattr(distill_loss, "encode_conditioning", lambda pipe, text, device, **kw: Conditioning(torch.zeros(len(text), 4, 8)))
    from types import SimpleNamespace

    from pocketdiff.train.distill_targets import round_plan
    from pocketdiff.train.distill import student_scheduler
    from pocketdiff.models import load_pipeline
    from pocketdiff.train.loop import BatchRandom

    pipe = load_pipeline(str(teacher_dir))
    sched = student_scheduler(cfg, pipe.scheduler)
    spec = SimpleNamespace(stage="progressive")
    loss_fn = distill_loss.make_loss_fn(cfg, spec, None, round_plan(sched, 2, 4), pipe, sched, None, None, "cpu")
    batch = {"mean": torch.randn(8, 4, 8, 8), "std": torch.zeros(8, 4, 8, 8), "text": [""] * 8}
    loss_fn(None, batch, BatchRandom(torch.Generator().manual_seed(0), 8))
    g = BatchRandom(torch.Generator().manual_seed(0), 8)  # the same draws again: x0 noise, eps, u (w), k
    g.randn(4, 8, 8)
    eps = g.randn(4, 8, 8)
    top = seen["t"] == 999
    assert top.any() and (~top).any()
    assert torch.equal(seen["z"][top], eps[top]) and not torch.allclose(seen["z"][~top], eps[~top])
