"""Decoder paths against the whole VAE decoder: FLOPs, parameters, largest tensor, PSNR (and FD where a
domain CLIP is given), and with `--delegate` each path's .tflite graphs timed on the LiteRT GPU delegate.

Paths (each a list of graphs with their calls per image):
- `whole`: the whole decoder (VaeDecoderGraph) once: the reference of every ratio.
- `tiled_stats`: the head once, then `passes` x tiles runs of the up path with norm statistics fed in
  (export/tiled_vae.py, control-variate scheme), as configs/sd21/export*.yaml had it.
- `lowres_stats` (`--lowres-stats DOWN ...`): the head once, the up path once on its features
  average-pooled by DOWN (every norm's statistics, 1/DOWN^2 of the work), then every tile once with them.
- `lowres_cv`: the same, but each tile keeps its own statistics, corrected by the pooled pass's
  whole-image ones against those of the tile's own region (one more pooled run per tile).
- `one_pass`: the head once, then every tile once through a norm-free up path (pocketdiff/normfree.py,
  runtime/onepass_decode.py). With `--student DIR` (a `pocketdiff distill-decoder` output) its decoder,
  else the user's decoder folded on calibration latents here (no fine-tune: mechanics at random weights).
- `tiny`: diffusers' AutoencoderTiny decoder (TAESD layout) for the same latent channels and factor,
  untrained: its cost only.

`--latents-from PIPELINE` decodes that model's samples for the held-out captions instead of the images'
own latents (FD against the real images: a decoder's cost on what users decode, where the generator's own
FD is the scale).

FLOPs and the largest tensor come from meta tensors (torch.utils.flop_counter; no compute), so SD size
costs seconds; PSNR is of [0, 1] images against the whole decode on the same latents: images of
`--data` encoded by the VAE (held-out items after `--train-items` of the seed-0 shuffle), or the
project's deterministic scene at SD size. `psnr_tiling_db` (one_pass): against the same norm-free
decoder untiled, the tiling's own error.

    python benchmarks/decoder_paths.py --arch sd21 --resolution 512 --out benchmarks/results/decoder_paths_sd21_cpu.json
    python benchmarks/decoder_paths.py --vae runs/openmoji_vae/pipeline --student runs/openmoji_decoder/vae \
        --data openmoji --resolution 64 --one-pass 8x16/4/2 --out benchmarks/results/decoder_paths_openmoji_cpu.json
    # on a GPU machine (Vulkan): add --delegate (converts every graph with litert-torch, then times it)
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _checkout import use_checkout

use_checkout()


@dataclasses.dataclass
class Graph:
    name: str
    module: torch.nn.Module
    inputs: dict  # name -> tensor (real values; meta copies are made for counting)
    calls: int  # runs per decoded image


@dataclasses.dataclass
class Path_:
    name: str
    graphs: list
    decode: object = None  # latents [1, C, h, w] (numpy) -> image [1, 3, H, W] in [0, 1]; None: no PSNR
    notes: str = ""


def count_flops(module: torch.nn.Module, inputs: dict) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    meta = copy.deepcopy(module).to("meta")
    args = [torch.empty(v.shape, dtype=v.dtype, device="meta") for v in inputs.values()]
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        meta(*args)
    return int(counter.get_total_flops())


def used_params(graphs: list) -> int:
    """Parameters the graphs' forwards use (leaf modules that ran; shared ones once): what their .tflite files store."""
    seen: dict = {}
    for g in graphs:
        meta = copy.deepcopy(g.module).to("meta")
        names = {id(p): n for n, p in meta.named_parameters()}
        ran = []
        hooks = [m.register_forward_hook(lambda m, i, o: ran.append(m)) for m in meta.modules() if not list(m.children())]
        with torch.no_grad():
            meta(*[torch.empty(v.shape, dtype=v.dtype, device="meta") for v in g.inputs.values()])
        for h in hooks:
            h.remove()
        for m in ran:
            for p in m.parameters(recurse=False):
                seen[names.get(id(p), id(p))] = p.numel()  # a graph's parameter names are the decoder's
    return int(sum(seen.values()))


