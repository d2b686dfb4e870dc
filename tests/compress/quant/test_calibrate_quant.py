"""Quantizer primitives and the reconstruction of a toy block (no UNet)."""
import dataclasses

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from pocketdiff.compress.quant.blocks import Block, Captured, Unit
from pocketdiff.compress.quant.int8_format import expand_scale, qmax
from pocketdiff.compress.quant.quantizer import (AdaRoundQuantizer, LayerSpec, beta_schedule, inverse_rectified_sigmoid, layer_specs,
                                       rectified_sigmoid, rtn, search_scale)
from pocketdiff.compress.quant.block_recon import ReconConfig, block_mse, layer_inits, reconstruct_block
from pocketdiff.errors import PocketdiffError


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_rectified_sigmoid_inverse():
    h = torch.linspace(0, 0.999, 101)
    assert torch.allclose(rectified_sigmoid(inverse_rectified_sigmoid(h)), h, atol=1e-5)


@pytest.mark.parametrize("bits,group_size", [(8, None), (4, None), (4, 9)])
def test_adaround_starts_at_float_weight_and_hard_rounds_to_floor_or_ceil(bits, group_size):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 3, 3, 3, generator=g)
    spec = LayerSpec(bits, group_size)
    scale = search_scale(w, spec)
    q = AdaRoundQuantizer(w, spec, scale)
    full = expand_scale(scale, w.shape, group_size)
    m = qmax(bits)
    inside = (w / full).abs() <= m
    assert torch.allclose(q.soft_weight()[inside], w[inside], atol=1e-5)
    with torch.no_grad():  # any rounding variables: codes stay floor or ceil, inside the range
        q.v.copy_(torch.randn(q.v.shape, generator=g) * 5)
    codes = q.codes()
    x = w / full
    lo = torch.clamp(torch.floor(x), -m, m)
    hi = torch.clamp(torch.ceil(x), -m, m)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) <= m
    assert torch.all((codes.float() == lo) | (codes.float() == hi))
    assert torch.equal(q.hard_weight(), codes.float() * full)


def test_scale_search_never_worse_than_maxabs():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)) ** 3  # heavy tails
    for bits in (4, 8):
        spec = LayerSpec(bits)
        c0, s0 = rtn(w, spec)
        c1, s1 = rtn(w, spec, search_scale(w, spec))
        e0 = ((c0.float() * s0[:, None] - w) ** 2).sum(1)
        e1 = ((c1.float() * s1[:, None] - w) ** 2).sum(1)
        assert torch.all(e1 <= e0 + 1e-7)
        if bits == 4:
            assert e1.sum() < e0.sum()


def test_layer_specs_overrides_and_group_fallback():
    shapes = {"conv_in": torch.Size([8, 4, 3, 3]), "a.proj": torch.Size([8, 64]), "conv_out": torch.Size([4, 8, 3, 3])}
    specs = layer_specs(shapes, shapes, 4, 32, {"conv_*": 8})
    assert specs["conv_in"] == LayerSpec(8, None)  # 36 inputs: 32 does not divide -> per channel
    assert specs["a.proj"] == LayerSpec(4, 32)
    assert specs["conv_out"].bits == 8


def test_beta_schedule():
    assert beta_schedule(0, 100, 0.2, 20, 2) is None
    assert beta_schedule(20, 100, 0.2, 20, 2) == 20
    assert beta_schedule(99, 100, 0.2, 20, 2) == pytest.approx(2 + 18 / 80)


def _toy(seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.SiLU(), nn.Conv2d(16, 8, 1))
    return m.eval().requires_grad_(False)


def _toy_block(module):
    unit = Unit("toy", "toy", "toy", module, {"0": "toy.0", "2": "toy.2"})
    return Block("toy", "resnet", [unit])


def _captured(x):
    leaves, spec = pytree.tree_flatten(([x], {}))
    return Captured(spec=spec, leaves=leaves, batched=[True])


