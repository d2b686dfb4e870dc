"""What `pocketdiff calibrate` writes, and reading it back.

- file names: `unet_int8.safetensors` (`UNET_FILE`), `<component>_int8.safetensors` (`int8_file`) for the
  text encoders (`TEXT_ENCODERS`) and the VAE decoder, each beside its JSON recipe (`make_recipe`: per-layer
  bits, group size and method, the seed, the library `versions()`)
- step 6 of the run: the reconstructed and RTN checkpoints (`save_checkpoints`; `rtn/` for the baseline), then
  stock diffusers folders `pipeline/` (and `rtn/pipeline/`) holding the dequantized weights and
  `quantization.json` (`save_pipelines`)
- `load_quantized_pipeline(DIR)`: the float pipeline rebuilt from the int8 codes and scales.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import torch

from pocketdiff.errors import PocketdiffError
from pocketdiff.models import load_pipeline, save_pipeline
from pocketdiff.outputs import commit_folder, write_json

from .calibrate_config import Config
from .int8_format import LayerRecipe, QuantRecipe, dequantized_state_dict, load_quantized, save_quantized
from .quantizer import LayerSpec, quantized_state_dict

UNET_FILE = "unet_int8.safetensors"
TEXT_ENCODER_FILE = "text_encoder_int8.safetensors"
VAE_DECODER_FILE = "vae_decoder_int8.safetensors"
TEXT_ENCODERS = ("text_encoder", "text_encoder_2")  # quantized by RTN at searched scales when listed


def int8_file(component: str) -> str:
    """A quantized component's checkpoint file name (text_encoder_int8.safetensors, ...)."""
    return f"{component}_int8.safetensors"



