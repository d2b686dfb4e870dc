"""Model factories, loading and saving (pocketdiff.models)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextModel

from pocketdiff.config import load_config
from pocketdiff.errors import ConfigError, PocketdiffError
from pocketdiff.models import (
    ARCHS,
    ModelConfig,
    build_pipeline,
    build_vae,
    count_params,
    iter_norm_modules,
    load_or_build,
    load_pipeline,
    perturb_norm_affines,
    save_pipeline,
    text_encoder_config,
    unet_config,
    vae_config,
    vae_scale_factor,
)
from pocketdiff.sampling import generate

CAPTIONS = ["a red circle on a white background", "a blue square", "a green star on a black background"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    return build_pipeline(ModelConfig(), captions=CAPTIONS)


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory) -> Path:
    return save_pipeline(tiny, tmp_path_factory.mktemp("tiny") / "pipe")


def _meta_counts(arch: str, vocab_size: int = 49408) -> dict[str, int]:
    with torch.device("meta"):
        unet = UNet2DConditionModel(**unet_config(arch))
        vae = AutoencoderKL(**vae_config(arch))
        text = CLIPTextModel(text_encoder_config(arch, vocab_size))
    return {"unet": count_params(unet), "vae": count_params(vae), "text": count_params(text)}


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


# ---------------------------------------------------------------------------- config


def test_model_config_validation():
    assert ModelConfig().arch == "tiny"
    with pytest.raises(ConfigError, match="model.arch"):
        ModelConfig(arch="sd3")  # no such arch (sdxl is one: tests/core/test_models_sdxl.py)
    with pytest.raises(ConfigError, match="model.prediction_type"):
        ModelConfig(prediction_type="x0")
    with pytest.raises(ConfigError, match="model.vocab_size"):
        ModelConfig(vocab_size=10)


def test_model_config_through_config_loader(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("arch: small\nprediction_type: v_prediction\n")
    cfg = load_config(ModelConfig, path)
    assert (cfg.arch, cfg.prediction_type, cfg.pretrained) == ("small", "v_prediction", None)
    with pytest.raises(ConfigError, match="model.arch"):
        load_config(ModelConfig, overrides=["arch=huge"])


# ---------------------------------------------------------------------------- architectures


def test_sd_param_counts_on_meta():
    sd15 = _meta_counts("sd15")
    sd21 = _meta_counts("sd21")
    assert sd15["unet"] == 859_520_964  # SD-1.5 UNet ~859.5M
    assert sd21["unet"] == 865_910_724  # SD-2.1 UNet ~865.9M
    assert sd15["vae"] == sd21["vae"] == 83_653_863
    assert sd15["text"] == 123_060_480  # CLIP ViT-L/14 text tower
    assert sd21["text"] == 340_387_840  # OpenCLIP ViT-H/14 text tower (23 layers)


def test_sd_configs_match_the_real_models():
    u15, u21 = unet_config("sd15"), unet_config("sd21", "v_prediction")
    assert (u15["cross_attention_dim"], u15["attention_head_dim"], u15["sample_size"]) == (768, 8, 64)
    assert u21["cross_attention_dim"] == 1024 and tuple(u21["attention_head_dim"]) == (5, 10, 20, 20)
    assert u21["use_linear_projection"] and u21["upcast_attention"] and u21["sample_size"] == 96
    assert unet_config("sd21", "epsilon")["sample_size"] == 64  # 2.1-base, 512 px
    t15, t21 = text_encoder_config("sd15"), text_encoder_config("sd21")
    assert (t15.hidden_size, t15.num_hidden_layers, t15.hidden_act) == (768, 12, "quick_gelu")
    assert (t21.hidden_size, t21.num_hidden_layers, t21.num_attention_heads, t21.hidden_act) == (1024, 23, 16, "gelu")
    assert (t21.bos_token_id, t21.eos_token_id) == (49406, 49407)


def test_small_archs_sizes():
    tiny = _meta_counts("tiny", 1024)
    small = _meta_counts("small", 1024)
    assert sum(tiny.values()) < 3_000_000
    assert 5_000_000 <= sum(small.values()) <= 15_000_000
    assert 2 ** (len(vae_config("tiny")["block_out_channels"]) - 1) == 4
    assert unet_config("tiny")["sample_size"] == 8  # 32 px
    assert unet_config("small")["sample_size"] == 16  # 64 px
    assert unet_config("small", resolution=128)["sample_size"] == 32
    with pytest.raises(PocketdiffError, match="multiple of"):
        unet_config("tiny", resolution=36)
    for arch in ARCHS:
        assert vae_config(arch)["latent_channels"] == unet_config(arch)["in_channels"] == 4


# ---------------------------------------------------------------------------- build


def test_build_tiny_components(tiny):
    assert isinstance(tiny, StableDiffusionPipeline)
    assert tiny.safety_checker is None and tiny.feature_extractor is None
    assert vae_scale_factor(tiny) == 4 == vae_scale_factor(tiny.vae)
    assert tiny.unet.config.sample_size == 8 and tiny.unet.config.cross_attention_dim == 64
    assert tiny.text_encoder.config.hidden_size == 64 and tiny.text_encoder.config.vocab_size == 1024
    assert tiny.text_encoder.config.eos_token_id == tiny.tokenizer.eos_token_id
    assert tiny.tokenizer.model_max_length == 77 and len(tiny.tokenizer) <= 1024
    s = tiny.scheduler
    assert isinstance(s, DDIMScheduler)
    c = s.config
    assert (c.beta_schedule, c.beta_start, c.beta_end, c.num_train_timesteps) == ("scaled_linear", 0.00085, 0.012, 1000)
    assert (c.set_alpha_to_one, c.steps_offset, c.prediction_type, c.clip_sample) == (False, 1, "epsilon", False)
    # the text encoder produces [B, 77, 64]
    ids = tiny.tokenizer(CAPTIONS, padding="max_length", max_length=77, return_tensors="pt").input_ids
    with torch.no_grad():
        assert tiny.text_encoder(ids)[0].shape == (3, 77, 64)


def test_build_is_deterministic_and_leaves_global_rng_alone(tiny):
    state = torch.random.get_rng_state()
    again = build_pipeline(ModelConfig(), captions=CAPTIONS)
    assert torch.equal(state, torch.random.get_rng_state())
    for name in ("unet", "vae", "text_encoder"):
        _assert_same_weights(getattr(tiny, name), getattr(again, name))
    other = build_pipeline(ModelConfig(), captions=CAPTIONS, seed=1)
    assert not torch.equal(other.unet.conv_in.weight, tiny.unet.conv_in.weight)


def test_build_vae_is_the_pipelines_vae(tiny):
    state = torch.random.get_rng_state()
    _assert_same_weights(build_vae("tiny", tiny.vae.config.sample_size), tiny.vae)
    assert torch.equal(state, torch.random.get_rng_state())
    assert not torch.equal(build_vae("tiny", tiny.vae.config.sample_size, seed=1).decoder.conv_in.weight, tiny.vae.decoder.conv_in.weight)


def test_build_small_v_prediction_and_resolution():
    pipe = build_pipeline(ModelConfig(arch="small", prediction_type="v_prediction"), resolution=32)
    assert pipe.scheduler.config.prediction_type == "v_prediction"
    assert pipe.unet.config.sample_size == 8 and pipe.vae.config.sample_size == 32
    assert 5e6 < sum(count_params(m) for m in (pipe.unet, pipe.vae, pipe.text_encoder)) < 15e6


def test_norm_affines_identity_then_perturbed():
    pipe = build_pipeline(ModelConfig())
    norms = list(iter_norm_modules(pipe.unet))
    assert len(norms) > 10
    for m in norms:  # the factory leaves diffusers' initialisation alone
        assert torch.equal(m.weight, torch.ones_like(m.weight)) and torch.equal(m.bias, torch.zeros_like(m.bias))
    unet_b = UNet2DConditionModel.from_config(pipe.unet.config)
    unet_b.load_state_dict(pipe.unet.state_dict())
    n = perturb_norm_affines(pipe.unet, torch.Generator().manual_seed(3), scale=0.1)
    assert n == len(norms)
    assert perturb_norm_affines(unet_b, 3, scale=0.1) == n
    _assert_same_weights(pipe.unet, unet_b)  # deterministic for the same seed
    w = torch.cat([m.weight.flatten() for m in norms])
    assert 0.05 < (w - 1).std().item() < 0.2
    assert torch.equal(pipe.unet.conv_in.weight, unet_b.conv_in.weight)  # only norms change


# ---------------------------------------------------------------------------- save / load


def test_save_load_roundtrip_through_stock_diffusers(tiny, saved):
    for sub in ("unet", "vae", "text_encoder"):
        assert list((saved / sub).glob("*.safetensors"))
        assert not list((saved / sub).glob("*.bin"))
    assert (saved / "tokenizer" / "vocab.json").is_file() and (saved / "tokenizer" / "merges.txt").is_file()
    stock = StableDiffusionPipeline.from_pretrained(str(saved))
    for name in ("unet", "vae", "text_encoder"):
        _assert_same_weights(getattr(tiny, name), getattr(stock, name))
    assert stock.scheduler.config.prediction_type == "epsilon" and stock.scheduler.config.steps_offset == 1
    assert stock.tokenizer(CAPTIONS).input_ids == tiny.tokenizer(CAPTIONS).input_ids
    a = generate(tiny, CAPTIONS[:2], steps=3, guidance_scale=2.0)
    b = generate(stock, CAPTIONS[:2], steps=3, guidance_scale=2.0)
    # Weights are bit-identical; loaded tensors sit at other memory alignments, which can make
    # CPU kernels pick other vectorised paths (differences ~1e-6), hence a float tolerance here.
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_load_pipeline_local_and_prediction_override(tiny, saved):
    pipe = load_pipeline(str(saved))
    assert pipe.safety_checker is None
    _assert_same_weights(tiny.unet, pipe.unet)
    v = load_pipeline(saved, prediction_type="v_prediction")
    assert v.scheduler.config.prediction_type == "v_prediction" and isinstance(v.scheduler, DDIMScheduler)
    half = load_pipeline(saved, torch_dtype=torch.float16)
    assert half.unet.dtype == torch.float16


def test_a_float16_folder_loads_as_float32_in_every_component(saved, tmp_path):
    load_pipeline(saved, torch_dtype=torch.float16).save_pretrained(tmp_path / "fp16")
    pipe = load_pipeline(tmp_path / "fp16")  # transformers alone would keep the text encoder in float16
    assert {c: getattr(pipe, c).dtype for c in ("unet", "vae", "text_encoder")} == dict.fromkeys(("unet", "vae", "text_encoder"), torch.float32)
    assert generate(pipe, CAPTIONS[:1], steps=2, guidance_scale=2.0).isfinite().all()


def test_load_pipeline_errors(saved, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PocketdiffError, match=r"empty: no unet/ \(not a diffusers pipeline folder\)"):
        load_pipeline(str(empty))
    broken = tmp_path / "broken"
    shutil.copytree(saved, broken)
    for f in (broken / "vae").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(PocketdiffError, match=r"broken: no vae/\*\.safetensors"):
        load_pipeline(str(broken))
    shutil.rmtree(broken / "text_encoder")
    with pytest.raises(PocketdiffError, match="no text_encoder/"):
        load_pipeline(str(broken))
    with pytest.raises(PocketdiffError, match="no such folder"):
        load_pipeline(str(tmp_path / "missing" / "dir"))


def test_load_or_build(tiny, saved, tmp_path):
    built = load_or_build(ModelConfig(), captions=CAPTIONS)
    _assert_same_weights(tiny.unet, built.unet)
    loaded = load_or_build(ModelConfig(pretrained=str(saved)))
    _assert_same_weights(tiny.unet, loaded.unet)
    # a separate VAE replaces the pipeline's (pipeline folder or bare VAE folder)
    other = build_pipeline(ModelConfig(), captions=CAPTIONS, seed=5)
    other.vae.save_pretrained(str(tmp_path / "vae_only"), safe_serialization=True)
    swapped = load_or_build(ModelConfig(pretrained=str(saved), vae=str(tmp_path / "vae_only")))
    _assert_same_weights(other.vae, swapped.vae)
    _assert_same_weights(tiny.unet, swapped.unet)
    built_with_vae = load_or_build(ModelConfig(vae=str(saved)), captions=CAPTIONS)
    _assert_same_weights(tiny.vae, built_with_vae.vae)


def test_model_index_is_stock(saved):
    index = json.loads((saved / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline"
    assert index["unet"] == ["diffusers", "UNet2DConditionModel"]
    assert index["requires_safety_checker"] is False


def test_declared_pocketdiff_classes_are_imported_and_others_are_not(tmp_path):
    import json

    from pocketdiff.errors import PocketdiffError
    from pocketdiff.models import import_declared_classes

    (tmp_path / "model_index.json").write_text(json.dumps({
        "unet": ["pocketdiff.sampling", "Anything"], "vae": ["os", "system"], "scheduler": ["diffusers", "DDIMScheduler"]}))
    assert import_declared_classes(tmp_path) == ["pocketdiff.sampling"]
    (tmp_path / "model_index.json").write_text(json.dumps({"unet": ["pocketdiff.no_such_module", "X"]}))
    with pytest.raises(PocketdiffError, match="pocketdiff.no_such_module"):
        import_declared_classes(tmp_path)


def test_read_distill_meta(tmp_path):
    from pocketdiff.errors import PocketdiffError
    from pocketdiff.models import read_distill_meta

    assert read_distill_meta(None) == {} and read_distill_meta(tmp_path) == {}  # no distill.json: not a student
    (tmp_path / "distill.json").write_text('{"num_inference_steps": 4}')
    assert read_distill_meta(tmp_path) == {}  # not written by pocketdiff distill
    (tmp_path / "distill.json").write_text('{"pocketdiff_distill": 1, "num_inference_steps": 4}')
    assert read_distill_meta(str(tmp_path))["num_inference_steps"] == 4
    (tmp_path / "distill.json").write_text('{"pocketdiff_distill": 1,')
    with pytest.raises(PocketdiffError, match="distill.json is not valid JSON"):
        read_distill_meta(tmp_path)
