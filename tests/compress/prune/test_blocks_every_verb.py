"""A block-removed UNet (no mid block, as `blocks.preset: small` / `tiny` leave it) through the other verbs:
distill (progressive and consistency), calibrate and evaluate take its stock pipeline folder. Smoke-sized
(the tiny arch at 32 px, a few steps each). The chunked export and run-bundle of such UNets:
tests/export/test_unet_chunks_blocks.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import UNet2DConditionModel

from pocketdiff.cli import main
from pocketdiff.compress.prune.blocks import BlocksSettings, remove_blocks
from pocketdiff.models import ModelConfig, build_pipeline, perturb_norm_affines, save_pipeline

PROMPTS = ["a red circle", "a blue square", "a green triangle", "a yellow star"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def slim_dir(tmp_path_factory):
    """The tiny arch's pipeline with its UNet through prune's block removal (`small`: the mid block gone)."""
    from pocketdiff.config import DataConfig
    from pocketdiff.data import load_captions

    captions = load_captions(DataConfig(source="shapes", shapes_count=16, resolution=32))
    pipe = build_pipeline(ModelConfig(arch="tiny"), captions=captions + PROMPTS, resolution=32)
    for i, comp in enumerate((pipe.unet, pipe.text_encoder, pipe.vae)):
        perturb_norm_affines(comp, i, scale=0.3)
    pipe.unet, plan = remove_blocks(pipe.unet, BlocksSettings(preset="small"))
    assert plan["removed"] == ["mid_block"]
    folder = save_pipeline(pipe, tmp_path_factory.mktemp("slim") / "pipeline")
    assert UNet2DConditionModel.from_pretrained(folder / "unet").mid_block is None
    return folder


@pytest.fixture(scope="module")
def tiny_clip_dir(tmp_path_factory):
    """A random tiny CLIP folder (FD features and CLIP score for evaluate)."""
    evaluate = pytest.importorskip("pocketdiff.evaluate.train_clip")
    from pocketdiff.config import DataConfig
    from pocketdiff.data import load_captions
    from pocketdiff.tokenizer import build_clip_tokenizer

    tok = build_clip_tokenizer(load_captions(DataConfig(source="shapes", shapes_count=64, resolution=32)), vocab_size=560,
                               model_max_length=16)
    mcfg = evaluate.ClipModelConfig(image_size=32, patch_size=8, vision_width=32, vision_layers=1, vision_heads=2,
                                    text_width=32, text_layers=1, text_heads=2, max_length=16, projection_dim=16, vocab_size=560)
    model, processor = evaluate.build_clip(mcfg, tok, seed=0)
    out = tmp_path_factory.mktemp("clip") / "tiny-clip"
    evaluate.save_clip(model, processor, out, {"domain": "tinytest", "label": "tinytest-CLIP"})
    return out


def _no_mid(folder) -> bool:
    return json.loads((folder / "unet" / "config.json").read_text()).get("mid_block_type", "x") is None


DISTILL = ["data.source=shapes", "data.shapes_count=16", "data.resolution=32", "guidance.embed_dim=16", "guidance.w_min=1",
           "guidance.w_max=3", "guidance.scale=2"]


def test_progressive_distillation_of_a_unet_without_mid_block(slim_dir, tmp_path):
    out = tmp_path / "pd"
    assert main(["distill", "--output", str(out), f"model.pretrained={slim_dir}", *DISTILL,
                 "guided.train.max_steps=1", "guided.train.batch_size=2", "progressive.start_steps=4", "progressive.final_steps=2",
                 "progressive.train.max_steps=1", "progressive.train.batch_size=2", "eval.enabled=false"]) == 0
    report = json.loads((out / "report.json").read_text())
    final = Path(report["pipeline_dir"])
    assert report["final_steps"] == 2 and _no_mid(final)
    assert UNet2DConditionModel.from_pretrained(final / "unet").config.time_cond_proj_dim == 16


def test_consistency_distillation_of_a_unet_without_mid_block(slim_dir, tmp_path):
    out = tmp_path / "cd"
    assert main(["distill", "--output", str(out), f"model.pretrained={slim_dir}", *DISTILL, "method=consistency",
                 "student_prediction_type=teacher", "consistency.solver_steps=10", "consistency.sample_steps=[1,2]",
                 "consistency.train.max_steps=2", "consistency.train.batch_size=2", "eval.enabled=false"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert _no_mid(Path(report["pipeline_dir"]))


def test_calibrate_a_unet_without_mid_block(slim_dir, tmp_path):
    from pocketdiff.compress.quant.calibrate_outputs import load_quantized_pipeline

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"device: cpu\nmodel: {{pretrained: {slim_dir}}}\n"
                   f"calib: {{prompts: {json.dumps(PROMPTS)}, num_prompts: 3, holdout_prompts: 1, steps: 2, guidance_scale: 2.0}}\n"
                   "recon: {iters: 4, batch_size: 8, lr: 2.0e-2}\noutput: {samples: 0}\n")
    out = tmp_path / "w8"
    assert main(["calibrate", "--config", str(cfg), "--output", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    names = [b["name"] for b in report["blocks"]]
    assert names and not any(n.startswith("mid_block") for n in names)
    assert any(n.startswith("up_blocks.0") for n in names)
    pipe = load_quantized_pipeline(out)
    assert pipe.unet.mid_block is None
    x = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        y = pipe.unet(x, 10, encoder_hidden_states=torch.randn(1, 77, 64)).sample
    assert torch.isfinite(y).all()


def test_evaluate_a_unet_without_mid_block(slim_dir, tmp_path, tiny_clip_dir):
    cfg = tmp_path / "e.yaml"
    cfg.write_text(f"models:\n  - {{name: slim, path: {slim_dir}}}\n"
                   "reference: {source: shapes, shapes_count: 16, resolution: 32}\nprompts: {from_reference: 4}\n"
                   f"metrics: {{features: clip, clip: {tiny_clip_dir}, cache_dir: {tmp_path / 'cache'}, reference_clip_samples: 4}}\n"
                   "steps: [2]\nseeds: [0]\nguidance_scale: 2.0\ngrid_prompts: 2\n")
    out = tmp_path / "eval"
    assert main(["evaluate", "--config", str(cfg), "--output", str(out)]) == 0
    (res,) = json.loads((out / "report.json").read_text())["results"]
    assert res["model"] == "slim" and res["fd"] > 0 and res["num_samples"] == 4
