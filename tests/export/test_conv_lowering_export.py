"""The tiny teacher's UNet exported with `rewrites.conv_lowering: shifted_1x1` + `int8.gpu_weights: direct`: no kxk
CONV_2D left, every 1x1 CONV_2D reads its int8 filter (no DEQUANTIZE for them), fully accelerated on the GPU
delegate (lavapipe) within the named parity thresholds, codes bit for bit the quantizer's (taps included); on
the CPU the file's direct int8 filters run as TFLite's hybrid kernels (activations quantized on the fly), so the
CPU variant (runtime/cpu_variant.py) runs them as float and matches the reference as the GPU does."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pocketdiff.runtime.tflite_file import TfliteModel


def _conv_filters(model: TfliteModel) -> dict:
    """Counts of CONV_2D by filter: kxk, 1x1 with an int8 filter read directly, 1x1 fed by DEQUANTIZE, other."""
    out = {"kxk": 0, "direct_1x1": 0, "dequant_1x1": 0, "float_1x1": 0}
    producers = model.producers()
    for op in model.graph.operators:
        if model.op_name(op) != "CONV_2D":
            continue
        f = int(op.inputs[1])
        t = model.graph.tensors[f]
        if [int(s) for s in t.shape][1:3] != [1, 1]:
            out["kxk"] += 1
        elif t.type == 9:  # INT8
            out["direct_1x1"] += 1
        elif f in producers and model.op_name(model.graph.operators[producers[f]]) == "DEQUANTIZE":
            out["dequant_1x1"] += 1
        else:
            out["float_1x1"] += 1
    return out


@pytest.fixture(scope="module")
def lowered_bundle(gpu_delegate, int8_checkpoint, tmp_path_factory):
    import yaml

    from pocketdiff.cli import main as cli_main

    tmp = tmp_path_factory.mktemp("lowered")
    cfg = {"seed": 0, "model": {"pretrained": "pocketdiff:shapes-teacher"}, "components": ["unet"], "weights": "int8",
           "int8": {"checkpoint": str(int8_checkpoint), "gpu_weights": "direct"},
           "rewrites": {"conv_lowering": "shifted_1x1", "group_norm_fp16_safe": False},
           "guidance": "cfg", "guidance_scale": 3.0, "steps": 4, "golden_prompt": "a large red circle at the center",
           "fp16_scan": {"enabled": False}}
    (tmp / "export.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp / "bundle"
    assert cli_main(["export", "--config", str(tmp / "export.yaml"), "--output", str(out)]) == 0
    return out


def test_lowered_direct_int8_unet_is_fully_accelerated_within_parity(lowered_bundle):
    from pocketdiff.export.parity import ParityConfig

    rep = json.loads((lowered_bundle / "report.json").read_text())["components"]["unet"]
    d = rep["details"]
    assert rep["fully_accelerated"] is True
    for prec in ("fp16", "fp32"):  # the export raised otherwise; the report carries what it checked
        th = getattr(ParityConfig(), prec)
        assert d["parity"][prec]["cosine"] >= th.cosine_min and d["parity"][prec]["psnr_db"] >= th.psnr_min_db
    assert d["rewrites"]["conv_lowering"]["lowered"] > 0
    counts = _conv_filters(TfliteModel(lowered_bundle / "unet.tflite"))
    assert counts["kxk"] == 0 and counts["dequant_1x1"] == 0 and counts["float_1x1"] == 0
    assert counts["direct_1x1"] == d["int8_direct_convs"] > 9 * d["rewrites"]["conv_lowering"]["lowered"]
    assert TfliteModel(lowered_bundle / "unet.tflite").op_histogram().get("DEQUANTIZE", 0) < d["int8_tensors"]
    man = json.loads((lowered_bundle / "manifest.json").read_text())["components"]["unet"]
    assert man["int8"]["storage"] == "direct"


def test_lowered_codes_are_the_quantizers_bit_for_bit(lowered_bundle, int8_checkpoint):
    from safetensors.torch import load_file

    state = load_file(str(int8_checkpoint))
    int8_map = json.loads(next(lowered_bundle.rglob("unet_int8_map.json")).read_text())
    tensors = TfliteModel(lowered_bundle / "unet.tflite").int8_weights()
    taps = 0
    for layer, places in int8_map.items():
        codes, scale = state[f"{layer}.weight"].numpy(), state[f"{layer}.weight_scale"].float().numpy()
        for p in places:
            t = tensors[p["tensor"]]
            got = t["codes"].transpose(0, 3, 1, 2) if p["layout"] == "ohwi" else t["codes"]
            want = codes[p["rows"][0]:p["rows"][1], p["cols"][0]:p["cols"][1]]
            if "tap" in p:
                want, taps = want[:, :, p["tap"][0], p["tap"][1]], taps + 1
            assert np.array_equal(got, want.reshape(got.shape)), (layer, p)
            np.testing.assert_allclose(t["scale"], scale[p["rows"][0]:p["rows"][1]] * p["scale_factor"], rtol=1e-6)
    assert taps > 0


def test_cpu_runs_direct_filters_as_float_and_matches_like_the_gpu(lowered_bundle, tmp_path):
    from pocketdiff.export.parity import ParityConfig
    from pocketdiff.runtime.cpu_variant import fp16_variant
    from pocketdiff.runtime.verify_bundle import verify_bundle

    n = fp16_variant(lowered_bundle / "unet.tflite", tmp_path / "unet_cpu.tflite")
    counts = _conv_filters(TfliteModel(tmp_path / "unet_cpu.tflite"))
    assert counts["direct_1x1"] == 0 and n >= counts["float_1x1"] > 0
    rep = verify_bundle(lowered_bundle, accelerator="cpu")
    m = rep["components"]["unet"]["parity"]["fp32"]
    assert m["cosine"] >= ParityConfig().fp16.cosine_min, m
