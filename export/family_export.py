"""What a model family changes in `pocketdiff export` (export/verb.py, export/export_components.py), in one place.

The family comes from the UNet's config (`pocketdiff.conditioning.family_of`: `addition_embed_type`). For the SDXL
family (`sdxl`):

- components: the second text encoder (`text_encoder_2`, registry `comes_with: text_encoder`) is exported with the
  first; both graphs return the penultimate layer's states, the second also its projected pooled embedding
  (export/components.py `TextEncoderGraph`, as StableDiffusionXLPipeline.encode_prompt);
- golden inputs: the UNet's `encoder_hidden_states` are the two encoders' states side by side, its `text_embeds` the
  pooled embedding, its `time_ids` the size / crop ids of the export's resolution: (original H, W, crop top, left,
  target H, W) = (res, res, 0, 0, res, res), what StableDiffusionXLPipeline uses for an uncropped image of that size;
- the bundle: a `tokenizer_2` block (its own folder), `pipeline.conditioning.time_ids`, `pipeline.family`, and
  `pipeline.conditioning.zero_unconditional` for a folder with `force_zeros_for_empty_prompt` (SDXL base's setting).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from pocketdiff.conditioning import family_of, sdxl_time_ids
from pocketdiff.errors import PocketdiffError
from pocketdiff.runtime.components import REGISTRY

from .components import TextEncoderGraph, tokenize

SD, SDXL = "sd", "sdxl"


def pipeline_family(pipe) -> str:
    """The bundle family of a pipeline: `sdxl` for a text_time UNet, else `sd`."""
    return family_of(pipe.unet).name


def with_family_components(names: list[str], pipe) -> list[str]:
    """`names` with each registry component that comes with one of them (`comes_with`) placed right after it, when
    the pipeline holds its weights (an SDXL pipeline's text_encoder_2 after text_encoder)."""
    out: list[str] = []
    for n in names:
        out.append(n)
        out += [c.name for c in REGISTRY.values() if c.comes_with == n and getattr(pipe, c.pipeline_attr or "", None) is not None]
    return out


def text_encoder_graph(pipe, name: str) -> TextEncoderGraph:
    """The graph of text encoder `name` for the pipeline's family."""
    if pipeline_family(pipe) != SDXL:
        return TextEncoderGraph(getattr(pipe, name))
    return TextEncoderGraph(getattr(pipe, name), hidden="penultimate", pooled=name == "text_encoder_2")


def check_family_settings(cfg, pipe) -> None:
    """Export settings a family cannot take, refused in one line before any conversion."""
    if pipeline_family(pipe) == SDXL and cfg.text_encoder_chunks > 1:
        raise PocketdiffError("text_encoder_chunks: an SDXL-family text encoder's output is its penultimate layer (and the "
                              "second's pooled embedding), which the chunked graphs do not build; use 1")


@torch.no_grad()
def sdxl_golden(pipe, prompt: str, resolution: int, batch: int) -> dict:
    """The SDXL family's golden inputs: the second tokenizer's ids of `prompt` [1, L] int32, and the UNet's
    `encoder_hidden_states`, `text_embeds`, `time_ids` for a batch of `batch` ([empty, prompt] for 2), computed by the
    very graphs the export converts."""
    ids = {}
    states, pooled = [], None
    for name, tok in (("text_encoder", pipe.tokenizer), ("text_encoder_2", pipe.tokenizer_2)):
        rows = tokenize(tok, [""] * (batch - 1) + [prompt])
        ids[name] = rows[-1:]
        out = text_encoder_graph(pipe, name)(torch.from_numpy(rows).long())
        if isinstance(out, tuple):
            out, pooled = out
        states.append(out)
    time_ids = sdxl_time_ids(None, None, batch, resolution=resolution)  # the samplers' own ids (pocketdiff.conditioning)
    return {"ids_2": ids["text_encoder_2"], "encoder_hidden_states": torch.cat(states, dim=-1), "text_embeds": pooled,
            "time_ids": time_ids}


def family_blocks(pipe, golden, tokenizer_entry) -> dict:
    """The manifest blocks a family adds: SDXL's `tokenizer_2` (`tokenizer_entry(tokenizer, folder, ids)` writes it).
    The family is the golden run's (the exported models are released from `pipe` by now; its tokenizers stay)."""
    if golden.family != SDXL:
        return {}
    return {"tokenizer_2": tokenizer_entry(pipe.tokenizer_2, "tokenizer_2", golden.ids_prompt_2)}


def conditioning_block(golden) -> dict:
    """`pipeline.conditioning`: the time ids a text_time UNet is fed (the golden run's); `zero_unconditional: true` when
    the folder says an empty prompt is zeros (`force_zeros_for_empty_prompt`) and guidance runs an unconditional row:
    the runners then feed zeros as every prompt role's unconditional row (runtime/guidance.py)."""
    block = {"time_ids": golden.time_ids} if golden.time_ids is not None else {}
    if golden.zero_unconditional:
        block["zero_unconditional"] = True
    return block


def golden_ids(golden, name: str) -> Optional[np.ndarray]:
    """The golden prompt's ids a text encoder graph takes."""
    return golden.ids_prompt_2 if name == "text_encoder_2" else golden.ids_prompt


def with_family_rewrites(rewrites_of: dict, names: list[str]) -> dict:
    """Each component that comes with another (`with_family_components`) rewritten as that one is."""
    for n in names:
        partner = REGISTRY[n].comes_with if n in REGISTRY else None
        if n not in rewrites_of and partner in rewrites_of:
            rewrites_of[n] = rewrites_of[partner]
    return rewrites_of