@pytest.mark.parametrize("bits", [8, 4])
def test_reconstruction_beats_rtn_on_a_toy_block(bits):
    module = _toy()
    block = _toy_block(module)
    x = torch.randn(128, 8, 6, 6, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        target = module(x)
    weights = {"toy.0": module[0].weight.detach().clone(), "toy.2": module[2].weight.detach().clone()}
    specs = {k: LayerSpec(bits) for k in weights}
    opts = ReconConfig(iters=150, batch_size=32, lr=2e-2, fallback=False)
    rtn_res, init = layer_inits(weights, specs, opts, "cpu")
    res = reconstruct_block(block, [_captured(x)], [target], weights, specs, rtn_res, init, opts, "cpu", seed=0)
    assert res.stats["chosen"] == "adaround"
    assert res.stats["mse_recon_calib"] < res.stats["mse_rtn_calib"]
    for name, lr in res.layers.items():  # every code is floor or ceil of W / s0 (s0: the initial scale; the stored one is learned)
        assert lr.codes.dtype == torch.int8 and int(lr.codes.abs().max()) <= qmax(bits)
        x0 = weights[name] / expand_scale(init[name], weights[name].shape, None)
        m = qmax(bits)
        assert torch.all((lr.codes.float() == torch.clamp(torch.floor(x0), -m, m)) | (lr.codes.float() == torch.clamp(torch.ceil(x0), -m, m)))
    # held-out inputs from the same distribution: still better than RTN
    x2 = torch.randn(64, 8, 6, 6, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        t2 = module(x2)
    from pocketdiff.compress.quant.quantizer import dequant

    rtn_w = {k: dequant(*rtn_res[k], specs[k]) for k in weights}
    rec_w = {k: dequant(v.codes, v.scale, specs[k]) for k, v in res.layers.items()}
    assert block_mse(block, [_captured(x2)], [t2], rec_w, "cpu") < block_mse(block, [_captured(x2)], [t2], rtn_w, "cpu")


def test_options_learned_scale_qdrop_fisher_run():
    module = _toy(1)
    block = _toy_block(module)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 8, 6, 6, generator=g)
    xq = x + 0.01 * torch.randn(x.shape, generator=g)
    with torch.no_grad():
        target = module(x)
    weights = {"toy.0": module[0].weight.detach().clone(), "toy.2": module[2].weight.detach().clone()}
    specs = {k: LayerSpec(4, 8) for k in weights}
    opts = ReconConfig(iters=30, batch_size=16, lr=1e-2, learn_scale=True, qdrop=0.5, loss="fisher")
    rtn_res, init = layer_inits(weights, specs, opts, "cpu")
    fisher = [torch.rand(64, 8) + 0.5]
    res = reconstruct_block(block, [_captured(xq)], [target], weights, specs, rtn_res, init, opts, "cpu",
                            fp_caps=[_captured(x)], fisher=fisher)
    assert res.stats["mse_recon_calib"] <= res.stats["mse_rtn_calib"]  # fallback keeps the best
    for lr in res.layers.values():
        assert lr.scale.shape == (lr.codes.shape[0], lr.codes[0].numel() // 8)


def test_recon_config_validation():
    from pocketdiff.errors import ConfigError

    with pytest.raises(ConfigError, match="recon.qdrop"):
        ReconConfig(mode="independent", qdrop=0.5)
    with pytest.raises(ConfigError, match="recon.iters"):
        ReconConfig(iters=0)
    assert ReconConfig(method="rtn", iters=0).iters == 0


def test_rounding_lr_falls_with_fan_in_above_the_reference():
    from pocketdiff.compress.quant.block_recon import rounding_lr

    opts = ReconConfig(lr=3e-2, lr_fan_in_ref=4608)
    assert rounding_lr(opts, (320, 320, 3, 3)) == 3e-2  # fan-in 2,880: unchanged
    assert rounding_lr(opts, (1280, 1280, 3, 3)) == pytest.approx(3e-2 * (4608 / 11520) ** 2)
    assert rounding_lr(opts, (1280, 5120)) == pytest.approx(3e-2 * (4608 / 5120) ** 2)  # linear
    assert rounding_lr(dataclasses.replace(opts, lr_fan_in_ref=None), (1280, 1280, 3, 3)) == 3e-2
    with pytest.raises(PocketdiffError, match="recon.lr_fan_in_ref"):
        ReconConfig(lr_fan_in_ref=0)


def test_reconstruction_uses_one_adam_group_per_rounding_lr():
    module = _toy()
    block = _toy_block(module)  # conv 8->16 3x3 (fan-in 72) and conv 16->8 1x1 (fan-in 16)
    x = torch.randn(32, 8, 6, 6, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        target = module(x)
    weights = {"toy.0": module[0].weight.detach().clone(), "toy.2": module[2].weight.detach().clone()}
    specs = {k: LayerSpec(8) for k in weights}
    opts = ReconConfig(iters=2, batch_size=8, lr=1e-2, lr_fan_in_ref=36)  # the 3x3 conv: 1e-2 x (36 / 72)^2
    rtn_res, init = layer_inits(weights, specs, opts, "cpu")
    res = reconstruct_block(block, [_captured(x)], [target], weights, specs, rtn_res, init, opts, "cpu", seed=0)
    assert res.stats["rounding_lr"] == pytest.approx([2.5e-3, 1e-2])
