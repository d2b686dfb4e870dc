#!/usr/bin/env python
"""Export benchmark: an SD-2.1-size UNet (random weights, norm affines perturbed) through
plain litert-torch and through pocketdiff's rewrites, side by side in one run.

Per variant: conversion wall time and peak RSS (each conversion in its own process),
op histogram / TRANSPOSE count / bytes / bytes per parameter, then on the LiteRT GPU
delegate (Vulkan: the NVIDIA driver on a GPU machine, Mesa lavapipe elsewhere): fully
accelerated or not (with the rejected ops), compile time, UNet step latency at the
delegate's default precision (fp16) and with enforce_f32, and XNNPACK on the CPU; parity of
every output with the PyTorch fp32 forward (cosine, PSNR, finite).

Variants (--variants, comma separated):
  litert_fp32   plain litert-torch conversion
  litert_fp16   plain litert-torch + its fp16 weight recipe
  litert_int8   plain litert-torch + its weight-only int8 recipe (expected: CPU only)
  litert_gn_composite  plain litert-torch with its fused GroupNorm composite (DESIGN.md: the
                delegate segfaults on STABLEHLO_COMPOSITE; the child process reports the crash)
  ours_fp16     pocketdiff rewrites + fp16 weights
  ours_int8     pocketdiff rewrites + int8 codes (RTN per channel) carried bit for bit
  ours_fp16_rs  ours_fp16 + residual-stream rescaling (--residual-scale, fp16 range)
  ours_int8_rs  ours_int8 + residual-stream rescaling

Weights: every conv / linear weight is a window of one tiled random block (`fill_tiled`), so
each SD-size .tflite compresses to a few MB with `zstd --long=31`; `--weights iid` draws them
independently. `--init default` (diffusers' init scale) or `normal002` (std 0.02, which drives
activations past the fp16 range). The fp32 reference forward records the activation peaks per
block (manifest / JSON `activations`), so the synthetic weights can be checked for realism.

Stages (--stage): `convert` builds the UNet, the fixed inputs and the PyTorch fp32 reference
(child process), converts each variant in its own child process and writes into --workdir the
.tflite files, the inputs / reference as .npy and manifest.json (`--pack DIR` also writes the
manifest, .npy and zstd- or xz-compressed .tflite files to DIR, for a GPU machine; `--stage pack`
does only that); `delegate` runs
each .tflite of a workdir on the GPU delegate at fp16 (all variants first), then enforce_f32,
then XNNPACK, each run a child process with a timeout (a crash or a timeout is recorded, the
JSON rewritten after each run); it needs only numpy, ai-edge-litert and pocketdiff's export
package (scripts/gpu/export_delegate.sh). `all` (default) does both here.

Examples:
  # quick check on CPU (tiny arch, lavapipe), ~3 min on 2 cores
  python benchmarks/export_sd21.py --arch tiny --resolution 32 --variants litert_fp32,ours_fp16,ours_int8 --out /tmp/bench.json
  # convert here (18 GB peak per SD-size conversion), run on a GPU machine
  python benchmarks/export_sd21.py --stage convert --arch sd21 --resolution 512 --init normal002 \
      --variants litert_fp32,ours_fp16_rs,ours_int8_rs --workdir /tmp/sd21 --min-free-gb 18 --pack .devexport
  bash scripts/gpu/export_delegate.sh      # there: --stage delegate on the unpacked .devexport
  # the real one, all in one, on a GPU machine (split across calls with --append if time per call is short)
  python benchmarks/export_sd21.py --arch sd21 --resolution 512 --out export_sd21.json
  python benchmarks/export_sd21.py --arch sd21 --resolution 512 --variants ours_int8_rs --out export_sd21.json --append
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from pocketdiff.outputs import write_json

MANIFEST = "manifest.json"
ALL_VARIANTS = ["litert_fp32", "litert_fp16", "litert_int8", "litert_gn_composite", "ours_fp16", "ours_int8", "ours_fp16_rs", "ours_int8_rs"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- synthetic weights
TILE_LEN = 65521  # prime: rows of any width < TILE_LEN are distinct cyclic shifts, never copies
TILE_SPIKE_EVERY = 256  # a +-127 code every 256 values: every row of >= 256 values has max |code| = 127
TILED_NORM3_SCALE = 1.0625  # the feed-forward LayerNorm's scale with tiled weights (see build_unet)


def tile_block(seed: int) -> np.ndarray:
    """The one random block every benchmark weight is tiled from: int8-grid values in
    [-127, 127] (float32), N(0, (127/4)^2) clipped, with a +-127 every TILE_SPIKE_EVERY values."""
    rng = np.random.default_rng(seed)
    k = np.clip(np.round(rng.standard_normal(TILE_LEN) * (127 / 4)), -127, 127)
    spikes = k[::TILE_SPIKE_EVERY]
    k[::TILE_SPIKE_EVERY] = np.where(rng.random(spikes.size) < 0.5, -127.0, 127.0)
    return k.astype(np.float32)


def tiled_values(block: np.ndarray, n: int, phase: int) -> np.ndarray:
    """block[(phase + i) % len(block)] for i < n (a window of the periodic stream)."""
    return np.resize(np.roll(block, -int(phase)), int(n))


def tiled_weight(shape, block: np.ndarray, phase: int, scale: float) -> np.ndarray:
    """A weight whose bytes in the .tflite are one window of the periodic block stream.

    litert-torch lays a Conv2d weight out OHWI (a Linear / 1x1 conv [O, I] as is), so the
    window is drawn in that layout and permuted back to torch's OIHW."""
    shape = tuple(int(s) for s in shape)
    flat = tiled_values(block, int(np.prod(shape)), phase) * np.float32(scale)
    if len(shape) == 4:
        o, i, kh, kw = shape
        return np.ascontiguousarray(flat.reshape(o, kh, kw, i).transpose(0, 3, 1, 2))
    return flat.reshape(shape)


