"""What tiled VAE decoding needs to match the whole decode: PSNR against the whole decode, by variant.

Issue 18 asks for tiled decode within 35 dB of the whole decode; `runtime/tiled_decode.py`
(independent tiles, linear blends) reaches 17.6 dB on the shipped tiny VAE. Two things differ
inside a tile: every GroupNorm normalises with the tile's own statistics, and the mid-block
attention sees only the tile. This script measures each fix on its own and together, in torch
(no export), so the design of a tiled decoder graph can follow the numbers:

- `independent`: today's tiles (each a whole decoder run);
- `global_norms`: every GroupNorm uses the whole image's statistics (an oracle: read from a
  whole decode), attention still per tile;
- `whole_mid`: post_quant_conv + conv_in + mid block (the global attention, at latent
  resolution, where activations are small) run once on the whole latent; only the up path is
  tiled, with its own per-tile norms;
- `whole_mid_global_norms`: both (oracle statistics);
- `whole_mid_iterated_k`: both, with the statistics a runner can get without a whole decode:
  pass 1 uses per-tile statistics; each tile also reports blend-weighted sums of every norm's
  input, whose totals give the next pass's statistics (k passes in all).

    python benchmarks/tiled_decode_bounds.py --out benchmarks/results/tiled_decode_bounds_cpu.json

With `--arch sd21` (the SD VAE, random weights with trained-like norm affines: 24 up-path norms
and conv_norm_out) it measures the split decoder's variants instead (benchmarks/_tiled_split.py:
edge_profile, oracle / jacobi / cv per blend margin), e.g.

    python benchmarks/tiled_decode_bounds.py --arch sd21 --image 256 --tile 16 --overlap 8 --margins 0,4 \
        --passes 6 --out benchmarks/results/tiled_decode_bounds_sd21_cpu.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from _checkout import use_checkout
from PIL import Image, ImageDraw

use_checkout()


def scene(size: int) -> np.ndarray:
    img = Image.new("RGB", (size, size), "white")
    d = ImageDraw.Draw(img)
    s = size / 128
    d.ellipse([10 * s, 12 * s, 70 * s, 72 * s], fill=(220, 30, 30))
    d.rectangle([60 * s, 50 * s, 118 * s, 110 * s], fill=(30, 60, 200))
    d.polygon([(20 * s, 120 * s), (60 * s, 80 * s), (100 * s, 124 * s)], fill=(40, 170, 60))
    return np.asarray(img, dtype=np.float32) / 255.0


class NormControl:
    """Per-GroupNorm statistics: record them, impose them, or accumulate blend-weighted sums.
    Patches GroupNorm.forward only inside `active()`."""

    def __init__(self):
        self.mode = "own"  # own | record | impose
        self.stats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.sums: dict[int, list] | None = None
        self.weight: torch.Tensor | None = None  # the tile's blend weights at latent resolution

    @contextlib.contextmanager
    def active(self):
        original = torch.nn.GroupNorm.forward
        control = self

        def forward(norm, x):
            return control.forward(norm, x, original)

        torch.nn.GroupNorm.forward = forward
        try:
            yield self
        finally:
            torch.nn.GroupNorm.forward = original

    def forward(self, norm, x, original):
        b = x.shape[0]
        g = x.reshape(b, norm.num_groups, -1)
        key = id(norm)
        if self.sums is not None:
            w = self._weight_like(x).reshape(1, 1, -1).expand(b, x.shape[1], -1).reshape(b, norm.num_groups, -1)
            acc = self.sums.setdefault(key, [0.0, 0.0, 0.0])
            acc[0] = acc[0] + (w * g).sum(-1)
            acc[1] = acc[1] + (w * g * g).sum(-1)
            acc[2] = acc[2] + w.sum(-1)
        if self.mode == "record":
            self.stats[key] = (g.mean(-1), g.var(-1, unbiased=False))
        if self.mode != "impose" or key not in self.stats:
            return original(norm, x)
        mean, var = self.stats[key]
        y = ((g - mean[..., None]) * torch.rsqrt(var[..., None] + norm.eps)).reshape_as(x)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return y * norm.weight.view(shape) + norm.bias.view(shape)

    def _weight_like(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4:
            size = x.shape[-2:]
        else:  # an attention norm sees [B, C, H * W]
            side = int(round(x.shape[-1] ** 0.5))
            size = (side, side)
        return F.interpolate(self.weight[None, None], size=size, mode="area")[0, 0]

    def totals_to_stats(self) -> None:
        self.stats = {k: (s / n, s2 / n - (s / n) ** 2) for k, (s, s2, n) in self.sums.items()}
        self.sums = None


def run(args) -> dict:
    from pocketdiff.export.components import VaeDecoderGraph
    from pocketdiff.runtime.tiled_decode import axis_weights, psnr_db, tile_starts, tiled_decode
    from pocketdiff.export.tiled_vae import VaeDecoderHead
    from pocketdiff.models import ModelConfig, load_or_build

    torch.manual_seed(0)
    vae = load_or_build(ModelConfig(pretrained=args.model)).vae.to(torch.float32).eval()
    graph = VaeDecoderGraph(vae).eval()
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    x = torch.from_numpy(scene(args.size)).permute(2, 0, 1)[None] * 2 - 1
    control = NormControl()
    with torch.no_grad(), control.active():
        lat = vae.encode(x).latent_dist.mean * vae.config.scaling_factor
        control.mode = "record"
        whole = graph(lat).clamp(0, 1).numpy()
        control.mode = "own"
        dec = graph.decoder
        mid = VaeDecoderHead(vae)(lat)  # whole-latent head
        oracle = dict(control.stats)
    H = lat.shape[-1]
    result = {"model": args.model, "image": args.size, "latent": H, "factor": factor, "variants": []}

    def up_path(h):
        for block in dec.up_blocks:
            h = block(h, None)
        return dec.conv_out(dec.conv_act(dec.conv_norm_out(h))) * 0.5 + 0.5

    for tile, overlap in args.tiles:
        starts = tile_starts(H, tile, overlap)
        axis = axis_weights(starts, tile)
        offsets = [(y, xx) for y in range(len(starts)) for xx in range(len(starts))]

        def decode_with(fn, accumulate=False):
            it = iter(offsets)

            def one(lat_tile):
                iy, ix = next(it)
                control.weight = torch.from_numpy(np.outer(axis[iy], axis[ix])).float()
                with torch.no_grad():
                    return fn(torch.from_numpy(lat_tile), starts[iy], starts[ix]).numpy()

            if accumulate:
                control.sums = {}
            img = tiled_decode(lat.numpy(), one, tile, overlap, factor)
            return np.clip(img, 0, 1)

        def whole_decoder(t, y, x):
            return graph(t)

        def mid_crop(t, y, x):
            return up_path(mid[:, :, y:y + tile, x:x + tile])

        def record(name, img, seconds, **extra):
            row = {"tile": tile, "overlap": overlap, "variant": name, "psnr_db": round(psnr_db(whole, img), 2),
                   "tiles": len(offsets), "seconds": round(seconds, 2), **extra}
            result["variants"].append(row)
            print(f"tile {tile} overlap {overlap} {name:28s} {row['psnr_db']:6.2f} dB")

        with control.active():
            for name, fn, mode in (("independent", whole_decoder, "own"), ("global_norms", whole_decoder, "impose"),
                                   ("whole_mid", mid_crop, "own"), ("whole_mid_global_norms", mid_crop, "impose")):
                control.mode, control.stats = mode, dict(oracle)
                t0 = time.perf_counter()
                record(name, decode_with(fn), time.perf_counter() - t0)
            control.mode, control.stats = "impose", {}  # pass 1: no statistics yet, so each norm uses its tile's
            t0 = time.perf_counter()
            for k in range(1, args.passes + 1):
                img = decode_with(mid_crop, accumulate=True)
                control.totals_to_stats()
                err = max(float((control.stats[key][0] - oracle[key][0]).abs().max()) for key in control.stats)
                record(f"whole_mid_iterated_{k}", img, time.perf_counter() - t0, passes=k, next_stats_max_mean_error=round(err, 5))
    return result


def run_sd21(args) -> dict:
    """The split decoder's variants on the SD VAE (or --model's), at one image size and tile."""
    from _tiled_split import Split, build_vae, edge_profile, run_split_variants

    from pocketdiff.runtime.tiled_decode import psnr_db

    vae = build_vae(args.arch, args.size, args.model)
    x = torch.from_numpy(scene(args.size)).permute(2, 0, 1)[None] * 2 - 1
    with torch.no_grad():
        lat = vae.encode(x).latent_dist.mean * vae.config.scaling_factor
    tile, overlap = args.tiles[0]
    split = Split(vae, lat, tile, overlap)
    result = {"model": args.arch if args.arch in ("sd21", "sd15") else args.model, "image": args.size, "latent": split.H,
              "factor": split.factor, "tile": tile, "overlap": overlap, "starts": split.starts,
              "norms": list(split.norms), "variants": []}

    def record(name, img, seconds, **extra):
        row = {"tile": tile, "overlap": overlap, "variant": name, "psnr_db": round(psnr_db(split.whole, img), 2),
               "tiles": len(split.starts) ** 2, "seconds": round(seconds, 2), **extra}
        result["variants"].append(row)
        print(f"image {args.size} tile {tile} overlap {overlap} {name:16s} {row['psnr_db']:6.2f} dB  ({row['seconds']:.0f} s)", flush=True)

    if "edge" in args.variants:
        result["edge_profile"] = edge_profile(split)
        print("edge profile (oracle statistics, one interior tile):", result["edge_profile"], flush=True)
    run_split_variants(split, args.variants, args.margins, args.passes, record)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--arch", default=None, help="sd21 / sd15: the split decoder's variants on the SD VAE (random weights)")
    p.add_argument("--model", default="pocketdiff:shapes-teacher", help="a pipeline folder, hub id or pocketdiff:NAME")
    p.add_argument("--size", "--image", dest="size", type=int, default=128, help="image size of the test scene (px)")
    p.add_argument("--tiles", default="16:8,24:12,16:4", help="tile:overlap pairs in latents")
    p.add_argument("--tile", type=int, default=None, help="one tile size in latents (with --overlap; replaces --tiles)")
    p.add_argument("--overlap", type=int, default=None)
    p.add_argument("--margins", default="0", help="--arch: blend margins in latents, comma-separated")
    p.add_argument("--variants", default="edge,oracle,jacobi,cv", help="--arch: edge, oracle, jacobi, cv")
    p.add_argument("--passes", type=int, default=4)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    args.tiles = [tuple(int(v) for v in pair.split(":")) for pair in args.tiles.split(",")]
    if args.tile is not None:
        args.tiles = [(args.tile, args.overlap if args.overlap is not None else args.tile // 2)]
    args.margins = [int(v) for v in args.margins.split(",")]
    args.variants = args.variants.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run_sd21(args) if args.arch else run(args)
    result.update({"torch": torch.__version__, "machine": platform.processor() or platform.machine(),
                   "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
                   "command": "python benchmarks/tiled_decode_bounds.py " + " ".join(sys.argv[1:])})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.arch:  # one file holds the runs of several sizes: replace this size's, keep the others
        runs = json.loads(out.read_text()).get("runs", []) if out.is_file() else []
        key = (result["image"], result["tile"], result["overlap"])
        runs = [r for r in runs if (r["image"], r["tile"], r["overlap"]) != key] + [result]
        result = {"runs": sorted(runs, key=lambda r: (r["image"], r["tile"], r["overlap"]))}
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
