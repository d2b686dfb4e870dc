"""`pocketdiff calibrate`: block-wise reconstruction PTQ of the UNet to int8 / int4 weights.

1. load (or build) the pipeline; refuse NaN/inf weights
2. calibration data: the model's own DDIM trajectories on calibration prompts, UNet inputs
   recorded at steps spread over each trajectory (cond + uncond under guidance); a held-out
   set from other prompts and seeds
3. per-layer specs (bits, group size), then BRECQ-style block reconstruction with AdaRound
   (`pocketdiff.compress.quant.reconstruct`); the RTN baseline comes for free. `memory_cap_gib`
   caps the process's device memory, `recon.stream` streams the reconstruction per block (the
   text encoder and VAE wait on the host meanwhile)
4. optional text encoder / VAE decoder: round to nearest at searched scales
5. held-out comparison (UNet cosine, per-block MSE, sample grid); named parity thresholds
6. outputs: `unet_int8.safetensors` + `.json` recipe, `rtn/unet_int8.*`, stock diffusers
   folders `pipeline/` (and `rtn/pipeline/`) whose weights are codes * scales, report + page
   (the files and their writing: `calibrate_outputs`)

`calibrate_outputs.load_quantized_pipeline(DIR)` rebuilds the float pipeline from the int8 codes and scales.
"""
from __future__ import annotations

import copy
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from pocketdiff.errors import ParityError, PocketdiffError
from pocketdiff.models import load_or_build, perturb_norm_affines
from pocketdiff.outputs import write_json
from pocketdiff.conditioning import encode_conditioning, encode_unconditional, text_encoders
from pocketdiff.device import cap_cuda_memory, resolve_device
from pocketdiff.runtime.memory import tune_allocator

from .blocks import build_blocks
from .calib_data import collect_unet_inputs, subsample
from .int8_format import dequantized_state_dict
from .metrics import compare_unets
from .quantizer import LayerSpec, dequant, layer_specs, quantizable_layers, quantized_state_dict, rtn, search_scale
from .calibrate_config import DEFAULT_MIN_COSINE, CalibDataConfig, Config  # Config: the verb's config, found here by the CLI
from .calibrate_outputs import (TEXT_ENCODERS, VAE_DECODER_FILE, int8_file, make_recipe, save_checkpoints,
                                save_pipelines, set_state)
from .host_memory import host_report, mark_peak, plan_for_run
from .reconstruct import reconstruct_unet, write_weights


# ----------------------------------------------------------------------------- helpers


def _log(msg: str) -> None:
    print(f"calibrate: {msg}", file=sys.stderr, flush=True)


def _memory_cap(cfg: Config, device: torch.device) -> Optional[int]:
    """The cap in bytes; on CUDA also set as this process's memory fraction."""
    if cfg.memory_cap_gib is None:
        return None
    cap = int(cfg.memory_cap_gib * 2 ** 30)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        cap_cuda_memory(cap, device)
        if cap > total:
            _log(f"memory_cap_gib={cfg.memory_cap_gib:g} is above {device}'s {total / 2 ** 30:.1f} GiB: the device is the cap")
    return cap


def _peak_bytes(device: torch.device, info: dict) -> tuple[int, int]:
    """(allocated, reserved) peaks of the whole run: the reconstruction meters its blocks one by one."""
    return (max(info.get("peak_gpu_bytes", 0), torch.cuda.max_memory_allocated(device)),
            max(info.get("peak_gpu_reserved_bytes", 0), torch.cuda.max_memory_reserved(device)))


def _worker_devices(cfg: Config, device: torch.device) -> list[str]:
    if cfg.recon.devices:
        return list(cfg.recon.devices)
    if cfg.recon.mode == "independent" and device.type == "cuda" and cfg.device == "auto" and torch.cuda.device_count() > 1:
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return []


def _prompts(cfg: CalibDataConfig) -> tuple[list[str], list[str]]:
    need = cfg.num_prompts + cfg.holdout_prompts
    if cfg.prompts:
        source = [p for p in cfg.prompts]
    else:
        from pocketdiff.data import load_captions

        source = [c for c in load_captions(cfg.data) if c is not None]
    if not source:
        raise PocketdiffError("calibration has zero prompts (calib.prompts is empty and calib.data gave no captions)")
    full = [source[i % len(source)] for i in range(need)]
    return full[: cfg.num_prompts], full[cfg.num_prompts:]


