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


def _xl_config(arch: str, resolution: int, **extra) -> dict:
    from pocketdiff.models import ModelConfig, built_unet_config

    return {**built_unet_config(ModelConfig(arch=arch), resolution, latent_channels=4, vae_factor=8 if arch == "sdxl" else 4), **extra}


@pytest.mark.parametrize("preset, depth, mid, billions", [("koala_1b", 6, True, 1.161), ("koala_700m", 5, False, 0.783)])
def test_koala_presets_size_sdxl_as_koala(preset, depth, mid, billions):
    """On SDXL's shapes (meta device): one layer per down stage, the lowest stage's transformers cut 10 -> 6 (1 B) or
    10 -> 5 and no mid block (700 M): KOALA-1B's 1.16 B and KOALA-700M's 0.78 B UNets."""
    from pocketdiff.compress.prune.blocks import BlocksSettings, precheck_blocks

    conf = _xl_config("sdxl", 1024)
    slim = precheck_blocks(conf, BlocksSettings(preset=preset))  # the teacher's shapes checked for every kept tensor
    assert list(slim.config.transformer_layers_per_block) == [1, 2, depth] and slim.config.layers_per_block == 1
    assert (slim.mid_block is not None) == mid
    assert abs(sum(p.numel() for p in slim.parameters()) / 1e9 - billions) < 0.005


def test_a_transformer_depth_cut_keeps_the_first_blocks_weights():
    """A tiny SDXL-shaped UNet with two transformer blocks in its lowest stage: koala_700m keeps the first (its weights
    the teacher's, by name), in the down stage and its mirrored up stage; a cut that is not a tail is refused."""
    import torch
    from diffusers import UNet2DConditionModel

    from pocketdiff.compress.prune.blocks import BlocksSettings, remove_blocks
    from pocketdiff.errors import PocketdiffError
    from pocketdiff.unet_blocks import slim_unet_config

    torch.manual_seed(0)
    teacher = UNet2DConditionModel(**_xl_config("tiny_xl", 32, transformer_layers_per_block=(1, 2))).eval()
    student, plan = remove_blocks(teacher, BlocksSettings(preset="koala_700m"))
    assert list(student.config.transformer_layers_per_block) == [1, 1] and student.mid_block is None
    assert len(student.down_blocks[1].attentions[0].transformer_blocks) == 1
    assert len(student.up_blocks[0].attentions[0].transformer_blocks) == 1
    s, t = student.state_dict(), teacher.state_dict()
    key = "down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.weight"
    assert torch.equal(s[key], t[key]) and "down_blocks.1.transformer_blocks.1" in " ".join(plan["removed"])
    with pytest.raises(PocketdiffError, match="only a tail can go"):
        slim_unet_config(dict(teacher.config), ["down_blocks.1.transformer_blocks.0"], "blocks.remove")
