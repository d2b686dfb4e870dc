"""Model factories and loading: every stage gets its Stable-Diffusion-family pipeline here.

Two ways in, one pipeline type per family out (`diffusers.StableDiffusionPipeline`; for the SDXL family,
`StableDiffusionXLPipeline`: `pocketdiff.models_xl`):

- `build_pipeline`: an architecture from `ARCHS` (`pocketdiff.archs`) with random weights, constructed from
  config dicts (nothing is downloaded), plus a CLIP-format tokenizer trained on the
  captions (`pocketdiff.tokenizer`). `tiny` trains on CPU in minutes (32 px), `small`
  is a few-MB teacher for 64 px domains, `sd15` / `sd21` are the real SD-1.5 / SD-2.1
  architectures for export and benchmarks; `tiny_xl` / `small_xl` / `sdxl` their SDXL-shaped
  counterparts (`pocketdiff.archs_xl`: two text encoders, pooled embeddings, size / crop time ids).
- `load_pipeline`: a diffusers pipeline folder or hub id through the stock
  `StableDiffusionPipeline.from_pretrained` (safetensors only, safety checker off), or
  `StableDiffusionXLPipeline.from_pretrained` when its model_index names an SDXL pipeline
  (refiners and folders without the second text encoder / tokenizer refused before any weights load).

Outputs are written with `save_pipeline`, which any stock diffusers install can load.

Freshly built models keep diffusers' initialisation, including identity norm affines
(weight 1, bias 0). Benchmarks and converter tests that need trained-like weights call
`perturb_norm_affines` themselves: identity affines are an artefact the converter folds into
BROADCAST_TO, which the GPU delegate rejects.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import torch
from torch import nn

from .archs import (  # noqa: F401  (ARCHS and the config factories are also imported from here)
    ARCHS,
    DEFAULT_RESOLUTION,
    MODEL_PREDICTION_TYPES,
    default_resolution,
    scheduler_config,
    text_encoder_config,
    unet_config,
    vae_config,
)
from .errors import PocketdiffError, require
from .archs_xl import is_xl
from .lora import LoraSpec, check_lora_specs, fuse_loras
from .models_xl import SDXL, XL_COMPONENTS, XL_WEIGHTED, family_of_index, read_index
from .normfree import apply_norm_free, norm_free_names
from .shipped import resolve_shipped
from .unet_blocks import ALL_PRESETS as BLOCK_PRESETS, apply_preset

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ModelConfig:
    """The `model:` section of every verb's config.

    `pretrained` (a diffusers pipeline folder or hub id) wins over `arch`; its own scheduler
    config is authoritative for the prediction type (a mismatch with `prediction_type` is
    logged, not applied). `prediction_type` and `vocab_size` apply to built models.
    """

    pretrained: Optional[str] = None  # diffusers pipeline folder or hub id; None -> build `arch` with random weights
    arch: str = "tiny"
    prediction_type: str = "epsilon"  # epsilon | v_prediction
    vae: Optional[str] = None  # optional separate pretrained VAE (AutoencoderKL folder, pipeline folder, or hub id)
    vocab_size: int = 1024  # tokenizer size for built (non-pretrained) models
    # built models only: the UNet with a block-removal preset's shape (base | small | tiny, pocketdiff/unet_blocks.py),
    # e.g. an SD-2.1-size `tiny` student with random weights for export benchmarks; a trained one comes from `prune`
    unet_blocks: Optional[str] = None
    # the user's LoRAs ({path: FILE.safetensors, scale: 1.0}, any number), fused into the UNet and text encoder
    # when the model is loaded (pocketdiff/lora.py): diffusers / PEFT, kohya / A1111 and LyCORIS LoCon files
    lora: list[LoraSpec] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.lora = check_lora_specs(self.lora, "model.lora")
        require(self.arch in ARCHS, "model.arch", f"must be one of {ARCHS}, got {self.arch!r}")
        require(
            self.prediction_type in MODEL_PREDICTION_TYPES,
            "model.prediction_type",
            f"must be one of {MODEL_PREDICTION_TYPES}, got {self.prediction_type!r}",
        )
        require(self.vocab_size >= 514, "model.vocab_size", f"must be >= 514 (CLIP byte symbols + specials), got {self.vocab_size}")
        require(self.pretrained is None or bool(str(self.pretrained).strip()), "model.pretrained", "must be a folder or hub id, or null")
        require(self.vae is None or bool(str(self.vae).strip()), "model.vae", "must be a folder or hub id, or null")
        require(self.unet_blocks is None or self.unet_blocks in BLOCK_PRESETS, "model.unet_blocks",
                f"must be one of {', '.join(BLOCK_PRESETS)} or null, got {self.unet_blocks!r}")
        require(self.unet_blocks is None or self.pretrained is None, "model.unet_blocks",
                "shapes built models only (model.pretrained is set; `pocketdiff prune` with blocks.preset slims a trained one)")
        if self.unet_blocks is not None:
            built_unet_config(self, None)  # a preset this arch cannot take is refused now


def built_unet_config(cfg: "ModelConfig", resolution: Optional[int], latent_channels: int = 4,
                      vae_factor: Optional[int] = None) -> dict:
    """The UNet config `build_pipeline` builds for `cfg` (its arch, with `cfg.unet_blocks` applied)."""
    conf = unet_config(cfg.arch, cfg.prediction_type, resolution, latent_channels=latent_channels, vae_factor=vae_factor)
    return apply_preset(conf, cfg.unet_blocks, key="model.unet_blocks") if cfg.unet_blocks else conf


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------

def vae_scale_factor(pipe_or_vae: Any) -> int:
    """Pixel-to-latent downsampling factor, 2 ** (len(vae.config.block_out_channels) - 1)."""
    vae = getattr(pipe_or_vae, "vae", pipe_or_vae)
    config = getattr(vae, "config", vae)
    channels = config["block_out_channels"] if isinstance(config, dict) else config.block_out_channels
    return 2 ** (len(channels) - 1)


def check_resolution(pipe, resolution: int, key: str = "data.resolution", unet=None) -> None:
    """`resolution` (pixels) must fit the pipeline: a multiple of the VAE factor times the UNet's
    downsampling (`unet`'s when given, e.g. a replacement UNet, else the pipeline's). Raised
    naming `key`, before any work."""
    config = getattr(unet, "config", None) or pipe.unet.config
    _check_fit(resolution, vae_scale_factor(pipe), _unet_downsampling(config), key, "the model")


def _unet_downsampling(config) -> int:
    channels = config["block_out_channels"] if isinstance(config, dict) else config.block_out_channels
    return 2 ** (len(channels) - 1)


def _check_fit(resolution: int, factor: int, down: int, key: str, what: str) -> None:
    """`resolution` a multiple of the VAE factor times the UNet's downsampling (both 2 ** (levels - 1))."""
    if int(resolution) % (factor * down):
        raise PocketdiffError(f"{key}={resolution} does not fit {what} (VAE factor {factor}, UNet downsampling "
                              f"{down}: a multiple of {factor * down})")