def fill_tiled(module, seed: int, init: str) -> dict:
    """Fill every Conv2d / Linear weight (and bias) of `module` from one tiled random block.

    Why tiled: an SD-size UNet's random weights are ~0.8-3.5 GB per .tflite and do not
    compress, so they cannot travel to the GPU machine that runs the delegate. Each weight here
    is a cyclic window of one 65,521-value block (a prime length, a distinct random phase per
    tensor, drawn in the file's layout), so `zstd --long=31` shrinks a file ~1000x. Each row is
    a distinct shift of an i.i.d. sequence, so rows stay uncorrelated (a power-of-two period
    repeats whole rows and blows activations up, DESIGN.md). The block sits on the int8 grid
    with a +-127 in every 256 values, so per-channel RTN int8 gives the block's own codes (the
    int8 file compresses too). The scale is exact per layer (std 1/sqrt(3 fan_in) for
    "default", PyTorch's / diffusers' init, biases alike; 0.02 and zero biases for
    "normal002"): rounding it to a power of two compounds along the skip / shortcut chains
    (activations ~3x smaller than i.i.d. weights of the same std). Each distinct scale costs
    one block in the compressed file. Returns {"block_std", "stds": {fan_in: std}, "tensors"}.
    """
    import torch

    block = tile_block(seed)
    block_std = float(block.std())
    rng = np.random.default_rng(seed + 1)
    convs = [m for m in module.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    phases = rng.choice(TILE_LEN, size=2 * len(convs), replace=False)  # distinct: no two weights alike
    stds: dict[int, float] = {}
    with torch.no_grad():
        for j, m in enumerate(convs):
            fan_in = int(m.weight[0].numel())
            target = 0.02 if init == "normal002" else 1.0 / np.sqrt(3.0 * fan_in)
            scale = float(np.float32(target / block_std))
            stds[fan_in] = scale * block_std
            m.weight.copy_(torch.from_numpy(tiled_weight(m.weight.shape, block, phases[2 * j], scale)))
            if m.bias is not None:
                if init == "normal002":
                    m.bias.zero_()
                else:
                    m.bias.copy_(torch.from_numpy(tiled_weight(m.bias.shape, block, phases[2 * j + 1], scale)))
    return {"block_std": block_std, "stds": {str(k): v for k, v in sorted(stds.items())}, "tensors": len(convs)}


# ----------------------------------------------------------------------------- setup
def build_unet(arch: str, resolution: int, seed: int, init: str = "default", weights: str = "tiled"):
    """A random UNet with norm affines perturbed (identity affines are an artefact, DESIGN.md).

    init: diffusers' own initialisation (activations stay small), or `normal002`: every conv /
    linear weight N(0, 0.02^2), biases 0, the synthetic kind that drives SD-size activations
    past the fp16 range (DESIGN.md) -- the case the fp16-safe rewrites must survive.
    weights: "tiled" (default; see `fill_tiled`: the files compress to a few MB and can be
    carried to a GPU machine) or "iid" (independent draws, as torch initialises).
    Returns (unet, info)."""
    import torch
    from diffusers import UNet2DConditionModel

    from pocketdiff.models import perturb_norm_affines, unet_config

    factor = 4 if arch in ("tiny", "small") else 8
    info: dict = {"weights": weights, "init": init}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(**unet_config(arch, resolution=resolution, vae_factor=factor)).eval()
        if weights == "tiled":
            info.update(fill_tiled(unet, seed, init))
        elif init == "normal002":
            with torch.no_grad():
                for m in unet.modules():
                    if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
                        m.weight.normal_(0.0, 0.02)
                        if m.bias is not None:
                            m.bias.zero_()
    perturb_norm_affines(unet, seed)
    if weights == "tiled":
        with torch.no_grad():
            for name, m in unet.named_modules():
                if isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm)) and m.weight is not None:
                    # on a 2^-10 grid: few significant bits, so these constants compress too
                    m.weight.copy_(torch.round(m.weight * 1024) / 1024)
                    m.bias.copy_(torch.round(m.bias * 1024) / 1024)
                    if name.endswith(".norm3"):
                        # plain litert-torch folds this LayerNorm's scale into the feed-forward's
                        # first Linear (per input column), which would break the tiling of ~11 %
                        # of the weights; a uniform non-identity scale folds into a uniform factor
                        m.weight.fill_(TILED_NORM3_SCALE)
    return unet, info


