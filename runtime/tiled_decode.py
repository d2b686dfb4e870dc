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

from typing import Callable, Optional

import numpy as np

from pocketdiff.errors import PocketdiffError


SCHEMES = ("plain", "control_variate")  # how later passes use the previous pass's totals (tiled_decode_with_stats)


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


def _spans(starts: list[int], tile: int, margin: int) -> list[tuple[int, int]]:
    """The latents each tile contributes, [lo, hi): its tile less `margin` latents on every side
    that has a neighbour (the image's own edges keep theirs). Refuses gaps between spans."""
    last = len(starts) - 1
    spans = [(s + (margin if i > 0 else 0), s + tile - (margin if i < last else 0)) for i, s in enumerate(starts)]
    for i in range(1, len(spans)):
        if spans[i - 1][1] < spans[i][0]:
            raise PocketdiffError(f"tiled decode: margin {margin} leaves latents [{spans[i - 1][1]}, {spans[i][0]}) to no tile "
                                  f"(tiles at {starts}, tile {tile}): the stride must be at most tile - 2 * margin")
    return spans


def axis_weights(starts: list[int], tile: int, margin: int = 0) -> np.ndarray:
    """[n, tile] blend weights along one axis at latent resolution, one row per tile: zero over the
    `margin` latents next to a neighbour (where the tile's receptive field is cut by its edge),
    linear ramps across the overlap of neighbouring spans, and normalised so the tiles' weights
    sum to one at every latent (the blend is a partition of unity, so weighted sums over the
    tiles are the whole image's)."""
    spans = _spans(starts, tile, margin)
    raw = np.zeros((len(starts), tile), dtype=np.float64)
    for i, (lo, hi) in enumerate(spans):
        fade_lo = spans[i - 1][1] - lo if i > 0 else 0
        fade_hi = hi - spans[i + 1][0] if i + 1 < len(spans) else 0
        raw[i, lo - starts[i]:hi - starts[i]] = _ramp(hi - lo, max(fade_lo, 0), max(fade_hi, 0))
    total = np.zeros(max(starts) + tile, dtype=np.float64)
    for i, s in enumerate(starts):
        total[s:s + tile] += raw[i]
    return np.stack([raw[i] / np.where(raw[i] > 0, total[s:s + tile], 1.0) for i, s in enumerate(starts)])


def stats_from_sums(sums: np.ndarray) -> np.ndarray:
    """[K, 3 or 5, G] sums (blend-weighted sum, sum of squares, weight; rows past 3 are ignored) ->
    [K, 2, G] (mean, variance)."""
    s = np.asarray(sums, dtype=np.float64)
    mean = s[:, 0] / s[:, 2]
    var = np.maximum(s[:, 1] / s[:, 2] - mean * mean, 0.0)  # E[x^2] - mean^2 may round below 0
    return np.stack([mean, var], axis=1).astype(np.float32)


def first_pass_corrections(norms: tuple[int, int]) -> np.ndarray:
    """[K, 2, G] corrections that leave every tile's own statistics as they are (shift 0, ratio 1)."""
    k, g = norms
    return np.stack([np.zeros((k, g)), np.ones((k, g))], axis=1).astype(np.float32)


