"""`pocketdiff prune` on an SDXL-shaped model (tiny_xl: two text encoders, pooled embeddings, time ids): channel
pruning and block removal (the `small` preset drops the mid block) with a recovery step each; the output folder
loads in stock StableDiffusionXLPipeline (the pruned UNet class resolved through pocketdiff's module, as for SD)
and samples."""
import json

import pytest

from pocketdiff.cli import run_stage

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

FAST = ["model.pretrained=null", "model.arch=tiny_xl", "data.shapes_count=16", "train.max_steps=1", "train.batch_size=4",
        "eval.probe_samples=4", "eval.prompts=[a red circle]", "eval.steps=2"]


@pytest.mark.parametrize("config, extra, check", [
    ("configs/smoke/prune.yaml", ["prune.taylor.samples=4", "prune.taylor.batch_size=4"], "channels"),
    ("configs/smoke/prune-blocks.yaml", [], "blocks"),
])
def test_pruned_sdxl_loads_in_stock_pipeline(tmp_path, config, extra, check):
    import pocketdiff.compress.prune.model  # noqa: F401  (lets diffusers resolve the pruned UNet class)
    from diffusers import StableDiffusionXLPipeline

    report = run_stage("prune", config, tmp_path / "o", FAST + extra)
    folder = tmp_path / "o" / "pipeline"
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline" and index["text_encoder_2"][1] == "CLIPTextModelWithProjection"
    pipe = StableDiffusionXLPipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    assert pipe.unet.config.addition_embed_type == "text_time"
    assert report["params_after"] < report["params_before"]
    if check == "blocks":
        assert pipe.unet.config.mid_block_type is None and pipe.unet.mid_block is None
    image = pipe("a red circle", num_inference_steps=2, guidance_scale=2.0, output_type="np").images[0]
    assert image.shape == (32, 32, 3)
