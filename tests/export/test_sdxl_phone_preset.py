"""configs/sdxl/export_koala700m_phone.yaml (issue 63 item 4): the SD-2.1 phone preset for the SDXL family, kept in
step with configs/sd21/export_student_int8gpu.yaml; and the tiled synthetic weights reach SDXL's second text encoder."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_the_sdxl_phone_preset_is_the_sd21_phone_preset_plus_the_sdxl_overrides():
    from pocketdiff.config import load_config
    from pocketdiff.export.verb import Config

    phone = yaml.safe_load((ROOT / "configs" / "sd21" / "export_student_int8gpu.yaml").read_text())
    xl = yaml.safe_load((ROOT / "configs" / "sdxl" / "export_koala700m_phone.yaml").read_text())
    phone["model"] = {"arch": "sdxl", "unet_blocks": "koala_700m", "prediction_type": "epsilon"}
    # chunks: the UNet in 5 layer-cut chunks (the fewest at the preset's heaviest layer, 226 M: the config's comment); the
    # chunked text encoder cannot build an SDXL encoder's penultimate output
    phone.update(resolution=768, unet_chunks=5, text_encoder_chunks=1, guidance_scale=5.0)
    phone["int8"] = {**phone["int8"], "components": ["text_encoder", "text_encoder_2", "unet"]}
    assert xl == phone
    cfg = load_config(Config, ROOT / "configs" / "sdxl" / "export_koala700m_phone.yaml", [])
    assert cfg.model.unet_blocks == "koala_700m" and cfg.synthetic_weights == "tiled" and cfg.int8.gpu_weights == "direct"


def test_the_koala_preset_in_5_chunks_is_the_fewest_at_its_heaviest_layer():
    """The preset's UNet on the meta device (no weights, no export): its lowest stage's layers are 202-226 M parameters,
    which no layer cut divides; 5 chunks reach that floor and 4 do not. SDXL's added embedding goes in unet.0."""
    import torch
    from diffusers import UNet2DConditionModel

    from pocketdiff.export.unet_chunks import plan_chunks, unet_stages
    from pocketdiff.models import ModelConfig, built_unet_config

    conf = built_unet_config(ModelConfig(arch="sdxl", unet_blocks="koala_700m", prediction_type="epsilon"), 768, vae_factor=8)
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config({n: v for n, v in conf.items() if not n.startswith("_")})
    floor = max(s.params for s in unet_stages(unet, "layer"))
    heaviest = {k: max(p.params for p in plan_chunks(unet, k, "layer")) for k in (4, 5, 6)}
    assert 220e6 < floor < 230e6 and heaviest[5] == heaviest[6] == floor < heaviest[4]
    first = plan_chunks(unet, 5, "layer")[0]
    assert first.inputs[-2:] == ["text_embeds", "time_ids"] and first.outputs[-1] == "emb"


def test_tile_pipeline_fills_the_second_text_encoder():
    """Without it an SDXL bundle's text_encoder_2 (0.69 B at SDXL size) is incompressible random floats."""
    import torch

    from pocketdiff.export.synthetic import tile_pipeline
    from pocketdiff.models import ModelConfig, build_pipeline

    pipe = build_pipeline(ModelConfig(arch="tiny_xl"))
    info = tile_pipeline(pipe, seed=0)
    assert set(info) == {"text_encoder", "text_encoder_2", "unet", "vae"}
    linears = [m for m in pipe.text_encoder_2.modules() if isinstance(m, torch.nn.Linear)]
    assert info["text_encoder_2"]["tensors"] == len(linears) > 0
    for m in linears[:4]:
        w = m.weight.detach().numpy().reshape(-1)
        scale = np.abs(w).max() / 127  # every row holds a +-127 code: the largest magnitude is 127 x scale
        codes = np.round(w / scale)
        assert np.allclose(codes * scale, w, rtol=1e-5, atol=0), "values on the int8 grid times one scale"
        assert np.abs(codes).max() == 127 and len(np.unique(codes)) > 50  # the block's spread, not a constant
