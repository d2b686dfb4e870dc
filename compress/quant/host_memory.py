"""Host memory of `pocketdiff calibrate`: the bytes the run needs, predicted from the config and the
model's shapes before any work, and the block-cache plan that keeps them under `host_cap_gib`.

Where the host bytes go (float32 sizes; SD-2.1 at 512 px, 256 calibration inputs, in parentheses):
- the process itself: Python, torch and diffusers as imported when the plan is made (measured then,
  VmRSS), plus `CUDA_RUNTIME_BYTES` for the CUDA context and its libraries on a GPU (an estimate,
  checked by the report's `host_peak_rss_gb` against `host_memory.predicted_gb`);
- the pipeline's weights (UNet 3.5 GB, text encoder 1.2-1.4 GB, VAE 0.3 GB): on the host while it
  loads, while a streamed reconstruction runs (the UNet between capture passes, the text encoder
  and VAE throughout) and while the outputs are written; always on a CPU run;
- calibration and held-out inputs: latents and text embeddings per input (0.4 MB each);
- the quantized codes: int8, one byte per quantized weight (0.87 GB), held for RTN and for the
  reconstruction, and again in the two checkpoints' state dicts while they are written;
- the block caches: per calibration input, every block's inputs and outputs (257 MB, so 66 GB in
  all), captured in groups of consecutive blocks; one group is held at a time, and each block's
  part goes when its reconstruction ends. The group budget is what the cap leaves;
- the outputs: the float UNet (kept to sample from) and one dequantized copy, plus safetensors'
  serialised copy of the component being written.
On a CPU run the reconstruction also holds its working set (`reconstruct.block_need_bytes`) and
the held-out comparison two more UNets (RTN and reconstruction) on the host.

The peak is the largest of the phases (`HostNeed.phases`). When even one block's cache does not
fit beside the rest, the caches go to files under the output folder (`recon.host_cache`, the
folder removed at the end) and the host holds only the rows it reads.
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Optional

import torch

from pocketdiff.conditioning import placeholder_conditioning
from pocketdiff.errors import PocketdiffError

from .blocks import CONDITIONING_KEYS, CalibSet, build_blocks, group_by_budget, human_bytes, order_blocks
from .cache_store import READ_CHUNK_BYTES, HostCache
from .calib_data import trajectory_indices
from .quantizer import quantizable_layers
from .reconstruct import block_need_bytes, module_bytes

CUDA_RUNTIME_BYTES = int(2.5 * 2 ** 30)  # CUDA context + cuBLAS / cuDNN on the host (estimate)
CACHE_FOLDER = ".calib_cache"
# share of host_cap_gib the block caches leave for what the prediction misses (measured on CPU runs: the
# peak 3 % above the prediction with in-memory caches, 11 % with on-disk ones; the CUDA share is an estimate)
CAP_HEADROOM = 0.15
TEXT_TOKENS = 77


@dataclasses.dataclass
class ModelSizes:
    """What the host accounting needs to know of a model, from its shapes only."""

    unet_bytes: int
    text_encoder_bytes: int  # every text encoder (an SDXL family: both)
    vae_bytes: int
    quantized_numel: int  # weights of the quantized layers (one int8 code each)
    per_sample: dict  # block name -> {"in", "out"}: float32 bytes per calibration input
    blocks: list  # the UNet's blocks in execution order (for the capture groups)
    input_bytes: int  # one calibration input (latents, timestep, text embeddings, ...) in float32
    block_need: int  # the largest block's reconstruction working set (a CPU run holds it on the host)


def _meta_unet(config: dict):
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        return UNet2DConditionModel.from_config(dict(config))


def _skeleton(model_cfg):
    """(meta UNet, text encoders' bytes (an SDXL family's two), VAE bytes) from the configs alone, or None where they
    cannot be read without loading (a hub id not in the local cache)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from pocketdiff.archs import default_resolution, is_xl, text_encoder_config, unet_config, vae_config
    from pocketdiff.models_xl import SDXL, family_of_index, read_index

    if not model_cfg.pretrained:
        res = default_resolution(model_cfg.arch, model_cfg.prediction_type)
        vae_cfg = vae_config(model_cfg.arch, res)
        factor = 2 ** (len(vae_cfg["block_out_channels"]) - 1)
        with torch.device("meta"):
            vae = AutoencoderKL(**vae_cfg)
            te = module_bytes(CLIPTextModel(text_encoder_config(model_cfg.arch, vocab_size=model_cfg.vocab_size)))
            if is_xl(model_cfg.arch):
                te += module_bytes(CLIPTextModelWithProjection(text_encoder_config(model_cfg.arch, vocab_size=model_cfg.vocab_size, which=2)))
        unet = _meta_unet(unet_config(model_cfg.arch, model_cfg.prediction_type, res, latent_channels=vae.config.latent_channels,
                                      vae_factor=factor))
        return unet, te, module_bytes(vae)
    from pocketdiff.shipped import resolve_shipped

    src = resolve_shipped(model_cfg.pretrained)
    try:
        unet = _meta_unet(UNet2DConditionModel.load_config(src, subfolder="unet"))
        with torch.device("meta"):
            vae = AutoencoderKL.from_config(AutoencoderKL.load_config(model_cfg.vae or src, subfolder=None if model_cfg.vae else "vae"))
            te = module_bytes(CLIPTextModel(CLIPTextConfig.from_pretrained(src, subfolder="text_encoder")))
            if family_of_index(read_index(src)) == SDXL:  # the second text encoder (with its projection)
                te += module_bytes(CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(src, subfolder="text_encoder_2")))
    except (OSError, ValueError, EnvironmentError):
        return None
    return unet, te, module_bytes(vae)


