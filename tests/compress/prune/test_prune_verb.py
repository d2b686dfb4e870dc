"""`pocketdiff prune` end to end on the tiny config, resume, report, and bad input."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pocketdiff.cli import main
from pocketdiff.compress.prune.verb import Config, load_pruned_pipeline
from pocketdiff.compress.prune.model import PrunedUNet2DConditionModel
from pocketdiff.config import load_config
from pocketdiff.errors import ConfigError

SMALL = [
    "data.source=shapes", "data.shapes_count=16", "data.resolution=32",
    "model.arch=tiny",
    "prune.ratio=0.3", "prune.importance=taylor", "prune.round_to=4", "prune.taylor.samples=4", "prune.taylor.batch_size=4",
    "recovery.feature_weight=0.1",
    "train.batch_size=4", "train.checkpoint_every=1", "train.log_every=1",
    "eval.probe_samples=4", "eval.metrics=false", "eval.prompts=[a red circle]", "eval.steps=2",
]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    """A random tiny CLIP folder: exercises the FD / CLIP path through pocketdiff.evaluate."""
    evaluate = pytest.importorskip("pocketdiff.evaluate.train_clip")
    from pocketdiff.config import DataConfig
    from pocketdiff.data import load_captions
    from pocketdiff.tokenizer import build_clip_tokenizer

    captions = load_captions(DataConfig(source="shapes", shapes_count=64, resolution=32))
    tok = build_clip_tokenizer(captions, vocab_size=560, model_max_length=16)
    mcfg = evaluate.ClipModelConfig(image_size=32, patch_size=8, vision_width=32, vision_layers=1, vision_heads=2,
                                    text_width=32, text_layers=1, text_heads=2, max_length=16, projection_dim=16, vocab_size=560)
    model, processor = evaluate.build_clip(mcfg, tok, seed=0)
    out = tmp_path_factory.mktemp("clip") / "tiny-clip"
    evaluate.save_clip(model, processor, out, {"domain": "tinytest", "label": "tinytest-CLIP"})
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, clip_dir):
    out = tmp_path_factory.mktemp("prune") / "run"
    metrics = ["eval.metrics=true", f"eval.clip={clip_dir}", "eval.num_samples=4", "eval.batch_size=4"]
    with pytest.MonkeyPatch.context() as mp:  # FD reference statistics in a throwaway cache
        mp.setenv("POCKETDIFF_CACHE", str(tmp_path_factory.mktemp("cache")))
        assert main(["prune", "--output", str(out), *SMALL, *metrics, "train.max_steps=2"]) == 0
    return out


def test_report_and_outputs(run_dir):
    report = json.loads((run_dir / "report.json").read_text())
    for key in ("params_before", "params_after", "pipeline_dir", "macs", "groups", "teacher_relative_error", "recovery"):
        assert key in report, key
    assert report["params_after"] < report["params_before"]
    frac = report["targeted_conv_params_removed_fraction"]
    assert 0.2 < frac < 0.4
    macs = report["macs"]
    assert macs["conv_after"] < macs["conv_before"] and macs["total_after"] < macs["total_before"]
    per_conv = {c["name"]: c for c in macs["per_conv"]}
    c = per_conv["up_blocks.0.resnets.0.conv1"]
    assert c["targeted"] and c["macs_after"] < c["macs_before"] and c["params_after"] < c["params_before"]
    assert per_conv["conv_in"]["macs_after"] == per_conv["conv_in"]["macs_before"]
    assert report["recovery"]["steps"] == 2
    q = report["teacher_relative_error"]
    assert q["after_pruning"]["relative_mse"] > 0 and "after_recovery" in q
    m = report["metrics"]
    assert m["available"] is True
    assert set(m["results"]) == {"before_pruning", "after_pruning", "after_recovery"}
    for r in m["results"].values():
        assert r["fd"] is not None and r["num_samples"] == 4 and r["features"] == "FD (tinytest-CLIP)"
    assert m["fd_ratio_after_recovery"] == pytest.approx(m["results"]["after_recovery"]["fd"] / m["results"]["before_pruning"]["fd"])
    assert (run_dir / "eval" / "index.html").is_file()
    for name in ("index.html", "importance.png", "samples.png", "config.yaml", "plan.json"):
        assert (run_dir / name).is_file(), name
    assert "importance.png" in (run_dir / "index.html").read_text()
    pipe = load_pruned_pipeline(report["pipeline_dir"])
    assert isinstance(pipe.unet, PrunedUNet2DConditionModel)
    assert sum(p.numel() for p in pipe.unet.parameters()) == report["params_after"]


def test_resume_latest_continues_recovery(run_dir):
    before = json.loads((run_dir / "report.json").read_text())
    assert main(["prune", "--output", str(run_dir), "--resume", "latest", *SMALL, "train.max_steps=3"]) == 0
    report = json.loads((run_dir / "report.json").read_text())
    assert report["resumed_pruning"] is True
    assert report["recovery"]["steps"] == 3
    assert report["metrics"] == {"available": False, "reason": "eval.metrics is false"}
    steps = [s for s, _ in report["recovery"]["losses"]]
    assert steps == [1, 2, 3]  # steps 1-2 from the first run's checkpoint, 3 new
    assert report["groups"] == before["groups"]  # the same pruned architecture, not re-pruned


@pytest.mark.parametrize("override,match", [
    ("prune.ratio=0", "prune.ratio"),
    ("prune.ratio=1.0", "prune.ratio"),
    ("prune.ratio=1.5", "prune.ratio"),
    ("prune.ratio=-0.1", "prune.ratio"),
    ("prune.ratio=0.9", "fewer than its 8 GroupNorm groups"),
    ("prune.targets.include=[encoder.*]", "matches no Conv2d"),
    ("prune.targets.include=[conv_in]", "no prunable conv"),
    ("prune.targets.min_weight_params=1000000000", "no prunable conv"),
    ("prune.groupnorm=some", "prune.groupnorm"),
    ("prune.importance=magic", "prune.importance"),
])
def test_bad_input_clear_error_nothing_written(tmp_path, capsys, override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(Config, None, ["model.arch=tiny", override])
    out = tmp_path / "never"
    assert main(["prune", "--output", str(out), "model.arch=tiny", override]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_global_allocation_config_checks_capacity():
    cfg = load_config(Config, None, ["model.arch=tiny", "prune.allocation=global", "prune.ratio=0.5"])
    assert cfg.prune.allocation == "global"
    with pytest.raises(ConfigError, match="cannot be reached"):
        load_config(Config, None, ["model.arch=tiny", "prune.allocation=global", "prune.ratio=0.8", "prune.max_layer_ratio=0.5"])


def test_smoke_recipe_is_valid():
    from pathlib import Path

    cfg = load_config(Config, Path(__file__).resolve().parents[3] / "configs" / "smoke" / "prune.yaml")
    assert cfg.prune.importance == "taylor" and cfg.train.max_steps <= 20


def test_guidance_conditioned_student(tmp_path):
    """A guided-distillation student (time_cond_proj_dim, distill.json) is pruned and distilled
    with the same w embedding for teacher and student, and keeps its sampling recipe."""
    from diffusers import UNet2DConditionModel

    from pocketdiff.models import ModelConfig, build_pipeline, perturb_norm_affines, save_pipeline, unet_config

    pipe = build_pipeline(ModelConfig(arch="tiny"), captions=["a red circle", "a blue square"], resolution=32)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**unet_config("tiny", resolution=32, vae_factor=4), time_cond_proj_dim=32).eval()
    perturb_norm_affines(unet, 0)
    with torch.no_grad():
        unet.time_embedding.cond_proj.weight.normal_(0, 0.5)
    pipe.unet = unet
    student_dir = save_pipeline(pipe, tmp_path / "student")
    meta = {"pocketdiff_distill": 1, "num_inference_steps": 2, "guidance": {"conditioned": True, "w_min": 2.0, "w_max": 5.0, "scale": 4.0}}
    (student_dir / "distill.json").write_text(json.dumps(meta))

    out = tmp_path / "run"
    args = [a for a in SMALL if not a.startswith(("eval.steps", "prune.importance"))]
    assert main(["prune", "--output", str(out), *args, "prune.importance=taylor", f"model.pretrained={student_dir}",
                 "train.max_steps=1"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["model_kind"]["guidance_conditioned"] is True
    assert report["recovery"]["w_range"] == [2.0, 5.0]
    assert report["samples"]["steps"] == 2 and report["samples"]["guidance_scale"] == 4.0
    kept = json.loads((Path(report["pipeline_dir"]) / "distill.json").read_text())
    assert kept["num_inference_steps"] == 2 and kept["pruned_by"] == "pocketdiff prune"
    loaded = load_pruned_pipeline(report["pipeline_dir"])
    assert loaded.unet.config.time_cond_proj_dim == 32


def test_stream_scope_through_the_verb(tmp_path):
    """`prune.scope=all`: block-output (stream) channels go too; Taylor scores them, feature KD
    compares the student's narrower block outputs with the teacher's kept channels, and the
    report's parameter counts are those of the saved pipeline."""
    out = tmp_path / "run"
    assert main(["prune", "--output", str(out), *SMALL, "prune.scope=all", "train.max_steps=1"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["scope"] == "all"
    assert any(s["channels_after"] < s["channels_before"] for s in report["streams"])
    assert report["groups"] and report["recovery"]["last_loss_parts"]["feature_kd"] > 0
    assert report["params_after"] < 0.85 * report["params_before"]
    pipe = load_pruned_pipeline(report["pipeline_dir"])
    assert sum(p.numel() for p in pipe.unet.parameters()) == report["params_after"]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["feature_channels"]["mid_block"] is not None
