"""The SDXL family in pocketdiff.models: a tiny SDXL-shaped pipeline built from config (arch tiny_xl), saved and
loaded (stock StableDiffusionXLPipeline too), and the folders refused before any weights load."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionXLPipeline
from transformers import CLIPTextModel, CLIPTextModelWithProjection

from pocketdiff.conditioning import encode_conditioning, family_of
from pocketdiff.errors import PocketdiffError
from pocketdiff.models import (
    ModelConfig,
    build_pipeline,
    check_resolution,
    load_or_build,
    load_pipeline,
    precheck_resolution,
    save_pipeline,
    text_encoder_config,
    unet_config,
    vae_config,
)

from tiny_sdxl import SDXL_CAPTIONS as CAPTIONS  # tests/tiny_sdxl.py: the SDXL tests' captions

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def xl():
    return build_pipeline(ModelConfig(arch="tiny_xl"), captions=CAPTIONS)


@pytest.fixture(scope="module")
def saved(xl, tmp_path_factory) -> Path:
    return save_pipeline(xl, tmp_path_factory.mktemp("tiny_xl") / "pipe")


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _copy(saved: Path, tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    shutil.copytree(saved, out)
    return out


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_tiny_xl_is_sdxl_shaped(xl):
    assert isinstance(xl, StableDiffusionXLPipeline)
    assert type(xl.text_encoder) is CLIPTextModel and type(xl.text_encoder_2) is CLIPTextModelWithProjection
    u, t1, t2 = xl.unet.config, xl.text_encoder.config, xl.text_encoder_2.config
    assert u.addition_embed_type == "text_time" and family_of(xl.unet).name == "sdxl"
    assert u.cross_attention_dim == t1.hidden_size + t2.hidden_size
    assert u.projection_class_embeddings_input_dim == t2.projection_dim + 6 * u.addition_time_embed_dim
    assert xl.config.force_zeros_for_empty_prompt is False  # the unconditional prompt is encoded, as our runners do
    cond = encode_conditioning(xl, CAPTIONS[:2])
    assert cond.prompt_embeds.shape == (2, 77, u.cross_attention_dim)
    assert cond.pooled_embeds.shape == (2, t2.projection_dim) and cond.time_ids.tolist()[0] == [32, 32, 0, 0, 32, 32]


def test_sdxl_arch_has_sdxl_base_shapes():
    u = unet_config("sdxl")
    assert (u["cross_attention_dim"], u["projection_class_embeddings_input_dim"], u["sample_size"]) == (2048, 2816, 128)
    assert u["transformer_layers_per_block"] == (1, 2, 10) and vae_config("sdxl")["scaling_factor"] == 0.13025
    assert text_encoder_config("sdxl", which=2).projection_dim == 1280
    with pytest.raises(PocketdiffError, match="model.arch.*no text encoder 2"):
        text_encoder_config("tiny", which=2)


def test_saved_folder_loads_in_stock_sdxl_and_ours(xl, saved):
    index = json.loads((saved / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline"
    for sub in ("unet", "vae", "text_encoder", "text_encoder_2"):
        assert list((saved / sub).glob("*.safetensors")) and not list((saved / sub).glob("*.bin"))
    assert (saved / "tokenizer_2" / "vocab.json").is_file() and (saved / "tokenizer_2" / "merges.txt").is_file()
    stock = StableDiffusionXLPipeline.from_pretrained(str(saved))
    ours = load_pipeline(str(saved))
    assert isinstance(ours, StableDiffusionXLPipeline)
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        _same_weights(getattr(xl, name), getattr(stock, name))
        _same_weights(getattr(xl, name), getattr(ours, name))
    assert stock.tokenizer_2(CAPTIONS).input_ids == xl.tokenizer(CAPTIONS).input_ids
    assert isinstance(load_or_build(ModelConfig(pretrained=str(saved))), StableDiffusionXLPipeline)


def _must_not_load(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(StableDiffusionXLPipeline, "from_pretrained", boom)


def test_a_refiner_folder_is_refused_before_loading(saved, tmp_path, monkeypatch):
    _must_not_load(monkeypatch)
    refiner = _copy(saved, tmp_path, "refiner")
    shutil.rmtree(refiner / "text_encoder")
    shutil.rmtree(refiner / "tokenizer")
    _edit_json(refiner / "model_index.json", _class_name="StableDiffusionXLImg2ImgPipeline", requires_aesthetics_score=True,
               text_encoder=[None, None], tokenizer=[None, None])
    with pytest.raises(PocketdiffError, match=r"refiner: an SDXL refiner \(one text encoder, aesthetic-score time ids\)"):
        load_pipeline(str(refiner))


@pytest.mark.parametrize("missing", ["text_encoder_2", "tokenizer_2"])
def test_a_folder_without_the_second_encoder_or_tokenizer_is_refused(saved, tmp_path, monkeypatch, missing):
    _must_not_load(monkeypatch)
    folder = _copy(saved, tmp_path, "no2")
    shutil.rmtree(folder / missing)
    with pytest.raises(PocketdiffError, match=rf"no2: no {missing}/ \(an SDXL folder has two text encoders and two tokenizers\)"):
        load_pipeline(str(folder))


def test_time_ids_of_the_wrong_length_are_refused(saved, tmp_path, monkeypatch):
    _must_not_load(monkeypatch)
    folder = _copy(saved, tmp_path, "ids5")
    _edit_json(folder / "unet" / "config.json", projection_class_embeddings_input_dim=32 + 5 * 8)  # a refiner's 5 ids
    with pytest.raises(PocketdiffError, match=r"takes 5 time ids of width 8 beside text_encoder_2's 32-wide pooled embedding; "
                                              r"the SDXL base family takes 6"):
        load_pipeline(str(folder))


def test_a_resolution_the_unet_cannot_divide_is_refused(xl, saved):
    with pytest.raises(PocketdiffError, match=r"resolution=36 does not fit .*a multiple of 8"):
        check_resolution(xl, 36, "resolution")
    with pytest.raises(PocketdiffError, match=r"resolution=36 does not fit .*pipe \(VAE factor 4, UNet downsampling 2: a multiple of 8\)"):
        precheck_resolution(ModelConfig(pretrained=str(saved)), 36)
    with pytest.raises(PocketdiffError, match=r"resolution 36 does not fit arch 'tiny_xl'"):
        precheck_resolution(ModelConfig(arch="tiny_xl"), 36)
    precheck_resolution(ModelConfig(pretrained=str(saved)), 64)  # a multiple of 8: fits


def test_export_of_a_refiner_is_one_line_exit_2_and_writes_nothing(saved, tmp_path, capsys):
    from pocketdiff.cli import main

    refiner = _copy(saved, tmp_path, "refiner")
    _edit_json(refiner / "model_index.json", requires_aesthetics_score=True)
    cfg = tmp_path / "export.yaml"
    cfg.write_text(f"model:\n  pretrained: {refiner}\n")
    out = tmp_path / "bundle"
    assert main(["export", "--config", str(cfg), "--output", str(out)]) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.strip()]
    assert len(err) == 1 and "an SDXL refiner" in err[0], err
    assert not out.exists()


def test_a_long_prompt_warns_once_for_both_encoders(xl, capsys):
    # well over 77 tokens for either tokenizer; words of this test's own, since a prompt warns once per process and
    # another test on the same worker may have encoded a long prompt before
    long = " ".join(["a long sdxl warning test prompt of many words"] * 20)
    encode_conditioning(xl, [long])
    encode_conditioning(xl, [long])
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning: prompt is")]
    assert len(warnings) == 1, warnings