def _collect(pipe, prompts, cfg: CalibDataConfig, seed: int, device):
    cond = encode_conditioning(pipe, prompts, device).to(dtype=torch.float32)
    uncond = None
    if float(cfg.guidance_scale) != 1.0:
        uncond = encode_unconditional(pipe, [cfg.negative_prompt] * len(prompts), device).to(dtype=torch.float32)
    side = pipe.unet.config.sample_size
    if isinstance(side, (list, tuple)):
        shape = (pipe.unet.config.in_channels, *side)
    else:
        shape = (pipe.unet.config.in_channels, side, side)
    return collect_unet_inputs(pipe.unet, pipe.scheduler, cond, uncond, steps=cfg.steps, guidance_scale=cfg.guidance_scale,
                               latent_shape=shape, seed=seed, per_trajectory=cfg.timesteps_per_trajectory,
                               batch_size=cfg.batch_size, class_label=cfg.class_label)


def _component_layers(module: torch.nn.Module, prefix_filter=None) -> dict[str, torch.nn.Module]:
    layers = quantizable_layers(module)
    if prefix_filter is not None:
        layers = {k: v for k, v in layers.items() if any(k == p or k.startswith(p + ".") for p in prefix_filter)}
    return layers


def _quantize_simple(module: torch.nn.Module, names: list[str], bits: int, group_size, overrides, device) -> tuple[dict, dict, dict]:
    """(rtn: name -> (codes, scale), searched: name -> (codes, scale), specs) for a module without reconstruction."""
    shapes = {n: module.get_submodule(n).weight.shape for n in names}
    specs = layer_specs(names, shapes, bits, group_size, overrides)
    rtn_res, searched = {}, {}
    for n in names:
        w = module.get_submodule(n).weight.detach().float().to(device)
        rtn_res[n] = tuple(t.cpu() for t in rtn(w, specs[n]))
        searched[n] = tuple(t.cpu() for t in rtn(w, specs[n], search_scale(w, specs[n])))
    return rtn_res, searched, specs


@torch.no_grad()
def _apply(module: torch.nn.Module, layers: dict[str, tuple], specs: dict[str, LayerSpec]) -> None:
    for n, (c, s) in layers.items():
        p = module.get_submodule(n).weight
        p.copy_(dequant(c, s, specs[n]).to(device=p.device, dtype=p.dtype))


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(1).double(), b.flatten(1).double(), dim=1).mean())


# ----------------------------------------------------------------------------- run


