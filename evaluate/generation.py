"""Models under evaluation and how their images are made (always through `pocketdiff.sampling`).

A model is a diffusers pipeline folder (teacher, distilled student, pruned or quantized model
saved as a pipeline), optionally with a separate UNet folder replacing the pipeline's (a
pruned UNet, a dequantized UNet), or an exported bundle (through run-bundle, see below), or a
pipeline object handed over by another stage in the same process.

Guidance (`guidance_mode`):

- ``cfg``: classifier-free guidance at scale w (two UNet batches per step);
- ``embedded``: a guided-distillation student that takes w as an input. With
  ``time_cond_proj_dim`` (pocketdiff's distill students, diffusers' convention) the sampler
  passes ``timestep_cond`` itself; with ``class_embed_type`` (``timestep``, ``projection`` or
  ``identity``) w goes in through ``class_labels`` (raw w, or its sinusoidal embedding for the
  two vector types) unless the caller gives its own `w_embedding_fn`;
- ``none``: one conditional pass, w = 1 (a student that folded a fixed guidance in);
- ``auto`` (default): read ``distill.json`` beside the pipeline (conditioned -> embedded,
  folded -> none, and its ``num_inference_steps`` as the default step count), else
  ``embedded`` when the UNet takes w, else ``cfg``.

Bundles: `kind: bundle` goes through the runtime's declared interface,
`pocketdiff.runtime.bundle_images` (`bundle_info`: the steps, resolution and guidance the
bundle was exported for, which become the model's defaults; `generate_images`: float images
[N, 3, H, W] in [0, 1], image i seeded with seed + i, on the LiteRT GPU delegate).
"""
from __future__ import annotations

import dataclasses
import inspect
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from pocketdiff.errors import PocketdiffError, require
from pocketdiff.config import renamed_value
from pocketdiff.lora import LoraSpec, check_lora_specs, fuse_loras
from pocketdiff.models import read_distill_meta
from pocketdiff.names import GUIDANCE_MODES as BUNDLE_GUIDANCE_MODES
from pocketdiff.names import OLD_GUIDANCE_MODES

GUIDANCE_MODES = ("auto", *BUNDLE_GUIDANCE_MODES)
KINDS = ("pipeline", "bundle")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclasses.dataclass
class ModelSpec:
    """One model to evaluate."""

    name: str = ""  # label in tables and grids (default: the folder name)
    path: Optional[str] = None  # diffusers pipeline folder / hub id, or a bundle folder (kind: bundle)
    kind: str = "pipeline"  # pipeline | bundle
    unet: Optional[str] = None  # a UNet2DConditionModel folder replacing the pipeline's (pruned, dequantized)
    guidance_mode: str = "auto"  # auto | cfg | embedded (a student taking w as an input) | none
    guidance_scale: Optional[float] = None  # default: the run's guidance_scale (distill.json's for students)
    steps: list[int] = dataclasses.field(default_factory=list)  # default: the run's steps (distill.json's for students)
    # scheduler config keys replaced for this evaluation, e.g. {timestep_spacing: leading, steps_offset: 1}
    # (stock SD's DDIM grid) to compare a model under another step spacing; the folder is not changed
    scheduler: dict = dataclasses.field(default_factory=dict)
    build: Optional[str] = None  # instead of path: build this arch (tiny | small ...) with random weights (smoke runs)
    build_resolution: int = 32  # image size of a built model
    lora: list[LoraSpec] = dataclasses.field(default_factory=list)  # {path, scale} LoRAs fused into the loaded model (pocketdiff/lora.py)

    def __post_init__(self) -> None:
        require(not (self.build and self.path), "models.build", "set either path or build, not both")
        self.lora = check_lora_specs(self.lora, "models.lora")
        require(not (self.lora and self.kind == "bundle"), "models.lora", "applies to pipelines only (export the bundle with model.lora)")
        require(self.kind in KINDS, "models.kind", f"must be one of {KINDS}, got {self.kind!r}")
        self.guidance_mode = renamed_value(self.guidance_mode, "models.guidance_mode", OLD_GUIDANCE_MODES)
        require(self.guidance_mode in GUIDANCE_MODES, "models.guidance_mode", f"must be one of {GUIDANCE_MODES}, got {self.guidance_mode!r}")
        require(all(int(s) >= 1 for s in self.steps), "models.steps", "step counts must be >= 1")
        require(self.guidance_scale is None or self.guidance_scale >= 0, "models.guidance_scale", "must be >= 0")
        require(isinstance(self.scheduler, dict), "models.scheduler", f"must be a mapping of scheduler config keys, got {type(self.scheduler).__name__}")
        require(not (self.scheduler and self.kind == "bundle"), "models.scheduler", "applies to pipelines only (a bundle's scheduler is in its bundle.json)")