def model_sizes(unet, text_encoder_bytes: int, vae_bytes: int, skip, opts) -> ModelSizes:
    """Sizes of a UNet (any device; measured on a meta-device copy of its config) and the other weights."""
    meta = unet if next(unet.parameters()).device.type == "meta" else _meta_unet(unet.config)
    blocks = build_blocks(meta, skip)
    c = meta.config
    side = c.sample_size if isinstance(c.sample_size, (list, tuple)) else (c.sample_size, c.sample_size)
    cond = placeholder_conditioning(c, 1, TEXT_TOKENS, "meta")  # the UNet family's conditioning fields
    one = {"sample": torch.zeros(1, c.in_channels, *side, device="meta"),
           "timestep": torch.zeros(1, dtype=torch.long, device="meta"),
           **{CONDITIONING_KEYS[name]: v for name, v in cond.tensors().items()}}
    if c.get("time_cond_proj_dim"):
        one["timestep_cond"] = torch.zeros(1, c.time_cond_proj_dim, device="meta")
    if getattr(meta, "class_embedding", None) is not None:
        one["class_labels"] = torch.zeros(1, dtype=torch.long, device="meta")
    per_sample = order_blocks(meta, blocks, CalibSet(**one), "meta")
    names = quantizable_layers(meta, skip)
    real = [b for b in blocks if b.kind != "rest"]
    return ModelSizes(unet_bytes=module_bytes(meta), text_encoder_bytes=int(text_encoder_bytes), vae_bytes=int(vae_bytes),
                      quantized_numel=sum(m.weight.numel() for m in names.values()), per_sample=per_sample, blocks=real,
                      input_bytes=sum(t.numel() * (8 if t.dtype == torch.long else 4) for t in one.values()),
                      block_need=max((block_need_bytes(b, per_sample, opts) for b in real), default=0))


def sizes_before_loading(cfg) -> Optional[ModelSizes]:
    skel = _skeleton(cfg.model)
    return None if skel is None else model_sizes(skel[0], skel[1], skel[2], cfg.quant.skip, cfg.recon)


def sizes_of_pipeline(pipe, cfg) -> ModelSizes:
    from pocketdiff.conditioning import text_encoders

    te = sum(module_bytes(e) for e in text_encoders(pipe))  # an SDXL family's two
    return model_sizes(pipe.unet, te, module_bytes(pipe.vae), cfg.quant.skip, cfg.recon)


def calibration_counts(calib_cfg) -> tuple[int, int]:
    """(calibration inputs, held-out inputs) the run records at most (cond + uncond under guidance)."""
    per = len(trajectory_indices(calib_cfg.steps, calib_cfg.timesteps_per_trajectory))
    rows = 2 if float(calib_cfg.guidance_scale) != 1.0 else 1
    n = calib_cfg.num_prompts * per * rows
    if calib_cfg.max_samples:
        n = min(n, calib_cfg.max_samples)
    return n, calib_cfg.holdout_prompts * per * rows