def make_inputs(unet, batch: int, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    s = unet.config.sample_size
    return {
        "sample": torch.randn(batch, unet.config.in_channels, s, s, generator=g),
        "timestep": torch.full((batch,), 501.0),
        "encoder_hidden_states": torch.randn(batch, 77, unet.config.cross_attention_dim, generator=g),
    }


def activation_report(graph, inputs: dict):
    """The fp32 reference forward with the fp16 scan's hooks (no emulation): how large the
    activations of these synthetic weights get, per top-level block and per quantity, against
    the fp16 maximum (random weights must stay realistic, or the fp16 test is meaningless)."""
    import torch

    from pocketdiff.export.fp16scan import FP16_MAX, Fp16Scanner
    from pocketdiff.export.rewrites import RewriteConfig

    sc = Fp16Scanner(emulate=False, accumulation=False)
    sc.attach(graph.unet, "unet")
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            y = graph(*inputs.values())
    finally:
        sc.detach()
    seconds = time.perf_counter() - t0
    rep = sc.report(RewriteConfig())
    per_block: dict[str, float] = {}
    for name, st in rep["stats"].items():
        parts = name.split(".")
        key = ".".join(parts[1:3]) if len(parts) > 2 and parts[1] in ("down_blocks", "up_blocks") else parts[1]
        per_block[key] = max(per_block.get(key, 0.0), float(st["stream"]))
    return y.numpy(), seconds, {
        "fp16_max": FP16_MAX,
        "max_abs": rep["max_abs"],
        "worst": rep["worst"][:5],
        "stream_peak": max(per_block.values(), default=0.0),
        "stream_peak_per_block": per_block,
        "peaks": rep["peaks"],
        "fp16_overflowing_ops": rep["overflowing_ops"],
        "fp16_unmitigated_ops": rep["unmitigated"],
        "output_std": float(y.std()),
        "output_max_abs": float(y.abs().max()),
    }


ARRAYS = ("sample", "timestep", "temb", "encoder_hidden_states", "reference")


def load_arrays(work: Path) -> dict:
    return {k: np.load(work / f"{k}.npy") for k in ARRAYS}


def prepare(args, work: Path) -> dict:
    """Build the UNet once (saved for the conversion processes), the fixed inputs and the
    PyTorch fp32 reference (with its activation report), as .npy files in `work`."""
    from pocketdiff.export.components import UNetGraph, time_embedding_table

    unet, winfo = build_unet(args.arch, args.resolution, args.seed, args.init, args.weights)
    n_params = sum(p.numel() for p in unet.parameters())
    unet.save_pretrained(str(work / "unet"), safe_serialization=True)
    inputs = make_inputs(unet, args.batch, args.seed)
    ref, ref_s, acts = activation_report(UNetGraph(unet), inputs)
    table = time_embedding_table(unet, 1000)
    arrays = {k: v.numpy() for k, v in inputs.items()}
    arrays.update(temb=table[[501] * args.batch], reference=ref)
    for k, v in arrays.items():
        np.save(work / f"{k}.npy", np.ascontiguousarray(v, dtype=np.float32))
    meta = {"params": int(n_params), "torch_forward_s": ref_s, "latent": list(inputs["sample"].shape), "weights_info": winfo, "activations": acts}
    if args.scan:
        meta["fp16_scan"] = fp16_scan(unet, inputs, args)
    return meta


def fp16_scan(unet, inputs: dict, args) -> dict:
    """fp16-emulated forward of the raw UNet and of the rescaled one (residual stream x s)."""
    import copy
    import dataclasses

    import torch

    from pocketdiff.export.components import UNetGraph
    from pocketdiff.export.fp16scan import Fp16Scanner, stream_peaks
    from pocketdiff.export.rewrites import RewriteConfig, apply_rewrites

    device = "cuda" if args.device == "cuda" and torch.cuda.is_available() else "cpu"
    out = {}
    scales = [("raw", None)]
    if args.residual_scale != "auto":
        scales.append(("residual_scaled", float(args.residual_scale)))
    for label, scale in scales:
        g = UNetGraph(copy.deepcopy(unet)).to(device)
        if scale:
            apply_rewrites(g, dataclasses.replace(RewriteConfig.none(), residual_scale=scale))
        sc = Fp16Scanner(emulate=True, accumulation=True)
        sc.attach(g, "unet")
        with torch.no_grad():
            y = g(*[v.to(device) for v in inputs.values()])
        sc.detach()
        rep = sc.report(RewriteConfig())
        out[label] = {k: rep[k] for k in ("overflowing_ops", "unmitigated", "first_overflow", "max_abs", "peaks")}
        out[label]["stream_peak"] = stream_peaks(rep).get("unet", 0.0)
        out[label]["output_finite"] = bool(torch.isfinite(y).all())
        out[label]["unmitigated_ops"] = [e["module"] for e in rep["ops"] if not e["mitigated_by"]][:20]
        del g
        if label == "raw" and args.residual_scale == "auto":
            from pocketdiff.export.fp16scan import residual_scale_for

            auto = residual_scale_for(out["raw"]["stream_peak"])
            out["auto_scale"] = auto
            if auto != 1.0:
                scales.append(("residual_scaled", auto))
    return out


# ----------------------------------------------------------------------------- conversion (child process)
def convert_variant(args, work: Path, variant: str) -> dict:
    import dataclasses

    import torch
    from diffusers import UNet2DConditionModel

    from pocketdiff.export.components import UNetGraph
    from pocketdiff.export.exporter import VerifyConfig, export_component, peak_rss_mb
    from pocketdiff.export.int8 import rtn_checkpoint
    from pocketdiff.export.parity import ParityConfig
    from pocketdiff.export.rewrites import RewriteConfig
    from pocketdiff.export.tflite_file import TfliteModel, sha256_file

    unet = UNet2DConditionModel.from_pretrained(str(work / "unet")).eval().requires_grad_(False)
    data = load_arrays(work)
    path = work / f"{variant}.tflite"
    meta: dict = {"variant": variant, "file": path.name}
    t0 = time.perf_counter()
    if variant.startswith("litert_"):
        import litert_torch
        from litert_torch.generative.quantize import quant_recipes

        qc = {"litert_fp32": None, "litert_gn_composite": None, "litert_fp16": quant_recipes.full_fp16_recipe(),
              "litert_int8": quant_recipes.full_weight_only_recipe()}[variant]
        if variant == "litert_gn_composite":
            litert_torch.config.enable_group_norm_composite = True
        sample = tuple(torch.from_numpy(data[k]) for k in ("sample", "timestep", "encoder_hidden_states"))
        edge = litert_torch.convert(UNetGraph(unet).eval(), sample, quant_config=qc)
        edge.export(str(path))
        meta["time_input"] = "timestep"
        # positional signature (args_0, ...): fed in this order
        meta["feeds"] = {"names": None, "arrays": ["sample", "timestep", "encoder_hidden_states"]}
    else:
        rs = None
        if variant.endswith("_rs"):
            if args.residual_scale == "auto":
                scan = json.loads((work / "prepare.json").read_text()).get("fp16_scan")
                if not scan:
                    raise SystemExit("--residual-scale auto needs --scan")
                rs = scan.get("auto_scale") or None
            else:
                rs = float(args.residual_scale)
        rewrites = dataclasses.replace(
            RewriteConfig(), residual_scale=rs, attention_budget_mb=args.attention_budget_mb, conv_budget_mb=args.conv_budget_mb
        )
        q = None
        weights = "int8" if "int8" in variant else "fp16"
        if weights == "int8":
            from pocketdiff.export.int8 import apply_to_module

            q = rtn_checkpoint(unet, "unet", 8)
            apply_to_module(unet, q)
        graph = UNetGraph(unet, external_time_embedding=True)
        inputs = {
            "sample": torch.from_numpy(data["sample"]),
            "timestep": torch.from_numpy(data["temb"]),
            "encoder_hidden_states": torch.from_numpy(data["encoder_hidden_states"]),
        }
        rep = export_component(
            "unet", graph, inputs, path, rewrites, weights, VerifyConfig(delegate=False), ParityConfig(enforce=False), quantized=q,
        )
        meta["time_input"] = "time_embedding"
        meta["feeds"] = {"names": ["sample", "timestep", "encoder_hidden_states"], "arrays": ["sample", "temb", "encoder_hidden_states"]}
        meta["rewrites"] = rep["rewrites"]
        meta["int8_tensors"] = rep.get("int8_tensors")
        meta["rewrite_parity_cosine"] = rep["rewrite_parity"]["cosine"]
        meta["largest_activation"] = rep.get("largest_activation")
        if q is not None:  # the int8 model's own torch output: parity of the delegate alone, without RTN's error
            meta["int8_layers"] = rep.get("int8_layers")
            np.save(work / f"reference_{variant}.npy", np.ascontiguousarray(rep["reference"], dtype=np.float32))
            meta["reference_own"] = f"reference_{variant}.npy"
    meta["convert_s"] = time.perf_counter() - t0
    meta["convert_peak_rss_mb"] = peak_rss_mb()
    m = TfliteModel(path)
    hist = m.op_histogram()
    meta.update(bytes=path.stat().st_size, sha256=sha256_file(path), ops=hist, op_count=int(sum(hist.values())),
                transposes=int(hist.get("TRANSPOSE", 0)), max_rank=m.max_rank())
    return meta


# ----------------------------------------------------------------------------- stage: convert
def mem_available_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("inf")


def wait_for_memory(need_gb: float, max_wait_s: float = 1800.0) -> None:
    """Conversions of an SD-size UNet need ~18 GB: wait (bounded) until that much is free."""
    if not need_gb:
        return
    t0 = time.monotonic()
    while mem_available_gb() < need_gb and time.monotonic() - t0 < max_wait_s:
        log(f"waiting for memory: {mem_available_gb():.1f} GB available, {need_gb:.0f} GB wanted")
        time.sleep(30)
    log(f"memory available: {mem_available_gb():.1f} GB")


def _child_cmd(args, work: Path, flag: str, value: str) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), flag, value, "--workdir", str(work), "--arch", args.arch,
           "--resolution", str(args.resolution), "--batch", str(args.batch), "--residual-scale", str(args.residual_scale),
           "--seed", str(args.seed), "--init", args.init, "--weights", args.weights, "--device", args.device]
    if args.scan:
        cmd.append("--scan")
    if args.attention_budget_mb:
        cmd += ["--attention-budget-mb", str(args.attention_budget_mb)]
    if args.conv_budget_mb:
        cmd += ["--conv-budget-mb", str(args.conv_budget_mb)]
    return cmd