def largest_tensor_mb(module: torch.nn.Module, inputs: dict) -> float:
    from pocketdiff.export.onepass_vae import largest_activation_mb

    meta = copy.deepcopy(module).to("meta")
    return largest_activation_mb(meta, tuple(torch.empty(v.shape, dtype=v.dtype, device="meta") for v in inputs.values()))


def _np_fn(module):
    def run(*arrays):
        with torch.no_grad():
            out = module(*[torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)) for a in arrays])
        return tuple(o.numpy() for o in out) if isinstance(out, tuple) else out.numpy()
    return run


def whole_path(vae, latents: torch.Tensor) -> Path_:
    from pocketdiff.export.components import VaeDecoderGraph

    g = VaeDecoderGraph(vae).eval()
    return Path_("whole", [Graph("vae_decoder", g, {"latents": latents}, 1)], lambda z: _np_fn(g)(z))


def tiled_stats_path(vae, latents: torch.Tensor, tile: int, overlap: int, margin: int, passes: int, with_psnr: bool) -> Path_:
    from pocketdiff.runtime.tiled_decode import first_pass_corrections, tile_starts, tiled_decode_with_stats
    from pocketdiff.export.tiled_vae import VaeDecoderHead, VaeUpPathTile

    head, up = VaeDecoderHead(vae).eval(), VaeUpPathTile(vae, tile).eval()
    _, _, h, w = latents.shape
    n = len(tile_starts(h, tile, overlap)) * len(tile_starts(w, tile, overlap))
    F = vae.config.block_out_channels[-1]
    norms = (up.num_norms, up.groups)
    up_in = {"features": torch.zeros(1, F, tile, tile), "weight": torch.ones(tile, tile),
             "stats": torch.from_numpy(first_pass_corrections(norms)), "own": torch.ones(1)}
    graphs = [Graph("vae_decoder_head", head, {"latents": latents}, 1), Graph("vae_up_tile", up, up_in, passes * n)]

    def decode(z):
        return tiled_decode_with_stats(z, _np_fn(head), _np_fn(up), tile, overlap, int(vae_factor(vae)), norms, passes,
                                       margin=margin, scheme="control_variate")

    return Path_(f"tiled_stats_{passes}pass", graphs, decode if with_psnr else None,
                 f"tile {tile}, overlap {overlap}, margin {margin}, {n} tiles x {passes} passes")