@dataclasses.dataclass
class HostNeed:
    """Predicted host bytes per phase, each split into its parts."""

    phases: dict

    def total(self, phase: str) -> int:
        return int(sum(self.phases[phase].values()))

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    @property
    def peak(self) -> int:
        return self.total(self.peak_phase)

    def summary(self) -> dict:
        return {"predicted_gb": round(self.peak / 2 ** 30, 3), "peak_phase": self.peak_phase,
                "phases_gb": {p: round(self.total(p) / 2 ** 30, 3) for p in self.phases},
                "parts_gb": {k: round(v / 2 ** 30, 3) for k, v in self.phases[self.peak_phase].items()}}


def _cache_bytes(cfg, sizes: ModelSizes, n: int, budget: float, on_disk: bool) -> tuple[int, int]:
    """(host bytes of the block caches at their largest, bytes of the largest capture group): as
    `reconstruct` groups them (float32 sizes against the budget, stored at `recon.cache_dtype`)."""
    from .block_recon import DTYPES

    scale = torch.empty((), dtype=DTYPES[cfg.recon.cache_dtype]).element_size() / 4
    sequential = cfg.recon.mode == "sequential" and cfg.recon.method == "adaround"
    keys = ("in", "out") if not sequential or cfg.recon.qdrop > 0 else ("out",)
    groups = group_by_budget(sizes.blocks, sizes.per_sample, n, budget / 2 if sequential else budget, keys)
    group = max((n * sum(sizes.per_sample[b.name][k] for b in g for k in keys) for g in groups), default=0)
    if sequential:  # each block's quantized-prefix inputs, beside its group's targets
        group += max((n * sizes.per_sample[b.name]["in"] for b in sizes.blocks), default=0)
    group = int(group * scale)
    return (2 * READ_CHUNK_BYTES if on_disk else group), group


def predict_host_need(cfg, sizes: ModelSizes, device: torch.device, runtime_bytes: int, cache_bytes: int) -> HostNeed:
    """Host bytes per phase of `calibrate.run` (see the module docstring), given the block caches' share."""
    cpu = device.type != "cuda"
    n, n_held = calibration_counts(cfg.calib)
    pipe = sizes.unet_bytes + sizes.text_encoder_bytes + sizes.vae_bytes
    codes = sizes.quantized_numel
    base = {"runtime": runtime_bytes + (0 if cpu else CUDA_RUNTIME_BYTES), "calibration_inputs": (n + n_held) * sizes.input_bytes}
    recon = {**base, "pipeline": pipe if (cpu or cfg.recon.stream) else 0, "codes": 2 * codes, "block_caches": cache_bytes}
    if cpu:
        recon["block_working_set"] = sizes.block_need
        if cfg.recon.mode == "sequential":
            recon["quantized_unet"] = sizes.unet_bytes
    phases = {
        "load": {**base, "pipeline": pipe},
        "reconstruct": recon,
        "evaluate": {**base, "pipeline": pipe if cpu else 0, "codes": 2 * codes, "compared_unets": 2 * sizes.unet_bytes if cpu else 0},
        "save": {**base, "pipeline": pipe, "codes": 4 * codes, "float_unet": sizes.unet_bytes,
                 "serialised_copy": sizes.unet_bytes},
        "samples": {**base, "pipeline": pipe if cpu else 0, "codes": 4 * codes, "float_unet": sizes.unet_bytes,
                    "dequantized_unet": sizes.unet_bytes},
    }
    return HostNeed(phases)


