"""`pocketdiff distill` with `student.lora_rank` (issue 65 item 2): a consistency student trained as a LoRA over its
teacher (train/distill_lora.py), on a tiny saved teacher. Only the LoRA factors train (the checkpoints, the EMA and the
target network hold them alone; the teacher's files stay as they were); the round folder holds the LoRA in diffusers'
format, which stock diffusers loads with `load_lora_weights` / `fuse_lora` and samples at 2 and 4 steps with the
folder's LCMScheduler, and which pocketdiff's own `model.lora` fuses to the same UNet; --resume continues a cut run
to the uninterrupted one's LoRA; recipes a LoRA student cannot serve are refused with one line naming the key."""
from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from pocketdiff.config import load_config
from pocketdiff.errors import PocketdiffError
from pocketdiff.train import distill

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LORA = "pytorch_lora_weights.safetensors"
# pocketdiff.lora and diffusers' fuse_lora both add scale * B @ A (float32, from the fp16 file) to the float32 weights,
# in another order of rounding: a few float32 ulps per weight, then ~20 layers of the tiny UNet (tests/core/test_lora.py
# measured the same bound on random LoRAs); the LoRA's own effect on the output is ~100x larger (asserted below)
MAX_OUTPUT_DIFF = 1e-4
# the same fused weights (to those ulps) sampled by the same stock pipeline with the same noise: 2-4 UNet passes and the
# VAE decode, images in [0, 1]
MAX_IMAGE_DIFF = 1e-3


class Interrupted(Exception):
    pass


@pytest.fixture(scope="module")
def teacher_dir(save_shapes_teacher):
    return save_shapes_teacher(arch="tiny", prediction_type="v_prediction")


def _cfg_args(teacher_dir, *extra) -> list[str]:
    return [
        f"model.pretrained={teacher_dir}", "data.source=shapes", "data.shapes_count=16", "data.resolution=32",
        "method=consistency", "student_prediction_type=teacher", "guidance.conditioned=false", "guidance.scale=2",
        "consistency.solver_steps=10", "consistency.sample_steps=[2,4]", "consistency.target_ema_decay=0.5",
        "consistency.train.max_steps=4", "consistency.train.batch_size=2", "consistency.train.checkpoint_every=2",
        "consistency.train.log_every=1", "consistency.train.lr=0.01", "consistency.train.ema_decay=0.5",
        "student.lora_rank=4", "student.lora_alpha=8", "eval.prompts=[a red circle]", "eval.reference_steps=8", *extra]


def _cfg(teacher_dir, *extra):
    return load_config(distill.Config, None, _cfg_args(teacher_dir, *extra))


def _digest(folder) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def lora_run(teacher_dir, tmp_path_factory):
    before = _digest(teacher_dir)
    out = tmp_path_factory.mktemp("lora")
    report = distill.run(_cfg(teacher_dir, "keep_round_checkpoints=true"), out)
    return out, report, before


def _is_lora_key(k: str) -> bool:
    return ".lora_A." in k or ".lora_B." in k


def test_only_the_lora_factors_train_and_the_teacher_stays(teacher_dir, lora_run):
    out, report, before = lora_run
    assert _digest(teacher_dir) == before  # the teacher's files, byte for byte
    ckpt = out / "checkpoints" / "round-0" / "checkpoint-4"
    for name in ("model.safetensors", "ema.safetensors", "companion.safetensors"):  # optimizer state follows the same params
        keys = set(load_file(str(ckpt / name)))
        assert keys and all(_is_lora_key(k) for k in keys), name
    assert len(torch.load(ckpt / "optimizer.pt", weights_only=True)["optimizer"]["state"]) == len(keys)
    state = load_file(str(out / "round-0" / LORA))
    ups = [v for k, v in state.items() if ".lora_B." in k]
    assert ups and any(float(v.abs().max()) > 0 for v in ups)  # B starts at zero: the factors did train
    assert all(v.dtype == torch.float16 for v in state.values())  # student.lora_dtype's default
    assert not (out / ".round-0.lora").exists()  # the staged LoRA moved into the round folder, its folder gone


