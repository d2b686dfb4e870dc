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

import time
from typing import Callable, Optional, Sequence

import numpy as np

from pocketdiff.errors import PocketdiffError

from .tiled_decode import axis_weights, tile_starts

ONE_PASS = "one_pass"


def tile_hw(tile) -> tuple[int, int]:
    """A tile as (rows, columns) of latents: an int is square, [rows, columns] a strip or rectangle."""
    if isinstance(tile, (list, tuple)):
        if len(tile) != 2:
            raise PocketdiffError(f"one-pass decode: tile must be an int or [rows, columns], got {tile!r}")
        return int(tile[0]), int(tile[1])
    return int(tile), int(tile)


def tiles_area_ratio(height: int, width: int, tile, overlap: int) -> float:
    """The up path's work over the tiles against the whole latent's: tiles x tile area / (height x width)."""
    th, tw = tile_hw(tile)
    th, tw = min(th, height), min(tw, width)
    n = len(tile_starts(height, th, overlap)) * len(tile_starts(width, tw, overlap))
    return n * th * tw / float(height * width)


def one_pass_decode(latents: np.ndarray, head: Callable[[np.ndarray], np.ndarray], up_tile: Callable[[np.ndarray], np.ndarray],
                    tile, overlap: int, factor: int, margin: int = 0) -> np.ndarray:
    """[1, C, H, W] latents -> [1, 3, H * factor, W * factor] pixels: `head(latents)` -> features
    [1, F, H, W] once, then `up_tile(features tile [1, F, th, tw])` -> pixels [1, 3, th*f, tw*f] per
    tile (`tile`: an int, or [rows, columns]; a side equal to the latent's is one tile along it)."""
    return one_pass_decode_parts(latents, head, [lambda tiles: [up_tile(t) for t in tiles]], tile, overlap, factor, margin)


def one_pass_decode_parts(latents: np.ndarray, head: Callable[[np.ndarray], np.ndarray], parts: Sequence[Callable[[list], list]],
                          tile, overlap: int, factor: int, margin: int = 0) -> np.ndarray:
    """`one_pass_decode` with the up path in graphs run part by part (export `vae_tiling.up_parts`): each of
    `parts` maps every tile's input (the features' tiles for the first, the previous part's outputs after)
    to its outputs, in tile order, so a part can be loaded, run over all tiles and released before the
    next one loads; the last part's outputs are the tiles' pixels."""
    lat = np.asarray(latents, dtype=np.float32)
    if lat.ndim != 4 or lat.shape[0] != 1:
        raise PocketdiffError(f"one-pass decode: latents must be [1, C, H, W], got {list(lat.shape)}")
    H, W = lat.shape[-2:]
    th, tw = tile_hw(tile)
    if th > H or tw > W:
        raise PocketdiffError(f"one-pass decode: tile {th}x{tw} is larger than the latent {H}x{W}")
    ys, xs = tile_starts(H, th, overlap), tile_starts(W, tw, overlap)
    wys, wxs = axis_weights(ys, th, margin), axis_weights(xs, tw, margin)
    feats = np.asarray(head(lat), dtype=np.float32)
    if feats.ndim != 4 or feats.shape[0] != 1 or feats.shape[-2:] != (H, W):
        raise PocketdiffError(f"one-pass decode: the head returned {list(feats.shape)} for latents {list(lat.shape)}")
    origins = [(iy, ix) for iy in range(len(ys)) for ix in range(len(xs))]
    tiles = [np.ascontiguousarray(feats[:, :, ys[iy]:ys[iy] + th, xs[ix]:xs[ix] + tw]) for iy, ix in origins]
    for k, part in enumerate(parts):
        tiles = list(part(tiles))
        if len(tiles) != len(origins):
            raise PocketdiffError(f"one-pass decode: up-path part {k} returned {len(tiles)} tiles for {len(origins)}")
    Th, Tw = th * factor, tw * factor
    image = None
    for (iy, ix), px in zip(origins, tiles):
        pixels = np.asarray(px, dtype=np.float64)
        if pixels.shape[0] != 1 or pixels.shape[-2:] != (Th, Tw):
            raise PocketdiffError(f"one-pass decode: the up tile returned {list(pixels.shape)}, expected [1, C, {Th}, {Tw}]")
        if image is None:
            image = np.zeros((1, pixels.shape[1], H * factor, W * factor), dtype=np.float64)
        y, x = ys[iy], xs[ix]
        blend = np.kron(np.outer(wys[iy], wxs[ix]), np.ones((factor, factor)))
        image[:, :, y * factor:y * factor + Th, x * factor:x * factor + Tw] += pixels * blend
    return image.astype(np.float32)  # the weights are a partition of unity: no division