def _disk_free(folder: Path) -> int:
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def plan_host_cache(cfg, sizes: ModelSizes, device: torch.device, out_dir: Path, runtime_bytes: int) -> tuple[HostCache, HostNeed]:
    """The block caches' place and group budget, and the predicted need; a PocketdiffError (before any
    work) when `host_cap_gib` cannot hold the run, or when the disk cannot hold an on-disk cache."""
    n = calibration_counts(cfg.calib)[0]
    cap = None if cfg.host_cap_gib is None else int(cfg.host_cap_gib * 2 ** 30)
    host_side = cfg.recon.stream or device.type != "cuda"
    if not host_side:  # the caches live on the device (or, when they do not fit there, in host memory: 40 % of it)
        return HostCache(), predict_host_need(cfg, sizes, device, runtime_bytes, 0)
    fixed = predict_host_need(cfg, sizes, device, runtime_bytes, 0).total("reconstruct")
    room = None if cap is None else int((1 - CAP_HEADROOM) * cap) - fixed
    budget = cfg.recon.cache_budget_gb * 2 ** 30 if cfg.recon.cache_budget_gb is not None else room
    in_memory = _cache_bytes(cfg, sizes, n, budget or HostCache().budget(), False)[0]
    mode = cfg.recon.host_cache
    if mode == "auto":
        mode = "memory" if room is None or in_memory <= room else "disk"
    if mode == "memory":
        cache, need = HostCache(budget_bytes=budget), predict_host_need(cfg, sizes, device, runtime_bytes, in_memory)
    else:
        folder = Path(out_dir) / CACHE_FOLDER
        disk_budget = cfg.recon.cache_budget_gb * 2 ** 30 if cfg.recon.cache_budget_gb is not None else float("inf")
        staging, on_disk = _cache_bytes(cfg, sizes, n, disk_budget, True)
        free = _disk_free(folder)
        if on_disk > free:
            raise PocketdiffError(f"the on-disk block cache in {folder} needs {on_disk:,} bytes ({human_bytes(on_disk)}) and the "
                                  f"disk has {free:,} free; free space there or set recon.cache_budget_gb lower")
        cache, need = HostCache(budget_bytes=disk_budget, folder=folder), predict_host_need(cfg, sizes, device, runtime_bytes, staging)
    if cap is not None and need.peak > cap:
        raise PocketdiffError(f"host_cap_gib={cfg.host_cap_gib:g} ({cap:,} bytes) is below what the run needs: {need.peak:,} bytes "
                              f"({human_bytes(need.peak)}) at its {need.peak_phase} phase; raise host_cap_gib")
    return cache, need


def plan_for_run(cfg, device: torch.device, out_dir: Path, pipe=None) -> Optional[tuple[HostCache, HostNeed]]:
    """`plan_host_cache` for `calibrate.run`: from the configs alone (before loading; None when the
    model's configs cannot be read without loading it), or from the loaded `pipe`. The process's own
    resident set now is the runtime's share."""
    from pocketdiff.runtime.memory import host_rss_mb

    sizes = sizes_before_loading(cfg) if pipe is None else sizes_of_pipeline(pipe, cfg)
    if sizes is None:
        return None
    runtime = int((host_rss_mb() or 0.0) * 2 ** 20)
    if pipe is not None:  # the pipeline is loaded already: what the process holds beyond it is the runtime's
        runtime = max(0, runtime - sizes.unet_bytes - sizes.text_encoder_bytes - sizes.vae_bytes)
    return plan_host_cache(cfg, sizes, device, out_dir, runtime)


def mark_peak(marks: dict, phase: str) -> None:
    """The process's host peak so far (VmHWM, GiB) as `marks[phase]`: read in phase order, the first
    mark that reaches the final peak names the phase that set it."""
    from pocketdiff.runtime.memory import host_peak_mb

    marks[phase] = round((host_peak_mb() or 0.0) / 1024, 3)


def host_report(cfg, plan: Optional[tuple[HostCache, HostNeed]], marks: dict) -> dict:
    """The report's `host_memory` section: the cap, the measured peak (and the peak so far at the end of
    each phase), where the caches were, the predicted need."""
    from pocketdiff.runtime.memory import host_peak_mb

    out = {"cap_gib": cfg.host_cap_gib, "peak_rss_gb": round((host_peak_mb() or 0.0) / 1024, 3), "peak_rss_gb_by_phase": marks}
    if plan is not None:
        cache, need = plan
        out.update(cache="disk" if cache.folder is not None else "memory",
                   cache_group_budget_gb=None if cache.budget_bytes in (None, float("inf")) else round(cache.budget_bytes / 2 ** 30, 3),
                   **need.summary())
    return out