def run(cfg: Config, out: Path, resume: Optional[str] = None) -> dict:
    # No checkpoints: `--resume latest` (what the CLI suggests for a folder left by a killed
    # run) reruns from the start in the same folder; the run is deterministic, so the files equal
    # an uninterrupted run's. A named checkpoint cannot exist.
    if resume is not None and resume != "latest":
        raise PocketdiffError(f"--resume {resume}: calibrate has no checkpoints (--resume latest reruns it in the same folder)")
    t_start = time.time()
    out = Path(out)
    device = resolve_device(cfg.device)
    tune_allocator()  # glibc: buffers of 1 MiB and up go back to the system when freed (runtime/memory.py)
    host_plan = plan_for_run(cfg, device, out)  # the host cap is checked before any work
    if cfg.cpu_threads is not None:
        torch.set_num_threads(cfg.cpu_threads)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cap = _memory_cap(cfg, device)
    timings: dict[str, float] = {}

    # 1. model
    pipe, calib_prompts, holdout_prompts = _load_model(cfg, device, timings)
    host_plan = host_plan or plan_for_run(cfg, device, out, pipe)  # a model whose configs needed loading
    marks: dict = {}
    mark_peak(marks, "load")

    # 2. calibration data
    calib, holdout = _calibration_data(cfg, pipe, calib_prompts, holdout_prompts, device, timings)
    mark_peak(marks, "collect")

    # 3. UNet reconstruction
    specs, results, info = _reconstruct(cfg, pipe, calib, device, cap, timings, host_plan[0] if host_plan else None)
    recon_layers = {g: lr for r in results for g, lr in r.layers.items()}
    rtn_layers = info["rtn"]
    mark_peak(marks, "reconstruct")

    # 4. held-out comparison
    t = time.time()
    q_unet = copy.deepcopy(pipe.unet)
    write_weights(q_unet, recon_layers, specs)
    r_unet = copy.deepcopy(pipe.unet)
    _apply(r_unet, rtn_layers, specs)
    blocks = build_blocks(pipe.unet, cfg.quant.skip)
    cmp = compare_unets(pipe.unet, {"rtn": r_unet, "recon": q_unet}, blocks, holdout, device, batch=cfg.recon.forward_batch)
    timings["evaluate_s"] = round(time.time() - t, 3)
    mark_peak(marks, "evaluate")

    extras = _optional_components(cfg, pipe, holdout_prompts, calib, device)

    # 5. report + parity
    report = _report(cfg, results, cmp, specs, calib, holdout, calib_prompts, device, timings)
    report.update(extras.get("report", {}))
    parity = _parity(cfg, min(s.bits for s in specs.values()), report["unet_cosine"], report["unet_cosine_rtn"], extras)
    report["parity"] = parity
    report["peak_gpu_memory_gb"] = None  # GiB
    if device.type == "cuda":
        peak, reserved = _peak_bytes(device, info)
        report["peak_gpu_memory_gb"] = round(peak / 2 ** 30, 3)
        report["memory"] = {"cap_gib": cfg.memory_cap_gib, "stream": cfg.recon.stream, "peak_allocated_gib": round(peak / 2 ** 30, 3),
                            "peak_reserved_gib": round(reserved / 2 ** 30, 3),
                            "reconstruct_peak_gib": round(info.get("peak_gpu_bytes", 0) / 2 ** 30, 3)}
    if not parity["passed"]:
        report["wall_time_s"] = round(time.time() - t_start, 3)
        report["host_memory"] = host_report(cfg, host_plan, marks)
        report["host_peak_rss_gb"] = report["host_memory"]["peak_rss_gb"]
        write_json(out / "report.json", report)
        _page(out, report, None)
        failed = [f"{k}: {v['value']:.6f} < {v['threshold']}" for k, v in parity["checks"].items() if not v["passed"]]
        raise ParityError("parity failed (no checkpoint written): " + "; ".join(failed))

    # 6. outputs
    t = time.time()
    pipe.to("cpu")  # the UNet's own float tensors are the float state (`set_state` assigns new ones): no copy
    float_state = {k: v.detach() for k, v in pipe.unet.state_dict().items()}
    saved = save_checkpoints(cfg, out, report, results, float_state, recon_layers, rtn_layers, specs, extras)
    report.update(save_pipelines(cfg, out, pipe, report["source"], saved, extras))
    timings["save_s"] = round(time.time() - t, 3)
    mark_peak(marks, "save")

    samples = _samples(cfg, pipe, float_state, saved.recon_state, saved.recon_recipe, saved.rtn_state, saved.rtn_recipe,
                       holdout_prompts, out, device)
    if samples:
        report["samples"] = samples
    report["wall_time_s"] = round(time.time() - t_start, 3)
    report["host_memory"] = host_report(cfg, host_plan, marks)
    report["host_peak_rss_gb"] = report["host_memory"]["peak_rss_gb"]  # GiB, VmHWM of this process (runtime/memory.py)
    _page(out, report, samples)
    _log(f"UNet cosine {report['unet_cosine']:.6f} (RTN {report['unet_cosine_rtn']:.6f}); {report['blocks_improved']}/"
         f"{report['blocks_evaluated']} blocks below RTN; {report['wall_time_s']:.1f}s"
         + (f", peak GPU memory {report['peak_gpu_memory_gb']:.2f} GiB" if report.get("peak_gpu_memory_gb") is not None else ""))
    return report


