"""kxk convolutions lowered to accumulated 1x1 taps (export/conv_lowering.py, `rewrites.conv_lowering: shifted_1x1`):
equal to the original in torch (stride 1 and the stride-2 downsamplers), serialized pieces lowered piece by piece,
each tap carrying its layer's int8 codes[rows, cols, dy, dx] bit for bit."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pocketdiff.compress.quant.int8_format import SCALE_SUFFIX, LayerRecipe, QuantRecipe, quantize_codes, rtn_scale
from pocketdiff.errors import PocketdiffError
from pocketdiff.export.conv_lowering import ShiftedConv2d, applies_to, lower_convs
from pocketdiff.export.int8 import QuantizedComponent, apply_to_module, pieces_for, split_groupwise
from pocketdiff.export.rewrites import RewriteConfig, SerializedConv2d, apply_rewrites


@pytest.mark.parametrize("k,stride,padding,dilation,bias", [(3, 1, 1, 1, True), (3, 2, 1, 1, True), (3, 1, 0, 1, False),
                                                            (5, 1, 2, 1, True), (3, 1, 2, 2, True), (3, 2, 1, 1, False)])
def test_shifted_taps_equal_the_conv(k, stride, padding, dilation, bias):
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 5, k, stride=stride, padding=padding, dilation=dilation, bias=bias)
    low = ShiftedConv2d(conv, "c")
    assert len(low.taps) == k * k and sum(t.bias is not None for t in low.taps) == int(bias)
    for h, w in ((9, 9), (8, 11)):
        x = torch.randn(2, 6, h, w)
        y, z = conv(x), low(x)
        assert y.shape == z.shape
        torch.testing.assert_close(z, y, rtol=0, atol=2e-5)


def test_grouped_or_reflect_padded_convs_are_not_lowered():
    with pytest.raises(PocketdiffError, match="only ungrouped"):
        ShiftedConv2d(nn.Conv2d(4, 4, 3, groups=2), "g")
    m = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 3, stride=2))
    rep = lower_convs(m, strided=False)
    assert rep == {"lowered": 0, "kept_strided": 1, "kernels": {}}
    assert lower_convs(m)["kernels"] == {"3x3/s2": 1}


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv_in = nn.Conv2d(8, 16, 3, padding=1)
        self.down = nn.Conv2d(16, 16, 3, stride=2, padding=1)
        self.proj = nn.Linear(16, 12)

    def forward(self, x):
        h = self.down(torch.tanh(self.conv_in(x)))
        return self.proj(h.permute(0, 2, 3, 1))


def _quantized(net: nn.Module) -> QuantizedComponent:
    state = {k: v.clone() for k, v in net.state_dict().items()}
    recipe = QuantRecipe(component="vae_decoder")  # graph prefix "": the module names as they are
    for name, m in net.named_modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            scale = rtn_scale(m.weight, 8)
            state[f"{name}.weight"], state[f"{name}.weight{SCALE_SUFFIX}"] = quantize_codes(m.weight, scale, 8), scale
            recipe.layers[name] = LayerRecipe(bits=8)
    return QuantizedComponent("vae_decoder", state, recipe)


def test_serialized_pieces_are_lowered_and_carry_their_codes_bit_exact():
    torch.manual_seed(0)
    net = _Net().eval()
    q = _quantized(net)
    apply_to_module(net, q)
    x = torch.randn(1, 8, 8, 8)
    ref = net(x)
    # conv_in's input is 8*8*8 = 512 elements: a 0.0005 MB budget (262 fp16 elements) splits it by input channel
    cfg = RewriteConfig(conv_budget_mb=0.0005, conv_budget_scope="input", conv_lowering="shifted_1x1")
    rep = apply_rewrites(net, cfg, sample_inputs=(x,), component=None)
    assert rep["serialized_convs"]["conv_in"] == [2, 1]
    assert isinstance(net.conv_in, SerializedConv2d) and all(isinstance(p, ShiftedConv2d) for p in net.conv_in.pieces)
    assert rep["conv_lowering"]["kernels"] == {"3x3": 2, "3x3/s2": 4}  # counted per serialized piece
    assert not [n for n, m in net.named_modules() if isinstance(m, nn.Conv2d) and tuple(m.kernel_size) != (1, 1)]
    torch.testing.assert_close(net(x), ref, rtol=0, atol=1e-5)
    pieces = pieces_for(net, q)
    assert len(pieces) == 2 * 9 + 4 * 9 + 1  # conv_in: 2 input pieces x 9 taps; down: 4 x 9; proj: one 1x1
    by_layer: dict = {}
    for p in pieces:
        codes = q.state[f"{p.layer}.weight"]
        want = codes[p.rows[0]:p.rows[1], p.cols[0]:p.cols[1]]
        if p.tap is not None:
            want = want[:, :, p.tap[0], p.tap[1]]
        assert p.codes.dtype == torch.int8 and torch.equal(p.codes.reshape(want.shape), want), (p.layer, p.tap)
        assert torch.equal(p.scale, q.state[f"{p.layer}.weight{SCALE_SUFFIX}"][p.rows[0]:p.rows[1]].float())
        by_layer.setdefault(p.layer, set()).add((p.cols, p.tap))
    assert len(by_layer["conv_in"]) == 18 and len(by_layer["down"]) == 36 and by_layer["proj"] == {((0, 16), None)}


def test_groupwise_layers_are_refused_with_lowering():
    torch.manual_seed(0)
    net = _Net().eval()
    q = _quantized(net)
    q.recipe.layers["conv_in"] = LayerRecipe(bits=8, group_size=36)
    apply_rewrites(net, RewriteConfig(conv_lowering="shifted_1x1"), sample_inputs=(torch.randn(1, 8, 8, 8),))
    with pytest.raises(PocketdiffError, match="conv_lowering"):
        split_groupwise(net, q)


def test_lowering_applies_to_the_named_components_and_their_chunks():
    assert applies_to("unet", ["unet"]) and applies_to("unet.3", ["unet"]) and not applies_to("text_encoder", ["unet"])
    assert applies_to("vae_up_tile", ["vae_decoder"]) and not applies_to("vae_up_tile", ["unet"])
    net = _Net()
    rep = apply_rewrites(net, RewriteConfig(conv_lowering="shifted_1x1"), sample_inputs=(torch.randn(1, 8, 8, 8),), component="vae_decoder")
    assert "conv_lowering" not in rep and isinstance(net.conv_in, nn.Conv2d)  # default components: [unet]


@pytest.mark.parametrize("overrides,key", [(["rewrites.conv_lowering=im2col"], "rewrites.conv_lowering"),
                                           (["rewrites.conv_lowering_components=[vae]"], "rewrites.conv_lowering_components"),
                                           (["int8.gpu_weights=int8"], "int8.gpu_weights"),
                                           (["weights=fp16", "int8.gpu_weights=direct"], "int8.gpu_weights")])
def test_config_names_the_wrong_key(export_config_error, overrides, key):
    assert key in export_config_error(overrides)


def test_the_int8gpu_preset_is_export_student_plus_the_phone_overrides():
    from pathlib import Path

    import yaml

    from pocketdiff.config import load_config
    from pocketdiff.export.verb import Config

    root = Path(__file__).resolve().parents[2] / "configs" / "sd21"
    base = yaml.safe_load((root / "export_student.yaml").read_text())
    phone = yaml.safe_load((root / "export_student_int8gpu.yaml").read_text())
    base.update(unet_chunks=16, unet_chunk_cut="layer", text_encoder_chunks=3)
    base["int8"] = {**base["int8"], "components": ["text_encoder", "unet"], "gpu_weights": "direct"}
    base["rewrites"] = {**base["rewrites"], "conv_lowering": "shifted_1x1", "conv_lowering_components": ["unet"],
                       "attention_budget_mb": 16}
    base["vae_tiling"] = {**base["vae_tiling"], "up_parts": 2}
    assert phone == base
    cfg = load_config(Config, root / "export_student_int8gpu.yaml", [])  # validates (chunk precheck included)
    assert cfg.rewrites.conv_lowering == "shifted_1x1" and cfg.int8.gpu_weights == "direct" and cfg.vae_tiling.up_parts == 2


def test_the_web_preset_is_export_student_plus_the_page_overrides():
    """configs/sd21/export_student_web.yaml: the layout measured for the page (issue 50), kept in step."""
    from pathlib import Path

    import yaml

    from pocketdiff.config import load_config
    from pocketdiff.export.verb import Config

    root = Path(__file__).resolve().parents[2] / "configs" / "sd21"
    base = yaml.safe_load((root / "export_student.yaml").read_text())
    web = yaml.safe_load((root / "export_student_web.yaml").read_text())
    base.update(unet_chunks=16, unet_chunk_cut="layer", text_encoder_chunks=3)
    base["int8"] = {**base["int8"], "components": ["text_encoder", "unet"]}
    base["rewrites"] = {**base["rewrites"], "conv_lowering": "shifted_1x1", "conv_lowering_components": ["unet", "vae_decoder"]}
    base["vae_tiling"] = {**base["vae_tiling"], "tile": 24, "up_parts": 2}
    assert web == base
    cfg = load_config(Config, root / "export_student_web.yaml", [])
    assert cfg.rewrites.conv_lowering_components == ["unet", "vae_decoder"] and cfg.vae_tiling.up_parts == 2
