"""The SDXL family in `pocketdiff.models`: which diffusers pipeline class a folder is, the checks an SDXL folder
must pass before any weights load, and building an SDXL-shaped pipeline from an XL arch (`pocketdiff.archs_xl`).

An SDXL-family folder (`StableDiffusionXLPipeline`, base and its fine-tunes) holds two text encoders and two
tokenizers; its UNet's added embedding takes the second encoder's pooled embedding and 6 time ids (original
size, crop top-left, target size). Refused in one line naming what is wrong: a refiner folder (one text encoder,
aesthetic-score time ids), a folder without `text_encoder_2/` or `tokenizer_2/`, a UNet whose added embedding
takes another number of time ids, or whose cross-attention width is not the two encoders' side by side.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from .archs_xl import TIME_IDS, time_ids_width
from .errors import PocketdiffError

SD, SDXL = "sd", "sdxl"
XL_CLASSES = ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline", "StableDiffusionXLInpaintPipeline")
XL_WEIGHTED = ("unet", "vae", "text_encoder", "text_encoder_2")
XL_COMPONENTS = ("unet", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler")


def read_index(folder: Path) -> dict:
    """A folder's model_index.json ({} when absent or unreadable: the folder checks name what is missing)."""
    try:
        index = json.loads((Path(folder) / "model_index.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return index if isinstance(index, dict) else {}


def _declared(index: dict, name: str) -> bool:
    """The index names a component `name` (an entry [library, class] that is not [null, null])."""
    value = index.get(name)
    return isinstance(value, list) and len(value) == 2 and value[0] is not None


def family_of_index(index: dict) -> str:
    """`sdxl` for an SDXL-family model_index (its class, or a text_encoder_2 entry), else `sd`."""
    return SDXL if index.get("_class_name") in XL_CLASSES or "text_encoder_2" in index else SD


def check_not_refiner(where: str, index: dict) -> None:
    """An SDXL refiner (StableDiffusionXLImg2ImgPipeline with requires_aesthetics_score, or no first text encoder) is
    refused in one line."""
    if index.get("requires_aesthetics_score") or (family_of_index(index) == SDXL and not _declared(index, "text_encoder")):
        raise PocketdiffError(f"{where}: an SDXL refiner (one text encoder, aesthetic-score time ids): pocketdiff takes "
                              "SDXL base-family folders (two text encoders, original-size / crop / target-size time ids)")


def _config(folder: Path, comp: str) -> dict:
    try:
        conf = json.loads((folder / comp / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PocketdiffError(f"{folder}: {comp}/config.json cannot be read ({type(e).__name__})") from None
    return conf if isinstance(conf, dict) else {}


def check_xl_configs(where: str, unet: dict, text_1: dict, text_2: dict) -> None:
    """The three configs of an SDXL model agree: the added embedding takes 6 time ids beside the second encoder's
    pooled embedding, and the cross-attention width is the two encoders' hidden sizes side by side."""
    if unet.get("addition_embed_type") != "text_time":
        raise PocketdiffError(f"{where}: unet addition_embed_type is {unet.get('addition_embed_type')!r}, an SDXL UNet's is 'text_time'")
    pooled = int(text_2.get("projection_dim") or 0)
    n = time_ids_width(unet, pooled)
    if n != TIME_IDS:
        raise PocketdiffError(
            f"{where}: unet projection_class_embeddings_input_dim={unet.get('projection_class_embeddings_input_dim')} takes "
            f"{'no' if n is None else format(n, 'g')} time ids of width {unet.get('addition_time_embed_dim')} beside "
            f"text_encoder_2's {pooled}-wide pooled embedding; the SDXL base family takes {TIME_IDS} (original size, crop, target size)")
    widths = (int(text_1.get("hidden_size") or 0), int(text_2.get("hidden_size") or 0))
    if unet.get("cross_attention_dim") != sum(widths):
        raise PocketdiffError(f"{where}: unet cross_attention_dim={unet.get('cross_attention_dim')}, but text_encoder and "
                              f"text_encoder_2 give {widths[0]} + {widths[1]} = {sum(widths)}")


def check_xl_folder(path: Path, index: dict) -> None:
    """An SDXL folder's own checks (refiner, the second encoder and tokenizer, the configs), before any weights load;
    `models.check_pipeline_folder` then checks every component's files."""
    check_not_refiner(str(path), index)
    for comp in ("text_encoder_2", "tokenizer_2"):
        if not (path / comp).is_dir():
            raise PocketdiffError(f"{path}: no {comp}/ (an SDXL folder has two text encoders and two tokenizers)")
    if all((path / c / "config.json").is_file() for c in ("unet", "text_encoder", "text_encoder_2")):
        check_xl_configs(str(path), _config(path, "unet"), _config(path, "text_encoder"), _config(path, "text_encoder_2"))


def xl_pipeline_kwargs(torch_dtype) -> dict:
    """`StableDiffusionXLPipeline.from_pretrained`'s keywords: safetensors only, no watermarker."""
    return dict(use_safetensors=True, dtype=torch_dtype, add_watermarker=False)


def build_xl_pipeline(cfg: Any, tokenizer, vae, unet_config: dict, seed: int, seeded, scheduler):
    """A `StableDiffusionXLPipeline` of XL arch `cfg.arch` around a built `tokenizer` (used for both encoders),
    `vae` and `scheduler`: two CLIP text encoders (the second with its projection) and a text_time UNet, random
    weights from `seed` (`seeded(s)` forks the RNG). The unconditional prompt is encoded, not zeroed
    (`force_zeros_for_empty_prompt` false); a folder that sets the flag (SDXL base) has zero unconditional rows in
    every pocketdiff sampler and runner (`pocketdiff.conditioning.encode_unconditional`, runtime/guidance.py)."""
    import copy

    from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    from .archs import text_encoder_config

    def text_config(which: int):
        return text_encoder_config(cfg.arch, vocab_size=cfg.vocab_size, bos_token_id=tokenizer.bos_token_id,
                                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, which=which)

    with seeded(seed):
        text_encoder = CLIPTextModel(text_config(1))
    with seeded(seed + 3):
        text_encoder_2 = CLIPTextModelWithProjection(text_config(2))
    with seeded(seed + 1):
        unet = UNet2DConditionModel(**unet_config)
    pipe = StableDiffusionXLPipeline(
        vae=vae, text_encoder=text_encoder.eval(), text_encoder_2=text_encoder_2.eval(), tokenizer=tokenizer,
        tokenizer_2=copy.deepcopy(tokenizer), unet=unet.eval(), scheduler=scheduler,
        force_zeros_for_empty_prompt=False, add_watermarker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline_class(family: str):
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    return StableDiffusionXLPipeline if family == SDXL else StableDiffusionPipeline


def hub_index(src: str) -> Optional[dict]:
    """A hub id's model_index.json through diffusers' own reader (None when it cannot be read: from_pretrained then
    reports the error)."""
    from diffusers import DiffusionPipeline

    try:
        index = DiffusionPipeline.load_config(src)
    except Exception:  # noqa: BLE001 - the load that follows names the problem
        return None
    return dict(index) if isinstance(index, dict) else None