def _run_child(cmd: list[str]) -> tuple[int, list[str], float]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return proc.returncode, tail, time.perf_counter() - t0


def run_key(args) -> str:
    return f"{args.arch}-{args.resolution}-{args.init}-{args.weights}-{args.seed}-{args.batch}"


def stage_convert(args, work: Path, variants: list[str]) -> dict:
    """Build + reference (child), each variant converted in its own child, manifest.json."""
    key = run_key(args)
    prep_file = work / "prepare.json"
    prep = json.loads(prep_file.read_text()) if prep_file.is_file() else {}
    have_arrays = all((work / f"{k}.npy").is_file() for k in ARRAYS)
    if prep.get("key") != key or not have_arrays or (args.scan and "fp16_scan" not in prep):
        wait_for_memory(args.min_free_gb)
        log(f"building the {args.arch} UNet at {args.resolution}px ({args.init}, {args.weights} weights), torch reference")
        rc, tail, wall = _run_child(_child_cmd(args, work, "--_prepare", "1"))
        if rc != 0:
            raise SystemExit("prepare failed:\n" + "\n".join(tail))
        prep = json.loads(prep_file.read_text())
        acts = prep["activations"]
        log(f"prepared in {wall:.0f} s: {prep['params'] / 1e6:.0f}M params, activation max {acts['max_abs']:.3g}, "
            f"residual stream peak {acts['stream_peak']:.3g} (fp16 max 65504)")
    mpath = work / MANIFEST
    manifest = json.loads(mpath.read_text()) if mpath.is_file() else {}
    if manifest.get("key") != key:
        manifest = {}
    arrays = {}
    for k in ARRAYS:
        a = np.load(work / f"{k}.npy", mmap_mode="r")
        arrays[k] = {"file": f"{k}.npy", "shape": list(a.shape), "dtype": str(a.dtype)}
    manifest.update(
        schema=1, key=key, arch=args.arch, resolution=args.resolution, batch=args.batch, init=args.init, weights=args.weights,
        seed=args.seed, residual_scale=args.residual_scale, params=prep["params"], latent=prep["latent"],
        torch_forward_s=prep["torch_forward_s"], weights_info=prep.get("weights_info"), activations=prep.get("activations"),
        arrays=arrays, reference="reference.npy", converted_on=platform.node(),
    )
    if "fp16_scan" in prep:
        manifest["fp16_scan"] = prep["fp16_scan"]
    manifest.setdefault("variants", {})
    write_json(mpath, manifest)
    for v in variants:
        wait_for_memory(args.min_free_gb)
        log(f"{v}: converting in a child process")
        rc, tail, wall = _run_child(_child_cmd(args, work, "--_convert", v))
        if rc != 0:
            manifest["variants"][v] = {"error": f"conversion failed (exit {rc})", "log_tail": tail, "wall_s": wall}
            log(f"{v}: conversion failed: {tail[-1] if tail else ''}")
        else:
            vmeta = json.loads((work / f"{v}.json").read_text())
            manifest["variants"][v] = vmeta
            log(f"{v}: {vmeta['convert_s']:.1f} s, peak RSS {vmeta['convert_peak_rss_mb'] / 1024:.1f} GB, "
                f"{vmeta['bytes'] / 2**20:.1f} MiB, TRANSPOSE {vmeta['transposes']}")
        write_json(mpath, manifest)
    if args.pack:
        pack(work, Path(args.pack), [v for v in variants if "error" not in manifest["variants"].get(v, {"error": 1})], args.pack_level,
             args.pack_format)
    return manifest


