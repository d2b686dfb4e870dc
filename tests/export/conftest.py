"""Fixtures the export tests share."""
from __future__ import annotations

import pytest
import torch

TEACHER = "pocketdiff:shapes-teacher"


@pytest.fixture(scope="session")
def int8_checkpoint(tmp_path_factory):
    """The shipped tiny teacher's UNet quantized to int8 by RTN (every Conv2d and Linear), saved in compress's
    checkpoint format: what `export int8.checkpoint=...` carries bit-exact into the .tflite."""
    from pocketdiff.compress.quant.int8_format import LayerRecipe, QuantRecipe, quantize_codes, rtn_scale, save_quantized
    from pocketdiff.models import ModelConfig, load_or_build

    pipe = load_or_build(ModelConfig(pretrained=TEACHER))
    state = {k: v.detach().clone() for k, v in pipe.unet.state_dict().items()}
    recipe = QuantRecipe(component="unet", extra={"method": "rtn"})
    for name, m in pipe.unet.named_modules():
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
            scale = rtn_scale(m.weight, 8)
            state[f"{name}.weight"], state[f"{name}.weight_scale"] = quantize_codes(m.weight, scale, 8), scale
            recipe.layers[name] = LayerRecipe(bits=8)
    path = tmp_path_factory.mktemp("calib") / "unet_int8.safetensors"
    save_quantized(state, recipe, path)
    return path


@pytest.fixture(scope="session")
def export_config_error():
    """The one-line refusal `pocketdiff export` gives for these config overrides (it must refuse them)."""
    from pocketdiff.config import load_config
    from pocketdiff.errors import PocketdiffError
    from pocketdiff.export.verb import Config

    def error(overrides: list[str]) -> str:
        with pytest.raises(PocketdiffError) as e:
            load_config(Config, None, overrides)
        return str(e.value)

    return error
