"""One-pass tiled decoding with a norm-free up path (numpy only; the runner's code).

With its GroupNorms folded into fixed per-channel affines (pocketdiff/normfree.py), the decoder's
up path is local: a tile decodes what the whole decode gives, except within its receptive field
of the tile's edge. So: the head (conv_in and the mid block, attention included) once on the whole
latent, then every tile of its features once through the up path, blended with weights that are
zero `margin` latents deep at edges facing a neighbour (`tiled_decode.axis_weights`, a partition
of unity). No statistics, no second pass: the cost is the head plus the up path over the tiles'
area (tiles x tile^2 against the latent's H x W).

The manifest's `vae_tiling` block says `scheme: one_pass`; the up tile takes `features`
[1, F, t, t] and returns pixels [1, 3, t*f, t*f].
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from pocketdiff.errors import PocketdiffError

from .tiled_decode import axis_weights, tile_starts

ONE_PASS = "one_pass"


def tiles_area_ratio(size: int, tile: int, overlap: int) -> float:
    """The up path's work over the tiles against the whole latent's (square latents): tiles x t^2 / size^2."""
    n = len(tile_starts(size, tile, overlap))
    return (n * min(tile, size)) ** 2 / float(size * size)


def one_pass_decode(latents: np.ndarray, head: Callable[[np.ndarray], np.ndarray], up_tile: Callable[[np.ndarray], np.ndarray],
                    tile: int, overlap: int, factor: int, margin: int = 0) -> np.ndarray:
    """[1, C, H, W] latents -> [1, 3, H * factor, W * factor] pixels: `head(latents)` -> features
    [1, F, H, W] once, then `up_tile(features tile [1, F, t, t])` -> pixels [1, 3, t*f, t*f] per tile."""
    lat = np.asarray(latents, dtype=np.float32)
    if lat.ndim != 4 or lat.shape[0] != 1:
        raise PocketdiffError(f"one-pass decode: latents must be [1, C, H, W], got {list(lat.shape)}")
    H, W = lat.shape[-2:]
    if tile > min(H, W):
        raise PocketdiffError(f"one-pass decode: tile {tile} is larger than the latent {H}x{W}")
    ys, xs = tile_starts(H, tile, overlap), tile_starts(W, tile, overlap)
    wys, wxs = axis_weights(ys, tile, margin), axis_weights(xs, tile, margin)
    feats = np.asarray(head(lat), dtype=np.float32)
    if feats.ndim != 4 or feats.shape[0] != 1 or feats.shape[-2:] != (H, W):
        raise PocketdiffError(f"one-pass decode: the head returned {list(feats.shape)} for latents {list(lat.shape)}")
    T = tile * factor
    image = None
    for iy, y in enumerate(ys):
        for ix, x in enumerate(xs):
            pixels = np.asarray(up_tile(np.ascontiguousarray(feats[:, :, y:y + tile, x:x + tile])), dtype=np.float64)
            if pixels.shape[0] != 1 or pixels.shape[-2:] != (T, T):
                raise PocketdiffError(f"one-pass decode: the up tile returned {list(pixels.shape)}, expected [1, C, {T}, {T}]")
            if image is None:
                image = np.zeros((1, pixels.shape[1], H * factor, W * factor), dtype=np.float64)
            blend = np.kron(np.outer(wys[iy], wxs[ix]), np.ones((factor, factor)))
            image[:, :, y * factor:y * factor + T, x * factor:x * factor + T] += pixels * blend
    return image.astype(np.float32)  # the weights are a partition of unity: no division


def check_one_pass_block(block: dict, latent: list) -> list[tuple[str, str]]:
    """(key, message) problems of a `scheme: one_pass` vae_tiling block beyond the common ones
    (tile, overlap, margin, factor): passes must be 1, and no norms are fed."""
    problems = []
    if block.get("passes", 1) != 1:
        problems.append(("vae_tiling.passes", f"must be 1 for scheme one_pass, got {block.get('passes')!r}"))
    return problems


def one_pass_io(block: dict, latent: list) -> dict:
    """{component: (inputs {name: shape}, [output shapes])} of a one-pass tiled decoder."""
    t, f, F = int(block["tile"]), int(block["factor"]), int(block["features"])
    return {"vae_decoder_head": ({"latents": [1, *latent]}, [[1, F, *latent[1:]]]),
            "vae_up_tile": ({"features": [1, F, t, t]}, [[1, 3, t * f, t * f]])}