PACKERS = {
    # zstd: fast, smallest for files with many distinct weight scales; needs zstd to unpack
    "zst": ["zstd", "-{level}", "--long=31", "-T2", "-q", "-f", "{src}", "-o", "{dst}"],
    # xz: unpacked by Python's own lzma (nothing to install on the GPU machine)
    "xz": ["sh", "-c", "xz -{level} -T1 --lzma2=preset={level},dict={dict} -c '{src}' > '{dst}'"],
}


def pack(work: Path, dest: Path, variants: list[str], level: int = 19, fmt: str = "zst", xz_dict: str = "192MiB") -> None:
    """Copy the manifest and the .npy files to `dest` and compress each variant's .tflite
    there (`zstd -d --long=31`, or Python's lzma for .xz, restores it)."""
    import shutil

    dest.mkdir(parents=True, exist_ok=True)
    for k in ARRAYS:
        shutil.copyfile(work / f"{k}.npy", dest / f"{k}.npy")
    manifest = json.loads((work / MANIFEST).read_text())
    for v in variants:
        own = manifest["variants"].get(v, {}).get("reference_own")
        if own:
            shutil.copyfile(work / own, dest / own)
        src = work / f"{v}.tflite"
        dst = dest / f"{v}.tflite.{fmt}"
        for other in dest.glob(f"{v}.tflite.*"):
            other.unlink()
        t0 = time.perf_counter()
        lvl = min(level, 9) if fmt == "xz" else level
        subprocess.run([a.format(level=lvl, src=src, dst=dst, dict=xz_dict) for a in PACKERS[fmt]], check=True)
        log(f"packed {v}: {src.stat().st_size / 2**20:.0f} MiB -> {dst.stat().st_size / 2**20:.2f} MiB in {time.perf_counter() - t0:.0f} s")
    if (dest / MANIFEST).is_file():  # keep variants packed by an earlier call
        old = json.loads((dest / MANIFEST).read_text())
        if old.get("key") == manifest.get("key"):
            for v, meta in old.get("variants", {}).items():
                if v not in variants and any(dest.glob(f"{v}.tflite.*")):
                    manifest["variants"].setdefault(v, meta)
    for v in list(manifest.get("variants", {})):
        if not any(dest.glob(f"{v}.tflite.*")):
            manifest["variants"].pop(v)
    write_json(dest / MANIFEST, manifest)


