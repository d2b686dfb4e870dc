"""The tiled VAE decoder in `pocketdiff export` (config `vae_tiling`): two components instead of
`vae_decoder`, their fixed inputs, the manifest's `vae_tiling` block and the tiled-decode parity.

- `vae_decoder_head`: latents [1, C, h, w] -> features [1, F, h, w] (export/tiled_vae.py)
- `vae_up_tile`: features [1, F, t, t], weight [t, t], stats [K, 2, G], own [1] ->
  pixels [1, 3, t*f, t*f] (output_0), sums [K, 5, G] (output_1)

Both go through the same rewrites / litert-torch / weight storage / delegate path as the other
components. After conversion, `tiled_parity` decodes the golden latents through the two .tflite
files on the CPU (the runner's code, runtime/run_bundle.py) and compares the image with the whole
torch decode: PSNR >= `vae_tiling.min_psnr_db`, else ParityError.
"""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from pocketdiff.errors import ParityError, PocketdiffError

from .components import VaeDecoderGraph
from pocketdiff.runtime.components import TILED_DECODER, expand
from pocketdiff.runtime.tiled_decode import axis_weights, control_variate, first_pass_corrections, psnr_db, stats_from_sums, tile_starts

HEAD, UP_TILE = TILED_DECODER


def expand_components(components: list[str], tiled: bool, up_parts: int = 1) -> list[str]:
    """The components the export converts: vae_decoder replaced by the tiled graphs (the registry's tiles, the up
    tile as `up_parts` graphs)."""
    return expand(components, tiled, up_parts)


@dataclasses.dataclass
class SplitDecoder:
    """The two graphs of a tiled export with their fixed inputs, and what the runtime needs."""

    graphs: dict  # name -> (module, {input name: tensor})
    block: dict  # the manifest's vae_tiling block (without the parity result)
    residual_scale: Optional[float] = None  # applied to the decoder before the split (rewrites.residual_scale)


@torch.no_grad()
def split_decoder(vae: torch.nn.Module, tiling, latents: torch.Tensor, factor: int, residual_scale=None) -> SplitDecoder:
    """Head and up-path tile of `vae` (a copy; with `residual_scale`, its residual stream scaled
    once for both graphs, so the features between them agree). The tile's golden inputs: the
    first tile of the head's features on `latents`, its blend weights (with `tiling.margin`), and
    what a later pass of `tiling.scheme` feeds it, from a first own-statistics pass over that tile:
    the statistics themselves with own = 0 ("plain"), or the control variate of those statistics
    against the tile's own with own = 1 ("control_variate")."""
    from .residual_scale import rescale_residual_stream
    from .tiled_vae import VaeDecoderHead, VaeUpPathTile

    _, _, h, w = latents.shape
    t = tiling.tile
    if t > min(h, w):
        raise PocketdiffError(f"vae_tiling.tile: {t} latents is larger than the latent {h}x{w}")
    if residual_scale is not None and residual_scale != 1.0:
        vae = copy.deepcopy(vae)
        rescale_residual_stream(vae.decoder, residual_scale)
    head = VaeDecoderHead(vae).eval()
    up = VaeUpPathTile(vae, t).eval()
    feats = head(latents)
    ys, xs = tile_starts(h, t, tiling.overlap), tile_starts(w, t, tiling.overlap)
    weight = torch.from_numpy(np.outer(axis_weights(ys, t, tiling.margin)[0], axis_weights(xs, t, tiling.margin)[0]).astype(np.float32))
    tile = feats[:, :, :t, :t].contiguous()
    norms = (int(up.num_norms), int(up.groups))
    _, sums = up(tile, weight, torch.from_numpy(first_pass_corrections(norms)), torch.ones(1))
    stats = stats_from_sums(sums.numpy())
    if tiling.scheme == "plain":
        later, own = stats, torch.zeros(1)
    else:  # a perturbed copy of the statistics, so the golden correction is not the identity
        later, own = control_variate(stats * np.float32(1.05), sums.numpy()[:, 3:5]), torch.ones(1)
    graphs = {
        HEAD: (head, {"latents": latents}),
        UP_TILE: (up, {"features": tile, "weight": weight, "stats": torch.from_numpy(later), "own": own}),
    }
    block = {"tile": t, "overlap": tiling.overlap, "margin": tiling.margin, "scheme": tiling.scheme, "passes": tiling.passes,
             "factor": int(factor), "norms": list(norms), "features": int(feats.shape[1]), "components": list(TILED_DECODER)}
    return SplitDecoder(graphs, block, residual_scale)


