"""Streamed calibration (recon.stream), the memory cap and the per-block progress (tiny UNet, CPU)."""
import dataclasses
import json

import pytest
import torch

from pocketdiff.cli import main
from pocketdiff.compress.quant.block_recon import ReconConfig
from pocketdiff.compress.quant.calibrate import Config
from pocketdiff.compress.quant.reconstruct import block_need_bytes, module_bytes, reconstruct_unet
from pocketdiff.config import load_config
from pocketdiff.errors import PocketdiffError
from tiny_calib import tiny_unet_calib  # tests/compress/quant/tiny_calib.py

PROMPTS = ["a red circle", "a blue square", "a green triangle"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    """A tiny UNet with trained-like norms and 8 random calibration inputs (no pipeline, no sampling)."""
    return tiny_unet_calib()


@pytest.mark.parametrize("mode", ["independent", "sequential"])
def test_streamed_run_equals_the_cached_one(tiny, mode):
    unet, calib, specs = tiny
    before = {k: v.clone() for k, v in unet.state_dict().items()}
    opts = ReconConfig(mode=mode, iters=3, batch_size=4)
    cached, _ = reconstruct_unet(unet, calib, specs, opts, device="cpu", log=None)
    streamed, info = reconstruct_unet(unet, calib, specs, dataclasses.replace(opts, stream=True), device="cpu", log=None)
    assert info["stream"] and [r.name for r in cached] == [r.name for r in streamed]
    for a, b in zip(cached, streamed):
        assert all(torch.equal(a.layers[g].codes, b.layers[g].codes) and torch.equal(a.layers[g].scale, b.layers[g].scale)
                   for g in a.layers), a.name
    assert all(torch.equal(before[k], v) for k, v in unet.state_dict().items())  # the float UNet is untouched


def test_a_cap_too_small_for_a_block_names_it_and_its_bytes(tiny):
    unet, calib, specs = tiny
    unet_bytes = module_bytes(unet)
    opts = ReconConfig(mode="independent", iters=2, batch_size=4)
    # not streamed, the UNet stays on the device: a cap just above it holds no block
    with pytest.raises(PocketdiffError, match=r"memory_cap_gib=\S+ \([\d,]+ bytes\) cannot hold block stem: reconstructing it "
                                              r"needs at least [\d,]+ bytes"):
        reconstruct_unet(unet, calib, specs, opts, device="cpu", log=None, memory_cap_bytes=unet_bytes + 1)
    with pytest.raises(PocketdiffError, match="cannot hold the UNet for the capture passes"):
        reconstruct_unet(unet, calib, specs, opts, device="cpu", log=None, memory_cap_bytes=unet_bytes // 2)
    # streamed, a cap above the UNet and every block's need runs
    results, _ = reconstruct_unet(unet, calib, specs, dataclasses.replace(opts, stream=True), device="cpu", log=None,
                                  memory_cap_bytes=unet_bytes + 2 ** 30)
    assert {g for r in results for g in r.layers} == set(specs)


def test_block_need_grows_with_the_minibatch(tiny):
    from pocketdiff.compress.quant.blocks import build_blocks, order_blocks

    unet, calib, _ = tiny
    blocks = build_blocks(unet)
    per_sample = order_blocks(unet, blocks, calib, "cpu")
    b = next(b for b in blocks if b.kind == "transformer")
    small, large = (block_need_bytes(b, per_sample, ReconConfig(batch_size=n)) for n in (4, 64))
    params = sum(p.numel() for u in b.units for p in u.module.parameters())
    assert 4 * params < small < large and large - small == 60 * (per_sample[b.name]["in"] + 3 * per_sample[b.name]["out"])


def test_verb_exits_2_naming_the_block_when_the_cap_is_too_small(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"""
device: cpu
perturb_norms: 0.3
memory_cap_gib: 0.01   # above the UNet (6 MiB), below a block at batch 512
model: {{arch: tiny, vocab_size: 600}}
calib: {{prompts: {json.dumps(PROMPTS)}, num_prompts: 2, holdout_prompts: 1, steps: 2}}
recon: {{iters: 2, batch_size: 512, stream: true}}
output: {{samples: 0}}
""")
    load_config(Config, cfg)  # valid
    assert main(["calibrate", "--config", str(cfg), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "cannot hold block" in err and "bytes" in err and not (tmp_path / "out" / "unet_int8.safetensors").exists()


@pytest.mark.parametrize("name", ["calibrate_w8", "calibrate_w4", "calibrate_smoke"])
def test_sd21_recipes_load(name):
    from pathlib import Path

    cfg = load_config(Config, Path(__file__).parents[3] / "configs" / "sd21" / f"{name}.yaml")
    assert cfg.memory_cap_gib == 24 and cfg.host_cap_gib == 32 and cfg.recon.stream and cfg.recon.mode == "independent" and cfg.recon.iters >= 500


def test_fp16_optimisation_reports_its_loss_to_the_progress_callback():
    """autocast fp16 runs through the GradScaler; the bar's callback gets every loss-curve point."""
    from torch import nn
    from torch.utils import _pytree as pytree

    from pocketdiff.compress.quant.block_recon import layer_inits, reconstruct_block
    from pocketdiff.compress.quant.blocks import Block, Captured, Unit
    from pocketdiff.compress.quant.quantizer import LayerSpec

    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.SiLU(), nn.Conv2d(16, 8, 1)).eval().requires_grad_(False)
    block = Block("toy", "resnet", [Unit("toy", "toy", "toy", module, {"0": "toy.0", "2": "toy.2"})])
    x = torch.randn(64, 8, 6, 6, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        target = module(x)
    leaves, spec = pytree.tree_flatten(([x], {}))
    weights = {"toy.0": module[0].weight.detach().clone(), "toy.2": module[2].weight.detach().clone()}
    specs = {k: LayerSpec(8) for k in weights}
    opts = ReconConfig(iters=40, batch_size=16, autocast="fp16", fallback=False)
    rtn_res, init = layer_inits(weights, specs, opts, "cpu")
    points = []
    res = reconstruct_block(block, [Captured(spec=spec, leaves=leaves, batched=[True])], [target], weights, specs, rtn_res, init,
                            opts, "cpu", progress=lambda it, loss: points.append((it, loss)))
    assert [it for it, _ in points] == [p[0] for p in res.stats["curve"]] and points[-1][0] == 39
    assert all(0 < loss < float("inf") for _, loss in points)
    assert res.stats["chosen"] == "adaround" and res.stats["mse_adaround_calib"] < res.stats["mse_rtn_calib"]
