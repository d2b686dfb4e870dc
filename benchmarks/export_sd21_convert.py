"""benchmarks/export_sd21.py, convert stage: build the UNet + reference (child process),
convert each variant in its own child process (its own peak RSS), manifest.json, and pack the
.tflite files compressed for a GPU machine."""
from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pocketdiff.outputs import write_json

from export_sd21_weights import activation_report, build_unet, make_inputs

MANIFEST = "manifest.json"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


MAIN_SCRIPT = Path(__file__).resolve().with_name("export_sd21.py")  # the children run the CLI
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
    from pocketdiff.runtime.tflite_file import TfliteModel, sha256_file

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
    cmd = [sys.executable, str(MAIN_SCRIPT), flag, value, "--workdir", str(work), "--arch", args.arch,
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
