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
  litert_gn_composite  plain litert-torch with its fused GroupNorm composite (measured: the
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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the stage modules beside this file (also when loaded by path)

from pocketdiff.outputs import write_json  # noqa: E402

from export_sd21_convert import (  # noqa: E402,F401 - stage functions, re-exported for tests and notebooks
    ARRAYS, MANIFEST, PACKERS, convert_variant, fp16_scan, load_arrays, log, pack, prepare, run_key, stage_convert,
)
from export_sd21_delegate import _failed_run, _summarize, stage_delegate  # noqa: E402,F401
from export_sd21_weights import (  # noqa: E402,F401
    TILE_LEN, TILE_SPIKE_EVERY, TILED_NORM3_SCALE, activation_report, build_unet, fill_tiled, make_inputs, tile_block,
    tiled_values, tiled_weight,
)

ALL_VARIANTS = ["litert_fp32", "litert_fp16", "litert_int8", "litert_gn_composite", "ours_fp16", "ours_int8", "ours_fp16_rs", "ours_int8_rs"]


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


if __name__ == "__main__":
    sys.exit(main())