def _load_model(cfg: Config, device, timings: dict) -> tuple:
    """Step 1: the pipeline (norm affines perturbed for built models when asked), in fp32 on the device."""
    t = time.time()
    calib_prompts, holdout_prompts = _prompts(cfg.calib)
    pipe = load_or_build(cfg.model, captions=calib_prompts + holdout_prompts)
    if getattr(pipe, "unet", None) is None:
        raise PocketdiffError("the pipeline has no UNet")
    if cfg.perturb_norms > 0:
        if cfg.model.pretrained:
            raise PocketdiffError("perturb_norms applies to built (random) models only; unset it for model.pretrained")
        for i, comp in enumerate((pipe.unet, pipe.text_encoder, pipe.vae, getattr(pipe, "text_encoder_2", None))):
            if comp is not None:
                perturb_norm_affines(comp, cfg.seed + i, scale=cfg.perturb_norms)
    # NaN / Inf weights were refused by load_pipeline (models.check_finite_weights)
    pipe.unet.to(device=device, dtype=torch.float32).eval().requires_grad_(False)
    for encoder in text_encoders(pipe):  # SDXL: text_encoder_2 too
        encoder.to(device=device, dtype=torch.float32).eval().requires_grad_(False)
    pipe.vae.to(device=device, dtype=torch.float32).eval().requires_grad_(False)
    missing = [c for c in cfg.quant.components if c in TEXT_ENCODERS and getattr(pipe, c, None) is None]
    if missing:
        raise PocketdiffError(f"quant.components: {missing[0]}: the model has no {missing[0]} (the SDXL family's second text encoder)")
    timings["load_s"] = round(time.time() - t, 3)
    return pipe, calib_prompts, holdout_prompts


def _calibration_data(cfg: Config, pipe, calib_prompts: list[str], holdout_prompts: list[str], device, timings: dict) -> tuple:
    """Step 2: UNet inputs from the model's own trajectories (calibration set, subsampled; held-out set)."""
    t = time.time()
    calib = subsample(_collect(pipe, calib_prompts, cfg.calib, cfg.calib.seed, device), cfg.calib.max_samples)
    holdout = _collect(pipe, holdout_prompts, cfg.calib, cfg.calib.seed + 100_000, device)
    if len(calib) == 0:
        raise PocketdiffError("zero calibration samples")
    timings["collect_s"] = round(time.time() - t, 3)
    _log(f"{len(calib)} calibration inputs ({len(calib_prompts)} {calib.meta['sampler']} trajectories x "
         f"{len(calib.meta['step_indices'])} steps"
         f"{' x cond/uncond' if calib.meta['cfg'] else ''}), {len(holdout)} held-out ({timings['collect_s']:.1f}s)")
    return calib, holdout


def _reconstruct(cfg: Config, pipe, calib, device, cap: Optional[int], timings: dict, host_cache=None) -> tuple:
    """Step 3: per-layer specs, then block reconstruction of the UNet; (specs, block results, info with the RTN layers)."""
    t = time.time()
    unet = pipe.unet
    names = list(quantizable_layers(unet, cfg.quant.skip))
    if not names:
        raise PocketdiffError("the UNet has no Conv2d / Linear layer left to quantize (check quant.skip)")
    shapes = {g: unet.get_submodule(g).weight.shape for g in names}
    specs = layer_specs(names, shapes, cfg.quant.bits, cfg.quant.group_size, cfg.quant.layer_bits)
    if cfg.recon.stream:  # the text encoders and VAE wait on the host
        for encoder in text_encoders(pipe):
            encoder.to("cpu")
        pipe.vae.to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results, info = reconstruct_unet(unet, calib, specs, cfg.recon, device=device, skip=cfg.quant.skip, seed=cfg.seed,
                                     log=_log, devices=_worker_devices(cfg, device), memory_cap_bytes=cap, host_cache=host_cache)
    for encoder in text_encoders(pipe):
        encoder.to(device)
    pipe.vae.to(device)
    timings["reconstruct_s"] = round(time.time() - t, 3)
    return specs, results, info


