"""`vae_tiling.scheme: one_pass` in `pocketdiff export`: a norm-free decoder (folded here, and one from
`distill-decoder` as model.vae), its manifest block and checks, the runner's one-pass decode; model.vae
folders that do not match the pipeline's VAE are refused."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import yaml

from pocketdiff.cli import main as cli_main
from pocketdiff.errors import ConfigError, PocketdiffError

TEACHER = "pocketdiff:shapes-teacher"
TILED = ("vae_decoder_head", "vae_up_tile")


def _export(root, name, tiling, model=None, **extra):
    cfg = {**extra, "seed": 0, "model": model or {"pretrained": TEACHER}, "weights": "fp16", "guidance": "cfg", "steps": 2,
           "components": ["vae_decoder"], "verify": {"delegate": False}, "fp16_scan": {"enabled": False},
           "vae_tiling": {"enabled": True, "scheme": "one_pass", "passes": 1, **tiling}}
    (root / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    out = root / name
    rc = cli_main(["export", "--config", str(root / f"{name}.yaml"), "--output", str(out)])
    return rc, out


@pytest.fixture(scope="module")
def one_pass(tmp_path_factory):
    root = tmp_path_factory.mktemp("onepass")
    rc, out = _export(root, "bundle", {"tile": 6, "overlap": 2, "margin": 1, "fold_norms": True, "min_psnr_db": 30.0})
    assert rc == 0
    return {"out": out, "report": json.loads((out / "report.json").read_text()), "manifest": json.loads((out / "manifest.json").read_text())}


def test_one_pass_bundle_block_io_and_parity(one_pass):
    man, rep = one_pass["manifest"], one_pass["report"]
    assert set(TILED) <= set(man["components"]) and "vae_decoder" not in man["components"]
    block = man["vae_tiling"]
    assert {k: block[k] for k in ("tile", "overlap", "margin", "scheme", "passes", "factor")} == {
        "tile": 6, "overlap": 2, "margin": 1, "scheme": "one_pass", "passes": 1, "factor": 4}
    up = man["components"]["vae_up_tile"]
    assert [i["name"] for i in up["inputs"]] == ["features"] and [o["shape"] for o in up["outputs"]] == [[1, 3, 24, 24]]
    assert rep["vae_tiling"]["up_tile_calls"] == 4  # 2 x 2 tiles, once each
    assert rep["vae_tiling"]["psnr_db"] >= 30.0 and rep["vae_tiling"]["fold"]["folded_norms"] > 0


def test_manifest_check_reads_one_pass_blocks(one_pass):
    from pocketdiff.runtime.manifest_check import manifest_problems

    man = one_pass["manifest"]
    assert manifest_problems(one_pass["out"], man, need=TILED) == []
    bad = json.loads(json.dumps(man))
    bad["vae_tiling"]["passes"] = 3
    bad["vae_tiling"]["tile"] = 5
    wheres = {p.where for p in manifest_problems(one_pass["out"], bad, need=TILED, files=False)}
    assert "vae_tiling.passes" in wheres and "components.vae_up_tile.inputs.features" in wheres


def test_group_norm_decoder_without_fold_is_refused(tmp_path, capsys):
    rc, _ = _export(tmp_path, "refused", {"tile": 6, "overlap": 2, "margin": 1})
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "fold_norms" in err[-1] and "distill-decoder" in err[-1]


def test_tile_over_the_profile_names_the_largest_that_fits(tmp_path, capsys):
    rc, _ = _export(tmp_path, "big", {"tile": 8, "overlap": 0, "fold_norms": True}, device_profile={"max_tensor_mb": 0.05})
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and re.search(r"vae_tiling.tile: 8 latents gives a [\d.]+ MB tensor .* tile \d+ is the largest that meets it", last), last


def test_one_pass_needs_one_pass():
    from pocketdiff.export.verb import VaeTilingConfig

    with pytest.raises(ConfigError, match="vae_tiling.passes"):
        VaeTilingConfig(enabled=True, scheme="one_pass", passes=2)


def test_model_vae_with_another_factor_is_refused(tmp_path):
    from diffusers import AutoencoderKL

    from pocketdiff.models import ModelConfig, load_or_build

    two = AutoencoderKL(block_out_channels=(32, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8)
    two.save_pretrained(str(tmp_path / "vae2"))
    with pytest.raises(PocketdiffError, match=r"scale factor 2, the VAE of .* with 4"):
        load_or_build(ModelConfig(pretrained=TEACHER, vae=str(tmp_path / "vae2")))
    three = AutoencoderKL(block_out_channels=(32, 32, 32), down_block_types=("DownEncoderBlock2D",) * 3,
                          up_block_types=("UpDecoderBlock2D",) * 3, latent_channels=3, norm_num_groups=8)
    three.save_pretrained(str(tmp_path / "vae3"))
    with pytest.raises(PocketdiffError, match=r"3 latent channels, the VAE of .* 4"):
        load_or_build(ModelConfig(pretrained=TEACHER, vae=str(tmp_path / "vae3")))


def test_random_weight_stand_ins_refuse_a_real_checkpoint():
    """perturb_norms (as the SD configs set it) on model.pretrained would change a user's norm weights."""
    from pocketdiff.export.verb import Config
    from pocketdiff.models import ModelConfig

    with pytest.raises(ConfigError, match="perturb_norms"):
        Config(model=ModelConfig(pretrained="some/checkpoint"), perturb_norms=True)
    assert Config(model=ModelConfig(pretrained="some/checkpoint")).perturb_norms is False