def precheck_resolution(model: "ModelConfig", resolution: Optional[int], key: str = "resolution") -> None:
    """`resolution` against the model's configs alone, before any weights load: a built arch's (its UNet config
    refuses a size it cannot divide), or a local pipeline folder's unet/ and vae/ config.json (a hub id is checked
    once loaded, by `check_resolution`)."""
    if resolution is None:
        return
    if not model.pretrained:
        built_unet_config(model, int(resolution))
        return
    import json

    folder = Path(resolve_shipped(str(model.pretrained))).expanduser()
    try:
        unet = json.loads((folder / "unet" / "config.json").read_text(encoding="utf-8"))
        vae = json.loads((folder / "vae" / "config.json").read_text(encoding="utf-8"))
        factor, down = vae_scale_factor(vae), _unet_downsampling(unet)
    except (OSError, ValueError, KeyError, TypeError):
        return  # not a readable local folder: loading names the problem
    _check_fit(resolution, factor, down, key, str(model.pretrained))


def count_params(module: nn.Module) -> int:
    """Number of (distinct) parameters; works on `meta`-device models."""
    return sum(p.numel() for p in module.parameters())


def _is_norm(module: nn.Module) -> bool:
    if isinstance(module, (nn.GroupNorm, nn.LayerNorm, nn.modules.batchnorm._NormBase)):
        return True
    weight = getattr(module, "weight", None)
    return type(module).__name__.endswith("Norm") and isinstance(weight, nn.Parameter) and weight.dim() == 1


