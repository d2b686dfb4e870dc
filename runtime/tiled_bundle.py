"""A tiled decoder run from a bundle's loaded models (run-bundle, export's parity, evaluate): the head once on the whole
latent, then the up path over the tiles (runtime/onepass_decode.py for a norm-free up path, runtime/tiled_decode.py for
the iterated schemes). numpy only."""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import numpy as np

from pocketdiff.errors import PocketdiffError

from .components import TILED_DECODER
from .loaded_model import LoadedModel
from .onepass_decode import ONE_PASS, one_pass_decode_loaded, timed


def load_tiled_decoder(entries: dict, accelerator: str, names: tuple[str, ...] = TILED_DECODER) -> tuple[LoadedModel, list[LoadedModel]]:
    """The tiled decoder's head and its up path's models (`names`: the head, then the up tile or its parts)."""
    head = LoadedModel(names[0], entries[names[0]], accelerator)
    return head, [LoadedModel(n, entries[n], accelerator) for n in names[1:]]


def tiled_decode_bundle(head: LoadedModel, ups: Sequence[Callable[[], LoadedModel]], block: dict, latents: np.ndarray,
                        done: Optional[Callable] = None) -> tuple[np.ndarray, dict]:
    """[1, C, h, w] latents -> ([1, 3, H, W] pixels, {latency_s, up_tile_calls}) through the tiled models, with
    the manifest's vae_tiling block (tile, overlap, passes, factor, norms [K, G], margin, scheme). `ups`: the up
    path's models in order (one_pass: the up tile or its parts; the iterated schemes: the up tile alone), each as a
    function that gives it when its turn comes; `done(model)` once a model ran every tile."""
    from .tiled_decode import tiled_decode_with_stats

    if block.get("scheme") == ONE_PASS:  # a norm-free up path: every tile once, no statistics (runtime/onepass_decode.py)
        return one_pass_decode_loaded(head, ups, block, latents, done)
    (load,) = ups  # the iterated schemes' up path is one graph (manifest_check refuses parts)
    up = load()
    K, G = (int(v) for v in block["norms"])
    # the manifest declares (pixels, sums) in that order, with their shapes (runtime/manifest_check.py) and
    # the .tflite's names (check_component_io); the signature may list them in either order
    declared = [o.get("name") for o in up.entry.get("outputs") or []]
    if len(declared) != 2 or sorted(declared) != sorted(up.out_names):
        raise PocketdiffError(f"vae_up_tile: outputs {up.out_names} in the .tflite, the manifest declares (pixels, sums) as {declared}")
    sums_at = up.out_names.index(declared[1])
    calls = {"head": 0.0, "up": 0.0, "up_calls": 0}
    run_head = timed(calls, "head", lambda z: head({"latents": z}))
    run_up_all = timed(calls, "up", lambda features, weight, stats, own: up.run_all(
        {"features": features, "weight": weight, "stats": stats, "own": own}))

    def run_up(features, weight, stats, own):
        outs = run_up_all(features, weight, stats, own)
        return outs[1 - sums_at], outs[sums_at]

    t0 = time.perf_counter()
    image = tiled_decode_with_stats(latents, run_head, run_up, int(block["tile"]), int(block["overlap"]), int(block["factor"]),
                                    (K, G), int(block["passes"]), margin=int(block.get("margin", 0)),
                                    scheme=str(block.get("scheme", "plain")))
    total = time.perf_counter() - t0
    latency = {"vae_decoder_head_run": calls["head"], "vae_up_tiles_run": calls["up"],
               "vae_up_tile_mean": calls["up"] / max(1, calls["up_calls"]), "vae_tiled_decode": total,
               "vae_tiled_pass_mean": (total - calls["head"]) / int(block["passes"])}
    if done is not None:
        done(up)
    return image, {"latency_s": latency, "up_tile_calls": calls["up_calls"]}
