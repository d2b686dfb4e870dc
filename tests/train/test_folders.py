"""Round folders that hardlink their unchanged components: stock loading, fallback to copies."""
import errno
import os

import pytest
import torch

from pocketdiff.train import folders

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def pipe_and_dir(tmp_path_factory):
    from pocketdiff.config import DataConfig
    from pocketdiff.data import load_captions
    from pocketdiff.models import ModelConfig, build_pipeline, save_pipeline

    pipe = build_pipeline(ModelConfig(arch="tiny"), captions=load_captions(DataConfig(source="shapes", shapes_count=16)), resolution=32)
    return pipe, save_pipeline(pipe, tmp_path_factory.mktemp("src") / "pipeline")


def _share(src):
    return {name: src for name in folders.SHAREABLE}


def test_unchanged_components_are_hardlinked_and_the_folder_loads(pipe_and_dir, tmp_path):
    from pocketdiff.models import load_pipeline

    pipe, src = pipe_and_dir
    with torch.no_grad():
        pipe.unet.conv_out.bias.add_(1.0)  # the "trained" UNet differs from the source's
    try:
        done = folders.write_pipeline_folder(pipe, tmp_path / "out", _share(src))
    finally:
        with torch.no_grad():
            pipe.unet.conv_out.bias.sub_(1.0)
    assert sorted(done["linked"]) == ["text_encoder", "tokenizer", "vae"] and sorted(done["written"]) == ["scheduler", "unet"]
    for name in ("vae/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"):
        assert os.stat(tmp_path / "out" / name).st_ino == os.stat(src / name).st_ino
    assert os.stat(tmp_path / "out" / "unet/diffusion_pytorch_model.safetensors").st_ino != \
        os.stat(src / "unet/diffusion_pytorch_model.safetensors").st_ino
    loaded = load_pipeline(str(tmp_path / "out"))
    assert torch.allclose(loaded.unet.conv_out.bias, pipe.unet.conv_out.bias + 1.0)
    assert torch.equal(loaded.vae.decoder.conv_out.weight, pipe.vae.decoder.conv_out.weight)


def test_copies_when_links_fail(pipe_and_dir, tmp_path, monkeypatch):
    pipe, src = pipe_and_dir

    def no_link(a, b):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(folders.os, "link", no_link)
    done = folders.write_pipeline_folder(pipe, tmp_path / "out", _share(src))
    assert sorted(done["copied"]) == ["text_encoder", "tokenizer", "vae"] and not done["linked"]
    f = "vae/diffusion_pytorch_model.safetensors"
    assert os.stat(tmp_path / "out" / f).st_ino != os.stat(src / f).st_ino
    assert (tmp_path / "out" / f).read_bytes() == (src / f).read_bytes()


def test_pickled_or_missing_components_are_written_not_linked(pipe_and_dir, tmp_path):
    pipe, src = pipe_and_dir
    fake = tmp_path / "fake"
    (fake / "vae").mkdir(parents=True)
    (fake / "model_index.json").write_text("{}")
    (fake / "vae" / "config.json").write_text("{}")
    (fake / "vae" / "diffusion_pytorch_model.bin").write_bytes(b"pickle")
    assert folders.shareable_component(fake, "vae") is None and folders.shareable_component(fake, "text_encoder") is None
    assert folders.shareable_component(src, "vae") == src / "vae"
    done = folders.write_pipeline_folder(pipe, tmp_path / "out", _share(fake))
    assert not done["linked"] and "vae" in done["written"]