def _block_row(r, held: Optional[dict]) -> dict:
    """One block's report row: its reconstruction stats and held-out errors (None: outside every block)."""
    row = {"name": r.name, "kind": r.kind, "layers": len(r.layers), "chosen": r.stats.get("chosen")}
    if held is None:  # layers outside every block (unusual UNets): quantized without reconstruction
        row.update(mse_rtn=None, mse_recon=None)
    else:
        row.update(mse_rtn=held["rtn"]["mse"], mse_recon=held["recon"]["mse"],
                   mse_rtn_local=held["rtn"]["mse_local"], mse_recon_local=held["recon"]["mse_local"],
                   output_power=held["power"])
    for k in ("mse_rtn_calib", "mse_init_calib", "mse_adaround_calib", "mse_recon_calib", "soft_fraction", "time_s", "iters",
              "peak_gpu_gib", "cache_on_device"):
        if k in r.stats:
            row[k] = r.stats[k]
    if "curve" in r.stats:
        row["curve"] = r.stats["curve"]
    return row


def _report(cfg: Config, results, cmp: dict, specs: dict, calib, holdout, calib_prompts: list[str], device,
            timings: dict) -> dict:
    """Step 5's report (before the optional components, parity and memory are added)."""
    block_rows = [_block_row(r, cmp["blocks"].get(r.name)) for r in results]
    rows_eval = [b for b in block_rows if b.get("mse_recon") is not None]
    return {
        "bits": cfg.quant.bits,
        "group_size": cfg.quant.group_size,
        "bits_per_layer": {str(b): sum(1 for s in specs.values() if s.bits == b) for b in sorted({s.bits for s in specs.values()})},
        "method": cfg.recon.method,
        "mode": cfg.recon.mode,
        "iters": cfg.recon.iters,
        "unet_cosine": cmp["unets"]["recon"]["cosine_mean"],
        "unet_cosine_min": cmp["unets"]["recon"]["cosine_min"],
        "unet_nmse": cmp["unets"]["recon"]["nmse"],
        "unet_cosine_rtn": cmp["unets"]["rtn"]["cosine_mean"],
        "unet_cosine_rtn_min": cmp["unets"]["rtn"]["cosine_min"],
        "unet_nmse_rtn": cmp["unets"]["rtn"]["nmse"],
        "blocks_improved": sum(1 for b in rows_eval if b["mse_recon"] < b["mse_rtn"]),
        "blocks_improved_local": sum(1 for b in rows_eval if b["mse_recon_local"] < b["mse_rtn_local"]),
        "blocks_evaluated": len(rows_eval),
        "blocks": block_rows,
        "calibration": {"samples": len(calib), "holdout_samples": len(holdout), "trajectories": len(calib_prompts),
                        "steps": cfg.calib.steps, "step_indices": calib.meta["step_indices"],
                        "guidance_scale": cfg.calib.guidance_scale, "cond_and_uncond": bool(calib.meta["cfg"]),
                        "sampler": calib.meta["sampler"], "timesteps": calib.meta["timesteps"]},
        "source": cfg.model.pretrained or f"built:{cfg.model.arch}",
        "device": str(device),
        "workers": _worker_devices(cfg, device),
        "timings": timings,
    }


def _parity(cfg: Config, min_bits: int, unet_cos: float, rtn_cos: float, extras: dict) -> dict:
    checks = {}
    thr = cfg.parity.min_unet_cosine if cfg.parity.min_unet_cosine is not None else DEFAULT_MIN_COSINE[min_bits]
    checks["min_unet_cosine"] = {"value": unet_cos, "threshold": thr, "passed": unet_cos >= thr}
    if cfg.parity.recon_not_worse_than_rtn:
        checks["recon_not_worse_than_rtn"] = {"value": unet_cos, "threshold": rtn_cos - 1e-4, "passed": unet_cos >= rtn_cos - 1e-4}
    bars = {"text_encoder": cfg.parity.min_text_encoder_cosine, "text_encoder_2": cfg.parity.min_text_encoder_cosine,
            "vae_decoder": cfg.parity.min_vae_decoder_cosine}  # text_encoder_2: the text encoders' bar
    for key, bar in bars.items():
        if key in extras.get("cosines", {}):
            val = extras["cosines"][key]
            t = bar if bar is not None else DEFAULT_MIN_COSINE[cfg.quant.bits]
            checks[f"min_{key}_cosine"] = {"value": val, "threshold": t, "passed": val >= t}
    return {"passed": all(c["passed"] for c in checks.values()), "checks": checks}