@torch.no_grad()
def perturb_norm_affines(module: nn.Module, generator: Union[torch.Generator, int, None] = None, scale: float = 0.1) -> int:
    """Give every norm layer a trained-like affine: weight 1 + scale*N(0,1), bias scale*N(0,1).

    For benchmarks and converter tests on random weights (identity affines get folded into
    BROADCAST_TO by litert-torch). Deterministic for a given generator / integer seed.
    Returns the number of norm modules changed.
    """
    if generator is None or isinstance(generator, int):
        generator = torch.Generator("cpu").manual_seed(0 if generator is None else int(generator))
    count = 0
    for sub in module.modules():
        if not _is_norm(sub):
            continue
        weight = getattr(sub, "weight", None)
        bias = getattr(sub, "bias", None)
        changed = False
        if isinstance(weight, torch.Tensor):
            noise = torch.randn(weight.shape, generator=generator, device=generator.device, dtype=torch.float32)
            weight.copy_((1.0 + scale * noise).to(device=weight.device, dtype=weight.dtype))
            changed = True
        if isinstance(bias, torch.Tensor):
            noise = torch.randn(bias.shape, generator=generator, device=generator.device, dtype=torch.float32)
            bias.copy_((scale * noise).to(device=bias.device, dtype=bias.dtype))
            changed = True
        count += int(changed)
    return count


# --------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------

def _seeded(seed: int):
    """Fork the CPU RNG so building a model neither depends on nor disturbs global RNG state."""
    ctx = torch.random.fork_rng(devices=[])
    torch.manual_seed(seed)
    return ctx


def build_vae(arch: str, resolution: int, seed: int = 0):
    """The `AutoencoderKL` of architecture `arch` with random weights, as `build_pipeline` builds it
    for the same `seed` (independent of global RNG state)."""
    from diffusers import AutoencoderKL

    with _seeded(seed + 2):
        return AutoencoderKL(**vae_config(arch, resolution))


