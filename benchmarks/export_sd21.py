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

Examples:
  # quick check on CPU (tiny arch, lavapipe), ~3 min on 2 cores
  python benchmarks/export_sd21.py --arch tiny --resolution 32 --variants litert_fp32,ours_fp16,ours_int8 --out /tmp/bench.json
  # the real one, on a GPU machine (split across calls with --append if time per call is short)
  python benchmarks/export_sd21.py --arch sd21 --resolution 512 --out export_sd21.json
  python benchmarks/export_sd21.py --arch sd21 --resolution 512 --variants ours_int8_rs --out export_sd21.json --append
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ALL_VARIANTS = ["litert_fp32", "litert_fp16", "litert_int8", "litert_gn_composite", "ours_fp16", "ours_int8", "ours_fp16_rs", "ours_int8_rs"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ----------------------------------------------------------------------------- setup
def build_unet(arch: str, resolution: int, seed: int, init: str = "default"):
    """diffusers' own initialisation (activations stay small), or `normal002`: every conv /
    linear weight N(0, 0.02^2), biases 0, the synthetic kind that drives SD-size activations
    past the fp16 range (DESIGN.md) -- the case the fp16-safe rewrites must survive."""
    import torch
    from diffusers import UNet2DConditionModel

    from pocketdiff.models import perturb_norm_affines, unet_config

    factor = 4 if arch in ("tiny", "small") else 8
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(**unet_config(arch, resolution=resolution, vae_factor=factor)).eval()
        if init == "normal002":
            with torch.no_grad():
                for m in unet.modules():
                    if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
                        m.weight.normal_(0.0, 0.02)
                        if m.bias is not None:
                            m.bias.zero_()
    perturb_norm_affines(unet, seed)
    return unet


def make_inputs(unet, batch: int, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    s = unet.config.sample_size
    return {
        "sample": torch.randn(batch, unet.config.in_channels, s, s, generator=g),
        "timestep": torch.full((batch,), 501.0),
        "encoder_hidden_states": torch.randn(batch, 77, unet.config.cross_attention_dim, generator=g),
    }


def prepare(args, work: Path) -> dict:
    """Build the UNet once (saved for the conversion processes), inputs and the torch reference."""
    import torch

    from pocketdiff.export.components import UNetGraph, time_embedding_table

    unet = build_unet(args.arch, args.resolution, args.seed, args.init)
    n_params = sum(p.numel() for p in unet.parameters())
    unet.save_pretrained(str(work / "unet"), safe_serialization=True)
    inputs = make_inputs(unet, args.batch, args.seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        ref = UNetGraph(unet)(*inputs.values())
    ref_s = time.perf_counter() - t0
    table = time_embedding_table(unet, 1000)
    np.savez(work / "inputs.npz", **{k: v.numpy() for k, v in inputs.items()}, temb=table[[501] * args.batch], reference=ref.numpy())
    meta = {"params": int(n_params), "torch_forward_s": ref_s, "latent": list(inputs["sample"].shape)}
    if args.scan:
        meta["fp16_scan"] = fp16_scan(unet, inputs, args)
    return meta


def fp16_scan(unet, inputs: dict, args) -> dict:
    """fp16-emulated forward of the raw UNet and of the rescaled one (residual stream x s)."""
    import copy
    import dataclasses

    import torch

    from pocketdiff.export.components import UNetGraph
    from pocketdiff.export.fp16scan import Fp16Scanner
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
        out[label]["stream_peak"] = max([v.get("stream", 0.0) for v in rep["stats"].values()] or [0.0])
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
    from pocketdiff.export.exporter import VerifyConfig, export_component
    from pocketdiff.export.int8 import rtn_checkpoint
    from pocketdiff.export.parity import ParityConfig
    from pocketdiff.export.rewrites import RewriteConfig
    from pocketdiff.export.tflite_file import TfliteModel

    unet = UNet2DConditionModel.from_pretrained(str(work / "unet")).eval().requires_grad_(False)
    data = np.load(work / "inputs.npz")
    path = work / f"{variant}.tflite"
    meta: dict = {"variant": variant}
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
        meta["rewrites"] = rep["rewrites"]
        meta["int8_tensors"] = rep.get("int8_tensors")
        meta["rewrite_parity_cosine"] = rep["rewrite_parity"]["cosine"]
        if q is not None:  # quantization error of RTN itself, for reference (torch, fp32)
            meta["int8_layers"] = rep.get("int8_layers")
    meta["convert_s"] = time.perf_counter() - t0
    meta["convert_peak_rss_mb"] = peak_rss_mb()
    m = TfliteModel(path)
    hist = m.op_histogram()
    meta.update(bytes=path.stat().st_size, ops=hist, op_count=int(sum(hist.values())), transposes=int(hist.get("TRANSPOSE", 0)), max_rank=m.max_rank())
    return meta


# ----------------------------------------------------------------------------- delegate runs
def measure(args, work: Path, variant: str, meta: dict, n_params: int) -> dict:
    from pocketdiff.export.delegate import run_on_delegate
    from pocketdiff.export.parity import metrics

    data = np.load(work / "inputs.npz")
    time_key = "temb" if meta.get("time_input") == "time_embedding" else "timestep"
    feeds = [data["sample"], data[time_key], data["encoder_hidden_states"]]
    ref = data["reference"]
    path = work / f"{variant}.tflite"
    res = dict(meta)
    res["bytes_per_param"] = meta["bytes"] / n_params
    if not args.skip_gpu:
        log(f"{variant}: GPU delegate ({args.repeats} runs per precision)")
        run = run_on_delegate(path, feeds, precisions=["fp16", "fp32"], repeats=args.repeats, warmup=1, timeout_s=args.timeout)
        res["gpu"] = {
            "driver": run.driver, "adapter": run.adapter, "compiled": run.compiled, "fully_accelerated": run.fully_accelerated,
            "rejected": [r.describe() for r in run.rejected][:20], "ops_split": run.ops_split, "error": run.error,
            "compile_s": run.compile_s, "step_latency_s": run.latency_s,
            "parity": {p: metrics(ref, o[0]) for p, o in run.outputs.items()},
        }
    if not args.skip_cpu:
        log(f"{variant}: CPU (XNNPACK, {args.cpu_threads or 'default'} threads)")
        run = run_on_delegate(path, feeds, accelerator="cpu", repeats=max(1, args.repeats // 2), warmup=1, timeout_s=args.timeout,
                              num_threads=args.cpu_threads)
        res["cpu"] = {
            "compiled": run.compiled, "error": run.error, "compile_s": run.compile_s.get("fp32"),
            "step_latency_s": run.latency_s.get("fp32"),
            "parity": metrics(ref, run.outputs["fp32"][0]) if "fp32" in run.outputs else None,
        }
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="sd21", choices=["tiny", "small", "sd15", "sd21"])
    p.add_argument("--resolution", type=int, default=512, help="pixels (latents = resolution / VAE factor)")
    p.add_argument("--batch", type=int, default=2, help="UNet batch (2: classifier-free guidance)")
    p.add_argument("--variants", default=",".join(ALL_VARIANTS))
    p.add_argument("--residual-scale", default="0.125", help="power of two for the *_rs variants, or 'auto' (from --scan)")
    p.add_argument("--init", default="default", choices=["default", "normal002"], help="synthetic weights (see build_unet)")
    p.add_argument("--attention-budget-mb", type=float, default=None)
    p.add_argument("--conv-budget-mb", type=float, default=None)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--cpu-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--skip-gpu", action="store_true")
    p.add_argument("--skip-cpu", action="store_true")
    p.add_argument("--scan", action="store_true", help="fp16-emulated forward scan of the raw and rescaled UNet")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="torch device of the scan")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None, help="work folder (kept: .tflite files); default next to --out")
    p.add_argument("--out", required=True, help="JSON result")
    p.add_argument("--append", action="store_true", help="merge into an existing --out (same arch/resolution)")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--_convert", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    out = Path(args.out)
    work = Path(args.work) if args.work else out.parent / (out.stem + "_work")
    work.mkdir(parents=True, exist_ok=True)

    if args._convert:  # child: one conversion, its own peak RSS
        meta = convert_variant(args, work, args._convert)
        (work / f"{args._convert}.json").write_text(json.dumps(meta, indent=2))
        return 0

    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in ALL_VARIANTS:
            p.error(f"unknown variant {v!r}; choose from {ALL_VARIANTS}")
    result = {}
    if args.append and out.is_file():
        result = json.loads(out.read_text())
        if (result.get("arch"), result.get("resolution")) != (args.arch, args.resolution):
            p.error(f"--append: {out} holds arch={result.get('arch')} resolution={result.get('resolution')}")
    from pocketdiff.export.delegate import delegate_available

    result.update(
        init=args.init, residual_scale=args.residual_scale, arch=args.arch, resolution=args.resolution, batch=args.batch, host=platform.node(), cpu_count=os.cpu_count(),
        delegate_driver=delegate_available()[1], started=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    key = f"{args.arch}-{args.resolution}-{args.init}-{args.seed}-{args.batch}"
    stale = (work / "prepare.json").is_file() and json.loads((work / "prepare.json").read_text()).get("key") != key
    if stale or not (work / "inputs.npz").is_file() or not (work / "prepare.json").is_file():
        log(f"building {args.arch} UNet at {args.resolution}px, torch reference")
        meta = prepare(args, work)
        meta["key"] = key
        (work / "prepare.json").write_text(json.dumps(meta, indent=2))
    meta = json.loads((work / "prepare.json").read_text())
    if args.scan and "fp16_scan" not in meta:
        import torch  # noqa: F401

        from diffusers import UNet2DConditionModel

        unet = UNet2DConditionModel.from_pretrained(str(work / "unet")).eval()
        data = np.load(work / "inputs.npz")
        import torch as _t

        meta["fp16_scan"] = fp16_scan(unet, {k: _t.from_numpy(data[k]) for k in ("sample", "timestep", "encoder_hidden_states")}, args)
        (work / "prepare.json").write_text(json.dumps(meta, indent=2))
    result["params"] = meta["params"]
    result["latent"] = meta["latent"]
    result["torch_forward_s"] = meta["torch_forward_s"]
    if "fp16_scan" in meta:
        result["fp16_scan"] = meta["fp16_scan"]
    result.setdefault("variants", {})
    for v in variants:
        log(f"{v}: converting in a child process")
        cmd = [sys.executable, __file__, "--_convert", v, "--work", str(work), "--out", str(out), "--arch", args.arch,
               "--resolution", str(args.resolution), "--residual-scale", str(args.residual_scale), "--seed", str(args.seed),
               "--init", args.init]
        if args.attention_budget_mb:
            cmd += ["--attention-budget-mb", str(args.attention_budget_mb)]
        if args.conv_budget_mb:
            cmd += ["--conv-budget-mb", str(args.conv_budget_mb)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
            result["variants"][v] = {"error": f"conversion failed (exit {proc.returncode})", "log_tail": tail, "wall_s": time.perf_counter() - t0}
            log(f"{v}: conversion failed: {tail[-1] if tail else ''}")
        else:
            vmeta = json.loads((work / f"{v}.json").read_text())
            log(f"{v}: {vmeta['convert_s']:.1f} s, peak RSS {vmeta['convert_peak_rss_mb']:.0f} MB, {vmeta['bytes'] / 2**20:.1f} MiB, TRANSPOSE {vmeta['transposes']}")
            result["variants"][v] = measure(args, work, v, vmeta, meta["params"])
        result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        out.write_text(json.dumps(_summarize(result), indent=2, default=float))
    result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    out.write_text(json.dumps(_summarize(result), indent=2, default=float))
    log(f"wrote {out}")
    return 0


def _summarize(result: dict) -> dict:
    """A side-by-side table of the variants measured so far."""
    rows = {}
    for v, r in result.get("variants", {}).items():
        if "error" in r:
            rows[v] = {"error": r["error"]}
            continue
        gpu = r.get("gpu", {})
        cpu = r.get("cpu", {})
        par = gpu.get("parity", {})
        rows[v] = {
            "convert_s": round(r["convert_s"], 1),
            "convert_peak_rss_gb": round(r["convert_peak_rss_mb"] / 1024, 2),
            "mib": round(r["bytes"] / 2**20, 1),
            "bytes_per_param": round(r["bytes_per_param"], 3),
            "transposes": r["transposes"],
            "fully_accelerated": gpu.get("fully_accelerated"),
            "gpu_fp16_ms": _ms(gpu.get("step_latency_s", {}).get("fp16")),
            "gpu_fp32_ms": _ms(gpu.get("step_latency_s", {}).get("fp32")),
            "cpu_ms": _ms(cpu.get("step_latency_s")),
            "fp16_cosine": par.get("fp16", {}).get("cosine"),
            "fp16_finite": par.get("fp16", {}).get("finite"),
            "fp32_cosine": par.get("fp32", {}).get("cosine"),
            "cpu_cosine": (cpu.get("parity") or {}).get("cosine"),
        }
    result["summary"] = rows
    return result


def _ms(x):
    return None if x is None else round(1000 * x, 2)


if __name__ == "__main__":
    sys.exit(main())
