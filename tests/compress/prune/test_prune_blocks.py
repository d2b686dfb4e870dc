"""Block removal (`blocks:` in `pocketdiff prune`): presets, the slim UNet from the teacher's kept blocks,
stock diffusers loading it, the verb with and without channel pruning, resume, and bad input."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from diffusers import UNet2DConditionModel

from pocketdiff.cli import main
from pocketdiff.compress.prune import Config
from pocketdiff.compress.prune.blocks import BlocksSettings, check_unet_folder, remove_blocks
from pocketdiff.config import load_config
from pocketdiff.errors import ConfigError, PocketdiffError
from pocketdiff.models import count_params, perturb_norm_affines, unet_config
from pocketdiff.unet_blocks import PRESETS, removals, slim_unet_config

RUN = ["data.source=shapes", "data.shapes_count=16", "data.resolution=32", "model.arch=small",
       "recovery.feature_weight=0.1", "train.batch_size=4", "train.checkpoint_every=1", "train.log_every=1",
       "eval.probe_samples=4", "eval.metrics=false", "eval.prompts=[a red circle]", "eval.steps=2"]


def _small_teacher(seed: int = 0) -> UNet2DConditionModel:
    """Three stages (64, 128, 128), two layers per down stage: SD's layout in small."""
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**unet_config("small", resolution=32, vae_factor=4)).eval()
    perturb_norm_affines(unet, seed)
    return unet


def _meta(config: dict) -> UNet2DConditionModel:
    with torch.device("meta"):
        return UNet2DConditionModel(**config)


@pytest.mark.parametrize("preset,params_m,channels,mid", [
    ("base", 583.5, [320, 640, 1280, 1280], True),
    ("small", 485.8, [320, 640, 1280, 1280], False),
    ("tiny", 326.8, [320, 640, 1280], False),
])
def test_sd21_presets_are_bk_sdm_shapes(preset, params_m, channels, mid):
    conf = unet_config("sd21", "v_prediction")
    slim, _ = slim_unet_config(conf, removals(conf, preset))
    unet = _meta(slim)
    assert round(count_params(unet) / 1e6, 1) == params_m
    assert list(slim["block_out_channels"]) == channels and slim["layers_per_block"] == 1
    assert (unet.mid_block is not None) == mid and (slim.get("mid_block_type", "x") is not None) == mid
    if preset == "tiny":  # every remaining block has attention; the per-block head dims lose the last stage's
        assert slim["down_block_types"] == ["CrossAttnDownBlock2D"] * 3 and slim["up_block_types"] == ["CrossAttnUpBlock2D"] * 3
        assert slim["attention_head_dim"] == [5, 10, 20]
        assert unet.down_blocks[-1].downsamplers is None and unet.up_blocks[0].upsamplers is not None


def test_slim_unet_comes_from_the_kept_blocks_and_loads_in_stock_diffusers(tmp_path):
    teacher = _small_teacher()
    student, plan = remove_blocks(teacher, BlocksSettings(preset="tiny"))
    assert type(student) is UNet2DConditionModel and student.mid_block is None and len(student.down_blocks) == 2
    bm = plan["block_map"]
    # down stages keep their first layer; up stages their first and last (the narrower skip input)
    assert bm["down_blocks.1.resnets.0"] == "down_blocks.1.resnets.0"
    assert bm["up_blocks.0.resnets.1"] == "up_blocks.1.resnets.2" and bm["up_blocks.1.attentions.0"] == "up_blocks.2.attentions.0"
    assert "down_blocks.1.downsamplers" not in bm and bm["up_blocks.0.upsamplers"] == "up_blocks.1.upsamplers"
    s_state, t_state = student.state_dict(), teacher.state_dict()
    assert torch.equal(s_state["up_blocks.0.resnets.1.conv1.weight"], t_state["up_blocks.1.resnets.2.conv1.weight"])
    assert torch.equal(s_state["conv_out.weight"], t_state["conv_out.weight"])
    # the lost downsampler: feature KD matches the student's stage with the teacher stage's last layer
    assert plan["feature_pairs"]["down_blocks.1"] == "down_blocks.1.attentions.1"
    assert plan["feature_pairs"]["up_blocks.0"] == "up_blocks.1" and "mid_block" not in plan["feature_pairs"]
    student.save_pretrained(tmp_path / "unet")
    assert not (tmp_path / "unet" / "pruning.json").exists()
    loaded = UNet2DConditionModel.from_pretrained(tmp_path / "unet").eval()
    g = torch.Generator().manual_seed(0)
    x, emb = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 77, 128, generator=g)
    with torch.no_grad():
        a = student(x, 10, encoder_hidden_states=emb).sample
        b = loaded(x, 10, encoder_hidden_states=emb).sample
    # the saved weights load back to the bit (a copy: exact by construction) ...
    l_state = loaded.state_dict()
    assert l_state.keys() == s_state.keys() and all(torch.equal(l_state[k], s_state[k]) for k in s_state)
    # ... but two module instances need not sum in the same order (CPU kernels pick vector paths by alignment and by
    # the CPU: AVX-512, AVX2, default), so their outputs agree to float32 rounding, not to the bit: measured up to
    # 1.1e-6 at |out| <= 0.94 under all three capabilities; 1e-5 is ~10x that, while a wrong block moves it by ~1e-1
    assert a.shape == x.shape
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_explicit_list_and_per_stage_layers():
    conf = unet_config("small", resolution=32, vae_factor=4)
    slim, lmap = slim_unet_config(conf, ["down_blocks.2.resnets.1", "up_blocks.0.layers.1"])
    assert slim["layers_per_block"] == [2, 2, 1]
    unet = _meta(slim)
    assert [len(b.resnets) for b in unet.up_blocks] == [2, 3, 3]
    assert lmap["up_blocks.0.layers.1"] == "up_blocks.0.layers.2"


