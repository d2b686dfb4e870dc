"""Synthetic weights that travel: every conv / linear weight a window of one tiled random block.

For benchmarks and carry-size bundles built from random weights (an SD-2.1-size bundle is ~2 GB
of incompressible floats; tiled, `zstd --long=31` shrinks each .tflite ~1000x). `fill_tiled`
fills a module; `tile_pipeline` fills a whole diffusers pipeline (text encoder, UNet, VAE) and
rounds the norm affines onto a coarse grid so they compress too.
"""
from __future__ import annotations

import numpy as np

TILE_LEN = 65521  # prime: rows of any width < TILE_LEN are distinct cyclic shifts, never copies
TILE_SPIKE_EVERY = 256  # a +-127 code every 256 values: every row of >= 256 values has max |code| = 127


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
    repeats whole rows and blows activations up past fp16's range). The block sits on the int8 grid
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


NORM_GRID = 1024  # norm affines rounded onto a 2^-10 grid: few significant bits, they compress


def round_norm_affines(module) -> int:
    """Round every GroupNorm / LayerNorm affine of `module` onto the 2^-10 grid (in place)."""
    import torch

    n = 0
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm)) and getattr(m, "weight", None) is not None:
                m.weight.copy_(torch.round(m.weight * NORM_GRID) / NORM_GRID)
                if m.bias is not None:
                    m.bias.copy_(torch.round(m.bias * NORM_GRID) / NORM_GRID)
                n += 1
    return n


def tile_pipeline(pipe, seed: int, init: str = "default") -> dict:
    """Tiled weights for the text encoder(s), the UNet and the VAE of `pipe` (norm affines are
    perturbed by the caller first, then rounded here). Returns per-component fill info."""
    out = {}
    parts = [("text_encoder", pipe.text_encoder), ("unet", pipe.unet), ("vae", pipe.vae)]
    if getattr(pipe, "text_encoder_2", None) is not None:  # the SDXL family's second text encoder (seed + 30)
        parts.append(("text_encoder_2", pipe.text_encoder_2))
    for k, (name, module) in enumerate(parts):
        info = fill_tiled(module, seed + 10 * k, init)
        info["norms_rounded"] = round_norm_affines(module)
        out[name] = info
    return out