def test_the_report_names_the_loras_file_hash_rank_and_size(lora_run):
    out, report, _ = lora_run
    entry = report["lora"]
    path = out / "round-0" / LORA
    assert entry == report["rounds"][0]["lora"] and entry["file"] == str(path)
    assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest() and entry["bytes"] == path.stat().st_size
    assert (entry["rank"], entry["alpha"], entry["dtype"]) == (4, 8.0, "fp16")
    with safe_open(str(path), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
    assert entry["params"] == sum(int(torch.Size(s).numel()) for s in shapes.values()) and entry["layers"] == len(shapes) // 2
    assert all(s[0] == 4 for k, s in shapes.items() if ".lora_A." in k) and all(k.startswith("unet.") for k in shapes)
    assert meta["unet.r"] == 4 and meta["unet.lora_alpha"] == 8
    modules = {k.split(".lora_")[0] for k in shapes}
    for target in ("to_q", "to_out.0", "ff.net.2", "conv1", "conv_shortcut", "time_emb_proj", "downsamplers.0.conv"):  # LCM-LoRA's
        assert any(m.endswith("." + target) for m in modules), target
    assert json.loads((out / "round-0" / "distill.json").read_text())["lora"]["lora_rank"] == 4
    assert "load_lora_weights" in (out / "round-0" / "README.md").read_text()
    assert entry["sha256"] in (out / "index.html").read_text()


def _stock_teacher_with_lora(teacher_dir, folder, fuse: bool = True):
    from diffusers import LCMScheduler, StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(str(teacher_dir), safety_checker=None, requires_safety_checker=False)
    pipe.scheduler = LCMScheduler.from_pretrained(str(folder), subfolder="scheduler")
    pipe.load_lora_weights(str(folder))  # finds pytorch_lora_weights.safetensors
    if fuse:
        pipe.fuse_lora()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _unet_out(unet, pipe) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, 8, generator=g)
    ids = pipe.tokenizer(["a red circle", "a blue square"], padding="max_length", max_length=pipe.tokenizer.model_max_length,
                         return_tensors="pt").input_ids
    with torch.no_grad():
        states = pipe.text_encoder(ids)[0]
        return unet(x, torch.tensor([999, 499]), encoder_hidden_states=states).sample


def test_stock_diffusers_loads_the_lora_and_draws_at_2_and_4_steps(teacher_dir, lora_run):
    from diffusers import StableDiffusionPipeline

    out, _, _ = lora_run
    pipe = _stock_teacher_with_lora(teacher_dir, out / "round-0")
    folder = StableDiffusionPipeline.from_pretrained(str(out / "round-0"), safety_checker=None, requires_safety_checker=False)
    folder.set_progress_bar_config(disable=True)
    noise = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    for steps in (2, 4):
        images = [p("a red circle", num_inference_steps=steps, guidance_scale=1.0, latents=noise.clone(), output_type="pt",
                    generator=torch.Generator().manual_seed(0)).images for p in (pipe, folder)]
        assert images[0].shape == (1, 3, 32, 32) and torch.isfinite(images[0]).all()
        # the teacher + LoRA in stock diffusers draws what the round folder (the teacher with the LoRA fused by us) draws
        assert float((images[0] - images[1]).abs().max()) <= MAX_IMAGE_DIFF, steps


def test_our_model_lora_fuses_the_file_as_diffusers_does(teacher_dir, lora_run):
    from pocketdiff.models import ModelConfig, load_or_build, load_pipeline

    out, _, _ = lora_run
    ours = load_or_build(ModelConfig(pretrained=str(teacher_dir), lora=[{"path": str(out / "round-0" / LORA), "scale": 1.0}]))
    theirs = _stock_teacher_with_lora(teacher_dir, out / "round-0")
    unfused = _stock_teacher_with_lora(teacher_dir, out / "round-0", fuse=False)
    plain = load_pipeline(str(teacher_dir))
    a, b, c = (_unet_out(p.unet, ours) for p in (ours, theirs, unfused))
    effect = float((a - _unet_out(plain.unet, ours)).abs().max())
    assert float((a - b).abs().max()) <= MAX_OUTPUT_DIFF and float((a - c).abs().max()) <= MAX_OUTPUT_DIFF
    assert effect > 100 * MAX_OUTPUT_DIFF  # the LoRA changes the output far beyond the tolerance: the check can fail
    folder = load_pipeline(str(out / "round-0"))  # the round folder's UNet is the same fusion
    assert float((a - _unet_out(folder.unet, ours)).abs().max()) <= MAX_OUTPUT_DIFF