def lowres_stats(features: np.ndarray, up_low, down: int, norms: tuple[int, int]) -> np.ndarray:
    """[K, 2, G] statistics of every up-path norm, estimated from one run of the up path on the head's
    features average-pooled by `down` (1 / down^2 of its work): `up_low` is the up-path graph at the
    pooled size (`export.tiled_vae.VaeUpPathTile`), run with its own statistics and unit weights."""
    from pocketdiff.errors import PocketdiffError
    from pocketdiff.runtime.tiled_decode import first_pass_corrections, stats_from_sums

    f = np.asarray(features, dtype=np.float32)
    _, c, h, w = f.shape
    if h % down or w % down:
        raise PocketdiffError(f"lowres_stats: features {h}x{w} do not divide by the statistics pass's factor {down}")
    pooled = f.reshape(1, c, h // down, down, w // down, down).mean(axis=(3, 5), dtype=np.float64).astype(np.float32)
    weight = np.ones((h // down, w // down), dtype=np.float32)
    _, sums = up_low(np.ascontiguousarray(pooled), weight, first_pass_corrections(norms), np.ones((1,), dtype=np.float32))
    return stats_from_sums(np.asarray(sums, dtype=np.float64)[:, :3])


def lowres_stats_path(vae, latents: torch.Tensor, tile: int, overlap: int, margin: int, down: int) -> Path_:
    """The head once, the up path once on its features pooled by `down` (the norms' statistics), then
    every tile once with those statistics (the user's decoder, no training)."""
    from pocketdiff.runtime.tiled_decode import first_pass_corrections, tile_starts, tiled_decode_with_stats
    from pocketdiff.export.tiled_vae import VaeDecoderHead, VaeUpPathTile

    _, _, h, w = latents.shape
    tile = min(tile, h)
    head, up, low = VaeDecoderHead(vae).eval(), VaeUpPathTile(vae, tile).eval(), VaeUpPathTile(vae, h // down).eval()
    n = len(tile_starts(h, tile, overlap)) * len(tile_starts(w, tile, overlap))
    F = vae.config.block_out_channels[-1]
    norms = (up.num_norms, up.groups)
    corr = torch.from_numpy(first_pass_corrections(norms))
    low_in = {"features": torch.zeros(1, F, h // down, w // down), "weight": torch.ones(h // down, w // down), "stats": corr, "own": torch.ones(1)}
    up_in = {"features": torch.zeros(1, F, tile, tile), "weight": torch.ones(tile, tile), "stats": corr, "own": torch.zeros(1)}
    graphs = [Graph("vae_decoder_head", head, {"latents": latents}, 1), Graph("vae_up_stats", low, low_in, 1),
              Graph("vae_up_tile", up, up_in, n)]
    fac = int(vae_factor(vae))

    def decode(z):
        feats = _np_fn(head)(z)
        given = lowres_stats(feats, _np_fn(low), down, norms)
        return tiled_decode_with_stats(z, lambda _: feats, _np_fn(up), tile, overlap, fac, norms, 1, margin=margin, given=given)

    return Path_(f"lowres_stats_d{down}_t{tile}", graphs, decode,
                 f"statistics from the up path on features pooled {down}x, then tile {tile}, overlap {overlap}, margin {margin}, {n} tiles, 1 pass; the user's decoder")


def lowres_cv_path(vae, latents: torch.Tensor, tile: int, overlap: int, margin: int, down: int) -> Path_:
    """As lowres_stats, but each tile keeps its own statistics, shifted and scaled by the pooled pass's
    whole-image statistics against those of the tile's own region (one more pooled run per tile)."""
    from pocketdiff.runtime.tiled_decode import control_variate, first_pass_corrections, tile_starts, tiled_decode_with_stats
    from pocketdiff.export.tiled_vae import VaeDecoderHead, VaeUpPathTile

    _, _, h, w = latents.shape
    tile = min(tile, h)
    head, up = VaeDecoderHead(vae).eval(), VaeUpPathTile(vae, tile).eval()
    low, region = VaeUpPathTile(vae, h // down).eval(), VaeUpPathTile(vae, tile // down).eval()
    n = len(tile_starts(h, tile, overlap)) * len(tile_starts(w, tile, overlap))
    F = vae.config.block_out_channels[-1]
    norms = (up.num_norms, up.groups)
    corr = torch.from_numpy(first_pass_corrections(norms))
    low_in = {"features": torch.zeros(1, F, h // down, w // down), "weight": torch.ones(h // down, w // down), "stats": corr, "own": torch.ones(1)}
    reg_in = {"features": torch.zeros(1, F, tile // down, tile // down), "weight": torch.ones(tile // down, tile // down), "stats": corr, "own": torch.ones(1)}
    up_in = {"features": torch.zeros(1, F, tile, tile), "weight": torch.ones(tile, tile), "stats": corr, "own": torch.ones(1)}
    graphs = [Graph("vae_decoder_head", head, {"latents": latents}, 1), Graph("vae_up_stats", low, low_in, 1),
              Graph("vae_up_region", region, reg_in, n), Graph("vae_up_tile", up, up_in, n)]
    fac = int(vae_factor(vae))

    def decode(z):
        feats = _np_fn(head)(z)
        given = lowres_stats(feats, _np_fn(low), down, norms)

        def first(y, x):
            own = lowres_stats(feats[:, :, y:y + tile, x:x + tile], _np_fn(region), down, norms)
            return control_variate(given, own)

        return tiled_decode_with_stats(z, lambda _: feats, _np_fn(up), tile, overlap, fac, norms, 1, margin=margin, first=first)

    return Path_(f"lowres_cv_d{down}_t{tile}", graphs, decode,
                 f"own statistics corrected by a {down}x-pooled pass (whole against the tile's region), tile {tile}, overlap {overlap}, margin {margin}, {n} tiles, 1 pass")


def one_pass_path(student, latents: torch.Tensor, tile, overlap: int, margin: int, notes: str) -> Path_:
    """The tiled one-pass decode of a norm-free decoder (`tile`: [rows, columns] of latents)."""
    from pocketdiff.runtime.onepass_decode import one_pass_decode
    from pocketdiff.runtime.tiled_decode import tile_starts
    from pocketdiff.export.tiled_vae import VaeDecoderHead
    from pocketdiff.export.onepass_vae import VaeUpPathPlain

    head, up = VaeDecoderHead(student).eval(), VaeUpPathPlain(student).eval()
    _, _, h, w = latents.shape
    th, tw = min(tile[0], h), min(tile[1], w)
    n = len(tile_starts(h, th, overlap)) * len(tile_starts(w, tw, overlap))
    F = student.config.block_out_channels[-1]
    graphs = [Graph("vae_decoder_head", head, {"latents": latents}, 1), Graph("vae_up_tile", up, {"features": torch.zeros(1, F, th, tw)}, n)]
    fac = int(vae_factor(student))

    def decode(z):
        return one_pass_decode(z, _np_fn(head), _np_fn(up), [th, tw], overlap, fac, margin)

    return Path_(f"one_pass_{th}x{tw}_o{overlap}_m{margin}", graphs, decode,
                 f"tile {th}x{tw}, overlap {overlap}, margin {margin}, {n} tiles, 1 pass; {notes}")


def norm_free_untiled(student, latents: torch.Tensor) -> Path_:
    from pocketdiff.export.components import VaeDecoderGraph

    whole = VaeDecoderGraph(student).eval()
    return Path_("norm_free_untiled", [Graph("vae_decoder", whole, {"latents": latents}, 1)], lambda z: _np_fn(whole)(z),
                 "the norm-free decoder as one graph (its largest tensor is the whole decoder's)")


def tiny_path(vae, latents: torch.Tensor) -> Path_:
    from diffusers import AutoencoderTiny

    ups = int(np.log2(vae_factor(vae)))
    tiny = AutoencoderTiny(latent_channels=int(vae.config.latent_channels), num_decoder_blocks=(3,) * ups + (1,),
                           decoder_block_out_channels=(64,) * (ups + 1), num_encoder_blocks=(1,) * (ups + 1),
                           encoder_block_out_channels=(64,) * (ups + 1)).eval()

    class TinyDecoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = tiny.decoder

        def forward(self, latents):
            return self.decoder(latents)

    return Path_("tiny_untrained", [Graph("vae_decoder", TinyDecoder().eval(), {"latents": latents}, 1)], None,
                 "AutoencoderTiny decoder (64 channels), untrained: cost only")


def vae_factor(vae) -> int:
    return 2 ** (len(vae.config.block_out_channels) - 1)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    from pocketdiff.runtime.tiled_decode import psnr_db

    return psnr_db(np.clip(a, 0, 1), np.clip(b, 0, 1))


def delegate_times(path: Path_, work: Path, repeats: int) -> dict:
    """Each graph of `path` converted (project rewrites, fp16 weights) and timed on the GPU delegate (fp16)."""
    from pocketdiff.runtime.delegate import run_on_delegate
    from pocketdiff.export.exporter import VerifyConfig, export_component
    from pocketdiff.export.parity import ParityConfig
    from pocketdiff.export.rewrites import RewriteConfig

    out = {}
    for g in path.graphs:
        f = work / f"{path.name}_{g.name}.tflite"
        rep = export_component(g.name, g.module, g.inputs, f, RewriteConfig(conv_budget_mb=3.5, conv_budget_scope="input",
                                                                            attention_budget_mb=64), "fp16",
                               VerifyConfig(delegate=False), ParityConfig())
        run = run_on_delegate(f, {k: v.numpy() for k, v in g.inputs.items()}, precisions=("fp16",), repeats=repeats, warmup=1)
        out[g.name] = {"fully_accelerated": bool(run.compiled and run.fully_accelerated), "latency_s": run.latency_s.get("fp16"),
                       "calls": g.calls, "driver": run.driver, "adapter": run.adapter, "bytes": rep.get("bytes"), "error": run.error or None}
        f.unlink(missing_ok=True)
    total = sum(v["latency_s"] * v["calls"] for v in out.values()) if all(v["latency_s"] for v in out.values()) else None
    return {"graphs": out, "per_image_s": total}


def measure(paths: list, latents_list: list, reference, delegate: bool, repeats: int) -> list:
    rows = []
    whole = paths[0]
    base_flops = sum(count_flops(g.module, g.inputs) * g.calls for g in whole.graphs)
    ref_images = [reference(z.numpy()) for z in latents_list] if latents_list else []
    for p in paths:
        t0 = time.perf_counter()
        flops = sum(count_flops(g.module, g.inputs) * g.calls for g in p.graphs)
        row = {"name": p.name, "notes": p.notes, "flops": flops, "flops_ratio": round(flops / base_flops, 4),
               "max_tensor_mb": round(max(largest_tensor_mb(g.module, g.inputs) for g in p.graphs), 2),
               "params": used_params(p.graphs),
               "graphs": {g.name: g.calls for g in p.graphs}}
        if p.decode is not None and latents_list:
            images = [p.decode(z.numpy()) for z in latents_list]
            vals = [psnr(r, i) for r, i in zip(ref_images, images)]
            row["psnr_db"] = round(float(np.mean(vals)), 3) if p is not whole else None  # the reference itself
            row["psnr_db_min"] = round(float(np.min(vals)), 3) if p is not whole else None
            row["_images"] = images
        if delegate:
            with tempfile.TemporaryDirectory(prefix="decoder-paths-") as tmp:
                row["delegate"] = delegate_times(p, Path(tmp), repeats)
        row["measure_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(f"{p.name}: flops x{row['flops_ratio']}, max tensor {row['max_tensor_mb']} MB, psnr {row.get('psnr_db')}", file=sys.stderr, flush=True)
    if delegate and rows[0].get("delegate", {}).get("per_image_s"):
        base = rows[0]["delegate"]["per_image_s"]
        for r in rows:
            t = r.get("delegate", {}).get("per_image_s")
            r["delegate_time_ratio"] = round(t / base, 4) if t else None
    return rows


def add_fd(rows: list, real_images: torch.Tensor, clip: str) -> str:
    """Each decoded row's FD (CLIP features of `clip`) against the real images its latents were encoded
    from, and `fd_ratio` to the whole decoder's FD on the same latents."""
    from pocketdiff.evaluate import MetricConfig, MetricSetup

    setup = MetricSetup(MetricConfig(features="clip", clip=clip, fd=True, clip_score=False, reference_clip_samples=0))
    for r in rows:
        if "_images" in r:
            images = torch.from_numpy(np.concatenate(r["_images"])).clamp(0, 1)
            r["fd"] = round(setup.fd_between(images, real_images), 4)
    base = rows[0].get("fd")
    for r in rows:
        if base and r.get("fd") is not None:
            r["fd_ratio"] = round(r["fd"] / base, 4)
    return (f"{setup.fd_label} of each path's decodes of the {len(real_images)} held-out images' latents against those "
            f"real images; fd_ratio: to the whole decoder's FD")


def _data_latents(vae, args) -> list:
    """Held-out images of `--data` (items after --train-items of the seed-0 shuffle), encoded: scaled latents [1, C, h, w]."""
    from pocketdiff.config import DataConfig
    from pocketdiff.data import ImageCaptionDataset, collate, load_captioned_dataset

    ds = load_captioned_dataset(DataConfig(source=args.data, resolution=args.resolution, max_samples=args.train_items + args.images))
    items = ImageCaptionDataset(ds)
    held = collate([items[i] for i in range(args.train_items, len(ds))])
    x = held["pixel_values"].float()
    args.real_images = ((x + 1) / 2).clamp(0, 1)  # [-1, 1] -> [0, 1]: the FD reference set (--clip)
    if args.latents_from:  # what users decode: a model's samples for the held-out captions
        from pocketdiff.models import load_pipeline
        from pocketdiff.sampling import generate

        pipe = load_pipeline(args.latents_from)
        z = generate(pipe, list(held["text"]), steps=args.latent_steps, guidance_scale=args.latent_guidance, seed=args.seed,
                     output_type="latent", progress=True)
    else:
        with torch.no_grad():
            z = vae.encode(x).latent_dist.mean * float(vae.config.scaling_factor)
    return [z[i:i + 1].contiguous() for i in range(z.shape[0])]


def _scene_latents(vae, args) -> list:
    from pocketdiff.export.tiled_export import parity_latents

    f = vae_factor(vae)
    return [parity_latents(vae, args.resolution // f, f)]


def _load(args):
    from pocketdiff.models import build_vae, load_vae, perturb_norm_affines

    if args.vae:
        return load_vae(args.vae).float().eval().requires_grad_(False)
    vae = build_vae(args.arch, args.resolution, args.seed).float().eval().requires_grad_(False)
    perturb_norm_affines(vae, args.seed + 1)  # trained-like norm affines, as export's perturb_norms
    return vae


def _student(vae, latents: list, args):
    from pocketdiff.models import load_vae
    from pocketdiff.normfree import calibrate_group_stats, fold_group_norms, up_path_norm_names

    if args.student:
        return load_vae(args.student).float().eval().requires_grad_(False), f"distilled decoder {args.student}"
    student = copy.deepcopy(vae)
    gen = torch.Generator().manual_seed(args.seed)
    sf = float(vae.config.scaling_factor)
    calib = [z / sf for z in latents] + [torch.randn(latents[0].shape, generator=gen) / sf for _ in range(args.calibration_latents)]
    fold_group_norms(student, calibrate_group_stats(student, calib, up_path_norm_names(student)))
    return student, f"folded here on {len(calib)} calibration latents, no fine-tune"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="sd21", help="a built random VAE (with --vae unset)")
    p.add_argument("--vae", help="the user's VAE: AutoencoderKL or pipeline folder")
    p.add_argument("--student", help="a distill-decoder output's vae/ folder (else: folded here)")
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--data", help="dataset source (pocketdiff.data) for held-out images; else the scene")
    p.add_argument("--train-items", type=int, default=4000)
    p.add_argument("--images", type=int, default=64, help="held-out images with --data")
    p.add_argument("--latents-from", help="a pipeline folder (a teacher or distilled student): decode its samples for the "
                   "held-out captions instead of the images' own latents (FD against the real images, PSNR against the whole decode)")
    p.add_argument("--latent-steps", type=int, default=4, help="sampling steps of --latents-from")
    p.add_argument("--latent-guidance", type=float, default=3.0, help="guidance scale of --latents-from")
    p.add_argument("--one-pass", nargs="+", default=["32x64/16/8", "36x36/8/4"], metavar="RxC/OVERLAP/MARGIN",
                   help="one-pass tile geometries in latents (rows x columns, overlap, margin)")
    p.add_argument("--stats-tile", type=int, default=40)
    p.add_argument("--stats-overlap", type=int, default=16)
    p.add_argument("--stats-margin", type=int, default=8)
    p.add_argument("--stats-passes", type=int, default=8)
    p.add_argument("--stats-psnr", action="store_true", help="also decode tiled_stats for PSNR (slow at SD size)")
    p.add_argument("--lowres-stats", nargs="*", type=int, default=[2, 4], metavar="DOWN",
                   help="statistics-pass pooling factors of the lowres_stats paths (tiles as --stats-tile/overlap/margin)")
    p.add_argument("--clip", help="a domain CLIP folder (pocketdiff train-clip): FD of each path's decodes against the real held-out images")
    p.add_argument("--calibration-latents", type=int, default=4)
    p.add_argument("--delegate", action="store_true", help="convert and time every graph on the LiteRT GPU delegate")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.latents_from and not args.data:
        p.error("--latents-from needs --data (its captions, and the real images FD compares with)")
    args.vae = args.vae or args.latents_from  # the sampled latents are that pipeline's VAE's
    torch.manual_seed(args.seed)
    vae = _load(args)
    latents = _data_latents(vae, args) if args.data else _scene_latents(vae, args)
    student, how = _student(vae, latents, args)
    z0 = latents[0]
    whole = whole_path(vae, z0)
    ones = []
    for spec in args.one_pass:
        tile, overlap, margin = spec.split("/")
        rows_cols = [int(v) for v in tile.split("x")]
        ones.append(one_pass_path(student, z0, rows_cols, int(overlap), int(margin), how))
    paths = [whole, tiled_stats_path(vae, z0, args.stats_tile, args.stats_overlap, args.stats_margin, args.stats_passes, args.stats_psnr),
             *[lowres_stats_path(vae, z0, args.stats_tile, args.stats_overlap, args.stats_margin, d) for d in args.lowres_stats],
             *[lowres_cv_path(vae, z0, args.stats_tile, args.stats_overlap, args.stats_margin, d) for d in args.lowres_stats
               if min(args.stats_tile, z0.shape[-1]) % d == 0],  # its per-tile regions are pooled by d as well
             norm_free_untiled(student, z0), *ones, tiny_path(vae, z0)]
    rows = measure(paths, latents, whole.decode, args.delegate, args.repeats)
    untiled = next(r for r in rows if r["name"] == "norm_free_untiled")
    for r in rows:
        if r["name"].startswith("one_pass") and "_images" in r and "_images" in untiled:
            r["psnr_tiling_db"] = round(float(np.mean([psnr(a, b) for a, b in zip(untiled["_images"], r["_images"])])), 3)
    fd_note = "FD needs a domain CLIP (--clip, configs/clip/openmoji.yaml) and --data; not measured here"
    if args.clip and getattr(args, "real_images", None) is not None:
        fd_note = add_fd(rows, args.real_images, args.clip)
    for r in rows:
        r.pop("_images", None)
        r.setdefault("fd", None)
    from pocketdiff.export.device_profile import PROFILES

    result = {"benchmark": "decoder_paths", "vae": args.vae or f"built:{args.arch} (random, perturbed norm affines)",
              "student": how, "resolution": args.resolution, "latent": list(z0.shape),
              "images": len(latents), "latents_from": (f"{args.latents_from} ({args.latent_steps} steps, guidance {args.latent_guidance}) "
                                                       f"for the captions of {args.data} held-out items {args.train_items}.." if args.data and args.latents_from
                                                       else f"{args.data} held-out items {args.train_items}.." if args.data else "the parity scene"),
              "phone_profile": PROFILES["phone"], "max_tensor_note": "MB = 2**20 bytes at fp16, largest tensor a module takes or returns (torch)",
              "fd_note": fd_note,
              "host": platform.node(), "torch_threads": torch.get_num_threads(), "paths": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({r["name"]: {k: r.get(k) for k in ("flops_ratio", "max_tensor_mb", "psnr_db", "psnr_tiling_db")} for r in rows}, indent=1))


if __name__ == "__main__":
    main()
