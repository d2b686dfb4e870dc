"""Shared fixtures: a tiny random CLIP folder and a tiny pipeline folder (seconds to build)."""
from __future__ import annotations

import pytest

from pocketdiff.config import DataConfig


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory):
    """A random (untrained) transformers CLIPModel + CLIPProcessor folder, 32 px, 16-d embeddings."""
    from pocketdiff.data import load_captions
    from pocketdiff.evaluate.train_clip import ClipModelConfig, build_clip, save_clip
    from pocketdiff.tokenizer import build_clip_tokenizer

    captions = load_captions(DataConfig(source="shapes", shapes_count=256, resolution=32))
    tok = build_clip_tokenizer(captions, vocab_size=560, model_max_length=16)
    mcfg = ClipModelConfig(image_size=32, patch_size=8, vision_width=32, vision_layers=1, vision_heads=2,
                           text_width=32, text_layers=1, text_heads=2, max_length=16, projection_dim=16, vocab_size=560)
    model, processor = build_clip(mcfg, tok, seed=0)
    out = tmp_path_factory.mktemp("clip") / "tiny-clip"
    save_clip(model, processor, out, {"domain": "tinytest", "label": "tinytest-CLIP"})
    return out


@pytest.fixture(scope="session")
def tiny_pipeline_dir(tmp_path_factory):
    from pocketdiff.data import load_captions
    from pocketdiff.models import ModelConfig, build_pipeline, save_pipeline

    captions = load_captions(DataConfig(source="shapes", shapes_count=64, resolution=32))
    pipe = build_pipeline(ModelConfig(arch="tiny", vocab_size=600), captions=captions, resolution=32)
    out = tmp_path_factory.mktemp("pipe") / "tiny-pipeline"
    save_pipeline(pipe, out)
    return out


@pytest.fixture()
def cache_dir(tmp_path):
    return tmp_path / "cache"


def _shapes_uint8(count: int, seed: int = 0, resolution: int = 32):
    from pocketdiff.data import load_captioned_dataset
    from pocketdiff.evaluate.train_clip import images_to_uint8

    ds = load_captioned_dataset(DataConfig(source="shapes", shapes_count=count, resolution=resolution, seed=seed))
    return images_to_uint8(ds), list(ds["text"])


@pytest.fixture(scope="session")
def shapes_uint8():
    """(count, seed=0, resolution=32) -> (uint8 images [N, 3, R, R], captions) of the shapes set."""
    return _shapes_uint8


@pytest.fixture(scope="session")
def inception_files(tmp_path_factory):
    """{"pth": ..., "safetensors": ...}: the same seeded random Inception-v3 weights in both
    formats metrics.inception_weights reads (a plain tensor state dict and safetensors)."""
    import torch
    from safetensors.torch import save_file

    from pocketdiff.evaluate.inception import seeded_random_state

    state = seeded_random_state(0)
    folder = tmp_path_factory.mktemp("inception")
    pth, st = folder / "random-inception.pth", folder / "random-inception.safetensors"
    torch.save(state, pth)
    save_file({k: v.contiguous() for k, v in state.items()}, str(st))
    return {"pth": pth, "safetensors": st}


@pytest.fixture()
def no_network(monkeypatch, tmp_path):
    """An empty torch hub cache, offline flags set, and the weights download made to fail loudly."""
    from pocketdiff.evaluate import inception

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "POCKETDIFF_OFFLINE"):
        monkeypatch.setenv(var, "1")

    def refuse(url, dst):
        raise AssertionError(f"network use: {url}")

    monkeypatch.setattr(inception, "_download", refuse)
    return tmp_path / "torch-home"
