"""calibrate's host-memory prediction counts both text encoders of an SDXL-family model (text_encoder_2 is most of
SDXL's text-encoder bytes: 2.6 GB of 3.1 at fp32), for a built arch, a saved folder and a loaded pipeline alike."""
from __future__ import annotations

import pytest

from pocketdiff.compress.quant import host_memory
from pocketdiff.compress.quant.calibrate import Config
from pocketdiff.compress.quant.reconstruct import module_bytes
from pocketdiff.models import ModelConfig, build_pipeline, save_pipeline

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_both_text_encoders_are_in_the_prediction(tmp_path):
    pipe = build_pipeline(ModelConfig(arch="tiny_xl"))
    both = module_bytes(pipe.text_encoder) + module_bytes(pipe.text_encoder_2)
    assert module_bytes(pipe.text_encoder_2) > 0 and both > module_bytes(pipe.text_encoder)
    cfg = Config(device="cpu")
    cfg.model.arch = "tiny_xl"
    assert host_memory.sizes_before_loading(cfg).text_encoder_bytes == both  # built from the arch's configs
    assert host_memory.sizes_of_pipeline(pipe, cfg).text_encoder_bytes == both  # the loaded pipeline
    save_pipeline(pipe, tmp_path / "xl")
    cfg.model.pretrained = str(tmp_path / "xl")
    assert host_memory.sizes_before_loading(cfg).text_encoder_bytes == both  # a saved folder's configs
    sd = Config(device="cpu")  # an SD model: its one text encoder, as before
    sd_pipe = build_pipeline(ModelConfig(arch="tiny"))
    assert host_memory.sizes_before_loading(sd).text_encoder_bytes == module_bytes(sd_pipe.text_encoder)