def _text_cos(pipe, name: str, module, prompts, device, ref=None):
    """The conditioning the prompts make with `module` as text encoder `name` (its text fields flattened side by side);
    with `ref`, its cosine to `ref`."""
    saved = getattr(pipe, name)
    setattr(pipe, name, module)
    try:
        cond = encode_conditioning(pipe, prompts, device)
    finally:
        setattr(pipe, name, saved)
    flat = torch.cat([v.float().flatten(1) for k, v in cond.tensors().items() if k != "time_ids"], dim=1)
    return flat if ref is None else _cos(flat, ref)


def _text_encoder_int8(cfg: Config, pipe, name: str, holdout_prompts, device, result: dict) -> dict:
    """Text encoder `name`: RTN at searched scales; cosine of the prompts' conditioning vs float (its save entry)."""
    te = getattr(pipe, name)
    names = list(_component_layers(te))
    rtn_res, searched, specs = _quantize_simple(te, names, cfg.quant.bits, cfg.quant.group_size, cfg.quant.layer_bits, device)
    q_te = copy.deepcopy(te)
    _apply(q_te, searched, specs)
    cos = _text_cos(pipe, name, q_te, holdout_prompts, device, _text_cos(pipe, name, te, holdout_prompts, device))
    result["cosines"][name] = cos
    result["report"][f"{name}_cosine"] = cos
    state, src = te.state_dict(), {"source_pipeline": cfg.model.pretrained or f"built:{cfg.model.arch}"}
    return {"component": name, "file": int8_file(name), "state": quantized_state_dict(state, searched),
            "recipe": make_recipe(name, specs, {n: "rtn_mse" for n in names}, cfg.seed, src),
            "rtn_state": quantized_state_dict(state, rtn_res), "rtn_recipe": make_recipe(name, specs, {n: "rtn" for n in names}, cfg.seed, src)}


@torch.no_grad()
def _optional_components(cfg: Config, pipe, holdout_prompts, calib, device) -> dict:
    """Text encoder / VAE decoder: RTN at searched scales; cosine vs float on held-out prompts / latents."""
    result: dict = {"save": [], "cosines": {}, "report": {}}
    seed = cfg.seed
    for name in (n for n in TEXT_ENCODERS if n in cfg.quant.components):  # SDXL's text_encoder_2 as the first
        result["save"].append(_text_encoder_int8(cfg, pipe, name, holdout_prompts, device, result))
    if "vae_decoder" in cfg.quant.components:
        vae = pipe.vae
        names = list(_component_layers(vae, ("decoder", "post_quant_conv")))
        rtn_res, searched, specs = _quantize_simple(vae, names, cfg.quant.bits, cfg.quant.group_size, cfg.quant.layer_bits, device)
        g = torch.Generator("cpu").manual_seed(seed)
        n = min(4, len(holdout_prompts))
        latents = torch.randn((n, vae.config.latent_channels, *calib.sample.shape[2:]), generator=g).to(device)
        ref = vae.decode(latents / vae.config.scaling_factor).sample.float()
        q_vae = copy.deepcopy(vae)
        _apply(q_vae, searched, specs)
        cos = _cos(q_vae.decode(latents / vae.config.scaling_factor).sample.float(), ref)
        result["cosines"]["vae_decoder"] = cos
        result["report"]["vae_decoder_cosine"] = cos
        state = {k: v for k, v in vae.state_dict().items() if k.startswith(("decoder.", "post_quant_conv."))}
        src = {"source_pipeline": cfg.model.pretrained or f"built:{cfg.model.arch}"}
        result["save"].append({
            "component": "vae_decoder", "file": VAE_DECODER_FILE,
            "state": quantized_state_dict(state, searched),
            "recipe": make_recipe("vae_decoder", specs, {n: "rtn_mse" for n in names}, seed, src),
            "rtn_state": quantized_state_dict(state, rtn_res),
            "rtn_recipe": make_recipe("vae_decoder", specs, {n: "rtn" for n in names}, seed, src),
        })
    return result


