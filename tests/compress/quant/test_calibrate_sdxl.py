"""`pocketdiff calibrate` (W8) on an SDXL-shaped model (tiny_xl: two text encoders, pooled embeddings, time ids):
the output's pipeline/ loads in stock StableDiffusionXLPipeline, and `load_quantized_pipeline` rebuilds an SDXL
pipeline whose images are those of the float model up to W8's error."""
import pytest
import torch

from pocketdiff.cli import run_stage

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SMOKE = "configs/smoke/calibrate.yaml"


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    out = tmp_path_factory.mktemp("cal_xl") / "out"
    report = run_stage("calibrate", SMOKE, out, ["model.arch=tiny_xl", "recon.iters=4", "output.samples=0",
                                                 "quant.components=[unet,text_encoder,text_encoder_2]"])
    return out, report


def test_w8_output_loads_in_stock_sdxl_pipeline(calibrated):
    from diffusers import StableDiffusionXLPipeline

    from pocketdiff.compress.quant.calibrate_outputs import load_quantized_pipeline

    out, report = calibrated
    assert report["parity"]["passed"], report["parity"]
    stock = StableDiffusionXLPipeline.from_pretrained(str(out / "pipeline"))
    stock.set_progress_bar_config(disable=True)
    q = load_quantized_pipeline(out)
    assert isinstance(q, StableDiffusionXLPipeline) and q.text_encoder_2 is not None
    kw = dict(num_inference_steps=2, guidance_scale=2.0, output_type="np",
              generator=torch.Generator().manual_seed(0))
    a = stock("a red circle", **kw).images[0]
    b = q("a red circle", **{**kw, "generator": torch.Generator().manual_seed(0)}).images[0]
    assert a.shape == b.shape == (32, 32, 3)
    # pipeline/ holds the dequantized codes x scales that load_quantized_pipeline rebuilds: the same weights, the
    # same diffusers code; 1e-5 leaves room for the rebuild's float32 products rounding apart from the saved ones
    assert float(abs(a - b).max()) < 1e-5
    import json

    meta = json.loads((out / "pipeline" / "quantization.json").read_text())
    assert meta["bits"] == 8 and meta["source_pipeline"] == "built:tiny_xl"


def test_both_text_encoders_are_quantized(calibrated):
    """text_encoder_2 is RTN-quantized at searched scales like the first: its checkpoint, its cosine (of the prompts'
    conditioning, pooled embedding included) against its bar, and load_quantized_pipeline applies its codes x scales."""
    from pocketdiff.compress.quant.calibrate_outputs import load_quantized_pipeline
    from pocketdiff.compress.quant.int8_format import dequantized_state_dict, load_quantized

    out, report = calibrated
    checks = report["parity"]["checks"]
    for name in ("text_encoder", "text_encoder_2"):
        assert (out / f"{name}_int8.safetensors").is_file(), name
        check = checks[f"min_{name}_cosine"]
        assert check["passed"] and check["value"] < 1.0, (name, check)  # quantized (not a copy), within the bar
    state, recipe = load_quantized(out / "text_encoder_2_int8.safetensors")
    assert recipe.component == "text_encoder_2" and recipe.layers
    want = dequantized_state_dict(state, recipe)
    got = load_quantized_pipeline(out).text_encoder_2.state_dict()
    layer = next(iter(recipe.layers))
    assert torch.equal(got[f"{layer}.weight"], want[f"{layer}.weight"])


def test_text_encoder_2_of_an_sd_model_is_refused_in_one_line(tmp_path):
    from pocketdiff.errors import PocketdiffError

    with pytest.raises(PocketdiffError, match="quant.components: text_encoder_2: the model has no text_encoder_2"):
        run_stage("calibrate", SMOKE, tmp_path / "o", ["quant.components=[unet,text_encoder_2]"])
    assert not (tmp_path / "o" / "unet_int8.safetensors").exists()
