"""train-teacher end to end on tiny settings: outputs, bit-exact resume, bad input."""
import json
import subprocess
import sys

import pytest
import torch
from diffusers import StableDiffusionPipeline
from safetensors.torch import load_file

from pocketdiff.cli import run_stage

TINY = ["data.shapes_count=16", "data.resolution=32", "vae.steps=2", "vae.batch_size=4", "train.batch_size=4",
        "train.checkpoint_every=2", "train.log_every=1", "samples.steps=2", "train.ema_decay=0.9"]
SMOKE = "configs/smoke/train-teacher.yaml"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def unet_weights(out):
    return load_file(str(out / "pipeline" / "unet" / "diffusion_pytorch_model.safetensors"))


def test_resume_after_interruption_equals_uninterrupted_run(tmp_path):
    full = run_stage("train-teacher", SMOKE, tmp_path / "full", TINY + ["train.max_steps=4"])
    # "interrupted" after 2 steps: then --resume latest continues the same output folder
    run_stage("train-teacher", SMOKE, tmp_path / "cut", TINY + ["train.max_steps=2"])
    resumed = run_stage("train-teacher", SMOKE, tmp_path / "cut", TINY + ["train.max_steps=4"], resume="latest")
    a, b = unet_weights(tmp_path / "full"), unet_weights(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert full["losses"] == resumed["losses"] and full["final_loss"] == resumed["final_loss"]


def test_outputs_are_a_stock_pipeline_with_report(tmp_path):
    report = run_stage("train-teacher", SMOKE, tmp_path / "o", TINY + ["train.max_steps=2"])
    for key in ("pipeline_dir", "steps", "final_loss"):
        assert key in report
    assert report["steps"] == 2
    on_disk = json.loads((tmp_path / "o" / "report.json").read_text())  # run_stage writes it as the CLI does
    assert on_disk["pipeline_dir"] == report["pipeline_dir"] and on_disk["pipeline_dir"].endswith("pipeline")
    pipe = StableDiffusionPipeline.from_pretrained(report["pipeline_dir"], safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    image = pipe("a large red circle in the center", num_inference_steps=2, output_type="np").images[0]
    assert image.shape == (32, 32, 3)
    assert (tmp_path / "o" / "samples.png").is_file() and (tmp_path / "o" / "loss.png").is_file()


@pytest.mark.parametrize("overrides, culprit", [
    (["data.source=imagefolder", "data.path=/nonexistent/folder"], "/nonexistent/folder"),
    (["data.resolution=30"], "data.resolution"),
    (["train.lr=fast"], "train.lr"),
    (["train.no_such_key=1"], "train.no_such_key"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, overrides, culprit):
    r = subprocess.run([sys.executable, "-m", "pocketdiff", "train-teacher", "--config", SMOKE, "--output",
                        str(tmp_path / "o"), *overrides], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr[-2000:]
    err = [l for l in r.stderr.strip().splitlines() if l.startswith("error:")]
    assert len(err) == 1 and culprit in err[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_dataset_without_caption_column_is_named(tmp_path):
    from PIL import Image

    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(4):
        Image.new("RGB", (32, 32), "red").save(folder / f"{i}.png")
    (folder / "metadata.jsonl").write_text("".join(json.dumps({"file_name": f"{i}.png", "label": "x"}) + "\n" for i in range(4)))
    r = subprocess.run([sys.executable, "-m", "pocketdiff", "train-teacher", "--config", SMOKE, "--output", str(tmp_path / "o"),
                        "data.source=imagefolder", f"data.path={folder}", "data.caption_column=caption"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "caption" in r.stderr.strip().splitlines()[-1]


def test_sdxl_shaped_teacher_trains_two_text_towers(tmp_path):
    """tiny_xl (two CLIP towers, pooled embeddings, time ids) on the shapes data: the conditioning goes through
    pocketdiff.conditioning, both text encoders get gradients (their weights move), and the folder is a stock
    StableDiffusionXLPipeline."""
    from diffusers import StableDiffusionXLPipeline

    from pocketdiff.models import ModelConfig, build_pipeline

    report = run_stage("train-teacher", SMOKE, tmp_path / "xl", TINY + ["train.max_steps=2", "model.arch=tiny_xl",
                                                                         "samples.prompts=[a red circle]"])
    assert report["steps"] == 2 and report["final_loss"] == report["final_loss"]  # finite (NaN != NaN)
    pipe = StableDiffusionXLPipeline.from_pretrained(report["pipeline_dir"])
    pipe.set_progress_bar_config(disable=True)
    start = build_pipeline(ModelConfig(arch="tiny_xl", vocab_size=1024), resolution=32)  # train-teacher's start (seed 0)
    for name in ("text_encoder", "text_encoder_2"):  # both towers trained: their weights moved
        trained, initial = getattr(pipe, name).state_dict(), getattr(start, name).state_dict()
        assert trained.keys() == initial.keys()
        assert any(not torch.equal(trained[k], initial[k]) for k in trained if k.endswith("weight")), name
    assert report["params"]["text_encoder"] == sum(p.numel() for n in ("text_encoder", "text_encoder_2")
                                                   for p in getattr(pipe, n).parameters())
    image = pipe("a red circle", num_inference_steps=2, guidance_scale=2.0, output_type="np").images[0]
    assert image.shape == (32, 32, 3)