@dataclasses.dataclass
class LoadedModel:
    name: str
    spec: ModelSpec
    pipe: Any = None  # StableDiffusionPipeline (None for bundles)
    unet: Any = None
    guidance_mode: str = "cfg"
    default_steps: list[int] = dataclasses.field(default_factory=list)
    default_guidance: Optional[float] = None
    w_embedding_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # w [B] -> class_labels, for class-embedding students
    meta: dict = dataclasses.field(default_factory=dict)


def _cfg(unet, key: str, default=None):
    config = getattr(unet, "config", None)
    if config is None:
        return default
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def unet_takes_w(unet) -> str:
    """'timestep_cond' | 'class_labels' | '' : how (if at all) a UNet is conditioned on w."""
    if _cfg(unet, "time_cond_proj_dim") is not None:
        return "timestep_cond"
    if _cfg(unet, "class_embed_type") in ("timestep", "projection", "identity"):
        return "class_labels"
    return ""


def class_label_w_fn(unet) -> Callable[[torch.Tensor], torch.Tensor]:
    """Default w -> class_labels for a class-embedding student (raw w for ``timestep``;
    sinusoidal embedding of w - 1 for the vector types, as for ``timestep_cond``)."""
    from pocketdiff.sampling import guidance_scale_embedding

    kind = _cfg(unet, "class_embed_type")
    if kind == "timestep":
        return lambda w: torch.as_tensor(w, dtype=torch.float32)
    if kind == "projection":
        dim = int(_cfg(unet, "projection_class_embeddings_input_dim"))
    else:  # identity: the class embedding has the time embedding's width
        dim = int(_cfg(unet, "time_embedding_dim") or 4 * _cfg(unet, "block_out_channels")[0])
    return lambda w: guidance_scale_embedding(torch.as_tensor(w, dtype=torch.float32) - 1.0, dim)


