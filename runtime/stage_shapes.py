"""The shapes a runner feeds and reads, by role, against each pipeline stage's component (runtime/pipeline_spec.py).

One rule per role, from the manifest's sizes: `token_ids` [1, L] (the stage tokenizer's max_length); an encode
stage's `prompt_embeds` [1, L, D] and `pooled_embeds` [1, P]; at the denoiser, with B = guidance.unet_batch,
`latents` [B, C, h, w], `prompt_embeds` [B, L, sum of the encoders' D], `pooled_embeds` [B, sum of P],
`time_ids` [B, K] (K = len(pipeline.conditioning.time_ids)), `timestep` [B] or `timestep_embedding` [B, W] (the
table's width; the table has num_train_timesteps rows), `noise_pred` [B, C, h, w]; the decoder's `latents`
[1, C, h, w] and `image` [1, 3, H, W] (a tiled decoder's io is checked with its vae_tiling block); the image encoder's
`init_image` [1, 3, H, W] (the image's size) and `image_latents` [1, C, h, w] (the latent's); an inpainting UNet's
`mask` [B, 1, h, w] and `masked_image_latents` [B, C, h, w], the encoder's `masked_image` as `init_image`. A problem names
the component and input (`components.unet.inputs.sample`) as the per-name checks before the pipeline block did.
"""
from __future__ import annotations

from typing import Optional

from .manifest_fields import expect_shape, is_int
from .components import DECODE, DENOISE, ENCODE_IMAGE, ENCODE_PROMPT



def _section(man: dict, key: str) -> dict:
    return man.get(key) if isinstance(man.get(key), dict) else {}


def _table_width(man: dict, found) -> Optional[int]:
    """The time-embedding table's width, its shape checked against the schedule (None when malformed)."""
    te = man.get("time_embedding")
    shape = te.get("shape") if isinstance(te, dict) else None
    if not isinstance(shape, list) or len(shape) != 2 or not all(is_int(d) and d > 0 for d in shape):
        found.add("time_embedding.shape", "type", f"must be [num_train_timesteps, width], got {shape!r}")
        return None
    T = _section(man, "scheduler").get("num_train_timesteps")
    if shape[0] != T:
        found.add("time_embedding.shape", "consistency", f"{shape[0]} rows, num_train_timesteps is {T}")
    return shape[1]


class _Made:
    """What the encode stages made: per role, the token length and the last-axis widths (concatenated)."""

    def __init__(self):
        self.length: Optional[int] = None
        self.widths: dict[str, list[Optional[int]]] = {}

    def width(self, role: str) -> Optional[int]:
        ws = self.widths.get(role)
        return None if not ws or None in ws else sum(ws)


def _encode_outputs(man: dict, stage: dict, outs: dict, made: _Made, found) -> None:
    comp = stage["component"]
    L = _section(man, str(stage.get("tokenizer"))).get("max_length")
    for role, spec in zip(stage["outputs"], outs.values()):
        shape = spec["shape"]
        if role == "prompt_embeds":
            ok = len(shape) == 3 and shape[:2] == [1, L]
            if not ok:
                found.add(f"components.{comp}.outputs", "consistency", f"shape {shape}, expected [1, {L}, width] (tokenizer.max_length)")
            made.length = L if made.length is None else made.length
            made.widths.setdefault(role, []).append(shape[2] if ok else None)
        else:  # pooled_embeds
            ok = len(shape) == 2 and shape[0] == 1
            if not ok:
                found.add(f"components.{comp}.outputs", "consistency", f"shape {shape}, expected [1, width] (a pooled embedding)")
            made.widths.setdefault(role, []).append(shape[1] if ok else None)


