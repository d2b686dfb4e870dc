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


# the shipped tiny teacher, int8 UNet from `int8_checkpoint`, residual stream x 1/4 (int8 codes stay the same, their
# scales absorb the factor): test_bundle.py's full export, which test_unet_chunks.py also uses as its whole-UNet bundle
TEACHER_INT8_EXPORT = {"seed": 0, "model": {"pretrained": TEACHER}, "weights": "int8", "guidance": "cfg", "guidance_scale": 3.0,
                       "steps": 4, "golden_prompt": "a large red circle at the center", "rewrites": {"residual_scale": 0.25}}


@pytest.fixture(scope="session")
def teacher_int8_bundle(gpu_delegate, int8_checkpoint, shared_conversions, tmp_path_factory):
    """One full `pocketdiff export` of TEACHER_INT8_EXPORT (+ a one-prompt, one-step fp16 scan) for the session:
    {"out": the bundle, "report": its report.json, "config": its export.yaml, "root": the folder holding both, "cfg": the
    config as a dict}.
    Tests read it or copy it; none writes into it. Its conversions are shared (tests/conftest.py's `shared_conversions`):
    test_unet_chunks.py's chunked bundles convert the same text encoder and decoder."""
    import json

    import yaml

    from pocketdiff.cli import main as cli_main

    root = tmp_path_factory.mktemp("export")
    cfg = {**TEACHER_INT8_EXPORT, "int8": {"checkpoint": str(int8_checkpoint)},
           "fp16_scan": {"enabled": True, "prompts": ["a red circle"], "steps": 1}}
    (root / "export.yaml").write_text(yaml.safe_dump(cfg))
    out = root / "bundle"
    with shared_conversions.of("text_encoder", "vae_decoder"):
        assert cli_main(["export", "--config", str(root / "export.yaml"), "--output", str(out)]) == 0
    return {"out": out, "report": json.loads((out / "report.json").read_text()), "config": root / "export.yaml", "root": root,
            "cfg": cfg}


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


@pytest.fixture(scope="session")
def lora_bundles(gpu_delegate, shared_conversions, tmp_path_factory):
    """The tiny teacher's LoRA-slot bundles and references (tests/lora_bundles.py `LoraBundles`: {name: bundle}, each
    exported the first time a test reads it; `.lora` the LoRA file the fused one holds), shared by test_lora_slots.py and
    test_lora_slots_chunks.py. Tests that change a bundle change a copy."""
    from lora_bundles import LoraBundles

    return LoraBundles(tmp_path_factory.mktemp("lora_bundles"), shared_conversions)