def _load_unet(folder: str, dtype: Optional[torch.dtype]):
    from diffusers import UNet2DConditionModel

    p = Path(folder).expanduser()
    if (p / "unet" / "config.json").is_file():
        p = p / "unet"
    if not (p / "config.json").is_file():
        raise PocketdiffError(f"models.unet: {folder} has no config.json or unet/config.json (not a diffusers UNet folder)")
    if not any(p.glob("*.safetensors")):
        raise PocketdiffError(f"models.unet: {p} has no *.safetensors (pocketdiff loads safetensors only)")
    if (p / "pruning.json").is_file():
        raise PocketdiffError(f"models.unet: {p} is a pruned UNet (pruning.json): evaluate the pruned pipeline folder "
                              "that prune writes (its model_index.json names the loader) with models.path instead")
    kwargs: dict = {"use_safetensors": True, "local_files_only": True}
    if dtype is not None:
        kwargs["torch_dtype"] = dtype
    try:
        return UNet2DConditionModel.from_pretrained(str(p), **kwargs).eval()
    except Exception as e:  # noqa: BLE001 - wrong files: one line naming the folder
        raise PocketdiffError(f"models.unet: cannot load {p}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def resolve_model(spec_or_obj: Any, index: int = 0, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> LoadedModel:
    """A `LoadedModel` from a ModelSpec, a folder path, a pipeline object, a (name, pipe) pair,
    or a dict {name, pipe, unet, guidance_mode, steps, guidance_scale, w_embedding_fn}."""
    from pocketdiff.models import load_pipeline

    w_fn = None
    if isinstance(spec_or_obj, LoadedModel):
        return spec_or_obj
    if isinstance(spec_or_obj, (str, Path)):
        spec_or_obj = ModelSpec(path=str(spec_or_obj))
    if isinstance(spec_or_obj, tuple) and len(spec_or_obj) == 2:
        spec_or_obj = {"name": spec_or_obj[0], "pipe": spec_or_obj[1]}
    pipe = unet = None
    if isinstance(spec_or_obj, dict):
        d = dict(spec_or_obj)
        pipe, unet, w_fn = d.pop("pipe", None), d.pop("unet", None), d.pop("w_embedding_fn", None)
        if pipe is None:
            raise PocketdiffError(f"models[{index}]: a dict model needs 'pipe' (a StableDiffusionPipeline)")
        spec = ModelSpec(**{k: v for k, v in d.items() if k in {f.name for f in dataclasses.fields(ModelSpec)}})
    elif isinstance(spec_or_obj, ModelSpec):
        spec = spec_or_obj
    elif hasattr(spec_or_obj, "unet") and hasattr(spec_or_obj, "vae"):
        pipe, spec = spec_or_obj, ModelSpec()
    else:
        raise PocketdiffError(f"models[{index}]: expected a ModelSpec, a folder, a pipeline or (name, pipeline), got {type(spec_or_obj).__name__}")

    name = spec.name or (Path(spec.path).name if spec.path else f"model{index}")
    if spec.kind == "bundle":
        if not spec.path:
            raise PocketdiffError(f"models[{index}] ({name}): kind=bundle needs path (an exported bundle folder)")
        return _bundle_model(index, name, spec)
    if pipe is None and spec.build:
        from pocketdiff.models import ModelConfig, build_pipeline

        name = spec.name or f"random-{spec.build}"
        try:
            mcfg = ModelConfig(arch=spec.build)
        except PocketdiffError as e:
            raise PocketdiffError(f"models[{index}].build: {e}") from None
        pipe = build_pipeline(mcfg, resolution=spec.build_resolution)
        if dtype is not None:
            pipe.to(dtype=dtype)
    if pipe is None:
        if not spec.path:
            raise PocketdiffError(f"models[{index}] ({name}): set path (a diffusers pipeline folder or hub id) or build")
        pipe = load_pipeline(spec.path, torch_dtype=dtype)
    if spec.scheduler:
        pipe = with_scheduler_overrides(pipe, spec.scheduler, f"models[{index}] ({name})")
    if spec.unet:
        unet = _load_unet(spec.unet, dtype)
    unet = unet if unet is not None else pipe.unet
    if spec.lora:
        if not (spec.path or spec.build) or isinstance(spec_or_obj, dict):
            raise PocketdiffError(f"models[{index}].lora: fuses into a model loaded from path or build, not a pipeline passed in")
        from types import SimpleNamespace

        fuse_loras(SimpleNamespace(unet=unet, text_encoder=pipe.text_encoder), spec.lora, f"models[{index}].lora")
    if device is not None:
        pipe.to(device)
        unet.to(device)
    meta = read_distill_meta(spec.path) if spec.path and spec.kind == "pipeline" else {}
    takes_w = unet_takes_w(unet)
    mode = spec.guidance_mode
    default_steps: list[int] = []
    default_guidance = None
    if meta.get("pocketdiff_distill"):
        g = meta.get("guidance") or {}
        if mode == "auto":
            mode = "embedded" if g.get("conditioned") else "none"
        if meta.get("num_inference_steps"):  # a consistency student lists every count it was measured at
            default_steps = [int(n) for n in meta.get("sampling_steps") or [meta["num_inference_steps"]]]
        if g.get("scale") is not None:
            default_guidance = float(g["scale"])
    if mode == "auto":
        mode = "embedded" if takes_w else "cfg"
    if mode == "embedded" and not takes_w:
        raise PocketdiffError(f"models[{index}] ({name}): guidance_mode=embedded but its UNet takes no w "
                              "(no time_cond_proj_dim, no class_embed_type); use cfg or none")
    if mode in ("cfg", "none") and takes_w == "timestep_cond":
        raise PocketdiffError(f"models[{index}] ({name}): its UNet is w-conditioned (time_cond_proj_dim); use guidance_mode=embedded or auto")
    if mode == "embedded" and takes_w == "class_labels" and w_fn is None:
        w_fn = class_label_w_fn(unet)
    return LoadedModel(name=name, spec=spec, pipe=pipe, unet=unet, guidance_mode=mode,
                       default_steps=list(spec.steps) or default_steps,
                       default_guidance=spec.guidance_scale if spec.guidance_scale is not None else default_guidance,
                       w_embedding_fn=w_fn, meta=meta)


def with_scheduler_overrides(pipe, overrides: dict, where: str):
    """A pipeline sharing `pipe`'s modules whose scheduler has `overrides` in its config (the
    caller's pipeline keeps its own scheduler). Unknown keys are refused, naming them."""
    from pocketdiff.sampling import scheduler_timesteps

    sched = pipe.scheduler
    unknown = sorted(set(overrides) - set(sched.config))
    if unknown:
        raise PocketdiffError(f"{where}.scheduler: {unknown} are not {type(sched).__name__} config keys "
                              f"(known: {sorted(k for k in sched.config if not k.startswith('_'))})")
    new = type(sched).from_config({**sched.config, **overrides})
    try:
        scheduler_timesteps(new, 1)  # a bad spacing or offset fails here, not mid-evaluation
    except PocketdiffError as e:
        raise PocketdiffError(f"{where}.scheduler: {e}") from None
    return type(pipe)(**{**pipe.components, "scheduler": new})




def _bundle_model(index: int, name: str, spec: ModelSpec) -> LoadedModel:
    """A bundle folder, checked now (not mid-evaluation); its exported steps (and embedded
    guidance) are the defaults."""
    from pocketdiff.runtime.bundle_images import bundle_info

    try:
        info = bundle_info(spec.path)
    except PocketdiffError as e:
        raise PocketdiffError(f"models[{index}] ({name}): {e}") from None
    mode = info.guidance_mode
    if mode not in BUNDLE_GUIDANCE_MODES:
        raise PocketdiffError(f"models[{index}] ({name}): bundle guidance mode {mode!r} is not one of {BUNDLE_GUIDANCE_MODES}")
    if spec.guidance_mode not in ("auto", mode):
        raise PocketdiffError(f"models[{index}] ({name}): guidance_mode={spec.guidance_mode} but the bundle was exported with "
                              f"guidance {info.guidance_mode!r} (use auto or {mode})")
    wrong = [int(s) for s in spec.steps if int(s) != info.steps]
    if wrong:
        raise PocketdiffError(f"models[{index}] ({name}).steps: {wrong}, but the bundle was exported for {info.steps} steps")
    guidance = spec.guidance_scale if spec.guidance_scale is not None else (info.guidance_scale if mode == "embedded" else None)
    return LoadedModel(name=name, spec=spec, guidance_mode=mode, default_steps=[info.steps], default_guidance=guidance)


def _bundle_generate(model: LoadedModel, prompts: Sequence[str], steps: int, guidance: float, seed: int, resolution: Optional[int]) -> torch.Tensor:
    """Images of an exported bundle through the runtime's interface."""
    from pocketdiff.runtime.bundle_images import generate_images as bundle_generate_images

    try:
        images = bundle_generate_images(model.spec.path, list(prompts), steps=steps, guidance_scale=guidance, seed=seed,
                                        resolution=resolution)
    except PocketdiffError as e:
        raise PocketdiffError(f"models ({model.name}): {e}") from None
    return torch.from_numpy(images).float().clamp(0, 1)


def _generate_accepts(name: str) -> bool:
    from pocketdiff.sampling import generate

    return name in inspect.signature(generate).parameters


@torch.no_grad()
def _class_label_images(model: LoadedModel, prompts: list[str], steps: int, guidance: float, seed: int,
                        resolution: Optional[int], batch_size: int) -> torch.Tensor:
    """Class-embedding students: `generate` per chunk with class_labels when it takes
    extra_unet_kwargs, else the same seeding through the sampler's own pieces."""
    from pocketdiff.models import vae_scale_factor
    from pocketdiff.conditioning import encode_conditioning
    from pocketdiff.sampling import ddim_sample, decode_latents, generate, randn_latents

    pipe, unet = model.pipe, model.unet
    device = next(unet.parameters()).device
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        w = torch.full((len(chunk),), float(guidance), device=device)
        labels = model.w_embedding_fn(w).to(device=device, dtype=unet.dtype)
        if _generate_accepts("extra_unet_kwargs"):
            out.append(generate(pipe, chunk, steps=steps, guidance_scale=1.0, seed=seed + start, resolution=resolution,
                                batch_size=len(chunk), unet=unet, extra_unet_kwargs={"class_labels": labels}))
            continue
        factor = vae_scale_factor(pipe.vae)
        res = int(resolution or unet.config.sample_size * factor)
        side = res // factor
        gens = [torch.Generator("cpu").manual_seed(int(seed) + start + j) for j in range(len(chunk))]
        noise = randn_latents((len(chunk), unet.config.in_channels, side, side), gens, device)
        cond = encode_conditioning(pipe, chunk, device, unet=unet, resolution=res)  # SDXL's time ids: the size asked for
        latents = ddim_sample(unet, pipe.scheduler, cond, None, steps=steps, guidance_scale=1.0, latents=noise,
                              extra_unet_kwargs={"class_labels": labels})
        out.append(decode_latents(pipe.vae, latents).cpu())
    return torch.cat(out)


@torch.no_grad()
def generate_images(model: LoadedModel, prompts: Sequence[str], steps: int, guidance_scale: float, seed: int,
                    resolution: Optional[int] = None, batch_size: int = 16) -> tuple[torch.Tensor, float]:
    """(images float [N, 3, H, W] in [0, 1] on the CPU, seconds) for `prompts`, image i seeded seed + i."""
    from pocketdiff.sampling import generate

    prompts = list(prompts)
    t0 = time.time()
    if model.spec.kind == "bundle":
        images = _bundle_generate(model, prompts, steps, guidance_scale, seed, resolution)
    elif model.guidance_mode == "embedded" and unet_takes_w(model.unet) == "class_labels":
        images = _class_label_images(model, prompts, steps, guidance_scale, seed, resolution, batch_size)
    else:
        w = 1.0 if model.guidance_mode == "none" else float(guidance_scale)
        images = generate(model.pipe, prompts, steps=steps, guidance_scale=w, seed=seed, resolution=resolution,
                          batch_size=batch_size, unet=model.unet)
    if model.pipe is not None and next(model.unet.parameters()).device.type == "cuda":
        torch.cuda.synchronize()
    return images.float().cpu(), time.time() - t0
