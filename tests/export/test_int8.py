"""Group-wise int8 scales are carried too: the layer is split at group boundaries into
per-channel-quantized pieces, codes bit for bit, fully accelerated on the delegate."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pocketdiff.compress.quant.int8_format import SCALE_SUFFIX, LayerRecipe, QuantRecipe, quantize_codes, rtn_scale
from pocketdiff.export.exporter import VerifyConfig, export_component
from pocketdiff.export.int8 import QuantizedComponent, apply_to_module
from pocketdiff.export.parity import ParityConfig
from pocketdiff.export.rewrites import RewriteConfig
from pocketdiff.runtime.tflite_file import TfliteModel


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.proj = nn.Linear(16, 8)

    def forward(self, x):
        h = torch.nn.functional.silu(self.conv(x))
        return self.proj(h.permute(0, 2, 3, 1))


def test_groupwise_int8_is_split_per_group_and_carried_bit_exact(gpu_delegate, tmp_path):
    torch.manual_seed(0)
    block = Block().eval()
    state = {k: v.clone() for k, v in block.state_dict().items()}
    recipe = QuantRecipe(component="vae_decoder")  # graph prefix "": module names as they are
    for name, m, group in (("conv", block.conv, 36), ("proj", block.proj, 8)):  # 36 = 4 input channels x 3x3
        scale = rtn_scale(m.weight, 8, group)
        state[f"{name}.weight"] = quantize_codes(m.weight, scale, 8, group)
        state[f"{name}.weight{SCALE_SUFFIX}"] = scale
        recipe.layers[name] = LayerRecipe(bits=8, group_size=group)
    q = QuantizedComponent("vae_decoder", state, recipe)
    apply_to_module(block, q)
    rep = export_component("block", block, {"x": torch.randn(1, 8, 6, 6)}, tmp_path / "b.tflite", RewriteConfig(), "int8",
                           VerifyConfig(), ParityConfig(), quantized=q)
    assert rep["fully_accelerated"] and rep["parity"]["fp32"]["cosine"] > 0.99999
    assert rep["rewrites"]["groupwise_split"] == 2
    assert rep["int8_tensors"] == 4  # two groups per layer
    tensors = TfliteModel(tmp_path / "b.tflite").int8_weights()
    for layer, places in rep["int8_map"].items():
        codes, scale = state[f"{layer}.weight"], state[f"{layer}.weight{SCALE_SUFFIX}"]
        for g, p in enumerate(sorted(places, key=lambda p: p["cols"][0])):
            t = tensors[p["tensor"]]
            got = t["codes"].transpose(0, 3, 1, 2) if p["layout"] == "ohwi" else t["codes"]
            c0, c1 = p["cols"]
            assert np.array_equal(got, codes[:, c0:c1].numpy().reshape(got.shape)), layer
            np.testing.assert_array_equal(t["scale"], scale[:, g].numpy())


def test_groups_that_straddle_input_channels_are_refused():
    from pocketdiff.errors import PocketdiffError
    from pocketdiff.export.int8 import split_groupwise

    block = Block()
    recipe = QuantRecipe(component="vae_decoder", layers={"conv": LayerRecipe(bits=8, group_size=24)})
    q = QuantizedComponent("vae_decoder", {}, recipe)
    for name, m in block.named_modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            m.pd_source = (name, None, None)
    with pytest.raises(PocketdiffError, match="group size 24 does not align"):
        split_groupwise(block, q)