@torch.no_grad()
def _samples(cfg: Config, pipe, float_state, recon_state, recon_recipe, rtn_state, rtn_recipe, prompts, out: Path, device) -> Optional[dict]:
    """Float / RTN / reconstruction images on held-out prompts, same seeds; grid + PSNR vs float."""
    if cfg.output.samples <= 0 or not prompts:
        return None
    from pocketdiff.report import save_grid
    from pocketdiff.sampling import generate

    prompts = prompts[: cfg.output.samples]
    steps = cfg.output.sample_steps or cfg.calib.steps
    pipe.to(device)
    images = {}
    for name, state in (("float", float_state), ("rtn", dequantized_state_dict(rtn_state, rtn_recipe)),
                        ("recon", dequantized_state_dict(recon_state, recon_recipe))):
        set_state(pipe.unet, state)
        images[name] = generate(pipe, prompts, steps=steps, guidance_scale=cfg.calib.guidance_scale, seed=cfg.calib.seed + 200_000)
    pipe.to("cpu")
    grid = torch.cat([images["float"], images["rtn"], images["recon"]])
    labels = [f"float: {p}" for p in prompts] + [f"rtn: {p}" for p in prompts] + [f"recon: {p}" for p in prompts]
    save_grid(grid, out / "samples.png", ncols=len(prompts), labels=labels, cell=128)

    def psnr(a, b):
        mse = float(((a - b) ** 2).mean())
        return 99.0 if mse == 0 else float(10 * torch.log10(torch.tensor(1.0 / mse)))

    return {"grid": "samples.png", "prompts": prompts, "steps": steps, "guidance_scale": cfg.calib.guidance_scale,
            "psnr_rtn": psnr(images["rtn"], images["float"]), "psnr_recon": psnr(images["recon"], images["float"])}


def _page(out: Path, report: dict, samples: Optional[dict]) -> None:
    from pocketdiff.report import img, plot_curves, table, write_page

    rows = [b for b in report["blocks"] if b.get("mse_recon") is not None]
    sections = []
    if rows:
        curves = {
            "RTN (in quantized UNet)": [(i, max(b["mse_rtn"], 1e-30)) for i, b in enumerate(rows)],
            "reconstruction (in quantized UNet)": [(i, max(b["mse_recon"], 1e-30)) for i, b in enumerate(rows)],
            "RTN (block alone)": [(i, max(b["mse_rtn_local"], 1e-30)) for i, b in enumerate(rows)],
            "reconstruction (block alone)": [(i, max(b["mse_recon_local"], 1e-30)) for i, b in enumerate(rows)],
        }
        plot_curves(curves, out / "block_mse.png", "block (execution order)", "output MSE (held-out)",
                    f"W{report['bits']} per-block error", logy=True)
        sections.append(("Per-block error", img("block_mse.png")))
        sections.append(("Blocks", table(
            ["#", "block", "kind", "chosen", "MSE RTN", "MSE recon", "MSE RTN (alone)", "MSE recon (alone)", "time s", "peak GiB"],
            [(i, b["name"], b["kind"], b.get("chosen", ""), b["mse_rtn"], b["mse_recon"], b["mse_rtn_local"],
              b["mse_recon_local"], b.get("time_s", 0.0), b.get("peak_gpu_gib", "")) for i, b in enumerate(rows)])))
    summary = [("UNet cosine (held-out)", report["unet_cosine"]), ("UNet cosine RTN", report["unet_cosine_rtn"]),
               ("UNet NMSE (held-out)", report["unet_nmse"]), ("UNet NMSE RTN", report["unet_nmse_rtn"]),
               ("blocks below RTN", f"{report['blocks_improved']}/{report['blocks_evaluated']}"),
               ("parity", "passed" if report["parity"]["passed"] else "FAILED")]
    if report.get("memory"):
        m = report["memory"]
        summary.append(("peak GPU memory GiB (cap)", f"{m['peak_allocated_gib']} ({m['cap_gib'] if m['cap_gib'] else 'none'})"))
    if report.get("wall_time_s") is not None:
        summary.append(("wall time s", report["wall_time_s"]))
    sections.insert(0, ("Summary", table(["", "value"], summary)))
    if samples:
        sections.append((f"Samples: float / RTN / reconstruction (rows), DDIM {samples['steps']} steps; PSNR vs float: "
                         f"RTN {samples['psnr_rtn']:.2f} dB, recon {samples['psnr_recon']:.2f} dB", img(samples["grid"])))
    write_page(out / "index.html", "pocketdiff calibrate", sections, report)