def _scene(size: int) -> np.ndarray:
    """A deterministic picture [3, size, size] in [-1, 1]: a gradient sky, a disc, a bar (numpy only)."""
    y, x = np.mgrid[0:size, 0:size] / max(1, size - 1)
    img = np.stack([0.3 + 0.5 * y, 0.5 + 0.3 * x, 0.9 - 0.4 * y])
    disc = (x - 0.35) ** 2 + (y - 0.4) ** 2 < 0.06
    img[:, disc] = np.array([0.9, 0.15, 0.1])[:, None]
    bar = (np.abs(x - 0.7) < 0.12) & (y > 0.45) & (y < 0.9)
    img[:, bar] = np.array([0.1, 0.25, 0.8])[:, None]
    return (img * 2.0 - 1.0).astype(np.float32)


@torch.no_grad()
def parity_latents(vae: torch.nn.Module, latent_size: int, factor: int) -> torch.Tensor:
    """Latents of a picture, as the sampler would hand them to the decoder (the VAE's own encoder,
    scaled): the tiled parity's input. Random normal latents have no image's structure."""
    x = torch.from_numpy(_scene(latent_size * factor))[None]
    mean = vae.encode(x).latent_dist.mean
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return ((mean - shift) * float(vae.config.scaling_factor)).contiguous()


def tiled_parity(out: Path, entries: dict, vae: torch.nn.Module, latents: torch.Tensor, block: dict, min_psnr_db: float) -> dict:
    """Decode `latents` through the bundle's two .tflite files on the CPU (LiteRT, the runner's
    code) and compare with the whole torch decode: PSNR of the [0, 1] images. Raises ParityError
    naming `vae_tiling.min_psnr_db` when below."""
    from pocketdiff.runtime.manifest_check import tiled_components
    from pocketdiff.runtime.run_bundle import load_tiled_decoder, tiled_decode_bundle

    with torch.no_grad():
        whole = np.clip(VaeDecoderGraph(vae).eval()(latents).numpy(), 0.0, 1.0)
    names = tiled_components(block)
    paths = {n: {**entries[n], "_path": str(out / entries[n]["path"])} for n in names}
    head, ups = load_tiled_decoder(paths, "cpu", names)
    try:
        image, timing = tiled_decode_bundle(head, [(lambda m=m: m) for m in ups], block, latents.numpy())
    finally:
        for model in (head, *ups):
            model.close()
    if not np.isfinite(image).all():
        raise ParityError("vae_tiling: the tiled decode through the .tflite files has NaN/Inf values")
    psnr = psnr_db(whole, np.clip(image, 0.0, 1.0))
    rep = {"psnr_db": round(psnr, 3), "min_psnr_db": min_psnr_db, "passes": block["passes"], "accelerator": "cpu",
           "latency_s": {k: round(v, 4) for k, v in timing["latency_s"].items()},
           "up_tile_calls": timing["up_tile_calls"]}
    if not psnr >= min_psnr_db:
        raise ParityError(f"vae_tiling: tiled decode (.tflite, cpu, {block['passes']} passes) vs the whole torch decode: "
                          f"PSNR {psnr:.2f} dB < vae_tiling.min_psnr_db={min_psnr_db}")
    return rep