def test_export_refuses_more_lcm_steps_than_the_students_grid(tmp_path, capsys):
    """A consistency (LCM) student exports (tests/export/test_lcm_export.py) at 1 to original_inference_steps
    steps; more is refused before any conversion, naming `steps`."""
    from diffusers import LCMScheduler

    from pocketdiff.models import ModelConfig, load_or_build, save_pipeline

    pipe = load_or_build(ModelConfig(pretrained=TEACHER))
    pipe.scheduler = LCMScheduler.from_config(pipe.scheduler.config, original_inference_steps=8)
    save_pipeline(pipe, tmp_path / "lcm")
    cfg_path = tmp_path / "export.yaml"
    cfg_path.write_text(yaml.safe_dump({"seed": 0, "model": {"pretrained": str(tmp_path / "lcm")}, "weights": "fp16",
                                        "guidance": "cfg", "steps": 9}))
    assert cli_main(["export", "--config", str(cfg_path), "--output", str(tmp_path / "bundle")]) == 2
    err = capsys.readouterr().err
    assert "steps" in err and "8-point grid" in err
    assert not (tmp_path / "bundle" / "manifest.json").exists()


def test_up_parts_are_checked_before_any_work():
    from pocketdiff.export.verb import VaeTilingConfig

    with pytest.raises(ConfigError, match="vae_tiling.up_parts"):
        VaeTilingConfig(enabled=True, scheme="one_pass", passes=1, up_parts=0)
    with pytest.raises(ConfigError, match="vae_tiling.up_parts: 2 parts need scheme one_pass"):
        VaeTilingConfig(enabled=True, scheme="control_variate", passes=3, up_parts=2)


def test_manifest_check_reads_an_up_path_in_parts():
    """The smoke twin exported with vae_tiling.up_parts=2 (tests/web/smoke_bundle_tiled_parts): its block passes;
    a components list out of order, parts under an iterated scheme, and a part whose input is not its
    predecessor's output are each one problem naming the key."""
    from pathlib import Path

    from pocketdiff.runtime.manifest_check import decoder_components, manifest_problems

    bundle = Path(__file__).resolve().parents[1] / "web" / "smoke_bundle_tiled_parts"
    man = json.loads((bundle / "manifest.json").read_text())
    parts = ("vae_decoder_head", "vae_up_tile.0", "vae_up_tile.1")
    assert decoder_components(man) == parts
    assert manifest_problems(bundle, man, need=parts, files=False) == []

    def wheres(edit) -> set:
        bad = json.loads(json.dumps(man))
        edit(bad)
        return {p.where for p in manifest_problems(bundle, bad, need=parts, files=False)}

    assert "vae_tiling.components" in wheres(lambda m: m["vae_tiling"].update(components=[parts[0], parts[2], parts[1]]))
    assert "vae_tiling.components" in wheres(lambda m: m["vae_tiling"].update(scheme="control_variate", norms=[4, 8], passes=3))
    assert "components.vae_up_tile.1.inputs.hidden" in wheres(
        lambda m: m["components"]["vae_up_tile.1"]["inputs"][0].update(shape=[1, 64, 6, 6]))