def control_variate(given: np.ndarray, own_before: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """[K, 2, G] corrections for a tile's next pass: the whole image's statistics `given` (mean,
    variance) relative to the tile's own `own_before` of the pass they came from, as a mean shift
    and a variance ratio. The tile normalises with own_now + shift and var_now * ratio: where its
    own statistics stop changing, that is `given` exactly; while upstream norms still change, the
    tile's own statistics follow them within the pass (the plain iteration, which feeds `given`
    alone, diverges on the SD VAE's 25 chained norms)."""
    g, o = np.asarray(given, np.float64), np.asarray(own_before, np.float64)
    return np.stack([g[:, 0] - o[:, 0], (np.maximum(g[:, 1], 0.0) + eps) / (np.maximum(o[:, 1], 0.0) + eps)], axis=1).astype(np.float32)


def tiled_decode_with_stats(latents: np.ndarray, head: Callable[[np.ndarray], np.ndarray], up_tile: Callable,
                            tile: int, overlap: int, factor: int, norms: tuple[int, int], passes: int, margin: int = 0,
                            scheme: str = "plain", on_pass: Optional[Callable[[int, np.ndarray], None]] = None,
                            given: Optional[np.ndarray] = None, first: Optional[Callable[[int, int], np.ndarray]] = None) -> np.ndarray:
    """[1, C, H, W] latents -> [1, 3, H * factor, W * factor] pixels that match the whole decode.

    `head(latents)` -> features [1, F, H, W] (the whole latent, once); `up_tile(features_tile,
    weight [t, t], stats [K, 2, G], own [1])` -> (pixels [1, 3, t*f, t*f], sums [K, 5, G]), as
    `export.tiled_vae.VaeUpPathTile` (`norms` = (K, G)). Pass 1 lets each tile normalise with its
    own statistics (own = 1, `first_pass_corrections`). Each later pass, by `scheme`:

    - "plain": the totals of the previous pass's blend-weighted sums as the statistics (own = 0).
      Exact after K passes in exact arithmetic (norm j depends only on norms < j), but the
      transients grow with K: fine on the tiny VAE (44.5 dB after 5 passes), diverging on the SD
      VAE's 25 norms (22.2 -> 7.1 dB from 1 to 5 passes).
    - "control_variate": own = 1, every tile's own statistics corrected by the previous totals
      against that tile's own statistics then (`control_variate`). Same fixed point; the tile's own
      statistics follow upstream changes within the pass (SD VAE, 256 px, tile 24 / overlap 16 /
      margin 8: 28.3 dB after 1 pass, 35.1 after 3, 39.6 after 8; benchmarks/tiled_decode_bounds.py).

    The blend weights (`axis_weights`) are zero `margin` latents deep at tile edges facing a
    neighbour, where the up path's receptive field is cut by the tile (on the SD VAE the error falls
    ~8 dB per latent from the edge), and the same at every resolution: both the image and the
    statistics come from tile interiors. `on_pass(p, image)` sees each pass's image (benchmarks).

    `given` [K, 2, G]: statistics known before the first pass (a pooled pass's:
    benchmarks/decoder_paths.py `lowres_stats`); every pass then
    normalises with them (own = 0), so one pass suffices. `first(y, x)`: instead, the first pass's
    corrections of the tile at latent (y, x) to its own statistics (own = 1)."""
    if passes < 1:
        raise PocketdiffError(f"tiled decode: passes must be at least 1, got {passes}")
    if scheme not in SCHEMES:
        raise PocketdiffError(f"tiled decode: scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    H, W = np.shape(latents)[-2:]  # the head keeps the latent's size (checked below)
    ys, xs = tile_starts(H, tile, overlap), tile_starts(W, tile, overlap)
    wys, wxs = axis_weights(ys, tile, margin), axis_weights(xs, tile, margin)  # refuses a margin that leaves gaps
    feats = np.asarray(head(np.asarray(latents, dtype=np.float32)), dtype=np.float32)
    if feats.ndim != 4 or feats.shape[0] != 1 or feats.shape[-2:] != np.asarray(latents).shape[-2:]:
        raise PocketdiffError(f"tiled decode: the head returned {list(feats.shape)} for latents {list(np.shape(latents))}")
    own = np.ones((1,), dtype=np.float32) if given is None else np.zeros((1,), dtype=np.float32)
    start = first_pass_corrections(norms) if given is None else np.asarray(given, dtype=np.float32)
    corrections = {(iy, ix): start if first is None else first(ys[iy], xs[ix]) for iy in range(len(ys)) for ix in range(len(xs))}
    # each tile's blend weights, at latent resolution (a graph input) and at pixel resolution: the same every pass
    weights = {key: np.outer(wys[key[0]], wxs[key[1]]).astype(np.float32) for key in corrections}
    blends = {key: np.kron(w.astype(np.float64), np.ones((factor, factor))) for key, w in weights.items()}
    for p in range(1, passes + 1):
        image, wsum = None, np.zeros((H * factor, W * factor), dtype=np.float64)
        totals = np.zeros((norms[0], 3, norms[1]), dtype=np.float64)
        owns = {}
        for (iy, ix), correction in corrections.items():
            y, x = ys[iy], xs[ix]
            weight, blend = weights[(iy, ix)], blends[(iy, ix)]
            pixels, sums = up_tile(np.ascontiguousarray(feats[:, :, y:y + tile, x:x + tile]), weight, correction, own)
            pixels, sums = np.asarray(pixels, dtype=np.float64), np.asarray(sums, dtype=np.float64)
            if sums.shape != (norms[0], 5, norms[1]):
                raise PocketdiffError(f"tiled decode: the up-path tile returned sums {list(sums.shape)}, expected {[norms[0], 5, norms[1]]}")
            if image is None:
                image = np.zeros((1, pixels.shape[1], H * factor, W * factor), dtype=np.float64)
            image[:, :, y * factor:(y + tile) * factor, x * factor:(x + tile) * factor] += pixels * blend
            wsum[y * factor:(y + tile) * factor, x * factor:(x + tile) * factor] += blend
            totals += sums[:, :3]  # weighted: the weight totals in totals[:, 2] divide them
            owns[(iy, ix)] = sums[:, 3:5]
        if on_pass is not None:
            on_pass(p, (image / wsum).astype(np.float32))
        given = stats_from_sums(totals)
        if scheme == "plain":
            corrections = {key: given for key in corrections}
            own = np.zeros((1,), dtype=np.float32)
        else:
            corrections = {key: control_variate(given, owns[key]) for key in corrections}
    return (image / wsum).astype(np.float32)
