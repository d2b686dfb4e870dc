"""The pruned UNet format: stock config + pruning.json + safetensors, our loader, pipeline folders."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pocketdiff.compress.prune.verb import PruneSettings, load_pruned_pipeline, load_pruned_unet, prune_unet
from pocketdiff.compress.prune.model import PrunedUNet2DConditionModel, is_pruned_pipeline
from pocketdiff.errors import PocketdiffError
from pocketdiff.models import ModelConfig, build_pipeline, perturb_norm_affines, save_pipeline

CAPTIONS = ["a red circle", "a blue square", "a green star"]


@pytest.fixture(scope="module")
def pruned_pipeline(tmp_path_factory):
    pipe = build_pipeline(ModelConfig(arch="tiny"), captions=CAPTIONS, resolution=32)
    perturb_norm_affines(pipe.unet, 0)
    pruned, plan = prune_unet(pipe.unet, PruneSettings(ratio=0.3, importance="l1", groupnorm="per_group", round_to=8))
    pipe.unet = pruned
    folder = save_pipeline(pipe, tmp_path_factory.mktemp("pruned") / "pipeline")
    return pipe, folder


def _io():
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 4, 8, 8, generator=g), torch.tensor([300]), torch.randn(1, 77, 64, generator=g)


def _out(unet):
    x, t, e = _io()
    with torch.no_grad():
        return unet(x, t, encoder_hidden_states=e).sample


def test_folder_layout_no_pickles(pruned_pipeline):
    _, folder = pruned_pipeline
    unet_dir = folder / "unet"
    names = sorted(p.name for p in unet_dir.iterdir())
    assert names == ["config.json", "diffusion_pytorch_model.safetensors", "pruning.json"]
    assert not list(folder.rglob("*.bin")) and not list(folder.rglob("*.pt")) and not list(folder.rglob("*.pkl"))
    spec = json.loads((unet_dir / "pruning.json").read_text())
    assert spec["format"] == "pocketdiff-pruned-unet" and spec["version"] == 1
    assert spec["modules"]["up_blocks.0.resnets.0.norm2"]["type"] == "GroupNorm"
    config = json.loads((unet_dir / "config.json").read_text())
    assert list(config["block_out_channels"]) == [32, 64]  # the stock architecture
    index = json.loads((folder / "model_index.json").read_text())
    assert index["unet"] == ["pocketdiff.compress.prune.model", "PrunedUNet2DConditionModel"]
    assert is_pruned_pipeline(folder)


def test_load_pruned_unet_round_trip(pruned_pipeline):
    pipe, folder = pruned_pipeline
    loaded = load_pruned_unet(folder / "unet")
    assert isinstance(loaded, PrunedUNet2DConditionModel)
    torch.testing.assert_close(_out(loaded), _out(pipe.unet), rtol=0, atol=1e-5)
    half = load_pruned_unet(folder / "unet", torch_dtype=torch.bfloat16)
    assert next(half.parameters()).dtype == torch.bfloat16


def test_load_pruned_pipeline_and_stock_diffusers(pruned_pipeline):
    from diffusers import StableDiffusionPipeline

    pipe, folder = pruned_pipeline
    loaded = load_pruned_pipeline(folder)
    assert isinstance(loaded.unet, PrunedUNet2DConditionModel)
    torch.testing.assert_close(_out(loaded.unet), _out(pipe.unet), rtol=0, atol=1e-5)
    # stock diffusers loads the folder once the pocketdiff module is imported (it is, above)
    stock = StableDiffusionPipeline.from_pretrained(str(folder), safety_checker=None, requires_safety_checker=False,
                                                    local_files_only=True)
    torch.testing.assert_close(_out(stock.unet), _out(pipe.unet), rtol=0, atol=1e-5)
    # a stock (unpruned) folder loads through the same hook
    plain = build_pipeline(ModelConfig(arch="tiny"), captions=CAPTIONS, resolution=32)
    plain_dir = save_pipeline(plain, folder.parent / "plain")
    assert not is_pruned_pipeline(plain_dir)
    assert not isinstance(load_pruned_pipeline(plain_dir).unet, PrunedUNet2DConditionModel)


def test_loader_refuses_bad_folders(pruned_pipeline, tmp_path):
    _, folder = pruned_pipeline
    bad = tmp_path / "unet"
    shutil.copytree(folder / "unet", bad)
    (bad / "pruning.json").unlink()
    with pytest.raises(PocketdiffError, match="pruning.json"):
        load_pruned_unet(bad)
    shutil.copy(folder / "unet" / "pruning.json", bad / "pruning.json")
    weights = load_file(str(bad / "diffusion_pytorch_model.safetensors"))
    name = "up_blocks.0.resnets.0.conv1.weight"
    weights[name] = torch.zeros(weights[name].shape[0] + 8, *weights[name].shape[1:])
    save_file(weights, str(bad / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(PocketdiffError, match="shape mismatch"):
        load_pruned_unet(bad)
    (bad / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(PocketdiffError, match="safetensors"):
        load_pruned_unet(bad)
    spec = json.loads((folder / "unet" / "pruning.json").read_text())
    spec["format"] = "something-else"
    (bad / "pruning.json").write_text(json.dumps(spec))
    shutil.copy(folder / "unet" / "diffusion_pytorch_model.safetensors", bad)
    with pytest.raises(PocketdiffError, match="format"):
        load_pruned_unet(bad)