def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for pkg in ("pocketdiff", "torch", "diffusers", "transformers", "safetensors"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def make_recipe(component: str, specs: dict[str, LayerSpec], methods: dict[str, str], seed: int, extra: dict) -> QuantRecipe:
    layers = {g: LayerRecipe(bits=s.bits, group_size=s.group_size, method=methods[g]) for g, s in specs.items()}
    return QuantRecipe(component=component, layers=layers, seed=seed, versions=versions(), extra=extra)


@dataclasses.dataclass
class Saved:
    """Step 6's checkpoints: the reconstructed and RTN states (codes + scales) with their recipes."""

    recon_state: dict
    recon_recipe: QuantRecipe
    rtn_state: dict
    rtn_recipe: QuantRecipe
    ckpt: Path
    rtn_ckpt: Path


def save_checkpoints(cfg: Config, out: Path, report: dict, results, float_state: dict, recon_layers: dict, rtn_layers: dict,
                      specs: dict, extras: dict) -> Saved:
    """Step 6a: unet_int8.safetensors + recipe, rtn/unet_int8.*, and the optional components' checkpoints."""
    extra = {"source_pipeline": report["source"], "mode": cfg.recon.mode, "method": cfg.recon.method,
             "recon": dataclasses.asdict(cfg.recon), "calibration": report["calibration"],
             "blocks": [{"name": r.name, "kind": r.kind, "chosen": r.stats.get("chosen")} for r in results]}
    recon_state = quantized_state_dict(float_state, {g: (lr.codes, lr.scale) for g, lr in recon_layers.items()})
    recon_recipe = make_recipe("unet", specs, {g: lr.method for g, lr in recon_layers.items()}, cfg.seed, extra)
    ckpt, _ = save_quantized(recon_state, recon_recipe, out / UNET_FILE)
    rtn_state = quantized_state_dict(float_state, rtn_layers)
    rtn_recipe = make_recipe("unet", specs, {g: "rtn" for g in specs}, cfg.seed, {**extra, "method": "rtn"})
    (out / "rtn").mkdir(exist_ok=True)
    rtn_ckpt, _ = save_quantized(rtn_state, rtn_recipe, out / "rtn" / UNET_FILE)
    for comp in extras.get("save", []):
        save_quantized(comp["state"], comp["recipe"], out / comp["file"])
        save_quantized(comp["rtn_state"], comp["rtn_recipe"], out / "rtn" / comp["file"])
    return Saved(recon_state, recon_recipe, rtn_state, rtn_recipe, ckpt, rtn_ckpt)


def save_pipelines(cfg: Config, out: Path, pipe, source: str, saved: Saved, extras: dict) -> dict:
    """Step 6b: pipeline/ (and rtn/pipeline/) with the dequantized weights; returns the report's paths."""
    pipe.to("cpu")
    set_state(pipe.unet, dequantized_state_dict(saved.recon_state, saved.recon_recipe))
    for comp in extras.get("save", []):
        set_component(pipe, comp["component"], dequantized_state_dict(comp["state"], comp["recipe"]))
    src_folder = Path(cfg.model.pretrained).expanduser() if cfg.model.pretrained and Path(cfg.model.pretrained).expanduser().is_dir() else None
    qmeta = {"pocketdiff_calibrate": 1, "variant": "recon", "bits": cfg.quant.bits, "group_size": cfg.quant.group_size,
             "checkpoint": f"../{UNET_FILE}", "source_pipeline": source,
             "note": "weights are the dequantized int8/int4 codes x scales of the checkpoint; load it with "
                     "pocketdiff.compress.quant.load_quantized_pipeline to rebuild them from the codes"}
    pipeline_dir = _save_pipeline_folder(pipe, out / "pipeline", src_folder, qmeta)
    report_paths = {"checkpoint": str(saved.ckpt), "recipe": str(saved.ckpt.with_suffix(".json")),
                    "rtn_checkpoint": str(saved.rtn_ckpt), "pipeline_dir": str(pipeline_dir)}
    if cfg.output.rtn_pipeline:
        set_state(pipe.unet, dequantized_state_dict(saved.rtn_state, saved.rtn_recipe))
        for comp in extras.get("save", []):
            set_component(pipe, comp["component"], dequantized_state_dict(comp["rtn_state"], comp["rtn_recipe"]))
        report_paths["rtn_pipeline_dir"] = str(_save_pipeline_folder(pipe, out / "rtn" / "pipeline", src_folder,
                                                                     {**qmeta, "variant": "rtn"}))
    return report_paths


QUANT_META = "quantization.json"


def _save_pipeline_folder(pipe, folder: Path, source: Optional[Path], meta: dict) -> Path:
    """A stock diffusers folder (written under a temporary name, then renamed), plus the
    source folder's extra top-level files (e.g. a distilled student's distill.json, so that
    evaluate samples it at its step count) and `quantization.json`."""
    import shutil

    tmp = folder.parent / f".{folder.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    save_pipeline(pipe, tmp)
    if source is not None:
        for f in source.iterdir():
            if f.is_file() and not (tmp / f.name).exists() and f.name != "model_index.json":
                shutil.copy2(f, tmp / f.name)
    write_json(tmp / QUANT_META, meta)
    return commit_folder(tmp, folder)


def set_state(module: torch.nn.Module, state: dict) -> None:
    """`state` as `module`'s tensors (float32, on its device), assigned: tensors a caller holds from the
    old state keep their values."""
    dev = next(module.parameters()).device
    module.load_state_dict({k: v.to(dev, torch.float32) if v.is_floating_point() else v.to(dev) for k, v in state.items()},
                           strict=True, assign=True)


def set_component(pipe, component: str, state: dict) -> None:
    if component in TEXT_ENCODERS:
        set_state(getattr(pipe, component), state)
    elif component == "vae_decoder":
        pipe.vae.load_state_dict(state, strict=False)


def load_quantized_pipeline(folder, variant: str = "recon", device=None, torch_dtype=None):
    """The stock `StableDiffusionPipeline` of a calibrate output folder with its UNet (and
    quantized text encoder / VAE decoder, when present) rebuilt from codes * scales.

    `variant` is "recon" (the reconstruction) or "rtn" (the baseline). The other components
    come from `DIR/pipeline` (or, without it, the recipe's source pipeline folder)."""
    if variant not in ("recon", "rtn"):
        raise PocketdiffError(f"variant must be 'recon' or 'rtn', got {variant!r}")
    folder = Path(folder)
    qdir = folder if variant == "recon" else folder / "rtn"
    state, recipe = load_quantized(qdir / UNET_FILE)
    base = folder / "pipeline"
    if not base.is_dir():
        src = recipe.extra.get("source_pipeline", "")
        if not src or src.startswith("built:"):
            raise PocketdiffError(f"{folder}: no pipeline/ folder and no source pipeline in the recipe to rebuild from")
        base = Path(src)
    pipe = load_pipeline(str(base))
    set_state(pipe.unet, dequantized_state_dict(state, recipe))
    for file, comp in ((int8_file(c), c) for c in (*TEXT_ENCODERS, "vae_decoder")):
        if (qdir / file).is_file():
            s, r = load_quantized(qdir / file)
            set_component(pipe, comp, dequantized_state_dict(s, r))
    if torch_dtype is not None:
        pipe.to(dtype=torch_dtype)
    if device is not None:
        pipe.to(device)
    return pipe
