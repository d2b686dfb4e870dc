"""export/int8.py's memory-lean RTN and apply (issue 63 item 4): the same checkpoint and the same loaded weights as the
whole-state versions they replaced (written out here as the reference), and verb's release of the models no exported
component reads."""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from pocketdiff.compress.quant.int8_format import SCALE_SUFFIX, LayerRecipe, QuantRecipe, dequantized_state_dict, quantize_codes, rtn_scale
from pocketdiff.errors import PocketdiffError
from pocketdiff.export.int8 import apply_to_module, rtn_checkpoint
from pocketdiff.export.verb import _release_unexported


def _small(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.Conv2d(8, 4, 1, bias=False), nn.Flatten(), nn.Linear(4, 6))
    m.add_module("head", nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 5)))
    m.register_buffer("table", torch.randn(7))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # norms off identity, so float tensors differ from their defaults
    return m


def _reference_rtn(module: nn.Module, component: str, bits: int, skip: tuple[str, ...] = ()):
    """The earlier rtn_checkpoint: a clone of the whole state, then codes in place of the weights."""
    state = {k: v.detach().clone() for k, v in module.state_dict().items() if not any(k.startswith(s) for s in skip)}
    recipe = QuantRecipe(component=component, extra={"method": "rtn", "made_by": "pocketdiff export"})
    for name, m in module.named_modules():
        if not isinstance(m, (nn.Conv2d, nn.Linear)) or any(name.startswith(s) for s in skip):
            continue
        scale = rtn_scale(m.weight, bits)
        state[f"{name}.weight"] = quantize_codes(m.weight, scale, bits)
        state[f"{name}.weight{SCALE_SUFFIX}"] = scale
        recipe.layers[name] = LayerRecipe(bits=bits)
    return state, recipe


@pytest.mark.parametrize("bits,skip", [(8, ()), (4, ()), (8, ("head",))])
def test_rtn_checkpoint_equals_the_whole_state_version(bits, skip):
    m = _small()
    ref_state, ref_recipe = _reference_rtn(m, "unet", bits, skip)
    q = rtn_checkpoint(m, "unet", bits, skip=skip)
    assert list(q.state) == list(ref_state)  # same keys, same order
    for k, v in ref_state.items():
        assert q.state[k].dtype == v.dtype and torch.equal(q.state[k], v), k
    assert q.recipe.to_json() == ref_recipe.to_json()
    assert any(k.endswith(".weight") and q.state[k].dtype == torch.int8 for k in q.state)
    # float tensors kept are copies: the module changing later does not change the checkpoint
    bias = q.state["0.bias"].clone()
    with torch.no_grad():
        m[0].bias.add_(1.0)
    assert torch.equal(q.state["0.bias"], bias)


def test_apply_to_module_loads_what_load_state_dict_loaded():
    src = _small(0)
    q = rtn_checkpoint(src, "unet", 8)
    lean, whole = _small(1), _small(1)
    apply_to_module(lean, q)
    whole.load_state_dict(dequantized_state_dict(q.state, q.recipe), strict=False)
    for (k, a), (_, b) in zip(lean.state_dict().items(), whole.state_dict().items()):
        assert torch.equal(a, b), k
    assert not torch.equal(lean[0].weight, src[0].weight)  # the codes' values, not the float weights


def test_apply_to_module_refuses_a_checkpoint_of_another_shape():
    q = rtn_checkpoint(_small(), "unet", 8)
    other = nn.Sequential(nn.Conv2d(3, 9, 3))
    with pytest.raises(PocketdiffError, match="tensors do not exist|has shape"):
        apply_to_module(other, q)
    del q.state[f"2.weight{SCALE_SUFFIX}"]
    with pytest.raises(PocketdiffError, match="layer 2 lacks its codes or scales"):
        apply_to_module(_small(), q)


def test_release_unexported_frees_only_models_no_component_reads():
    def pipe():
        return types.SimpleNamespace(text_encoder=nn.Linear(4, 4), text_encoder_2=nn.Linear(4, 4), vae=nn.Linear(4, 4),
                                     unet=nn.Linear(4, 4))

    p = pipe()
    assert _release_unexported(p, ["unet.0", "unet.1"]) == ["text_encoder", "text_encoder_2", "vae"]
    assert p.text_encoder.weight.is_meta and p.vae.weight.is_meta and not p.unet.weight.is_meta
    p = pipe()
    assert _release_unexported(p, ["text_encoder", "text_encoder_2", "unet", "vae_decoder_head", "vae_up_tile.0"]) == []
    p = pipe()
    assert _release_unexported(p, ["unet", "not_a_component"]) == []  # an unknown name: nothing released
    assert not p.text_encoder.weight.is_meta
