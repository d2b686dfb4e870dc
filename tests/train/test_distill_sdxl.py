"""`pocketdiff distill` on an SDXL-shaped teacher (tiny_xl: two text encoders, pooled embeddings, time ids),
progressive and consistency, end to end with the round evaluation: each round folder is a stock
StableDiffusionXLPipeline (text_encoder_2 / tokenizer_2 shared from the teacher) that samples at its step count.
Smoke sizes: a couple of steps a round."""
import json

import pytest
import torch

from pocketdiff.config import load_config
from pocketdiff.train import distill

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def xl_teacher(save_shapes_teacher):
    return save_shapes_teacher(arch="tiny_xl")  # tests/train/conftest.py


COMMON = ["data.source=shapes", "data.shapes_count=16", "data.resolution=32", "guidance.embed_dim=16",
          "guidance.w_min=1", "guidance.w_max=3", "guidance.scale=2", "eval.prompts=[a red circle]", "eval.num_images=2"]
PROGRESSIVE = ["guided.train.max_steps=1", "guided.train.batch_size=2", "progressive.start_steps=4", "progressive.final_steps=2",
               "progressive.train.max_steps=1", "progressive.train.batch_size=2", "eval.reference_steps=4"]
CONSISTENCY = ["method=consistency", "consistency.solver_steps=10", "consistency.sample_steps=[1,2]",
               "consistency.train.max_steps=2", "consistency.train.batch_size=2", "eval.reference_steps=4"]


def _stock_sample(folder, steps):
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    assert pipe.text_encoder_2 is not None and pipe.tokenizer_2 is not None
    image = pipe("a red circle", num_inference_steps=steps, guidance_scale=2.0, output_type="np").images[0]
    assert image.shape == (32, 32, 3) and bool(torch.isfinite(torch.from_numpy(image)).all())
    return pipe


@pytest.mark.parametrize("method, extra", [("progressive", PROGRESSIVE), ("consistency", CONSISTENCY)])
def test_distill_an_sdxl_teacher(xl_teacher, tmp_path, method, extra):
    cfg = load_config(distill.Config, None, [f"model.pretrained={xl_teacher}", *COMMON, *extra])
    report = distill.run(cfg, tmp_path)
    rounds = report["rounds"]
    assert rounds and all(r.get("pipeline_dir") for r in rounds), rounds
    last = rounds[-1]
    assert "eval" in last  # the round's evaluation ran (it rebuilt the pipeline of the teacher's family)
    folder = tmp_path / last["pipeline_dir"]
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline" and "text_encoder_2" in index
    pipe = _stock_sample(folder, 2)
    assert pipe.unet.config.addition_embed_type == "text_time"
    # the unchanged towers are the teacher's, file for file (hardlinked or copied)
    for name in ("text_encoder_2", "tokenizer_2"):
        ours = sorted(p.name for p in (folder / name).iterdir())
        assert ours == sorted(p.name for p in (xl_teacher / name).iterdir()), name
