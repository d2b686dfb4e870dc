"""`pocketdiff export`: a diffusers pipeline -> a mobile bundle for the LiteRT GPU delegate.

1. load (or build) the pipeline; int8 checkpoints from `calibrate` (or RTN) when weights=int8
2. fixed shapes (resolution, UNet batch 2 for classifier-free guidance, 1 for a student)
   and fixed inputs (a golden prompt, its text-encoder states, seeded latents)
3. per component (text encoder, UNet, VAE decoder): module swaps, litert-torch, weight
   storage, the GPU delegate must accelerate every op, parity at fp16 and fp32
4. fp16 overflow scan on calibration prompts (PyTorch hooks with fp16 emulation)
5. bundle: manifest.json, tokenizer files, golden vectors, time-embedding table, sha256

A consistency (LCM) student (its folder holds an LCMScheduler) gets a `scheduler.type: "lcm"` block
(export/lcm_block.py) for the runners' consistency step (runtime/lcm_step.py); `steps` must be on its grid.

With `vae_tiling.enabled` the decoder is two components, `vae_decoder_head` and `vae_up_tile`
(export/tiled_export.py), checked by a tiled-decode PSNR against the whole torch decode.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from pocketdiff.conditioning import zero_unconditional
from pocketdiff.errors import PocketdiffError, require
from pocketdiff.lora import lora_entries
from pocketdiff.models import ModelConfig, load_or_build, perturb_norm_affines, precheck_resolution
from pocketdiff.outputs import write_json
from pocketdiff.runtime.bundle import MANIFEST, load_manifest
from pocketdiff.runtime.chunks import block_key
from pocketdiff.names import GUIDANCE_MODES as BUNDLE_GUIDANCE_MODES
from pocketdiff.runtime.components import (CHUNKABLE, COMPONENTS, REGISTRY, STAGE_COMPONENTS, TASK_STAGES, TEXT_TO_IMAGE_COMPONENTS,
                                          TILED_DECODER)
from pocketdiff.runtime.onepass_decode import ONE_PASS
from pocketdiff.runtime.tiled_decode import SCHEMES as TILING_SCHEMES

from . import bundle as bundle_lib
from .components import inpainting_unet, shapes_for, time_embedding_table, tokenize
from .inpaint_check import check_inpainting_export, precheck_inpainting
from pocketdiff.runtime.pipeline_spec import derive_pipeline
from .convert import WEIGHT_FORMATS
from .device_profile import DeviceProfile
from .export_components import ComponentExport, GoldenInputs, say
from .family_export import (SDXL, check_family_settings, conditioning_block, family_blocks, pipeline_family, sdxl_golden,
                            with_family_components, with_family_rewrites)
from .exporter import VerifyConfig, peak_rss_mb
from .parity import ParityConfig
from .rewrites import RewriteConfig
from .onepass_export import split_one_pass
from .tiled_export import expand_components, parity_latents, split_decoder
from .chunk_export import check_chunk_plans
from .unet_chunks import CUTS, MAX_CHUNKS, precheck_chunks
from .up_parts_check import precheck_up_parts
from .lora_slots import LoraSlotsConfig, check_slot_settings
from .encoder_check import precheck_encoder

log = logging.getLogger(__name__)


GUIDANCE_MODES = ("auto", *BUNDLE_GUIDANCE_MODES)


@dataclasses.dataclass
class Int8Config:
    checkpoint: Optional[str] = None  # calibrate output folder or one *_int8.safetensors; None + rtn: quantize here
    rtn: bool = False  # no checkpoint: round-to-nearest per channel here (benchmarks, smoke)
    bits: int = 8
    components: list[str] = dataclasses.field(default_factory=lambda: ["unet"])  # RTN: which components
    float_storage: str = "fp16"  # the unquantized constants (biases, norms): fp16 | fp32
    # dequantize: int8 constant -> DEQUANTIZE -> float filter (every runtime; the GPU holds it as float);
    # direct: 1x1 convolutions read the int8 filter itself, which LiteRT's GPU accelerator keeps as int8
    # (export/int8_direct.py; the runtime asks for its int8 kernels). For the GPU: the CPU runs such a conv as a
    # hybrid op that quantizes the activations on the fly.
    gpu_weights: str = "dequantize"

    def __post_init__(self) -> None:
        require(self.bits in (4, 8), "int8.bits", f"must be 4 or 8, got {self.bits}")
        require(self.float_storage in ("fp16", "fp32"), "int8.float_storage", "must be fp16 or fp32")
        require(self.gpu_weights in ("dequantize", "direct"), "int8.gpu_weights", f"must be dequantize or direct, got {self.gpu_weights!r}")
        for c in self.components:
            require(c in STAGE_COMPONENTS, "int8.components", f"unknown component {c!r}; choose from {STAGE_COMPONENTS}")


@dataclasses.dataclass
class ScanConfig:
    enabled: bool = True
    prompts: list[str] = dataclasses.field(default_factory=lambda: ["a red circle", "a blue square on a white background"])
    steps: int = 4  # DDIM steps of the calibration trajectories
    fail: bool = False  # fail the export when the scan finds overflow


@dataclasses.dataclass
class VaeTilingConfig:
    """The VAE decoder as two graphs (export/tiled_vae.py): `vae_decoder_head` on the whole latent,
    `vae_up_tile` on tile x tile latents, driven by runtime/tiled_decode.tiled_decode_with_stats."""

    enabled: bool = False
    tile: int = 32  # latents per tile side (pixels: tile x the VAE factor)
    overlap: int = 8  # latents shared by neighbouring tiles
    passes: int = 5  # passes over the tiles (norm statistics iterated towards the whole image's)
    margin: int = 0  # latents at tile edges facing a neighbour that blend with weight 0 (the up path's cut receptive field)
    scheme: str = "plain"  # plain | control_variate: how later passes use the previous totals (runtime/tiled_decode.py) | one_pass
    fold_norms: bool = False  # one_pass with a GroupNorm decoder: fold it here, no fine-tune (export/onepass_export.py)
    up_parts: int = 1  # one_pass: the up path in this many graphs (vae_up_tile.0 ...), each loaded, run over every tile, released
    min_psnr_db: float = 35.0  # tiled decode through the .tflite files vs the whole torch decode

    def __post_init__(self) -> None:
        require(isinstance(self.tile, int) and self.tile >= 1, "vae_tiling.tile", f"must be a positive int, got {self.tile!r}")
        require(isinstance(self.overlap, int) and 0 <= self.overlap < self.tile, "vae_tiling.overlap",
                f"must be an int in [0, tile={self.tile}), got {self.overlap!r}")
        require(isinstance(self.passes, int) and self.passes >= 1, "vae_tiling.passes", f"must be an int >= 1, got {self.passes!r}")
        require(isinstance(self.margin, int) and 0 <= 2 * self.margin <= self.overlap, "vae_tiling.margin",
                f"must be an int with 0 <= 2 * margin <= overlap={self.overlap} (neighbouring tiles' weighted parts must meet), got {self.margin!r}")
        require(self.scheme in TILING_SCHEMES + (ONE_PASS,), "vae_tiling.scheme",
                f"must be one of {', '.join(TILING_SCHEMES + (ONE_PASS,))}, got {self.scheme!r}")
        require(self.scheme != ONE_PASS or self.passes == 1, "vae_tiling.passes", f"must be 1 with scheme one_pass, got {self.passes}")
        require(isinstance(self.up_parts, int) and not isinstance(self.up_parts, bool) and self.up_parts >= 1, "vae_tiling.up_parts",
                f"must be an int >= 1, got {self.up_parts!r}")
        require(self.up_parts == 1 or self.scheme == ONE_PASS, "vae_tiling.up_parts",
                f"{self.up_parts} parts need scheme one_pass (the iterated schemes feed norm statistics through one graph), got {self.scheme!r}")
        require(math.isfinite(self.min_psnr_db), "vae_tiling.min_psnr_db", f"must be a finite number, got {self.min_psnr_db!r}")


@dataclasses.dataclass
class Config:
    seed: int = 0
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    perturb_norms: bool = False  # random-weight builds: trained-like norm affines (identity ones convert to BROADCAST_TO)
    synthetic_weights: Optional[str] = None  # built models only: "tiled" (export.synthetic: .tflite files that compress ~1000x)
    guidance_embed_dim: Optional[int] = None  # built models only: a w-conditioned UNet (time_cond_proj_dim), a student's layout
    components: list[str] = dataclasses.field(default_factory=lambda: list(TEXT_TO_IMAGE_COMPONENTS))
    # what the bundle serves: text_to_image, image_to_image, inpaint (the image tasks add the vae_encoder component and
    # the pipeline's encode_image stage; inpainting blends latents with any text-to-image UNet)
    tasks: list[str] = dataclasses.field(default_factory=lambda: ["text_to_image"])
    weights: str = "fp16"  # fp32 | fp16 | int8 (int8 where a checkpoint exists, fp16 elsewhere)
    int8: Int8Config = dataclasses.field(default_factory=Int8Config)
    resolution: Optional[int] = None  # pixels; default: the UNet's sample size x the VAE factor
    guidance: str = "auto"  # auto | cfg (UNet batch 2) | embedded (w-conditioned student, batch 1) | none (batch 1)
    guidance_scale: float = 7.5
    steps: int = 20  # scheduler steps recorded in the manifest
    golden_prompt: str = "a red circle on a white background"
    rewrites: RewriteConfig = dataclasses.field(default_factory=RewriteConfig)
    verify: VerifyConfig = dataclasses.field(default_factory=VerifyConfig)
    parity: ParityConfig = dataclasses.field(default_factory=ParityConfig)
    fp16_scan: ScanConfig = dataclasses.field(default_factory=ScanConfig)
    device_profile: DeviceProfile = dataclasses.field(default_factory=DeviceProfile)  # phone budgets, checked per component
    jobs: int = 1  # conversions in parallel worker processes (each holds a copy of its component)
    vae_tiling: VaeTilingConfig = dataclasses.field(default_factory=VaeTilingConfig)  # enabled: head + up-path tile instead of vae_decoder
    unet_chunks: int = 1  # > 1: the UNet as that many .tflite files cut at block boundaries, weights balanced (export/unet_chunks.py)
    unet_chunk_cut: str = "block"  # block | layer: also between a down/up block's layers (lighter chunks, more of them)
    text_encoder_chunks: int = 1  # > 1: the text encoder as that many .tflite files cut between its layers (export/text_encoder_chunks.py)
    # {rank, targets}: the UNet's attention projections take LoRA factors as graph inputs, swapped by the runners (export/lora_slots.py)
    lora_slots: Optional[LoraSlotsConfig] = None

    def _check_chunks(self, component: str) -> None:
        """`<component>_chunks`: an int from 1 to MAX_CHUNKS; above 1, the component exported, one conversion at a time."""
        key = block_key(component)
        k = getattr(self, key)
        require(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= MAX_CHUNKS, key, f"must be an int from 1 to {MAX_CHUNKS}, got {k!r}")
        if k > 1:
            require(component in self.components, key, f"splits the {component} component, which components does not list")
            require(self.jobs == 1, key, f"converts the chunks one after another: needs jobs: 1, got {self.jobs}")

    def _check_tasks(self) -> None:
        """`tasks`: known, not repeated; an image task's components are added to `components` (the whole bundle's
        export) and a task component without its task is refused."""
        require(isinstance(self.tasks, list) and self.tasks and all(t in TASK_STAGES for t in self.tasks), "tasks",
                f"must list tasks of {', '.join(TASK_STAGES)}, got {self.tasks!r}")
        require(len(set(self.tasks)) == len(self.tasks), "tasks", f"must not repeat, got {self.tasks!r}")
        needed = list(dict.fromkeys(s[2] for t in self.tasks for s in TASK_STAGES[t]))
        for c in self.components:
            require(c in TEXT_TO_IMAGE_COMPONENTS or c in needed, "components",
                    f"{c} serves the tasks {', '.join(t for t, st in TASK_STAGES.items() if any(s[2] == c for s in st))}: add one to tasks")
        if set(TEXT_TO_IMAGE_COMPONENTS) <= set(self.components):  # the whole bundle: the tasks' components with it
            self.components += [c for c in needed if c not in self.components]

    def __post_init__(self) -> None:
        require(self.jobs >= 1, "jobs", f"must be >= 1, got {self.jobs}")
        require(self.synthetic_weights in (None, "tiled"), "synthetic_weights", f"must be null or tiled, got {self.synthetic_weights!r}")
        require(self.synthetic_weights is None or self.model.pretrained is None, "synthetic_weights", "applies to built models only (model.pretrained is set)")
        require(not self.perturb_norms or self.model.pretrained is None, "perturb_norms",
                "would perturb the norm weights of model.pretrained: random-weight builds only (set perturb_norms=false)")
        require(self.guidance_embed_dim is None or (self.guidance_embed_dim > 0 and self.model.pretrained is None), "guidance_embed_dim",
                "must be a positive int, for built models only (a pretrained student carries its own time_cond_proj_dim)")
        require(self.weights in WEIGHT_FORMATS, "weights", f"must be one of {WEIGHT_FORMATS}, got {self.weights!r}")
        require(self.guidance in GUIDANCE_MODES, "guidance", f"must be one of {GUIDANCE_MODES}, got {self.guidance!r}")
        require(len(self.components) > 0, "components", "must name at least one component")
        for c in self.components:
            require(c in COMPONENTS, "components", f"unknown component {c!r}; choose from {COMPONENTS}")
        require(len(set(self.components)) == len(self.components), "components", "must not repeat")
        self._check_tasks()
        require(self.steps >= 1, "steps", "must be >= 1")
        require(self.resolution is None or self.resolution >= 8, "resolution", "must be >= 8")
        if self.model.pretrained:  # a size the folder's UNet cannot divide: refused before any weights load
            precheck_resolution(self.model, self.resolution)
            precheck_inpainting(self)
        for p in self.verify.precisions:
            require(p in ("fp16", "fp32"), "verify.precisions", f"must be fp16 and/or fp32, got {p!r}")
        if self.weights == "int8":
            require(self.int8.checkpoint is not None or self.int8.rtn, "int8.checkpoint", "weights=int8 needs a checkpoint (or int8.rtn: true)")
            require(not (self.model.lora and self.int8.checkpoint), "model.lora",
                    "the int8 checkpoint's weights would replace the fused ones: give the LoRA to calibrate (its model.lora)")
        require(self.int8.gpu_weights == "dequantize" or self.weights == "int8", "int8.gpu_weights", "direct needs weights: int8")
        require(not self.vae_tiling.enabled or "vae_decoder" in self.components, "vae_tiling.enabled",
                "tiles the vae_decoder component, which components does not list")
        if "vae_encoder" in self.components and self.device_profile.enforce:  # a size no band count fits is refused now
            precheck_encoder(self.model, self.int8.checkpoint, self.resolution, self.device_profile.budgets(),
                             self.device_profile.activation_bytes)
        if self.vae_tiling.enabled:  # the up path's layer count from the VAE's config alone, before any model is built
            precheck_up_parts(self.model, self.int8.checkpoint, self.vae_tiling.up_parts)
        require(self.unet_chunk_cut in CUTS, "unet_chunk_cut", f"must be one of {', '.join(CUTS)}, got {self.unet_chunk_cut!r}")
        for component in CHUNKABLE:
            self._check_chunks(component)
        check_slot_settings(self.lora_slots, self.components)
        if self.unet_chunks > 1:
            require(self.rewrites.time_embedding_outside, "unet_chunks",
                    "needs rewrites.time_embedding_outside: true (the chunks take the time embedding as an input)")
            precheck_chunks(self.model, self.int8.checkpoint, self.resolution, self.unet_chunks, self.unet_chunk_cut)  # before any conversion
        require(not self.rewrites.residual_scale_auto or self.fp16_scan.enabled, "rewrites.residual_scale_auto",
                "needs fp16_scan.enabled: true (the scan measures the residual stream)")
        conv_input = self.device_profile.budgets()["conv_input_mb"]
        if self.device_profile.enforce and conv_input is not None:  # fail now, not after the conversions
            budget = self.rewrites.conv_budget_mb
            require(budget is not None and budget <= conv_input, "rewrites.conv_budget_mb",
                    f"must be set and <= device_profile.conv_input_mb={conv_input} (with conv_budget_scope: input) when the "
                    f"{self.device_profile.name!r} profile is enforced, got {budget}")


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for pkg in ("pocketdiff", "torch", "diffusers", "transformers", "litert-torch", "ai-edge-litert"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def _guidance_mode(cfg: Config, unet) -> str:
    embedded = getattr(unet.config, "time_cond_proj_dim", None) is not None
    if cfg.guidance == "auto":
        return "embedded" if embedded else "cfg"
    if cfg.guidance == "embedded" and not embedded:
        raise PocketdiffError("guidance: embedded needs a UNet with time_cond_proj_dim (a guidance-distilled student)")
    return cfg.guidance


def _save_tokenizer(tokenizer, folder: Path) -> dict:
    from tokenizers import Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(folder))
    try:
        from pocketdiff.tokenizer import export_vocab_merges

        export_vocab_merges(tokenizer, folder)
    except Exception as e:  # noqa: BLE001 - vocab/merges are a convenience for other readers
        log.info("vocab.json/merges.txt not written: %s", e)
    if not (folder / "tokenizer.json").is_file():
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise PocketdiffError("the pipeline's tokenizer has no tokenizers backend; cannot write tokenizer.json for the bundle")
        backend.save(str(folder / "tokenizer.json"))
    Tokenizer.from_file(str(folder / "tokenizer.json"))  # must load without transformers
    return {p.name: p for p in sorted(folder.iterdir()) if p.is_file()}


def _load_pipeline(cfg: Config):
    """Step 1: the pipeline (an int8 checkpoint's own pipeline when model.pretrained is unset), in fp32,
    with the random-weight stand-ins asked for, and int8 weights applied: (model_cfg, pipe, synthetic, quantized)."""
    from .int8 import apply_to_module, load_component_checkpoints, rtn_checkpoint
    from .vae_encoder import encoder_int8

    model_cfg = cfg.model
    if model_cfg.pretrained is None and cfg.int8.checkpoint and (Path(cfg.int8.checkpoint) / "pipeline").is_dir():
        model_cfg = dataclasses.replace(model_cfg, pretrained=str(Path(cfg.int8.checkpoint) / "pipeline"))
    pipe = load_or_build(model_cfg, resolution=cfg.resolution)
    if cfg.guidance_embed_dim:  # a random-weight stand-in for a guidance-distilled student
        from diffusers import UNet2DConditionModel

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed + 1)
            pipe.unet = UNet2DConditionModel(**{**dict(pipe.unet.config), "time_cond_proj_dim": int(cfg.guidance_embed_dim)})
    for comp in (pipe.text_encoder, getattr(pipe, "text_encoder_2", None), pipe.unet, pipe.vae):
        if comp is not None:
            comp.to(torch.float32).eval().requires_grad_(False)
    if cfg.perturb_norms:
        perturb_norm_affines(pipe.unet, cfg.seed)
        perturb_norm_affines(pipe.vae, cfg.seed + 1)
        perturb_norm_affines(pipe.text_encoder, cfg.seed + 2)
        if getattr(pipe, "text_encoder_2", None) is not None:
            perturb_norm_affines(pipe.text_encoder_2, cfg.seed + 3)
    synthetic = None
    if cfg.synthetic_weights == "tiled":
        from .synthetic import tile_pipeline

        synthetic = tile_pipeline(pipe, cfg.seed)
    quantized: dict = {}
    if cfg.weights == "int8":
        if cfg.int8.checkpoint:
            quantized = load_component_checkpoints(cfg.int8.checkpoint)
        else:
            for c in cfg.int8.components:
                if getattr(pipe, REGISTRY[c].pipeline_attr, None) is None:
                    raise PocketdiffError(f"int8.components: {c}: the model has no {c} (the SDXL family's second text encoder)")
                quantized[c] = rtn_checkpoint(getattr(pipe, REGISTRY[c].pipeline_attr), c, cfg.int8.bits, skip=REGISTRY[c].int8_skip)
        quantized.update(encoder_int8(cfg.weights, cfg.components, pipe, quantized))  # the encoder int8 with the others
        if cfg.rewrites.conv_lowering != "none":  # before any conversion: the lowered taps carry one scale per output channel
            grouped = [f"{c}.{n}" for c, q in quantized.items() if c in cfg.rewrites.conv_lowering_components
                       for n, lr in q.recipe.layers.items() if lr.group_size is not None]
            require(not grouped, "rewrites.conv_lowering", f"cannot lower group-wise quantized layers ({', '.join(grouped[:3])}); use none")
        for c in STAGE_COMPONENTS:  # text_encoder_2 too
            if c in quantized:
                apply_to_module(getattr(pipe, REGISTRY[c].pipeline_attr), quantized[c])
    return model_cfg, pipe, synthetic, quantized


def _golden_inputs(cfg: Config, pipe) -> GoldenInputs:
    """Step 2: guidance mode, shapes, the golden prompt's ids and text states, seeded latents, the
    timestep (or its time-embedding row) at the middle of the schedule."""
    from pocketdiff.consistency_sampling import is_consistency_scheduler
    from pocketdiff.sampling import default_w_embedding_fn, scheduler_timesteps

    from .lcm_block import lcm_schedule_timesteps

    mode = _guidance_mode(cfg, pipe.unet)
    shapes = shapes_for(pipe, cfg.resolution, unet_batch=2 if mode == "cfg" else 1)
    T = int(pipe.scheduler.config.num_train_timesteps)
    if is_consistency_scheduler(pipe.scheduler):  # a consistency (LCM) student: the manifest's scheduler block is lcm
        timesteps = lcm_schedule_timesteps(pipe.scheduler, cfg.steps)
    else:
        timesteps = scheduler_timesteps(pipe.scheduler, cfg.steps).tolist()
    w_emb = None
    if mode == "embedded":
        fn = default_w_embedding_fn(pipe.unet)
        w_emb = fn(torch.tensor([float(cfg.guidance_scale)])).to(torch.float32)
    gen = torch.Generator().manual_seed(cfg.seed)
    ids_prompt = tokenize(pipe.tokenizer, [cfg.golden_prompt])
    ids_empty = tokenize(pipe.tokenizer, [""])
    with torch.no_grad():
        h_prompt = pipe.text_encoder(torch.from_numpy(ids_prompt).long(), return_dict=False)[0]
        h_empty = pipe.text_encoder(torch.from_numpy(ids_empty).long(), return_dict=False)[0]
    B = shapes.unet_batch
    ehs = torch.cat([h_empty, h_prompt]) if B == 2 else h_prompt
    latents = torch.randn(B, shapes.latent_channels, shapes.latent_size, shapes.latent_size, generator=gen)
    t_golden = timesteps[len(timesteps) // 2]
    table = None
    if cfg.rewrites.time_embedding_outside:
        table = time_embedding_table(pipe.unet, T, w_emb)
        time_input = torch.from_numpy(table[[t_golden] * B])
    else:
        time_input = torch.full((B,), float(t_golden))
    unet_inputs = {"sample": latents, "timestep": time_input, "encoder_hidden_states": ehs}
    takes_cond = mode == "embedded" and not cfg.rewrites.time_embedding_outside
    if takes_cond:
        unet_inputs["timestep_cond"] = w_emb.expand(B, -1).contiguous()
    family, xl = pipeline_family(pipe), None
    if family == SDXL:  # the two encoders' states side by side, the pooled embedding, the size / crop ids (family_export.py)
        xl = sdxl_golden(pipe, cfg.golden_prompt, shapes.resolution, B)
        unet_inputs.update(encoder_hidden_states=xl["encoder_hidden_states"], text_embeds=xl["text_embeds"], time_ids=xl["time_ids"])
    family_fields = dict(family=family, ids_prompt_2=xl and xl["ids_2"], time_ids=xl and xl["time_ids"][0].tolist(),
                         zero_unconditional=mode == "cfg" and zero_unconditional(pipe))
    vae_latents = torch.randn(1, shapes.latent_channels, shapes.latent_size, shapes.latent_size, generator=gen)
    # the image encoder's golden picture: smooth colour fields (8 x 8 random colours, bilinear), drawn after the rest
    low = torch.rand(1, 3, 8, 8, generator=gen)
    pixels = torch.nn.functional.interpolate(low, size=(shapes.resolution, shapes.resolution), mode="bilinear", align_corners=False)
    if inpainting_unet(pipe.unet):  # its mask (the right half repainted) and masked-picture latents, drawn after the rest
        check_inpainting_export(cfg)
        side = shapes.latent_size
        mask = (torch.arange(side) >= side // 2).to(torch.float32).expand(B, 1, side, side).contiguous()
        unet_inputs.update(mask=mask, masked_image_latents=torch.randn(B, shapes.latent_channels, side, side, generator=gen))
    return GoldenInputs(mode, shapes, timesteps, ids_prompt, unet_inputs, takes_cond, vae_latents, table, pixels.contiguous(),
                        **family_fields)


def _scan_and_rewrites(cfg: Config, pipe, golden: GoldenInputs, work: Path, timings: dict):
    """Step 3: the fp16 overflow scan, the rewrites per component (the residual-stream scale it
    chose), the tiled decoder's split: (scan or None, rewrites per component, split or None)."""
    from .fp16scan import scan_pipeline

    shapes = golden.shapes
    scan = None
    t_scan = time.perf_counter()
    if cfg.fp16_scan.enabled:
        say(f"fp16 overflow scan over {len(cfg.fp16_scan.prompts)} prompt(s) ...")
        scan = scan_pipeline(pipe, cfg.fp16_scan.prompts, steps=cfg.fp16_scan.steps, guidance_scale=cfg.guidance_scale,
                             resolution=shapes.resolution, seed=cfg.seed, rewrites=cfg.rewrites)
    timings["fp16_scan_s"] = round(time.perf_counter() - t_scan, 2)
    rewrites_of = {n: cfg.rewrites for n in cfg.components}
    if cfg.rewrites.residual_scale_auto:  # Config made sure the scan ran
        from .fp16scan import residual_scale_for, stream_peaks

        peaks = stream_peaks(scan)
        for n in (n for n in COMPONENTS if REGISTRY[n].residual_scaled):
            if n in rewrites_of:
                s = residual_scale_for(peaks.get(n, 0.0))
                rewrites_of[n] = dataclasses.replace(cfg.rewrites, residual_scale=None if s == 1.0 else s)
        scan["residual_scale_auto"] = {n: rewrites_of[n].residual_scale for n in rewrites_of}
    split = None
    if cfg.vae_tiling.enabled:  # the decoder as head + up-path tile; its residual stream scaled once for both
        vae_rw = rewrites_of.pop("vae_decoder")
        if cfg.vae_tiling.scheme == ONE_PASS:  # a norm-free up path, every tile once (export/onepass_export.py)
            split = split_one_pass(pipe.vae, cfg.vae_tiling, golden.vae_latents, parity_latents(pipe.vae, shapes.latent_size, shapes.vae_factor),
                                   shapes.vae_factor, vae_rw.residual_scale, cfg.device_profile.budgets()["max_tensor_mb"], cfg.seed)
        else:
            split = split_decoder(pipe.vae, cfg.vae_tiling, golden.vae_latents, shapes.vae_factor, vae_rw.residual_scale)
        for n in split.block["components"]:
            rewrites_of[n] = dataclasses.replace(vae_rw, residual_scale=None)
    if scan is not None:
        write_json(work / "fp16_scan.json", scan)
        if cfg.fp16_scan.fail and scan["overflowing_ops"]:
            raise PocketdiffError(f"fp16 scan: {scan['overflowing_ops']} ops leave the fp16 range (first: {scan['first_overflow']})")
    return scan, rewrites_of, split


def _tokenizer_entry(cfg: Config, tok, out: Path, ids_prompt, folder: str = "tokenizer") -> dict:
    """The bundle's tokenizer/ folder (`folder`: SDXL's second, tokenizer_2/) and its manifest entry (with the golden
    prompt's ids)."""
    tok_files = _save_tokenizer(tok, out / folder)
    return {
        "files": {n: bundle_lib.file_entry(out, p) for n, p in tok_files.items()},
        "max_length": int(tok.model_max_length),
        "pad_id": int(tok.pad_token_id),
        "bos_id": int(tok.bos_token_id),
        "eos_id": int(tok.eos_token_id),
        "pad_token": str(tok.pad_token),
        "golden": {"prompt": cfg.golden_prompt, "ids": ids_prompt[0].tolist()},
    }


def _scheduler_block(cfg: Config, sched, timesteps: list) -> dict:
    """The manifest's scheduler, written by pocketdiff/scheduler_blocks.py: DDIM's, or a consistency student's lcm
    block (export/lcm_block.py); its timesteps are the golden run's."""
    from pocketdiff.consistency_sampling import is_consistency_scheduler
    from pocketdiff.sampling import final_alpha_cumprod
    from pocketdiff.scheduler_blocks import DDIM, block_for

    from .lcm_block import lcm_scheduler_block

    alphas = sched.alphas_cumprod.to(torch.float64).numpy()
    if is_consistency_scheduler(sched):
        return lcm_scheduler_block(sched, cfg.steps, timesteps, alphas)
    block = block_for(DDIM, sched.config, cfg.steps, alphas, float(final_alpha_cumprod(sched)))
    if block["timesteps"] != [int(t) for t in timesteps]:
        raise PocketdiffError(f"export: the ddim block's timesteps {block['timesteps']} are not the golden run's {list(timesteps)}")
    return block


def _manifest(cfg: Config, out: Path, sched, golden: GoldenInputs, model_cfg: ModelConfig, tokenizer_entry: dict,
              components: dict, split, tiling_report: dict, chunk_blocks: Optional[dict] = None, extra: Optional[dict] = None) -> dict:
    """manifest.json's content (time_embedding.npy written beside it when the table is outside the graph)."""
    shapes, table = golden.shapes, golden.table
    te_entry = None
    if table is not None:
        np.save(out / "time_embedding.npy", table.astype(np.float32))
        te_entry = {**bundle_lib.file_entry(out, out / "time_embedding.npy"), "shape": list(table.shape), "dtype": "float32"}
    manifest = {
        "created_by": "pocketdiff export",
        "image": {"height": shapes.resolution, "width": shapes.resolution, "channels": 3, "range": [0, 1]},
        "latent": {"channels": shapes.latent_channels, "height": shapes.latent_size, "width": shapes.latent_size, "vae_factor": shapes.vae_factor},
        "guidance": {"mode": golden.mode, "scale": float(cfg.guidance_scale), "unet_batch": shapes.unet_batch},
        "scheduler": _scheduler_block(cfg, sched, golden.timesteps),
        "unet_time_input": "time_embedding" if table is not None else "timestep",
        "tokenizer": tokenizer_entry,
        **(extra or {}),  # a family's blocks (SDXL: tokenizer_2)
        "time_embedding": te_entry,
        "components": components,
        **({"vae_tiling": {**split.block, "parity_psnr_db": tiling_report["psnr_db"]}} if split is not None else {}),
        **{block_key(base): block for base, block in (chunk_blocks or {}).items()},
        "provenance": {
            "source": model_cfg.pretrained or f"built:{model_cfg.arch}",
            "arch": None if model_cfg.pretrained else model_cfg.arch,
            "lora": lora_entries(model_cfg.lora),  # the LoRAs fused into the weights: file, sha256, scale
            "perturb_norms": cfg.perturb_norms,
            "synthetic_weights": cfg.synthetic_weights,
            "int8_checkpoint": cfg.int8.checkpoint,
            "int8_rtn": bool(cfg.weights == "int8" and not cfg.int8.checkpoint),
            "rewrites": dataclasses.asdict(cfg.rewrites),
            "versions": _versions(),
        },
    }
    # the stages a runner runs and the role of every graph input, from the registry (runtime/pipeline_spec.py)
    pipeline = derive_pipeline(manifest, golden.family, tasks=tuple(cfg.tasks))
    pipeline["conditioning"] = conditioning_block(golden)  # a text_time UNet's time ids (family_export.py)
    return {**manifest, "pipeline": pipeline}


def run(cfg: Config, output_dir: Path, resume: Optional[str] = None) -> dict:
    from pocketdiff.runtime.run_bundle import bundle_tokenize

    if resume:
        raise PocketdiffError("export does not resume; rerun with --overwrite")
    t_start = time.perf_counter()
    out = Path(output_dir)
    work = out / "_export"
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)

    # 1. pipeline and int8 checkpoints
    model_cfg, pipe, synthetic, quantized = _load_pipeline(cfg)
    check_chunk_plans(cfg, pipe)  # before the scan and any conversion (a hub id's UNet is first seen here)
    check_family_settings(cfg, pipe)
    timings = {"load_s": round(time.perf_counter() - t_start, 2)}

    # 2. shapes and fixed inputs
    golden = _golden_inputs(cfg, pipe)
    mode, shapes = golden.mode, golden.shapes

    # 3. fp16 overflow scan (before conversion: it can choose the residual-stream scale)
    scan, rewrites_of, split = _scan_and_rewrites(cfg, pipe, golden, work, timings)
    tiled = tuple(split.block["components"]) if split is not None else TILED_DECODER
    names = with_family_components(expand_components(cfg.components, split is not None, cfg.vae_tiling.up_parts), pipe)
    rewrites_of = with_family_rewrites(rewrites_of, names)

    # 4. components (export_components: one at a time, or converted in parallel workers)
    weights_of = {n: (cfg.weights if (cfg.weights != "int8" or quantized.get(n) is not None) else "fp16") for n in names}
    comps = ComponentExport(out=out, work=work, pipe=pipe, names=names, golden=golden, rewrites_of=rewrites_of,
                            weights_of=weights_of, quantized=quantized, split=split, tiled=tiled, settings=cfg,
                            timings=timings)
    comps.run()
    comp_reports, tiling_report = comps.reports, comps.tiling_report

    t_bundle = time.perf_counter()
    # 5. bundle: tokenizer, time embedding, manifest
    tokenizer_entry = _tokenizer_entry(cfg, pipe.tokenizer, out, golden.ids_prompt)
    runner_ids = bundle_tokenize(out / "tokenizer" / "tokenizer.json", cfg.golden_prompt, tokenizer_entry)
    if runner_ids.tolist() != golden.ids_prompt[0].tolist():
        raise PocketdiffError("the bundle's tokenizer.json does not reproduce the pipeline tokenizer's ids for the golden prompt")
    extra = family_blocks(pipe, golden, lambda tok, folder, ids: _tokenizer_entry(cfg, tok, out, ids, folder))
    for key, entry in extra.items():  # SDXL's tokenizer_2, checked as the first
        if bundle_tokenize(out / key / "tokenizer.json", cfg.golden_prompt, entry).tolist() != entry["golden"]["ids"]:
            raise PocketdiffError(f"the bundle's {key}/tokenizer.json does not reproduce the pipeline's {key} ids for the golden prompt")
    if comps.lora_block is not None:  # the UNet's LoRA slots: rank, modules, their factor inputs (export/lora_slots.py)
        extra = {**extra, "lora_slots": comps.lora_block}
    manifest = _manifest(cfg, out, pipe.scheduler, golden, model_cfg, tokenizer_entry, comps.manifest, split, tiling_report,
                         comps.chunk_blocks, extra)
    bundle_lib.write_manifest(out, manifest)
    load_manifest(out)  # the bundle we wrote must pass the runner's checks
    from pocketdiff.runtime.verify_bundle import verify_bundle

    verify_bundle(out, run=False)  # and verify-bundle's checks that need no model run (manifest, files, io, goldens)

    summary = {
        name: {k: r.get(k) for k in ("file", "weights", "fully_accelerated", "cosine", "psnr_db", "max_abs", "bytes", "ops", "op_count", "transposes",
                                     "peak_rss_mb", "params", "bytes_per_param", "device_profile")}
        for name, r in comp_reports.items()
    }
    for name, r in comp_reports.items():
        summary[name]["details"] = {k: v for k, v in r.items() if k not in summary[name]}
    report = {
        "bundle_dir": str(out.resolve()),
        "manifest": str((out / MANIFEST).resolve()),
        "guidance": mode,
        "resolution": shapes.resolution,
        "weights": cfg.weights,
        "components": summary,
        "bundle_bytes": int(sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and "_export" not in p.parts)),
        "vae_tiling": {**split.block, **tiling_report, "residual_scale": split.residual_scale} if split is not None else None,
        "fp16_scan": None if scan is None else {k: scan.get(k) for k in ("overflowing_ops", "unmitigated", "first_overflow", "max_abs", "peaks",
                                                                   "residual_scale_auto", "components")},
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "synthetic_weights": synthetic,
        "timings": {**timings, "bundle_s": round(time.perf_counter() - t_bundle, 2),
                    **{f"{n}_convert_s": r.get("convert_s") for n, r in comp_reports.items()}},
        "export_s": round(time.perf_counter() - t_start, 2),
    }
    return report
