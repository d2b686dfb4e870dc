"""benchmarks/export_sd21.py, synthetic weights: the SD-size UNet with tiled random weights
(compressible .tflite files, int8-exact codes, uncorrelated rows), its fixed inputs and the fp32
reference forward's activation report."""
from __future__ import annotations

import time

import numpy as np


# ----------------------------------------------------------------------------- synthetic weights
TILE_LEN = 65521  # prime: rows of any width < TILE_LEN are distinct cyclic shifts, never copies
TILE_SPIKE_EVERY = 256  # a +-127 code every 256 values: every row of >= 256 values has max |code| = 127
TILED_NORM3_SCALE = 1.0625  # the feed-forward LayerNorm's scale with tiled weights (see build_unet)


def tile_block(seed: int) -> np.ndarray:
    """The one random block every benchmark weight is tiled from: int8-grid values in
    [-127, 127] (float32), N(0, (127/4)^2) clipped, with a +-127 every TILE_SPIKE_EVERY values."""
    rng = np.random.default_rng(seed)
    k = np.clip(np.round(rng.standard_normal(TILE_LEN) * (127 / 4)), -127, 127)
    spikes = k[::TILE_SPIKE_EVERY]
    k[::TILE_SPIKE_EVERY] = np.where(rng.random(spikes.size) < 0.5, -127.0, 127.0)
    return k.astype(np.float32)


def tiled_values(block: np.ndarray, n: int, phase: int) -> np.ndarray:
    """block[(phase + i) % len(block)] for i < n (a window of the periodic stream)."""
    return np.resize(np.roll(block, -int(phase)), int(n))


def tiled_weight(shape, block: np.ndarray, phase: int, scale: float) -> np.ndarray:
    """A weight whose bytes in the .tflite are one window of the periodic block stream.

    litert-torch lays a Conv2d weight out OHWI (a Linear / 1x1 conv [O, I] as is), so the
    window is drawn in that layout and permuted back to torch's OIHW."""
    shape = tuple(int(s) for s in shape)
    flat = tiled_values(block, int(np.prod(shape)), phase) * np.float32(scale)
    if len(shape) == 4:
        o, i, kh, kw = shape
        return np.ascontiguousarray(flat.reshape(o, kh, kw, i).transpose(0, 3, 1, 2))
    return flat.reshape(shape)


def fill_tiled(module, seed: int, init: str) -> dict:
    """Fill every Conv2d / Linear weight (and bias) of `module` from one tiled random block.

    Why tiled: an SD-size UNet's random weights are ~0.8-3.5 GB per .tflite and do not
    compress, so they cannot travel to the GPU machine that runs the delegate. Each weight here
    is a cyclic window of one 65,521-value block (a prime length, a distinct random phase per
    tensor, drawn in the file's layout), so `zstd --long=31` shrinks a file ~1000x. Each row is
    a distinct shift of an i.i.d. sequence, so rows stay uncorrelated (a power-of-two period
    repeats whole rows and blows activations up, DESIGN.md). The block sits on the int8 grid
    with a +-127 in every 256 values, so per-channel RTN int8 gives the block's own codes (the
    int8 file compresses too). The scale is exact per layer (std 1/sqrt(3 fan_in) for
    "default", PyTorch's / diffusers' init, biases alike; 0.02 and zero biases for
    "normal002"): rounding it to a power of two compounds along the skip / shortcut chains
    (activations ~3x smaller than i.i.d. weights of the same std). Each distinct scale costs
    one block in the compressed file. Returns {"block_std", "stds": {fan_in: std}, "tensors"}.
    """
    import torch

    block = tile_block(seed)
    block_std = float(block.std())
    rng = np.random.default_rng(seed + 1)
    convs = [m for m in module.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    phases = rng.choice(TILE_LEN, size=2 * len(convs), replace=False)  # distinct: no two weights alike
    stds: dict[int, float] = {}
    with torch.no_grad():
        for j, m in enumerate(convs):
            fan_in = int(m.weight[0].numel())
            target = 0.02 if init == "normal002" else 1.0 / np.sqrt(3.0 * fan_in)
            scale = float(np.float32(target / block_std))
            stds[fan_in] = scale * block_std
            m.weight.copy_(torch.from_numpy(tiled_weight(m.weight.shape, block, phases[2 * j], scale)))
            if m.bias is not None:
                if init == "normal002":
                    m.bias.zero_()
                else:
                    m.bias.copy_(torch.from_numpy(tiled_weight(m.bias.shape, block, phases[2 * j + 1], scale)))
    return {"block_std": block_std, "stds": {str(k): v for k, v in sorted(stds.items())}, "tensors": len(convs)}


# ----------------------------------------------------------------------------- setup
def build_unet(arch: str, resolution: int, seed: int, init: str = "default", weights: str = "tiled"):
    """A random UNet with norm affines perturbed (identity affines are an artefact, DESIGN.md).

    init: diffusers' own initialisation (activations stay small), or `normal002`: every conv /
    linear weight N(0, 0.02^2), biases 0, the synthetic kind that drives SD-size activations
    past the fp16 range (DESIGN.md) -- the case the fp16-safe rewrites must survive.
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
