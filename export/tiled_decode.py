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


def _fades(starts: list[int], i: int, tile: int) -> tuple[int, int]:
    """Latents tile i shares with its previous and its next neighbour along one axis (0: none)."""
    lo = starts[i - 1] + tile - starts[i] if i else 0
    hi = starts[i] + tile - starts[i + 1] if i + 1 < len(starts) else 0
    return lo, hi


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
            fy = _ramp(T, *(f * factor for f in _fades(ys, iy, tile)))
            fx = _ramp(T, *(f * factor for f in _fades(xs, ix, tile)))
            w = fy[:, None] * fx[None, :]
            acc[:, :, y * factor:y * factor + T, x * factor:x * factor + T] += img * w
            wsum[y * factor:y * factor + T, x * factor:x * factor + T] += w
    return (acc / wsum).astype(np.float32)


def psnr_db(reference: np.ndarray, image: np.ndarray, peak: float = 1.0) -> float:
    mse = float(np.mean((np.asarray(reference, np.float64) - np.asarray(image, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(peak**2 / mse)


def _blend_ramps(starts: list[int], i: int, tile: int, factor: int) -> tuple[np.ndarray, np.ndarray]:
    """Tile i's blend ramp along one axis at latent resolution, and at pixel resolution."""
    latent = _ramp(tile, *_fades(starts, i, tile))
    return latent, np.repeat(latent, factor)


def stats_from_sums(sums: np.ndarray) -> np.ndarray:
    """[K, 3, G] blend-weighted sums (sum, sum of squares, weight) -> [K, 2, G] (mean, variance)."""
    s = np.asarray(sums, dtype=np.float64)
    mean = s[:, 0] / s[:, 2]
    var = np.maximum(s[:, 1] / s[:, 2] - mean * mean, 0.0)  # E[x^2] - mean^2 may round below 0
    return np.stack([mean, var], axis=1).astype(np.float32)


def tiled_decode_with_stats(latents: np.ndarray, head: Callable[[np.ndarray], np.ndarray], up_tile: Callable,
                            tile: int, overlap: int, factor: int, norms: tuple[int, int], passes: int) -> np.ndarray:
    """[1, C, H, W] latents -> [1, 3, H * factor, W * factor] pixels that match the whole decode.

    `head(latents)` -> features [1, F, H, W] (the whole latent, once); `up_tile(features_tile,
    weight [t, t], stats [K, 2, G], own [1])` -> (pixels [1, 3, t*f, t*f], sums [K, 3, G]), as
    `export.tiled_vae.VaeUpPathTile` (`norms` = (K, G)). Pass 1 normalises with each tile's own
    statistics; each later pass with the totals of the previous pass's blend-weighted sums, which
    converge to the whole image's statistics (tiny VAE, tile 16 / overlap 8: 22.9 dB after one
    pass, 44.5 dB after 5, 49.4 dB after 6). The blend weights are the same ramps at every resolution
    (where three tiles meet at an image edge, both the image and the statistics divide by the
    weights' total)."""
    if passes < 1:
        raise PocketdiffError(f"tiled decode: passes must be at least 1, got {passes}")
    feats = np.asarray(head(np.asarray(latents, dtype=np.float32)), dtype=np.float32)
    if feats.ndim != 4 or feats.shape[0] != 1 or feats.shape[-2:] != np.asarray(latents).shape[-2:]:
        raise PocketdiffError(f"tiled decode: the head returned {list(feats.shape)} for latents {list(np.shape(latents))}")
    _, _, H, W = feats.shape
    ys, xs = tile_starts(H, tile, overlap), tile_starts(W, tile, overlap)
    stats = np.zeros((norms[0], 2, norms[1]), dtype=np.float32)
    own = np.ones((1,), dtype=np.float32)
    for _ in range(passes):
        image, wsum = None, np.zeros((H * factor, W * factor), dtype=np.float64)
        totals = np.zeros((norms[0], 3, norms[1]), dtype=np.float64)
        for iy, y in enumerate(ys):
            wy, py = _blend_ramps(ys, iy, tile, factor)
            for ix, x in enumerate(xs):
                wx, px = _blend_ramps(xs, ix, tile, factor)
                weight = np.outer(wy, wx).astype(np.float32)
                pixels, sums = up_tile(np.ascontiguousarray(feats[:, :, y:y + tile, x:x + tile]), weight, stats, own)
                pixels, sums = np.asarray(pixels, dtype=np.float64), np.asarray(sums, dtype=np.float64)
                if image is None:
                    image = np.zeros((1, pixels.shape[1], H * factor, W * factor), dtype=np.float64)
                blend = np.outer(py, px)
                image[:, :, y * factor:(y + tile) * factor, x * factor:(x + tile) * factor] += pixels * blend
                wsum[y * factor:(y + tile) * factor, x * factor:(x + tile) * factor] += blend
                totals += sums  # weighted: the weight totals in totals[:, 2] divide them
        stats = stats_from_sums(totals)
        own = np.zeros((1,), dtype=np.float32)
    return (image / wsum).astype(np.float32)