def _run_interrupted(cfg, out, monkeypatch, steps: int) -> None:
    real_loop = distill.train_loop

    def interrupted_loop(loop_cfg, **kw):
        real_loop(dataclasses.replace(loop_cfg, max_steps=steps), **kw)
        raise Interrupted

    monkeypatch.setattr(distill, "train_loop", interrupted_loop)
    with pytest.raises(Interrupted):
        distill.run(cfg, out)
    monkeypatch.setattr(distill, "train_loop", real_loop)


def test_resume_latest_continues_to_the_uninterrupted_lora(teacher_dir, lora_run, tmp_path, monkeypatch):
    full_out, full_report, _ = lora_run
    cfg = _cfg(teacher_dir, "keep_round_checkpoints=true", "eval.enabled=false", "consistency.train.checkpoints_total_limit=1")
    _run_interrupted(cfg, tmp_path, monkeypatch, 2)
    assert [p.name for p in (tmp_path / "checkpoints" / "round-0").iterdir()] == ["checkpoint-2"]
    report = distill.run(cfg, tmp_path, resume="latest")
    assert [p.name for p in (tmp_path / "checkpoints" / "round-0").iterdir()] == ["checkpoint-4"]  # rotation
    a, b = load_file(str(full_out / "round-0" / LORA)), load_file(str(tmp_path / "round-0" / LORA))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert report["rounds"][0]["losses"] == full_report["rounds"][0]["losses"]
    assert report["lora"]["sha256"] == full_report["lora"]["sha256"]
    with pytest.raises(PocketdiffError, match="recipe changed"):
        distill.run(_cfg(teacher_dir, "keep_round_checkpoints=true", "eval.enabled=false", "student.lora_rank=8"),
                    tmp_path, resume="latest")


@pytest.mark.parametrize("override, line", [
    ("student.lora_rank=0", "(^config: )student.lora_rank: must be a positive integer"),
    ("student.lora_rank=-2", "(^config: )student.lora_rank: must be a positive integer"),
    ("student.lora_rank=2.5", "student.lora_rank"),
    ("student.lora_alpha=0", "(^config: )student.lora_alpha: must be a finite number > 0"),
    ("student.lora_targets=everything", "(^config: )student.lora_targets: must be one of"),
    ("student.lora_targets=[]", "(^config: )student.lora_targets: must be one of"),
    ("student.lora_dtype=fp8", "(^config: )student.lora_dtype: must be one of"),
    ("method=progressive", "(^config: )method: progressive cannot train a LoRA student"),
    ("guidance.conditioned=true", "(^config: )guidance.conditioned: must be false with student.lora_rank"),
])
def test_recipes_a_lora_student_cannot_serve_are_refused_naming_the_key(teacher_dir, override, line):
    with pytest.raises(PocketdiffError, match=line) as e:
        _cfg(teacher_dir, override)
    assert "\n" not in str(e.value)


def test_lora_keys_without_a_rank_are_refused(teacher_dir):
    with pytest.raises(PocketdiffError, match="^config: student.lora_rank: is null"):
        load_config(distill.Config, None, [f"model.pretrained={teacher_dir}", "student.lora_alpha=4"])
    assert load_config(distill.Config, None, [f"model.pretrained={teacher_dir}"]).student.enabled is False


@pytest.mark.parametrize("override, line", [
    ("student.lora_targets=[to_q,to_qq]", "^student.lora_targets: 'to_qq' names no linear or conv layer"),
    ("student.lora_targets=[attn1]", "^student.lora_targets: 'attn1' names no linear or conv layer"),
    ("student_prediction_type=epsilon", "^student_prediction_type: epsilon differs from the teacher's v_prediction"),
])
def test_run_time_refusals_come_before_anything_is_written(teacher_dir, tmp_path, override, line):
    with pytest.raises(PocketdiffError, match=line):
        distill.run(_cfg(teacher_dir, override), tmp_path / "out")
    assert not (tmp_path / "out" / "distill_plan.json").exists() and not (tmp_path / "out" / "checkpoints").exists()


