"""int8 filters fed directly to 1x1 convolutions (export/int8_direct.py, export `int8.gpu_weights: direct`): the
graph holds no DEQUANTIZE before a 1x1 CONV_2D, the codes are the same bytes, and the bundle runs fully on the GPU
delegate (lavapipe) to the same image, with the runtime asking for the accelerator's int8 kernels."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pocketdiff.errors import PocketdiffError
from pocketdiff.export.int8_direct import rewrite_bundle
from pocketdiff.runtime.tflite_file import TfliteModel

BUNDLE = Path(__file__).resolve().parents[1] / "web" / "smoke_bundle"


def _int8_filters(model: TfliteModel) -> tuple[int, int]:
    """(1x1 CONV_2D reading an int8 filter directly, 1x1 CONV_2D whose filter comes from a DEQUANTIZE)."""
    direct = via_dequant = 0
    producers = model.producers()
    for op in model.graph.operators:
        if model.op_name(op) != "CONV_2D":
            continue
        f = int(op.inputs[1])
        shape = [int(s) for s in model.graph.tensors[f].shape]
        if shape[1:3] != [1, 1]:
            continue
        if model.graph.tensors[f].type == 9:  # INT8
            direct += 1
        elif f in producers and model.op_name(model.graph.operators[producers[f]]) == "DEQUANTIZE":
            src = model.graph.tensors[int(model.graph.operators[producers[f]].inputs[0])]
            via_dequant += int(src.type == 9)
    return direct, via_dequant


@pytest.fixture(scope="module")
def direct_bundle(tmp_path_factory):
    """The smoke bundle rewritten once for the module: (its folder, rewrite_bundle's counts)."""
    out = tmp_path_factory.mktemp("int8_direct") / "direct"
    return out, rewrite_bundle(BUNDLE, out)


def test_rewrite_feeds_every_int8_1x1_directly_and_keeps_the_codes(direct_bundle):
    out, counts = direct_bundle
    before, after = TfliteModel(BUNDLE / "unet.tflite"), TfliteModel(out / "unet.tflite")
    assert _int8_filters(before)[0] == 0 and _int8_filters(before)[1] > 0
    direct, via_dequant = _int8_filters(after)
    assert direct == counts["unet"] == _int8_filters(before)[1] and via_dequant == 0
    assert after.op_histogram().get("DEQUANTIZE", 0) < before.op_histogram()["DEQUANTIZE"]
    codes_before = sorted(v["codes"].tobytes() for v in before.int8_weights().values())
    codes_after = sorted(v["codes"].tobytes() for v in after.int8_weights().values())
    assert codes_before == codes_after  # the same int8 tensors, bit for bit
    man = json.loads((out / "manifest.json").read_text())
    assert man["components"]["unet"]["int8"]["storage"] == "direct"
    assert set(counts) == {"unet"}  # the fp16 components are left alone
    with pytest.raises(PocketdiffError, match="exists"):
        rewrite_bundle(BUNDLE, out)  # never overwrites


def test_a_direct_bundle_runs_on_the_gpu_delegate_to_the_same_image(direct_bundle):
    from pocketdiff.runtime.run_bundle import generate

    out, _ = direct_bundle
    ref, _ = generate(BUNDLE, "a red circle", seed=1, gpu_cache=False)
    img, summary = generate(out, "a red circle", seed=1, gpu_cache=False)
    assert summary["fully_accelerated"] is True
    err = np.mean((img.astype(np.float64) - ref.astype(np.float64)) ** 2)  # images in [0, 1]
    assert 10 * np.log10(1.0 / max(err, 1e-12)) >= 40


def test_the_runner_asks_for_int8_kernels_only_for_direct_components(direct_bundle):
    from pocketdiff.runtime.run_bundle import BundleRunner

    out, _ = direct_bundle
    with BundleRunner(out, "gpu", False, None, gpu_cache=False) as runner:
        assert runner._options_for("unet").get("allow_src_quantized_fc_conv_ops") is True
        assert "allow_src_quantized_fc_conv_ops" not in runner._options_for("text_encoder")


def test_export_config_names_a_wrong_storage():
    from pocketdiff.export.verb import Int8Config

    with pytest.raises(PocketdiffError, match="int8.gpu_weights"):
        Int8Config(gpu_weights="int8")


def test_export_with_direct_int8_passes_the_delegate_parity_and_carries_the_codes(gpu_delegate, int8_checkpoint, tmp_path):
    import yaml

    from pocketdiff.cli import main as cli_main

    cfg = {"seed": 0, "model": {"pretrained": "pocketdiff:shapes-teacher"}, "components": ["unet"], "weights": "int8",
           "int8": {"checkpoint": str(int8_checkpoint), "gpu_weights": "direct"}, "guidance": "cfg", "guidance_scale": 3.0,
           "steps": 4, "golden_prompt": "a large red circle at the center", "fp16_scan": {"enabled": False}}
    (tmp_path / "export.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "bundle"
    assert cli_main(["export", "--config", str(tmp_path / "export.yaml"), "--output", str(out)]) == 0
    rep = json.loads((out / "report.json").read_text())["components"]["unet"]
    assert rep["fully_accelerated"] is True and rep["details"]["parity"]["fp32"]["cosine"] > 0.99999
    assert rep["details"]["int8_direct_convs"] > 0
    direct, via_dequant = _int8_filters(TfliteModel(out / "unet.tflite"))
    assert direct == rep["details"]["int8_direct_convs"] and via_dequant == 0
    assert json.loads((out / "manifest.json").read_text())["components"]["unet"]["int8"]["storage"] == "direct"