def build_pipeline(
    cfg: ModelConfig,
    captions: Optional[list[str]] = None,
    resolution: Optional[int] = None,
    *,
    seed: int = 0,
    tokenizer_dir: Optional[Path] = None,
):
    """A `StableDiffusionPipeline` of architecture `cfg.arch` with random weights (never downloaded); an XL arch
    gives a `StableDiffusionXLPipeline` (whose two text encoders share the one trained tokenizer).

    The tokenizer is trained on `captions` (a small built-in corpus when None), at most
    `cfg.vocab_size` tokens; the text encoder's embedding table has `cfg.vocab_size` rows.
    `resolution` (pixels) sets the UNet/VAE sample sizes (default: the arch's own). With
    `cfg.vae` set, that pretrained VAE replaces the built one (latent channels and factor
    follow it). Weights depend only on (`cfg`, `resolution`, `seed`), not on global RNG.
    """
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    from .tokenizer import build_clip_tokenizer

    resolution = int(resolution or default_resolution(cfg.arch, cfg.prediction_type))
    tokenizer = build_clip_tokenizer(captions, out_dir=tokenizer_dir, vocab_size=cfg.vocab_size, model_max_length=77)
    if len(tokenizer) > cfg.vocab_size:  # cannot happen: the builder respects vocab_size
        raise PocketdiffError(f"tokenizer has {len(tokenizer)} tokens, more than model.vocab_size={cfg.vocab_size}")

    vae = load_vae(cfg.vae) if cfg.vae else build_vae(cfg.arch, resolution, seed)
    factor = vae_scale_factor(vae)

    if is_xl(cfg.arch):  # two text encoders and a text_time UNet (pocketdiff/models_xl.py)
        from .models_xl import build_xl_pipeline

        unet_conf = built_unet_config(cfg, resolution, latent_channels=vae.config.latent_channels, vae_factor=factor)
        return build_xl_pipeline(cfg, tokenizer, vae, unet_conf, seed, _seeded, DDIMScheduler(**scheduler_config(cfg.prediction_type)))
    with _seeded(seed):
        text_encoder = CLIPTextModel(
            text_encoder_config(
                cfg.arch,
                vocab_size=cfg.vocab_size,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
    with _seeded(seed + 1):
        unet = UNet2DConditionModel(
            **built_unet_config(cfg, resolution, latent_channels=vae.config.latent_channels, vae_factor=factor)
        )
    scheduler = DDIMScheduler(**scheduler_config(cfg.prediction_type))
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        unet=unet.eval(),
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


# --------------------------------------------------------------------------------------
# Load / save
# --------------------------------------------------------------------------------------

_WEIGHTED = ("unet", "vae", "text_encoder")
_COMPONENTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")


def _has_safetensors(folder: Path) -> bool:
    return any(folder.glob("*.safetensors")) or any(folder.glob("*.safetensors.index.json"))


def _looks_like_hub_id(source: str) -> bool:
    parts = source.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not source.startswith((".", "~"))
        and all(c.isalnum() or c in "-_." for c in source.replace("/", ""))
    )


def check_pipeline_folder(path: Path) -> None:
    """Raise PocketdiffError naming the folder and the first missing piece of a diffusers SD folder (an SDXL one:
    also its second text encoder and tokenizer, not a refiner, its configs agreeing: `models_xl.check_xl_folder`)."""
    path = Path(path)
    if not path.is_dir():
        raise PocketdiffError(f"{path}: not a folder")
    index = read_index(path)
    xl = family_of_index(index) == SDXL
    if xl:
        from .models_xl import check_xl_folder

        check_xl_folder(path, index)
    for comp in XL_COMPONENTS if xl else _COMPONENTS:
        if not (path / comp).is_dir():
            raise PocketdiffError(f"{path}: no {comp}/ (not a diffusers pipeline folder)")
    if not (path / "model_index.json").is_file():
        raise PocketdiffError(f"{path}: no model_index.json (not a diffusers pipeline folder)")
    for comp in XL_WEIGHTED if xl else _WEIGHTED:
        if not (path / comp / "config.json").is_file():
            raise PocketdiffError(f"{path}: no {comp}/config.json (incomplete diffusers pipeline folder)")
        if not _has_safetensors(path / comp):
            raise PocketdiffError(
                f"{path}: no {comp}/*.safetensors (pocketdiff loads safetensors only; convert .bin/.ckpt weights first)"
            )
    for name in ("tokenizer", "tokenizer_2") if xl else ("tokenizer",):
        tok = path / name
        if not ((tok / "tokenizer.json").is_file() or ((tok / "vocab.json").is_file() and (tok / "merges.txt").is_file())):
            raise PocketdiffError(f"{path}: no {name}/vocab.json + merges.txt or {name}/tokenizer.json")
    if not (path / "scheduler" / "scheduler_config.json").is_file():
        raise PocketdiffError(f"{path}: no scheduler/scheduler_config.json (incomplete diffusers pipeline folder)")


def _resolve_source(source: str) -> tuple[str, bool]:
    """(what to pass to from_pretrained, is_local)."""
    text = resolve_shipped(source)
    path = Path(text).expanduser()
    if path.exists():
        return str(path), True
    if _looks_like_hub_id(text):
        return text, False
    raise PocketdiffError(f"{text}: no such folder (and not a hub id like 'owner/name')")


def _load_error(source: str, err: Exception) -> PocketdiffError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return PocketdiffError(f"{source}: cannot load: {first}")


def import_declared_classes(folder: Path) -> list[str]:
    """Import the `pocketdiff.*` modules a folder's model_index.json names for its components
    (e.g. a pruned UNet class), so the stock `from_pretrained` resolves them. Only our own
    namespace is imported: the folder declares the class, no remote code is ever run."""
    import importlib
    import json

    index = Path(folder) / "model_index.json"
    try:
        entries = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return []  # from_pretrained reports a missing or broken file
    imported = []
    for value in entries.values() if isinstance(entries, dict) else []:
        if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and value[0].startswith("pocketdiff."):
            try:
                importlib.import_module(value[0])
            except ImportError as e:
                raise PocketdiffError(f"{index}: names {value[0]}.{value[1]}, which cannot be imported ({e})") from None
            imported.append(value[0])
    return imported


def _family_of_source(src: str, local: bool) -> str:
    """`sd` or `sdxl` from the folder's (or hub id's) model_index.json; a refiner is refused here."""
    from .models_xl import check_not_refiner, hub_index

    index = read_index(Path(src)) if local else (hub_index(src) or {})
    check_not_refiner(src, index)
    return family_of_index(index)


def load_pipeline(source: str, prediction_type: Optional[str] = None, torch_dtype=None):
    """Load a diffusers SD pipeline folder or hub id with the stock `StableDiffusionPipeline.from_pretrained`
    (an SDXL-family one, as its model_index.json says: `StableDiffusionXLPipeline.from_pretrained`).

    Safetensors only, safety checker and feature extractor off. Local folders are checked
    first and load offline. `prediction_type` (when given) overrides the scheduler's.
    Every component comes back in `torch_dtype`, float32 by default, whatever the files hold
    (left to itself, diffusers upcasts its own models of a float16 folder but transformers
    keeps the text encoder in float16, and a mixed pipeline fails at the cross-attention).
    """
    from .models_xl import pipeline_class, xl_pipeline_kwargs

    if prediction_type is not None:
        require(prediction_type in MODEL_PREDICTION_TYPES, "model.prediction_type", f"must be one of {MODEL_PREDICTION_TYPES}, got {prediction_type!r}")
    src, local = _resolve_source(source)
    if local:
        check_pipeline_folder(Path(src))
        import_declared_classes(Path(src))
    family = _family_of_source(src, local)
    dtype = torch_dtype if torch_dtype is not None else torch.float32  # diffusers 0.42 name (torch_dtype is deprecated)
    if family == SDXL:
        kwargs: dict[str, Any] = xl_pipeline_kwargs(dtype)
    else:
        kwargs = dict(use_safetensors=True, safety_checker=None, feature_extractor=None, requires_safety_checker=False, dtype=dtype)
    if local:
        kwargs["local_files_only"] = True
    try:
        pipe = pipeline_class(family).from_pretrained(src, **kwargs)
    except PocketdiffError:
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, AttributeError) as e:
        raise _load_error(src, e) from e
    if family == SDXL and not local:  # a local folder's configs were checked before loading
        from .models_xl import check_xl_configs

        check_xl_configs(src, dict(pipe.unet.config), pipe.text_encoder.config.to_dict(), pipe.text_encoder_2.config.to_dict())
    for comp in XL_WEIGHTED if family == SDXL else _WEIGHTED:
        check_finite_weights(getattr(pipe, comp, None), f"{src}: {comp}")
    if prediction_type is not None and pipe.scheduler.config.get("prediction_type") != prediction_type:
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, prediction_type=prediction_type)
    pipe.set_progress_bar_config(disable=True)
    return pipe


