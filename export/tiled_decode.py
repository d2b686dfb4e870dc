"""Tiled VAE decoding: fixed latent tiles with overlap, blended linearly (numpy only).

The VAE decoder at 512 px holds the pipeline's largest activations (512 x 512 x 128 and
256 x 256 x 256 at fp16: 64 and 32 MB), the component phones fail on first. Decoding fixed
latent tiles (e.g. 32 x 32 -> 256 x 256 px) bounds every activation by the tile, so one small
decoder graph serves any image size. Neighbouring tiles overlap by `overlap` latents and are
blended with linear ramps across the overlap (as diffusers' `AutoencoderKL.tiled_decode`
does), which hides the seams the per-tile GroupNorm statistics leave.

`tiled_decode(latents, decode, tile, overlap, factor)`: `decode` maps [1, C, tile, tile]
latents to [1, 3, tile * factor, tile * factor] pixels (a .tflite, or torch in tests).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from pocketdiff.errors import PocketdiffError


def tile_starts(size: int, tile: int, overlap: int) -> list[int]:
    """Start offsets covering [0, size) with tiles of `tile`, stride tile - overlap; the last
    tile ends at `size` exactly (it may overlap its neighbour more)."""
    if tile >= size:
        return [0]
    stride = tile - overlap
    if stride <= 0:
        raise PocketdiffError(f"tiled decode: overlap {overlap} must be smaller than the tile {tile}")
    starts = list(range(0, size - tile, stride))
    starts.append(size - tile)
    return sorted(set(starts))


def _ramp(n: int, lo_fade: int, hi_fade: int) -> np.ndarray:
    """Weights over n pixels: rising over lo_fade pixels, falling over hi_fade, 1 between."""
    w = np.ones(n, dtype=np.float64)
    if lo_fade > 0:
        w[:lo_fade] = (np.arange(lo_fade) + 0.5) / lo_fade
    if hi_fade > 0:
        w[n - hi_fade:] = np.minimum(w[n - hi_fade:], (np.arange(hi_fade)[::-1] + 0.5) / hi_fade)
    return w


def tiled_decode(latents: np.ndarray, decode: Callable[[np.ndarray], np.ndarray], tile: int, overlap: int, factor: int) -> np.ndarray:
    """[1, C, H, W] latents -> [1, 3, H * factor, W * factor] pixels, tile by tile."""
    lat = np.asarray(latents, dtype=np.float32)
    if lat.ndim != 4 or lat.shape[0] != 1:
        raise PocketdiffError(f"tiled decode: latents must be [1, C, H, W], got {list(lat.shape)}")
    _, _, H, W = lat.shape
    if H < tile or W < tile:
        raise PocketdiffError(f"tiled decode: latents {H}x{W} are smaller than the tile {tile}")
    ys, xs = tile_starts(H, tile, overlap), tile_starts(W, tile, overlap)
    acc = None
    wsum = np.zeros((H * factor, W * factor), dtype=np.float64)
    T = tile * factor
    for iy, y in enumerate(ys):
        for ix, x in enumerate(xs):
            img = np.asarray(decode(np.ascontiguousarray(lat[:, :, y:y + tile, x:x + tile])), dtype=np.float64)
            if img.shape[-2:] != (T, T):
                raise PocketdiffError(f"tiled decode: the decoder returned {list(img.shape)} for a {tile}x{tile} tile (expected {T}x{T})")
            if acc is None:
                acc = np.zeros((1, img.shape[1], H * factor, W * factor), dtype=np.float64)
            # fade only towards a neighbour, over the pixels both tiles cover
            fy = (_ramp(T, (ys[iy - 1] + tile - y) * factor if iy else 0, (y + tile - ys[iy + 1]) * factor if iy + 1 < len(ys) else 0))
            fx = (_ramp(T, (xs[ix - 1] + tile - x) * factor if ix else 0, (x + tile - xs[ix + 1]) * factor if ix + 1 < len(xs) else 0))
            w = fy[:, None] * fx[None, :]
            acc[:, :, y * factor:y * factor + T, x * factor:x * factor + T] += img * w
            wsum[y * factor:y * factor + T, x * factor:x * factor + T] += w
    return (acc / wsum).astype(np.float32)


def psnr_db(reference: np.ndarray, image: np.ndarray, peak: float = 1.0) -> float:
    mse = float(np.mean((np.asarray(reference, np.float64) - np.asarray(image, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(peak**2 / mse)
