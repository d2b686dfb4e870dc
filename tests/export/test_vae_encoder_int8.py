"""The VAE encoder's int8 weights (export/vae_encoder.encoder_int8): under `weights: int8` the encoder is int8 with the
others. From a calibrate-style checkpoint that quantizes the UNet alone, its convs are rounded to nearest per output
channel at 8 bits; the .tflite then holds those codes as INT8 constants, bit for bit, runs fully on the GPU delegate
within the golden tolerances, and the banded encoder's parity gate still raises."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml

from pocketdiff.errors import ParityError
from pocketdiff.export.banded_encoder import BandedEncoderGraph, check_band_parity, psnr_db
from pocketdiff.export.vae_encoder import ENCODER_INT8_BITS, VaeEncoderGraph, encoder_int8, smooth_picture

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def teacher():
    from pocketdiff.models import ModelConfig, load_or_build

    return load_or_build(ModelConfig(pretrained="pocketdiff:shapes-teacher"))


def _encoder_layers(vae) -> set:
    return {f"encoder.{n}" for n, m in vae.encoder.named_modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))}


def test_int8_follows_the_export_weights(teacher):
    before = {k: v.clone() for k, v in teacher.vae.state_dict().items()}
    assert encoder_int8("fp16", ["vae_encoder"], teacher, {}) == {}
    assert encoder_int8("int8", ["text_encoder", "unet", "vae_decoder"], teacher, {}) == {}  # no encoder exported
    listed = object()
    assert encoder_int8("int8", ["vae_encoder"], teacher, {"vae_encoder": listed}) == {}  # the checkpoint's / RTN's own
    q = encoder_int8("int8", ["vae_encoder"], teacher, {"unet": object()})["vae_encoder"]
    assert set(q.recipe.layers) == _encoder_layers(teacher.vae)  # every encoder conv and linear; quant_conv, the decoder float
    assert all(lr.bits == ENCODER_INT8_BITS and lr.group_size is None for lr in q.recipe.layers.values())
    codes = q.state["encoder.conv_in.weight"]
    assert codes.dtype == torch.int8 and q.state["encoder.conv_in.weight_scale"].numel() == codes.shape[0]  # per channel
    assert not any(k.startswith(("decoder.", "post_quant_conv.", "quant_conv.")) for k in q.state)
    assert 30.0 < q.recipe.extra["latents_psnr_db_vs_float"] < 120.0  # moved by the rounding, not far
    for k, v in teacher.vae.state_dict().items():  # the caller applies it: the VAE is left as it was
        assert torch.equal(v, before[k]), k


def test_band_parity_gate_still_raises_on_int8_weights(teacher):
    """With the encoder's int8 weights applied, the banded graph still equals the whole one (> 100 dB), and a banded
    graph with per-band norm statistics still misses the named bar."""
    import copy

    from pocketdiff.export.int8 import apply_to_module

    vae = copy.deepcopy(teacher.vae)
    apply_to_module(vae, encoder_int8("int8", ["vae_encoder"], teacher, {})["vae_encoder"])
    px = smooth_picture(32, 32, seed=3)
    assert check_band_parity(vae, BandedEncoderGraph(vae, 2, 3).eval(), px, 100.0) > 100.0
    bad = BandedEncoderGraph(vae, 1, 4).eval()
    bad._norm_act = lambda norm, act, bands, fractions: [act(norm(b)) for b in bands]  # a plain tiling's norms
    with pytest.raises(ParityError, match="parity.encoder_bands_psnr_db=60"):
        check_band_parity(vae, bad, px, 60.0)


def test_calibrated_export_writes_int8_encoder_on_the_delegate(gpu_delegate, teacher, tmp_path):
    """A checkpoint holding the UNet alone (calibrate's layout) and the image task, the encoder banded by a profile
    scaled to its size: INT8 per-channel constants equal to the encoder's RTN codes, fully accelerated, golden parity
    within the manifest's tolerances, and the golden latents those of the int8 weights, not the float ones."""
    from pocketdiff.cli import main as cli_main
    from pocketdiff.compress.quant.int8_format import save_quantized
    from pocketdiff.export.int8 import rtn_checkpoint
    from pocketdiff.runtime.tflite_file import TfliteModel

    q = rtn_checkpoint(teacher.unet, "unet", 8)
    save_quantized(q.state, q.recipe, tmp_path / "calib" / "unet_int8.safetensors")
    cfg = {"seed": 0, "model": {"pretrained": "pocketdiff:shapes-teacher"}, "components": ["vae_encoder"],
           "tasks": ["image_to_image"], "weights": "int8", "int8": {"checkpoint": str(tmp_path / "calib")},
           "guidance": "cfg", "guidance_scale": 3.0, "steps": 4, "fp16_scan": {"enabled": False}, "resolution": 32,
           "rewrites": {"conv_budget_mb": 3.5, "conv_budget_scope": "input"},
           "device_profile": {"name": "phone", "max_tensor_mb": 0.03, "enforce": True}}
    (tmp_path / "export.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "enc"
    assert cli_main(["export", "--config", str(tmp_path / "export.yaml"), "--output", str(out)]) == 0
    entry = json.loads((out / "manifest.json").read_text())["components"]["vae_encoder"]
    rep = json.loads((out / "report.json").read_text())["components"]["vae_encoder"]["details"]
    assert entry["weights"] == "int8" and entry["int8"] == {"layers": len(_encoder_layers(teacher.vae)), "method": "rtn"}
    assert rep["bands"]["bands"] == 3 and rep["bands"]["parity_psnr_db"] > 100.0

    expect = encoder_int8("int8", ["vae_encoder"], teacher, {})["vae_encoder"]  # deterministic: the same codes
    tensors = TfliteModel(out / entry["path"]).int8_weights()
    places = json.loads((out / "_export" / "vae_encoder_int8_map.json").read_text())
    assert set(places) == set(expect.recipe.layers)
    for layer, where in places.items():
        codes, scale = expect.state[f"{layer}.weight"].numpy(), expect.state[f"{layer}.weight_scale"].numpy()
        for p in where:
            t = tensors[p["tensor"]]
            got = t["codes"].transpose(0, 3, 1, 2) if p["layout"] == "ohwi" else t["codes"]
            (r0, r1), (c0, c1) = p["rows"], p["cols"]
            assert np.array_equal(got, codes[r0:r1, c0:c1].reshape(got.shape)), layer
            np.testing.assert_allclose(t["scale"], scale[r0:r1].reshape(-1) * p["scale_factor"], rtol=1e-6)  # x a power of two
            assert t["consumer"] == "DEQUANTIZE"

    assert entry["fully_accelerated"] is True
    for prec, m in rep["parity"].items():
        tol = entry["golden"]["tolerances"][prec]
        assert m["cosine"] >= tol["cosine_min"] and m["psnr_db"] >= tol["psnr_min_db"], prec
    golden = np.load(out / entry["golden"]["path"])
    with torch.no_grad():
        float_latents = VaeEncoderGraph(teacher.vae)(torch.from_numpy(golden["input_pixels"]))
    assert 30.0 < psnr_db(float_latents, torch.from_numpy(golden["output_0"])) < 120.0  # int8 weights: near, not equal