DISTILL_META = "distill.json"  # written by `pocketdiff distill` into every round folder (and kept by prune)


def read_distill_meta(source: Optional[str | Path]) -> dict:
    """The distill.json of a pipeline folder (`pocketdiff:NAME` resolved): a distilled student's
    sampling recipe (steps, guidance). {} when the folder has none; a broken one is an error."""
    from .outputs import read_json

    if not source:
        return {}
    f = Path(resolve_shipped(str(source))).expanduser() / DISTILL_META
    if not f.is_file():
        return {}
    meta = read_json(f)
    return meta if isinstance(meta, dict) and meta.get("pocketdiff_distill") else {}


def check_finite_weights(module: Optional[nn.Module], where: str) -> None:
    """Refuse a module with NaN/Inf weights, naming the tensor (a loaded model would otherwise
    train to a non-finite loss, or sample NaN images that metrics score silently)."""
    if module is None:
        return
    for name, t in module.state_dict().items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise PocketdiffError(f"{where}: weight {name!r} has NaN/Inf values")


def load_vae(source: str, torch_dtype=None):
    """An AutoencoderKL from a VAE folder, a pipeline folder (its vae/), or a hub id."""
    from diffusers import AutoencoderKL

    src, local = _resolve_source(source)
    kwargs: dict[str, Any] = dict(use_safetensors=True)
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype  # diffusers 0.42 name (torch_dtype is deprecated)
    if local:
        path = Path(src)
        if (path / "vae" / "config.json").is_file():
            path = path / "vae"
        if not (path / "config.json").is_file():
            raise PocketdiffError(f"{src}: no config.json or vae/config.json (not a diffusers AutoencoderKL folder)")
        if not _has_safetensors(path):
            raise PocketdiffError(f"{path}: no *.safetensors (pocketdiff loads safetensors only)")
        src = str(path)
        kwargs["local_files_only"] = True
    try:
        vae = AutoencoderKL.from_pretrained(src, **kwargs)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, AttributeError) as e:
        raise _load_error(src, e) from e
    check_finite_weights(vae, f"{src}: vae")
    apply_norm_free(vae, norm_free_names(vae))  # a distill-decoder folder: its folded norms back as affines
    return vae


def load_or_build(cfg: ModelConfig, captions: Optional[list[str]] = None, resolution: Optional[int] = None):
    """`load_pipeline(cfg.pretrained)` (+ `cfg.vae`) when pretrained is set, else `build_pipeline`;
    then `cfg.lora` fused into its UNet and text encoder (all checked before any weight changes)."""
    pipe = _load_or_build(cfg, captions, resolution)
    if cfg.lora:
        entries = fuse_loras(pipe, cfg.lora, "model.lora")
        for e in entries:
            log.info("%s: fused %s at scale %g (%s, %s)", e["key"], e["file"], e["scale"], e["format"],
                     ", ".join(f"{n} {c} layers" for c, n in e["layers"].items()))
    return pipe


