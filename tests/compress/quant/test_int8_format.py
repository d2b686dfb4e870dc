"""The quantized checkpoint format (what calibrate writes and export reads)."""
import json

import pytest
import torch

from pocketdiff.compress.quant.int8_format import (LayerRecipe, QuantRecipe, dequantize, dequantized_state_dict, expand_scale,
                                             load_quantized, qmax, quantize_codes, rtn_scale, save_quantized)
from pocketdiff.errors import PocketdiffError


def _layer(shape=(6, 4, 3, 3), seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [None, 12])
def test_codes_within_range_and_close(bits, group_size):
    w = _layer()
    s = rtn_scale(w, bits, group_size)
    assert s.shape == ((6,) if group_size is None else (6, 3))
    c = quantize_codes(w, s, bits, group_size)
    assert c.dtype == torch.int8 and int(c.abs().max()) <= qmax(bits)
    err = (dequantize(c, s, group_size) - w).abs()
    assert torch.all(err <= expand_scale(s, w.shape, group_size) / 2 + 1e-6)


def test_bits_outside_4_8_rejected():
    with pytest.raises(PocketdiffError, match="bits must be 4 or 8"):
        qmax(3)


def test_group_size_must_divide():
    with pytest.raises(PocketdiffError, match="does not divide"):
        rtn_scale(_layer(), 8, 7)


def _state():
    w = _layer()
    s = rtn_scale(w, 8)
    return {"conv.weight": quantize_codes(w, s, 8), "conv.weight_scale": s, "conv.bias": torch.randn(6)}, \
        QuantRecipe(component="unet", layers={"conv": LayerRecipe(bits=8)}, seed=3, versions={"torch": torch.__version__},
                    extra={"source_pipeline": "x"})


def test_save_load_roundtrip_exact(tmp_path):
    state, recipe = _state()
    path, rpath = save_quantized(state, recipe, tmp_path / "unet_int8.safetensors")
    assert rpath.name == "unet_int8.json"
    loaded, rec = load_quantized(path)
    assert loaded.keys() == state.keys()
    for k in state:
        assert loaded[k].dtype == state[k].dtype and torch.equal(loaded[k], state[k])
    assert rec == recipe
    deq = dequantized_state_dict(loaded, rec)
    assert "conv.weight_scale" not in deq
    assert torch.equal(deq["conv.weight"], state["conv.weight"].float() * state["conv.weight_scale"][:, None, None, None])


def test_save_is_atomic_an_interrupted_write_keeps_the_old_file(tmp_path, monkeypatch):
    state, recipe = _state()
    path, rpath = save_quantized(state, recipe, tmp_path / "unet_int8.safetensors")
    before = path.read_bytes(), rpath.read_bytes()
    state2 = {**state, "conv.bias": state["conv.bias"] + 1}

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # a kill between writing the temporary file and the rename

    monkeypatch.setattr("pocketdiff.outputs.os.replace", killed)
    with pytest.raises(KeyboardInterrupt):
        save_quantized(state2, recipe, path)
    monkeypatch.undo()
    assert (path.read_bytes(), rpath.read_bytes()) == before
    assert sorted(f.name for f in tmp_path.iterdir()) == ["unet_int8.json", "unet_int8.safetensors"]  # no temporary left


def test_save_refuses_bad_codes(tmp_path):
    state, recipe = _state()
    bad = dict(state, **{"conv.weight": state["conv.weight"].float()})
    with pytest.raises(PocketdiffError, match="int8"):
        save_quantized(bad, recipe, tmp_path / "a.safetensors")
    recipe4 = QuantRecipe(component="unet", layers={"conv": LayerRecipe(bits=4)})
    with pytest.raises(PocketdiffError, match="4-bit range"):
        save_quantized(state, recipe4, tmp_path / "b.safetensors")
    missing = {k: v for k, v in state.items() if k != "conv.weight_scale"}
    with pytest.raises(PocketdiffError, match="lacks"):
        save_quantized(missing, recipe, tmp_path / "c.safetensors")
    assert not any(tmp_path.iterdir())


def test_load_errors(tmp_path):
    with pytest.raises(PocketdiffError, match="not found"):
        load_quantized(tmp_path / "none.safetensors")
    state, recipe = _state()
    path, rpath = save_quantized(state, recipe, tmp_path / "u.safetensors")
    raw = json.loads(rpath.read_text())
    raw["format"] = "other"
    rpath.write_text(json.dumps(raw))
    with pytest.raises(PocketdiffError, match="format"):
        load_quantized(path)
    rpath.write_text("{not json")
    with pytest.raises(PocketdiffError, match="not valid JSON"):
        load_quantized(path)
