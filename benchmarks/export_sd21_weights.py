"""benchmarks/export_sd21.py, synthetic weights: the SD-size UNet with tiled random weights
(compressible .tflite files, int8-exact codes, uncorrelated rows), its fixed inputs and the fp32
reference forward's activation report."""
from __future__ import annotations

import time

from pocketdiff.export.synthetic import (  # noqa: F401 - moved to the export package (the verb builds tiled bundles too)
    TILE_LEN,
    TILE_SPIKE_EVERY,
    fill_tiled,
    tile_block,
    tiled_values,
    tiled_weight,
)

TILED_NORM3_SCALE = 1.0625  # the feed-forward LayerNorm's scale with tiled weights (see build_unet)


# ----------------------------------------------------------------------------- setup
def build_unet(arch: str, resolution: int, seed: int, init: str = "default", weights: str = "tiled"):
    """A random UNet with norm affines perturbed (identity affines are an artefact).

    init: diffusers' own initialisation (activations stay small), or `normal002`: every conv /
    linear weight N(0, 0.02^2), biases 0, the synthetic kind that drives SD-size activations
    past the fp16 range -- the case the fp16-safe rewrites must survive.
    weights: "tiled" (default; see `fill_tiled`: the files compress to a few MB and can be
    carried to a GPU machine) or "iid" (independent draws, as torch initialises).
    Returns (unet, info)."""
    import torch
    from diffusers import UNet2DConditionModel

    from pocketdiff.models import perturb_norm_affines, unet_config

    factor = 4 if arch in ("tiny", "small") else 8
    info: dict = {"weights": weights, "init": init}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(**unet_config(arch, resolution=resolution, vae_factor=factor)).eval()
        if weights == "tiled":
            info.update(fill_tiled(unet, seed, init))
        elif init == "normal002":
            with torch.no_grad():
                for m in unet.modules():
                    if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
                        m.weight.normal_(0.0, 0.02)
                        if m.bias is not None:
                            m.bias.zero_()
    perturb_norm_affines(unet, seed)
    if weights == "tiled":
        with torch.no_grad():
            for name, m in unet.named_modules():
                if isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm)) and m.weight is not None:
                    # on a 2^-10 grid: few significant bits, so these constants compress too
                    m.weight.copy_(torch.round(m.weight * 1024) / 1024)
                    m.bias.copy_(torch.round(m.bias * 1024) / 1024)
                    if name.endswith(".norm3"):
                        # plain litert-torch folds this LayerNorm's scale into the feed-forward's
                        # first Linear (per input column), which would break the tiling of ~11 %
                        # of the weights; a uniform non-identity scale folds into a uniform factor
                        m.weight.fill_(TILED_NORM3_SCALE)
    return unet, info


def make_inputs(unet, batch: int, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    s = unet.config.sample_size
    return {
        "sample": torch.randn(batch, unet.config.in_channels, s, s, generator=g),
        "timestep": torch.full((batch,), 501.0),
        "encoder_hidden_states": torch.randn(batch, 77, unet.config.cross_attention_dim, generator=g),
    }


def activation_report(graph, inputs: dict):
    """The fp32 reference forward with the fp16 scan's hooks (no emulation): how large the
    activations of these synthetic weights get, per top-level block and per quantity, against
    the fp16 maximum (random weights must stay realistic, or the fp16 test is meaningless)."""
    import torch

    from pocketdiff.export.fp16scan import FP16_MAX, Fp16Scanner
    from pocketdiff.export.rewrites import RewriteConfig

    sc = Fp16Scanner(emulate=False, accumulation=False)
    sc.attach(graph.unet, "unet")
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            y = graph(*inputs.values())
    finally:
        sc.detach()
    seconds = time.perf_counter() - t0
    rep = sc.report(RewriteConfig())
    per_block: dict[str, float] = {}
    for name, st in rep["stats"].items():
        parts = name.split(".")
        key = ".".join(parts[1:3]) if len(parts) > 2 and parts[1] in ("down_blocks", "up_blocks") else parts[1]
        per_block[key] = max(per_block.get(key, 0.0), float(st["stream"]))
    return y.numpy(), seconds, {
        "fp16_max": FP16_MAX,
        "max_abs": rep["max_abs"],
        "worst": rep["worst"][:5],
        "stream_peak": max(per_block.values(), default=0.0),
        "stream_peak_per_block": per_block,
        "peaks": rep["peaks"],
        "fp16_overflowing_ops": rep["overflowing_ops"],
        "fp16_unmitigated_ops": rep["unmitigated"],
        "output_std": float(y.std()),
        "output_max_abs": float(y.abs().max()),
    }