def check_one_pass_block(block: dict, latent: list) -> list[tuple[str, str]]:
    """(key, message) problems of a `scheme: one_pass` vae_tiling block beyond the common ones
    (tile, overlap, margin, factor): passes must be 1, and no norms are fed."""
    problems = []
    if block.get("passes", 1) != 1:
        problems.append(("vae_tiling.passes", f"must be 1 for scheme one_pass, got {block.get('passes')!r}"))
    return problems


def one_pass_io(block: dict, latent: list, ups: Sequence[str] = ("vae_up_tile",), ios: Optional[dict] = None) -> dict:
    """{component: (inputs {name: shape}, [output shapes] or None)} of a one-pass tiled decoder whose up path is the
    components `ups` in order: the first takes `features`, each later one `hidden` of the shape its
    predecessor returns (read from `ios`, {component: (inputs, outputs)} as the manifest declares them), the
    last returns the tile's pixels; the others one tensor (None in place of the output shapes)."""
    (th, tw), f, F = tile_hw(block["tile"]), int(block["factor"]), int(block["features"])
    want = {"vae_decoder_head": ({"latents": [1, *latent]}, [[1, F, *latent[1:]]])}
    for k, name in enumerate(ups):
        if k == 0:
            ins = {"features": [1, F, th, tw]}
        else:
            before = (ios or {}).get(ups[k - 1])
            if before is None or len(before[1]) != 1:
                continue  # its predecessor is missing or malformed: reported there
            ins = {"hidden": next(iter(before[1].values()))["shape"]}
        out = [[1, 3, th * f, tw * f]] if k == len(ups) - 1 else None  # None: one output, its shape the next part's input
        want[name] = (ins, out)
    return want


def timed(calls: dict, key: str, fn: Callable) -> Callable:
    """`fn` that adds its wall time to `calls[key]` and counts itself in `calls[key + "_calls"]` (the decoders'
    per-model latency keys)."""
    def run(*args):
        t0 = time.perf_counter()
        out = fn(*args)
        calls[key] += time.perf_counter() - t0
        calls[f"{key}_calls"] = calls.get(f"{key}_calls", 0) + 1
        return out
    return run


def one_pass_decode_loaded(head, ups: Sequence[Callable], block: dict, latents: np.ndarray,
                           done: Optional[Callable] = None) -> tuple[np.ndarray, dict]:
    """The runner's one-pass decode (`head({"latents": z})` -> features): ([1, 3, H, W] pixels, {latency_s,
    up_tile_calls}), with the timing keys of the iterated scheme's decode. `ups`: the up path's models in order
    (the up tile, or its parts: `vae_tiling.up_parts`), each as a function that gives it when its turn comes
    (run-bundle --pipelined loads it there); each part runs every tile (`run_all` on its one input), then
    `done(model)` (which may release it) before the next part is asked for."""
    calls = {"head": 0.0, "up": 0.0, "tiles": 0}
    part_s: dict = {}
    run_head = timed(calls, "head", lambda z: head({"latents": z}))

    def runner(load: Callable) -> Callable[[list], list]:
        def run(tiles: list) -> list:
            model = load()
            t0 = time.perf_counter()
            outs = [model.run_all({model.in_names[0]: x})[0] for x in tiles]
            part_s[model.name] = time.perf_counter() - t0
            calls["up"] += part_s[model.name]
            calls["tiles"] = len(tiles)
            if done is not None:
                done(model)
            return outs
        return run

    t0 = time.perf_counter()
    image = one_pass_decode_parts(latents, run_head, [runner(up) for up in ups], block["tile"], int(block["overlap"]),
                                  int(block["factor"]), int(block.get("margin", 0)))
    total = time.perf_counter() - t0
    latency = {"vae_decoder_head_run": calls["head"], "vae_up_tiles_run": calls["up"],
               "vae_up_tile_mean": calls["up"] / max(1, calls["tiles"]), "vae_tiled_decode": total,
               "vae_tiled_pass_mean": total - calls["head"]}
    if len(ups) > 1:  # each part's runs over all tiles
        latency.update({f"{name}_run": s for name, s in part_s.items()})
    return image, {"latency_s": latency, "up_tile_calls": calls["tiles"]}