@pytest.mark.parametrize("remove,match", [
    (["down_blocks.0.layers.0", "down_blocks.0.layers.1", "up_blocks.2.layers.0", "up_blocks.2.layers.1"], "leaves down_blocks.0 empty"),
    (["down_blocks.1.layers.1"], "one layer more than its down stage"),
    (["down_blocks.2"], "go together"),
    (["down_blocks.1", "up_blocks.1"], "lowest resolution up"),
    (["down_blocks.0", "down_blocks.1", "down_blocks.2", "up_blocks.0", "up_blocks.1", "up_blocks.2"], "every stage"),
    (["side_blocks.0"], "not a block name"),
    (["down_blocks.7"], "has 3 down blocks"),
    (["down_blocks.1.layers.0", "up_blocks.1.layers.1"], "whose weight is"),  # the layer left takes other channels
])
def test_bad_block_lists(remove, match):
    with pytest.raises(PocketdiffError, match=match):
        remove_blocks(_small_teacher(), BlocksSettings(remove=remove))


@pytest.mark.parametrize("override", [
    "blocks.preset=huge",
    "blocks.remove=[down_blocks.0.layers.0]",  # the stage's up mirror keeps three layers
    "prune.ratio=0",  # nothing to do: no blocks, no channels
])
def test_bad_input_exit_2_one_line_nothing_written(tmp_path, capsys, override):
    args = ["model.arch=small", "data.resolution=32", override]
    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        load_config(Config, None, args)
    out = tmp_path / "never"
    assert main(["prune", "--output", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_tiny_preset_on_a_two_stage_teacher_is_refused_naming_the_block():
    """The tiny arch's two stages differ in width: the up stage left would take other channels."""
    with pytest.raises(ConfigError, match="blocks.*up_blocks.0.resnets.0"):
        load_config(Config, None, ["model.arch=tiny", "blocks.preset=tiny", "prune.ratio=0"])


@pytest.fixture(scope="module")
def blocks_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("blocks") / "run"
    assert main(["prune", "--output", str(out), *RUN, "blocks.preset=tiny", "prune.ratio=0", "train.max_steps=2"]) == 0
    return out


def test_block_removal_run_report_and_stock_folder(blocks_run):
    report = json.loads((blocks_run / "report.json").read_text())
    b = report["blocks"]
    assert b["preset"] == "tiny" and "mid_block" in b["removed"] and "down_blocks.2" in b["removed"]
    assert b["stages"]["before"]["down"] == [2, 2, 2] and b["stages"]["after"] == {
        "down": [1, 1], "up": [2, 2], "mid_block": False, "block_out_channels": [64, 128]}
    assert b["params"]["after"] == b["params"]["after_block_removal"] == report["params_after"] < report["params_before"]
    assert b["macs"]["after"] < b["macs"]["before"] and b["macs"]["after"] == report["macs"]["total_after"]
    rows = {c["name"]: c for c in report["macs"]["per_conv"]}
    assert rows["down_blocks.0.resnets.1.conv1"]["name_after"] is None and rows["down_blocks.0.resnets.1.conv1"]["params_after"] == 0
    assert rows["up_blocks.1.resnets.2.conv1"]["name_after"] == "up_blocks.0.resnets.1.conv1"
    assert report["recovery"]["last_loss_parts"]["feature_kd"] > 0
    unet_dir = blocks_run / "pipeline" / "unet"
    assert not (unet_dir / "pruning.json").exists()
    unet = UNet2DConditionModel.from_pretrained(unet_dir)
    assert unet.mid_block is None and count_params(unet) == report["params_after"]
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(blocks_run / "pipeline")  # stock, nothing of pocketdiff imported for it
    assert type(pipe.unet) is UNet2DConditionModel


def test_resume_with_another_preset_is_refused(blocks_run, capsys):
    before = (blocks_run / "config.yaml").read_text()
    assert main(["prune", "--output", str(blocks_run), "--resume", "latest", *RUN, "blocks.preset=small",
                 "prune.ratio=0", "train.max_steps=3"]) == 2
    assert "recipe changed" in capsys.readouterr().err
    assert (blocks_run / "config.yaml").read_text() == before


def test_blocks_and_stream_channel_pruning_in_one_run(tmp_path):
    out = tmp_path / "both"
    assert main(["prune", "--output", str(out), *RUN, "blocks.preset=small", "prune.ratio=0.3", "prune.scope=all",
                 "prune.importance=l1", "prune.round_to=4", "train.max_steps=1"]) == 0
    report = json.loads((out / "report.json").read_text())
    p = report["blocks"]["params"]
    assert p["before"] > p["after_block_removal"] > p["after"] == report["params_after"]
    assert 0.2 < report["targeted_conv_params_removed_fraction"] < 0.4
    assert all(not t.startswith("mid_block") for t in report["targeted_convs"])
    from pocketdiff.compress.prune import load_pruned_pipeline

    pipe = load_pruned_pipeline(report["pipeline_dir"])
    assert pipe.unet.mid_block is None and count_params(pipe.unet) == report["params_after"]


def test_folder_whose_config_and_weights_disagree_is_refused_before_work(tmp_path, capsys):
    student, _ = remove_blocks(_small_teacher(), BlocksSettings(preset="small"))
    student.save_pretrained(tmp_path / "unet")
    check_unet_folder(tmp_path / "unet", dict(student.config))  # as saved: fine
    conf = json.loads((tmp_path / "unet" / "config.json").read_text())
    conf["layers_per_block"] = 2  # the folder says two layers per stage, its weights hold one
    bad = tmp_path / "pipe"
    from pocketdiff.models import ModelConfig, build_pipeline, save_pipeline

    pipe = build_pipeline(ModelConfig(arch="small"), resolution=32)
    pipe.unet = student
    save_pipeline(pipe, bad)
    (bad / "unet" / "config.json").write_text(json.dumps(conf))
    out = tmp_path / "never"
    assert main(["prune", "--output", str(out), f"model.pretrained={bad}", "data.source=shapes", "data.resolution=32",
                 "blocks.preset=tiny", "prune.ratio=0"]) == 2
    err = capsys.readouterr().err
    assert "config.json: does not match its weights" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
    shutil.rmtree(bad)


def test_every_preset_keeps_the_sd15_layout_buildable():
    conf = unet_config("sd15")
    for preset in PRESETS:
        slim, _ = slim_unet_config(conf, removals(conf, preset))
        _meta(slim)


@pytest.mark.parametrize("preset", PRESETS)
def test_sd21_recipes_validate_on_the_sd21_shapes(preset):
    """The SD recipes against a built SD-2.1-base UNet's shapes (meta device): the blocks and their init shapes."""
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[3] / "configs" / "sd21" / f"prune_blocks_{preset}.yaml"
    cfg = load_config(Config, recipe, ["model.pretrained=null", "model.arch=sd21", "data.source=shapes"])
    assert cfg.blocks.preset == preset and cfg.prune.ratio == 0 and cfg.recovery.feature_weight > 0
    smoke = load_config(Config, recipe.parents[1] / "smoke" / "prune-blocks.yaml")
    assert smoke.blocks.preset == "small"