def _want_input(man: dict, stage: dict, role: str, made: _Made, found) -> tuple[Optional[list], str]:
    """The shape a role feeds a stage's input, and what gives it (None: nothing to check)."""
    lat = _section(man, "latent")
    latent = [lat.get("channels"), lat.get("height"), lat.get("width")]
    B = _section(man, "guidance").get("unet_batch") if stage["kind"] == DENOISE else 1
    if role in ("init_image", "masked_image"):
        image = _section(man, "image")
        return [1, image.get("channels"), image.get("height"), image.get("width")], "image"
    if role == "mask":
        return [B, 1, *latent[1:]], "guidance.unet_batch x 1 x the latent's size"
    if role == "masked_image_latents":
        return [B, *latent], "guidance.unet_batch x latent"
    if role == "token_ids":
        return [1, _section(man, str(stage.get("tokenizer"))).get("max_length")], "tokenizer.max_length"
    if role == "latents":
        return ([B, *latent], "guidance.unet_batch x latent") if stage["kind"] == DENOISE else ([1, *latent], "latent")
    if role == "timestep":
        return [B], "guidance.unet_batch (no time-embedding table)"
    if role == "timestep_embedding":
        W = _table_width(man, found)
        return (None if W is None else [B, W]), "guidance.unet_batch x the time-embedding width"
    if role == "time_ids":
        ids = _section(_section(man, "pipeline"), "conditioning").get("time_ids")
        return (None if not isinstance(ids, list) else [B, len(ids)]), "guidance.unet_batch x pipeline.conditioning.time_ids"
    if role == "prompt_embeds" and made.width(role) is not None:
        return [B, made.length, made.width(role)], "guidance.unet_batch x the text encoder's output"
    if role == "pooled_embeds" and made.width(role) is not None:
        return [B, made.width(role)], "guidance.unet_batch x the pooled embeddings"
    return None, ""


def _stage_outputs(man: dict, stage: dict, outs: dict, found) -> None:
    comp, lat, image = stage["component"], _section(man, "latent"), _section(man, "image")
    latent = [lat.get("channels"), lat.get("height"), lat.get("width")]
    first = next(iter(outs.values()))["shape"]
    if stage["kind"] == DENOISE:
        expect_shape(found, f"components.{comp}.outputs", first, [_section(man, "guidance").get("unet_batch"), *latent], "guidance.unet_batch x latent")
    elif stage["kind"] == DECODE:
        expect_shape(found, f"components.{comp}.outputs", first, [1, image.get("channels"), image.get("height"), image.get("width")], "image")
    elif stage["kind"] == ENCODE_IMAGE:
        expect_shape(found, f"components.{comp}.outputs", first, [1, *latent], "latent")


def check_stage_shapes(man: dict, stages: list[dict], ios: dict, found, lacking: frozenset = frozenset()) -> None:
    """Every stage's role-fed inputs and its outputs against the rules above (`ios`: component -> (inputs, outputs)
    as declared, chunked models as one; `lacking`: components already reported for a missing input)."""
    made = _Made()
    for i, stage in enumerate(stages):
        comp = stage["component"]
        if comp not in ios:  # a tiled decoder: its io is checked with vae_tiling
            continue
        ins, outs = ios[comp]
        where = f"pipeline.stages[{i}] ({stage.get('stage')})"
        unfed = [n for n in ins if n not in stage["inputs"]]
        if unfed:
            found.add(f"{where}.inputs", "consistency", f"component {comp}: input {', '.join(unfed)} is fed no role")
        if len(stage["outputs"]) != len(outs):
            found.add(f"{where}.outputs", "consistency", f"component {comp}: {len(outs)} outputs, the stage names {len(stage['outputs'])} roles")
            continue
        if comp not in lacking:
            for name, role in stage["inputs"].items():
                if name not in ins:
                    found.add(f"{where}.inputs.{name}", "consistency", f"component {comp} has no input {name} (has {', '.join(ins)})")
                    continue
                want, what = _want_input(man, stage, role, made, found)
                if want is not None:
                    expect_shape(found, f"components.{comp}.inputs.{name}", ins[name]["shape"], want, what)
        if stage["kind"] == ENCODE_PROMPT:
            _encode_outputs(man, stage, outs, made, found)
        else:
            _stage_outputs(man, stage, outs, found)