# ----------------------------------------------------------------------------- stage: delegate
def _feeds(meta: dict, arrays: dict):
    f = meta.get("feeds") or {}
    keys = f.get("arrays") or (["sample", "temb", "encoder_hidden_states"] if meta.get("time_input") == "time_embedding"
                               else ["sample", "timestep", "encoder_hidden_states"])
    names = f.get("names")
    if names:
        return {n: arrays[k] for n, k in zip(names, keys)}
    return [arrays[k] for k in keys]


def _log_tail(text: str, n: int = 10) -> list[str]:
    """The first distinct error lines of a delegate log (the cause; later ones echo it) + its tail."""
    import re

    lines = [ln for ln in text.splitlines() if ln.strip() and "Warning" not in ln]
    first: list[str] = []
    seen = set()
    for ln in lines:
        if re.search(r"error|invalid|exceed|fail|not supported", ln, re.I):
            key = re.sub(r"\d+", "N", ln)
            if key not in seen:
                seen.add(key)
                first.append(ln[:300])
        if len(first) >= 6:
            break
    tail = [ln[:300] for ln in lines[-n:] if ln[:300] not in first]
    return first + ["..."] + tail


def _failed_run(accelerator: str, error: str):
    from pocketdiff.export.delegate import DelegateRun

    return DelegateRun(accelerator=accelerator, driver="n/a", compiled=False, fully_accelerated=False, rejected=[], ops_split=None,
                       outputs={}, output_names=[], input_names=[], compile_s={}, latency_s={}, adapter="", error=error, log=error)


