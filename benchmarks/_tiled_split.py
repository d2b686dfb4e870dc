"""The split tiled decoder (export/tiled_vae.py) on a VAE with many up-path norms: the variants of
`tiled_decode_bounds.py --arch sd21`, through the real graphs and driver (torch, no export).

- `edge_profile`: one interior tile with the whole image's norm statistics (an oracle): PSNR of
  the pixels at least m latents from the tile's edge, and of the ring at exactly m latents. It
  measures how deep the up path's receptive field, cut by the tile edge, reaches into the tile.
- `oracle_m{M}`: one pass of `runtime.tiled_decode.tiled_decode_with_stats` with every tile given the
  oracle statistics, blend weights zero over M latents at edges facing a neighbour
  (`runtime.tiled_decode.axis_weights`): the ceiling of any statistics scheme at that margin.
- `jacobi_m{M}`: pass 1 own statistics, each later pass the previous pass's totals (own = 0), as
  the first tiled decoder did (margin 0 there): the driver with scheme "plain".
- `cv_m{M}`: `runtime.tiled_decode.tiled_decode_with_stats` itself: each later pass corrects every
  tile's own statistics by the previous totals against that tile's own statistics then (a
  control variate: mean shift, variance ratio).
"""
from __future__ import annotations

import time

import numpy as np
import torch


def build_vae(arch: str, image: int, model: str):
    """The VAE under test: arch sd21/sd15 builds the SD VAE with random weights and trained-like norm
    affines (identity affines measure an artefact); otherwise `model`'s VAE."""
    from pocketdiff.models import ModelConfig, build_vae, load_or_build, perturb_norm_affines

    if arch in ("sd21", "sd15"):
        vae = build_vae(arch, image)
        perturb_norm_affines(vae, 1)
    else:
        vae = load_or_build(ModelConfig(pretrained=model)).vae
    return vae.to(torch.float32).eval()


class Split:
    """Head features, the whole decode and the oracle statistics of one latent, and one tile pass."""

    def __init__(self, vae, lat: torch.Tensor, tile: int, overlap: int):
        self.overlap = overlap
        from pocketdiff.export.components import VaeDecoderGraph
        from pocketdiff.runtime.tiled_decode import first_pass_corrections, stats_from_sums, tile_starts
        from pocketdiff.export.tiled_vae import VaeDecoderHead, VaeUpPathTile

        self.H = lat.shape[-1]
        self.factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.tile, self.starts = tile, tile_starts(self.H, tile, overlap)
        self.up = VaeUpPathTile(vae, tile).eval()
        self.norms = (self.up.num_norms, self.up.groups)
        with torch.no_grad():
            self.feats = VaeDecoderHead(vae).eval()(lat)
            self.whole = np.clip(VaeDecoderGraph(vae).eval()(lat).numpy(), 0, 1)
            whole_up = VaeUpPathTile(vae, self.H).eval()
            _, sums = whole_up(self.feats, torch.ones(self.H, self.H), torch.from_numpy(first_pass_corrections(self.norms)), torch.ones(1))
        self.oracle = stats_from_sums(sums.numpy())

    def run_tile(self, y: int, x: int, weight: np.ndarray, stats: np.ndarray, own: float):
        t = self.tile
        with torch.no_grad():
            pixels, sums = self.up(self.feats[:, :, y:y + t, x:x + t].contiguous(), torch.from_numpy(weight).float(),
                                   torch.from_numpy(stats).float(), torch.full((1,), float(own)))
        return pixels.numpy().astype(np.float64), sums.numpy().astype(np.float64)

    def stats_error(self, stats: np.ndarray) -> float:
        return round(float(np.abs(stats - self.oracle).max()), 4)


def edge_profile(split: Split) -> list[dict]:
    """PSNR by latent distance from the edge of the most central tile, oracle statistics."""
    from pocketdiff.runtime.tiled_decode import psnr_db

    t, f = split.tile, split.factor
    y = split.starts[len(split.starts) // 2]
    pixels, _ = split.run_tile(y, y, np.ones((t, t)), split.oracle, 0.0)
    ref = split.whole[:, :, y * f:(y + t) * f, y * f:(y + t) * f]
    idx = np.arange(t * f)
    d = np.minimum(idx, t * f - 1 - idx) // f
    dist = np.minimum(d[:, None], d[None, :])
    rows = []
    for m in range(t // 2):
        rows.append({"distance": m, "psnr_db_at_least": round(psnr_db(ref[..., dist >= m], np.clip(pixels, 0, 1)[..., dist >= m]), 2),
                     "psnr_db_ring": round(psnr_db(ref[..., dist == m], np.clip(pixels, 0, 1)[..., dist == m]), 2)})
    return rows


def run_split_variants(split: Split, variants: list[str], margins: list[int], passes: int, record) -> None:
    """`record(name, image, seconds, **extra)` for each variant, margin and pass. `jacobi` and `cv` are
    `runtime.tiled_decode.tiled_decode_with_stats` itself, with scheme "plain" and "control_variate"."""
    from pocketdiff.runtime.tiled_decode import stats_from_sums, tiled_decode_with_stats

    tiles = len(split.starts) ** 2

    def head(z):
        return split.feats.numpy()

    def up_tile(features, weight, stats, own):
        with torch.no_grad():
            pixels, sums = split.up(*(torch.from_numpy(np.asarray(a, np.float32)) for a in (features, weight, stats, own)))
        return pixels.numpy(), sums.numpy()

    lat = np.zeros((1, 4, split.H, split.H), np.float32)  # the head above ignores it
    for m in margins:
        if "oracle" in variants:  # one pass of the driver, every tile given the oracle statistics (own = 0)
            totals = []

            def oracle_tile(features, weight, stats, own):
                pixels, sums = up_tile(features, weight, split.oracle, np.zeros(1, np.float32))
                totals.append(sums[:, :3])
                return pixels, sums

            t0 = time.perf_counter()
            img = tiled_decode_with_stats(lat, head, oracle_tile, split.tile, split.overlap, split.factor, split.norms, 1, margin=m)
            record(f"oracle_m{m}", np.clip(img, 0, 1), time.perf_counter() - t0, margin=m, passes=1, tile_runs=tiles,
                   next_stats_max_error=split.stats_error(stats_from_sums(np.sum(totals, axis=0))))
        for variant, scheme in (("jacobi", "plain"), ("cv", "control_variate")):
            if variant not in variants:
                continue
            t0 = time.perf_counter()

            def on_pass(p, image, variant=variant):
                record(f"{variant}_m{m}_{p}", np.clip(image, 0, 1), time.perf_counter() - t0, margin=m, passes=p, tile_runs=p * tiles)

            tiled_decode_with_stats(lat, head, up_tile, split.tile, split.overlap, split.factor, split.norms, passes, margin=m,
                                    scheme=scheme, on_pass=on_pass)