def test_attention_targets_adapt_only_the_attention_projections(teacher_dir):
    from pocketdiff.models import load_pipeline
    from pocketdiff.train.distill_lora import add_lora

    unet = add_lora(load_pipeline(str(teacher_dir)).unet, _cfg(teacher_dir, "student.lora_targets=attention").student)
    adapted = {n.split(".lora_A.")[0] for n, p in unet.named_parameters() if ".lora_A." in n}
    trainable = [n for n, p in unet.named_parameters() if p.requires_grad]
    assert adapted and all(n.rsplit(".", 2)[-2:] in (["attn1", "to_q"], ["attn1", "to_k"], ["attn1", "to_v"], ["attn2", "to_q"],
                                                     ["attn2", "to_k"], ["attn2", "to_v"], ["to_out", "0"]) for n in adapted)
    assert trainable and all(_is_lora_key(n) for n in trainable)


def test_two_processes_train_the_same_lora(teacher_dir, lora_run, tmp_path):
    """Under `accelerate launch` with 2 processes (gloo on the CPU; DDP over a frozen UNet with trainable factors) the
    run trains the one-process run's LoRA up to the all-reduce's rounding: the losses agree to it; a few factors differ
    by up to ~lr (Adam's first updates are about lr * g / |g|: a gradient element near 0 whose rounding differs moves
    by a fraction of lr either way, as tests/train/test_distill_world_size_resume.py found for the whole UNet)."""
    from cpu_launch import accelerate_cpu

    full_out, full_report, _ = lora_run
    overrides = [a for a in _cfg_args(teacher_dir) if not a.startswith("eval.")] + ["eval.enabled=false"]
    accelerate_cpu(2, "-m", "pocketdiff", "distill", "--output", str(tmp_path / "two"), *overrides)
    a, b = load_file(str(full_out / "round-0" / LORA)), load_file(str(tmp_path / "two" / "round-0" / LORA))
    assert a.keys() == b.keys()
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    mean = sum(float((a[k].float() - b[k].float()).abs().sum()) for k in a) / sum(v.numel() for v in a.values())
    assert worst <= 0.01 and mean < 1e-4, (worst, mean)  # lr = 0.01; the factors reach ~0.2
    assert any(float(v.abs().max()) > 0 for k, v in b.items() if ".lora_B." in k)
    two = json.loads((tmp_path / "two" / "report.json").read_text())["rounds"][0]["losses"]
    one = full_report["rounds"][0]["losses"]
    assert [s for s, _ in two] == [s for s, _ in one] and all(abs(x - y) <= 1e-4 * max(1.0, abs(y)) for (_, x), (_, y) in zip(one, two))


def test_a_lora_target_network_and_model_load_exactly_their_factors(teacher_dir):
    """The target network (a LoRA student's: its factors alone) and the model checkpoint (trainable_only) load a state
    of exactly their trained parameters; one more or one less is refused (train_loop's resume names the file)."""
    from pocketdiff.models import load_pipeline
    from pocketdiff.train.checkpoints import load_model_state, model_state
    from pocketdiff.train.consistency_targets import TargetNetwork
    from pocketdiff.train.distill_lora import add_lora

    unet = add_lora(load_pipeline(str(teacher_dir)).unet, _cfg(teacher_dir, "student.lora_targets=attention").student)
    target = TargetNetwork(unet, 0.5)
    state = target.state_dict()
    assert state and all(_is_lora_key(k) for k in state) and state.keys() == model_state(unet, trainable_only=True).keys()
    moved = {k: v + 1 for k, v in state.items()}
    target.load_state_dict(moved)
    assert all(torch.equal(target.state_dict()[k], moved[k]) for k in moved)
    first = sorted(state)[0]
    for bad in ({k: v for k, v in state.items() if k != first}, {**state, "conv_in.weight": unet.conv_in.weight}):
        with pytest.raises(ValueError, match="is in one only"):
            target.load_state_dict(bad)
        with pytest.raises(ValueError, match="is in one only"):
            load_model_state(unet, bad, trainable_only=True)