def stage_delegate(args, work: Path, variants: Optional[list[str]], out: Path) -> dict:
    """Every converted variant in `work` on the LiteRT GPU delegate (fp16 default, then
    enforce_f32) and on XNNPACK, each run in its own child process with a timeout; a crash or
    timeout is recorded, not fatal. Runs go phase by phase (all fp16 first), and the JSON is
    rewritten after each, so a cut-off run keeps what it measured."""
    from pocketdiff.export.delegate import delegate_available, run_on_delegate
    from pocketdiff.export.parity import metrics

    t_start = time.monotonic()
    manifest = json.loads((work / MANIFEST).read_text())
    arrays = load_arrays(work)
    ref = arrays["reference"]
    result: dict = {}
    if args.append and out.is_file():
        result = json.loads(out.read_text())
        if result.get("key") not in (None, manifest.get("key")):
            raise SystemExit(f"--append: {out} holds another run ({result.get('key')} != {manifest.get('key')})")
    ok, driver = delegate_available()
    for k in ("key", "arch", "resolution", "batch", "init", "weights", "seed", "residual_scale", "params", "latent",
              "torch_forward_s", "weights_info", "activations", "fp16_scan", "converted_on"):
        if k in manifest:
            result[k] = manifest[k]
    result.update(host=platform.node(), cpu_count=os.cpu_count(), delegate_driver=driver, started=time.strftime("%Y-%m-%d %H:%M:%S"))
    result.setdefault("variants", {})
    todo = variants or list(manifest.get("variants", {}))
    for v in todo:
        meta = manifest.get("variants", {}).get(v)
        if meta is None:
            result["variants"][v] = {"error": "not in the manifest (not converted)"}
            continue
        entry = result["variants"].setdefault(v, {})
        entry.update({k: val for k, val in meta.items() if k not in ("gpu", "cpu")})
        if "error" in meta:
            continue
        path = work / meta.get("file", f"{v}.tflite")
        if not path.is_file():
            entry["error"] = f"{path.name} missing"
        elif path.stat().st_size != meta.get("bytes", path.stat().st_size):
            entry["error"] = f"{path.name}: {path.stat().st_size} bytes, manifest says {meta['bytes']} (truncated?)"
        else:
            entry["bytes_per_param"] = meta["bytes"] / manifest["params"]
    runnable = [v for v in todo if v in result["variants"] and "error" not in result["variants"][v]]
    jobs = []
    if not args.skip_gpu:
        jobs += [("gpu", "fp16", v) for v in runnable]
        if not args.skip_f32:
            jobs += [("gpu", "fp32", v) for v in runnable]
    if not args.skip_cpu:
        jobs += [("cpu", "fp32", v) for v in runnable]

    def save() -> None:
        result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        result["wall_s"] = round(time.monotonic() - t_start, 1)
        write_json(out, _summarize(result))

    save()
    for acc, prec, v in jobs:
        entry = result["variants"][v]
        meta = manifest["variants"][v]
        timeout = args.timeout
        if args.budget_s:
            left = args.budget_s - (time.monotonic() - t_start) - 10
            if left < 30:
                entry.setdefault("skipped", []).append(f"{acc} {prec}: time budget spent")
                log(f"{v}: {acc} {prec} skipped (time budget)")
                save()
                continue
            timeout = min(timeout, left)
        label = "CPU (XNNPACK)" if acc == "cpu" else f"GPU delegate {prec}"
        t0 = time.perf_counter()
        repeats, warmup = (args.repeats, args.warmup) if acc == "gpu" else (max(1, args.repeats // 2), min(1, args.warmup))
        log(f"{v}: {label}, {repeats} runs after {warmup} warm-up, timeout {timeout:.0f} s")
        try:
            run = run_on_delegate(work / meta.get("file", f"{v}.tflite"), _feeds(meta, arrays), precisions=[prec], accelerator=acc,
                                  repeats=repeats, warmup=warmup, timeout_s=timeout, num_threads=args.cpu_threads if acc == "cpu" else 0)
        except Exception as e:  # noqa: BLE001 - e.g. no Vulkan driver: recorded, the other runs go on
            run = _failed_run(acc, f"{type(e).__name__}: {e}")
        wall = time.perf_counter() - t0
        par = metrics(ref, run.outputs[prec][0]) if prec in run.outputs else None
        own = meta.get("reference_own")
        if par is not None and own and (work / own).is_file():
            par["vs_own_reference"] = metrics(np.load(work / own), run.outputs[prec][0])
        if acc == "gpu":
            g = entry.setdefault("gpu", {"compile_s": {}, "step_latency_s": {}, "parity": {}, "errors": {}, "wall_s": {},
                                         "fully_accelerated_at": {}})
            g.update(driver=run.driver)
            if run.adapter:
                g["adapter"] = run.adapter
            if run.compiled:
                g["compiled"] = True
                g["fully_accelerated"] = bool(g.get("fully_accelerated", True) and run.fully_accelerated)
                g["fully_accelerated_at"][prec] = run.fully_accelerated
            else:
                g.setdefault("compiled", False)
            if run.rejected:
                g["rejected"] = [r.describe() for r in run.rejected][:20]
            if run.ops_split:
                g["ops_split"] = run.ops_split
            g["compile_s"].update(run.compile_s)
            g["step_latency_s"].update(run.latency_s)
            g["wall_s"][prec] = round(wall, 1)
            if par is not None:
                g["parity"][prec] = par
            if run.error:
                g["errors"][prec] = run.error
                g["log_tail"] = _log_tail(run.log)
                g.setdefault("error", run.error)
        else:
            entry["cpu"] = {"compiled": run.compiled, "error": run.error, "compile_s": run.compile_s.get("fp32"),
                            "step_latency_s": run.latency_s.get("fp32"), "parity": par, "threads": args.cpu_threads,
                            "wall_s": round(wall, 1)}
            if run.error:
                entry["cpu"]["log_tail"] = _log_tail(run.log)
        lat = run.latency_s.get(prec)
        log(f"{v}: {label}: " + (f"error {run.error}; " if run.error else "")
            + (f"fully accelerated {run.fully_accelerated}, " if acc == "gpu" and run.compiled else "")
            + (f"{1000 * lat:.1f} ms/step, " if lat is not None else "")
            + (f"finite {par['finite']}, cosine {par['cosine']:.6f}, PSNR {par['psnr_db']:.1f} dB" if par else "no output")
            + f" ({wall:.0f} s)")
        save()
    save()
    log(f"wrote {out}")
    return result


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", default="all", choices=["all", "convert", "pack", "delegate"],
                   help="all: convert then run here; convert: build, reference, .tflite files, manifest.json; "
                        "pack: --pack a converted --workdir; delegate: run a converted --workdir (needs only numpy + ai-edge-litert)")
    p.add_argument("--arch", default="sd21", choices=["tiny", "small", "sd15", "sd21"])
    p.add_argument("--resolution", type=int, default=512, help="pixels (latents = resolution / VAE factor)")
    p.add_argument("--batch", type=int, default=2, help="UNet batch (2: classifier-free guidance)")
    p.add_argument("--variants", default=None, help=f"comma separated, in run order (convert default: all; delegate default: the manifest's); from {ALL_VARIANTS}")
    p.add_argument("--residual-scale", default="0.125", help="power of two for the *_rs variants, or 'auto' (from --scan)")
    p.add_argument("--init", default="default", choices=["default", "normal002"], help="synthetic weights' scale (see build_unet)")
    p.add_argument("--weights", default="tiled", choices=["tiled", "iid"], help="tiled: compressible files (see fill_tiled); iid: independent draws")
    p.add_argument("--attention-budget-mb", type=float, default=None)
    p.add_argument("--conv-budget-mb", type=float, default=None)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--cpu-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--skip-gpu", action="store_true")
    p.add_argument("--skip-f32", action="store_true", help="GPU delegate at its default fp16 only (no enforce_f32 run)")
    p.add_argument("--skip-cpu", action="store_true")
    p.add_argument("--scan", action="store_true", help="fp16-emulated forward scan of the raw and rescaled UNet")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="torch device of the scan")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", "--work", dest="work", default=None, help="work folder (.tflite, .npy, manifest.json); default next to --out")
    p.add_argument("--out", default=None, help="JSON result (all, delegate)")
    p.add_argument("--append", action="store_true", help="merge into an existing --out (same run)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per delegate run (one child process)")
    p.add_argument("--budget-s", type=float, default=None, help="delegate stage: skip runs once this many seconds have passed")
    p.add_argument("--min-free-gb", type=float, default=0.0, help="convert stage: wait until this much memory is available before each heavy child")
    p.add_argument("--pack", default=None, help="convert / pack stage: write manifest, .npy and compressed .tflite files here")
    p.add_argument("--pack-level", type=int, default=19, help="zstd level (xz: at most 9)")
    p.add_argument("--pack-format", default="zst", choices=sorted(PACKERS), help="zst (zstd --long=31) or xz (Python's lzma unpacks it)")
    p.add_argument("--_convert", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_prepare", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.work is None and args.out is None:
        p.error("give --workdir or --out")
    out = Path(args.out) if args.out else None
    work = Path(args.work) if args.work else out.parent / (out.stem + "_work")
    work.mkdir(parents=True, exist_ok=True)

    if args._prepare:  # child: build, save, reference
        meta = prepare(args, work)
        meta["key"] = run_key(args)
        write_json(work / "prepare.json", meta)
        return 0
    if args._convert:  # child: one conversion, its own peak RSS
        meta = convert_variant(args, work, args._convert)
        write_json(work / f"{args._convert}.json", meta)
        return 0

    variants = [v for v in args.variants.split(",") if v] if args.variants is not None else None
    for v in variants or []:
        if v not in ALL_VARIANTS:
            p.error(f"unknown variant {v!r}; choose from {ALL_VARIANTS}")
    if args.stage in ("all", "delegate") and out is None:
        p.error(f"--stage {args.stage} needs --out")
    if args.stage in ("all", "convert"):
        stage_convert(args, work, ALL_VARIANTS if variants is None else variants)
    if args.stage == "pack":
        if not args.pack or not (work / MANIFEST).is_file():
            p.error("--stage pack needs --pack DIR and a converted --workdir")
        done = json.loads((work / MANIFEST).read_text()).get("variants", {})
        pack(work, Path(args.pack), [v for v in (variants or list(done)) if v in done and "error" not in done[v]], args.pack_level,
             args.pack_format)
    if args.stage in ("all", "delegate"):
        if not (work / MANIFEST).is_file():
            p.error(f"{work / MANIFEST} missing: run --stage convert first")
        stage_delegate(args, work, variants, out)
    return 0


def _summarize(result: dict) -> dict:
    """A side-by-side table of the variants measured so far."""
    rows = {}
    for v, r in result.get("variants", {}).items():
        if "error" in r:
            rows[v] = {"error": r["error"]}
            continue
        gpu = r.get("gpu", {})
        cpu = r.get("cpu") or {}
        par = gpu.get("parity", {})
        fp16 = par.get("fp16") or {}
        rows[v] = {
            "convert_s": _round(r.get("convert_s"), 1),
            "convert_peak_rss_gb": _round((r.get("convert_peak_rss_mb") or 0) / 1024, 2),
            "mib": _round(r.get("bytes", 0) / 2**20, 1),
            "bytes_per_param": _round(r.get("bytes_per_param"), 3),
            "transposes": r.get("transposes"),
            "fully_accelerated": gpu.get("fully_accelerated"),
            "gpu_compile_s": {k: _round(x, 1) for k, x in gpu.get("compile_s", {}).items()},
            "gpu_fp16_ms": _ms(gpu.get("step_latency_s", {}).get("fp16")),
            "gpu_fp32_ms": _ms(gpu.get("step_latency_s", {}).get("fp32")),
            "cpu_ms": _ms(cpu.get("step_latency_s")),
            "fp16_finite": fp16.get("finite"),
            "fp16_cosine": fp16.get("cosine"),
            "fp16_psnr_db": fp16.get("psnr_db"),
            "fp32_cosine": (par.get("fp32") or {}).get("cosine"),
            "cpu_cosine": (cpu.get("parity") or {}).get("cosine"),
            "gpu_errors": gpu.get("errors") or None,
        }
        # the claim under test: every op on the delegate, finite and accurate at its default fp16
        if "fp16" in par:
            rows[v]["fp16_ok"] = bool(gpu.get("fully_accelerated") and fp16.get("finite") and fp16.get("cosine", 0) >= 0.999)
    result["summary"] = rows
    return result


def _round(x, n):
    return None if x is None else round(float(x), n)


def _ms(x):
    return None if x is None else round(1000 * x, 2)


if __name__ == "__main__":
    sys.exit(main())
