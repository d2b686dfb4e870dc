"""The one-pass tiled decoder in `pocketdiff export` (`vae_tiling.scheme: one_pass`).

Two components, as the iterated scheme (export/tiled_export.py), with a plainer up tile:
- `vae_decoder_head`: latents [1, C, h, w] -> features [1, F, h, w] (export/tiled_vae.VaeDecoderHead)
- `vae_up_tile`: features [1, F, t, t] -> pixels [1, 3, t*f, t*f] (export/onepass_vae.VaeUpPathPlain)

The decoder must be norm-free in its up path: a `pocketdiff distill-decoder` output given as
`model.vae` (fine-tuned to the original), or, with `vae_tiling.fold_norms: true`, the pipeline's
decoder folded here on calibration latents without a fine-tune (random-weight builds: the mechanics
and the budgets; its quality against the original decoder is reported, not enforced).
The parity decodes the golden scene through the two .tflite files (the runner's code) against the
same norm-free decoder whole in torch: the tiling's own error, PSNR >= `vae_tiling.min_psnr_db`.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Optional

import numpy as np
import torch

from pocketdiff.errors import PocketdiffError
from pocketdiff.normfree import calibrate_group_stats, fold_group_norms, has_group_norm_up_path, up_path_norm_names

from .components import VaeDecoderGraph
from pocketdiff.runtime.components import TILED_DECODER, up_tile_parts
from pocketdiff.runtime.onepass_decode import ONE_PASS, tiles_area_ratio
from pocketdiff.runtime.tiled_decode import psnr_db

HEAD, UP_TILE = TILED_DECODER


@dataclasses.dataclass
class OnePassDecoder:
    graphs: dict  # name -> (module, {input name: tensor})
    block: dict  # the manifest's vae_tiling block (without the parity result)
    vae: torch.nn.Module  # the norm-free VAE the graphs come from (the parity's reference)
    residual_scale: Optional[float] = None
    fold: Optional[dict] = None  # fold_norms: what was folded here and its PSNR against the original decoder


@torch.no_grad()
def fold_here(vae: torch.nn.Module, latents: torch.Tensor, seed: int, extra: int = 2) -> torch.nn.Module:
    """A copy of `vae` with its up path folded on `latents` (scaled, as the sampler gives them) and `extra` random latents."""
    folded = copy.deepcopy(vae)
    sf = float(vae.config.scaling_factor)
    gen = torch.Generator().manual_seed(seed)
    calib = [latents / sf] + [torch.randn(latents.shape, generator=gen) / sf for _ in range(extra)]
    fold_group_norms(folded, calibrate_group_stats(folded, calib, up_path_norm_names(folded)))
    return folded


@torch.no_grad()
def split_one_pass(vae: torch.nn.Module, tiling, latents: torch.Tensor, parity_lat: torch.Tensor, factor: int,
                   residual_scale=None, max_tensor_mb: Optional[float] = None, seed: int = 0) -> OnePassDecoder:
    """Head and plain up tile of a norm-free `vae` (folded here with `tiling.fold_norms`); the tile's
    largest tensor checked against `max_tensor_mb` before any conversion."""
    from .onepass_vae import VaeUpPathPart, VaeUpPathPlain, check_tile_budget, plan_up_parts
    from .residual_scale import rescale_residual_stream
    from .tiled_vae import VaeDecoderHead

    _, _, h, w = latents.shape
    t = tiling.tile
    if t > min(h, w):
        raise PocketdiffError(f"vae_tiling.tile: {t} latents is larger than the latent {h}x{w}")
    fold = None
    if has_group_norm_up_path(vae):
        if not tiling.fold_norms:
            raise PocketdiffError("vae_tiling.scheme one_pass: the decoder's up path has GroupNorms; give a norm-free decoder "
                                  "(pocketdiff distill-decoder) as model.vae, or set vae_tiling.fold_norms: true (no fine-tune)")
        original = vae
        vae = fold_here(vae, parity_lat, seed)
        fold = {"folded_norms": len(up_path_norm_names(original)), "calibration_latents": 3,
                "psnr_vs_original_db": round(psnr_db(np.clip(VaeDecoderGraph(original).eval()(parity_lat).numpy(), 0, 1),
                                                     np.clip(VaeDecoderGraph(vae).eval()(parity_lat).numpy(), 0, 1)), 3)}
    if residual_scale is not None and residual_scale != 1.0:
        vae = copy.deepcopy(vae)
        rescale_residual_stream(vae.decoder, residual_scale)
    head, up = VaeDecoderHead(vae).eval(), VaeUpPathPlain(vae).eval()
    feats = head(latents)
    F = int(feats.shape[1])
    largest = check_tile_budget(up, F, t, max_tensor_mb) if max_tensor_mb else None
    graphs = {HEAD: (head, {"latents": latents})}
    stages = None
    if tiling.up_parts == 1:
        graphs[UP_TILE] = (up, {"features": feats[:, :, :t, :t].contiguous()})
    else:  # the up path in graphs run one after another: each one's fixed input is its predecessor's output
        stages = plan_up_parts(vae, tiling.up_parts)
        x, key = feats[:, :, :t, :t].contiguous(), "features"
        for name, layers in zip(up_tile_parts(tiling.up_parts), stages):
            part = VaeUpPathPart(vae, layers).eval()
            graphs[name] = (part, {key: x})
            x, key = part(x).contiguous(), "hidden"
    block = {"tile": t, "overlap": tiling.overlap, "margin": tiling.margin, "scheme": ONE_PASS, "passes": 1,
             "factor": int(factor), "features": F, "components": [HEAD, *up_tile_parts(tiling.up_parts)],
             **({"up_stages": stages} if stages else {}),
             "up_area_ratio": round(tiles_area_ratio(h, w, t, tiling.overlap), 4),
             **({"up_tile_max_tensor_mb": round(largest, 2)} if largest is not None else {})}
    return OnePassDecoder(graphs, block, vae, residual_scale, fold)