def _load_or_build(cfg: ModelConfig, captions: Optional[list[str]], resolution: Optional[int]):
    if not cfg.pretrained:
        return build_pipeline(cfg, captions=captions, resolution=resolution)
    pipe = load_pipeline(cfg.pretrained)
    apply_norm_free(pipe.vae, norm_free_names(pipe.vae))
    folder_type = pipe.scheduler.config.get("prediction_type", "epsilon")
    if folder_type != cfg.prediction_type:
        log.warning(
            "model.prediction_type=%s ignored: %s's scheduler says %s (the folder is authoritative)",
            cfg.prediction_type, cfg.pretrained, folder_type,
        )
    if cfg.vae:
        vae = load_vae(cfg.vae, torch_dtype=pipe.vae.dtype)
        ours = int(pipe.vae.config.latent_channels)
        if vae.config.latent_channels != ours or vae.config.latent_channels != pipe.unet.config.in_channels:
            raise PocketdiffError(
                f"model.vae: {cfg.vae} has {vae.config.latent_channels} latent channels, "
                f"the VAE of {cfg.pretrained} {ours} (its UNet expects {pipe.unet.config.in_channels})"
            )
        if vae_scale_factor(vae) != vae_scale_factor(pipe.vae):
            raise PocketdiffError(
                f"model.vae: {cfg.vae} decodes with scale factor {vae_scale_factor(vae)}, "
                f"the VAE of {cfg.pretrained} with {vae_scale_factor(pipe.vae)}"
            )
        pipe.register_modules(vae=vae)
        if hasattr(pipe, "vae_scale_factor"):
            pipe.vae_scale_factor = vae_scale_factor(vae)
    return pipe


def pipeline_like(pipe, **replace):
    """A pipeline of `pipe`'s own family and class (StableDiffusionPipeline, StableDiffusionXLPipeline) with its
    components, `replace` swapped in (e.g. ``unet=student, scheduler=sched``), its config flags kept (an SDXL
    folder's force_zeros_for_empty_prompt); no safety checker. What every stage that saves or samples a student,
    pruned or quantized model builds, so a family's extra components (text_encoder_2, tokenizer_2) travel."""
    components = dict(pipe.components)
    unknown = sorted(set(replace) - set(components))
    if unknown:
        raise PocketdiffError(f"{type(pipe).__name__} has no component {unknown[0]!r}")
    components.update(replace)
    kwargs = {}
    if "safety_checker" in components:
        components.update(safety_checker=None, feature_extractor=None)
        kwargs["requires_safety_checker"] = False
    for flag in ("force_zeros_for_empty_prompt", "add_watermarker"):
        if flag in pipe.config:
            kwargs[flag] = pipe.config[flag]
    if kwargs.get("add_watermarker") is None:
        kwargs.pop("add_watermarker", None)
    out = type(pipe)(**components, **kwargs)
    out.set_progress_bar_config(disable=True)
    return out


def save_pipeline(pipe, out_dir: Union[str, Path]) -> Path:
    """`save_pretrained(safe_serialization=True)`; loads back with `StableDiffusionPipeline.from_pretrained`
    (an SDXL pipeline: `StableDiffusionXLPipeline.from_pretrained`).

    Also writes tokenizer/vocab.json + merges.txt (CLIP's file pair, for export bundles and
    older readers) next to the tokenizer.json that transformers 5 saves (and tokenizer_2/'s).
    """
    from .tokenizer import export_vocab_merges

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer", "tokenizer_2"):
        tok_dir = out / name
        tokenizer = getattr(pipe, name, None)
        if tokenizer is not None and tok_dir.is_dir() and not (tok_dir / "vocab.json").is_file():
            try:
                export_vocab_merges(tokenizer, tok_dir)
            except PocketdiffError as e:  # a non-BPE tokenizer: tokenizer.json alone is fine
                log.info("%s vocab/merges not written: %s", name, e)
    return out


def iter_norm_modules(module: nn.Module) -> Iterable[nn.Module]:
    """Norm layers (GroupNorm, LayerNorm, ...) inside `module`, as `perturb_norm_affines` sees them."""
    return (m for m in module.modules() if _is_norm(m))


EMBEDDED_TEACHER = "pocketdiff:shapes-teacher"


def embedded_teacher_dir() -> Path:
    """The shipped shapes teacher (a diffusers pipeline folder made by our train-teacher)."""
    return Path(resolve_shipped(EMBEDDED_TEACHER))
