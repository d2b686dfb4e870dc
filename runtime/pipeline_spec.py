"""The manifest's `pipeline` block: what a runner runs, in which order, and what it feeds every graph input.

    pipeline: {family: sd, tasks: [text_to_image], conditioning: {time_ids: [6 numbers]} (only for a UNet that
               takes time ids), stages: [{stage, kind, component, tokenizer (encode_prompt only),
                                          inputs: {graph input name: role}, outputs: [role per output, in order]}]}

A stage's `kind` says what a runner does with it (`STAGE_KINDS`); its `component` is a whole registry component
(runtime/components.py): a runner runs its chunks (`<name>_chunks`) or its tiled parts (`vae_tiling`) in its place.
Every input of the component is fed by *role* (`ROLES`): where the value comes from (the tokenizer, an earlier
stage, the scheduler, the time-embedding table, a constant of the block, the latents) and whether it has one row per
prompt (stacked `[unconditional, conditional]` under classifier-free guidance) or per sample (repeated to the UNet's
batch). A role produced by several encode stages (an SDXL-style pair of text encoders) is their outputs
concatenated on the last axis, in stage order. So a new family is a registry entry (its components' roles and its
stages, `components.FAMILIES`) and a new task a stage kind, not a rewrite of the runners.
The tasks (`TASKS`): text_to_image, and image_to_image / inpaint, which add an `encode_image` stage before the
denoise stage (`components.TASK_STAGES`: the VAE encoder, `init_image` -> `image_latents`, the loop's start); a bundle
whose UNet inpaints (9 channels: `mask` and `masked_image_latents` inputs) serves inpaint only and has a second one on the
masked picture (`components.MASKED_IMAGE_STAGE`: `masked_image` -> `masked_image_latents`).

Bundles written before the block (schema_version 1 and 2) are read through `derive_pipeline`: the SD family's
stages, with the UNet's `timestep` fed the table's row when the bundle has one. `pipeline_problems` checks a
block against the registry and the manifest (known kinds and roles, each stage's component present, every input
fed, each role made before it is read, every role-fed shape) and names the stage, component and input at fault.
Plain Python and the registry only: the web page mirrors it in `web/static/stages.js`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from pocketdiff.lora_keys import slot_input_names

from .chunks import block_key, parts_of
from .components import (CHUNKABLE, DECODE, DENOISE, ENCODE_IMAGE, ENCODE_PROMPT, FAMILIES, INPAINT_UNET_ROLES, MASKED_IMAGE_STAGE,
                         REGISTRY, TASK_STAGES, TILED_DECODER, VAE_DECODER, up_tile_parts)
from .stage_shapes import check_stage_shapes

PIPELINE_SCHEMA_VERSION = 3  # a manifest with a `pipeline` block; 1 and 2 are read through derive_pipeline
STAGE_KINDS = (ENCODE_PROMPT, ENCODE_IMAGE, DENOISE, DECODE)
TASKS = tuple(TASK_STAGES)  # text_to_image, image_to_image, inpaint (the stages each adds: components.TASK_STAGES)
IMAGE_TASKS = tuple(t for t, stages in TASK_STAGES.items() if stages)  # the tasks that start from the user's picture
PROMPT, SAMPLE, MODEL = "prompt", "sample", "model"


@dataclasses.dataclass(frozen=True)
class Role:
    """Where a graph input's value comes from (`source`) and how it meets the UNet's batch (`per`)."""

    source: str  # tokenizer | stage | scheduler | table | constant | latents | picture (the user's) | adapter (the user's LoRA) | none
    per: str  # prompt: a row per prompt ([uncond, cond] under cfg); sample: repeated to the batch; model: one for all rows
    rank: int  # the tensor's dims


ROLES: dict[str, Role] = {
    "token_ids": Role("tokenizer", PROMPT, 2),  # [1, L] int32: the stage's tokenizer
    "prompt_embeds": Role("stage", PROMPT, 3),  # [rows, L, D]: encode stages' hidden states
    "pooled_embeds": Role("stage", PROMPT, 2),  # [rows, P]: a pooled text embedding (SDXL's text_embeds)
    "time_ids": Role("constant", SAMPLE, 2),  # [B, K]: pipeline.conditioning.time_ids (size and crop ids)
    "timestep": Role("scheduler", SAMPLE, 1),  # [B] float32: the timestep
    "timestep_embedding": Role("table", SAMPLE, 2),  # [B, W]: the time-embedding table's row of the timestep
    "latents": Role("latents", SAMPLE, 4),  # [B, C, h, w]: the latents (the decoder: [1, C, h, w])
    "guidance_embedding": Role("none", SAMPLE, 2),  # a w-conditioned student's timestep_cond, inside the table instead
    "noise_pred": Role("stage", SAMPLE, 4),  # the denoiser's output
    "image": Role("stage", SAMPLE, 4),  # the decoder's pixels [1, 3, H, W]
    "init_image": Role("picture", SAMPLE, 4),  # [1, 3, H, W] float32 in [0, 1]: the user's picture (image-to-image, inpaint)
    "image_latents": Role("stage", SAMPLE, 4),  # [1, C, h, w]: the encoder's latents of it (the denoise loop's start)
    # an inpainting UNet's (9 channels): the mask on the latent grid [B, 1, h, w] (1 = repaint), the picture with the
    # repainted part grey (0.5) [1, 3, H, W] and its latents [B, C, h, w] (an encode_image stage's)
    "mask": Role("picture", SAMPLE, 4),
    "masked_image": Role("picture", SAMPLE, 4),
    "masked_image_latents": Role("stage", SAMPLE, 4),
    # a LoRA slot's factor (manifest `lora_slots`): down [in, rank] or up [rank, out] (scaled) of the user's LoRA, zeros without one
    "lora_factors": Role("adapter", MODEL, 2),
}
OUTPUT_ROLES = {ENCODE_PROMPT: ("prompt_embeds", "pooled_embeds"), ENCODE_IMAGE: ("image_latents", "masked_image_latents"), DENOISE: ("noise_pred",),
                DECODE: ("image",)}
NOT_FED = ("noise_pred", "image", "image_latents")  # roles a stage makes that no runner feeds a graph (yet)


def tiled_components(block: dict) -> tuple[str, ...]:
    """A vae_tiling block's components: its `components` list when it names the head and the up path's parts
    (`vae_up_tile`, or `vae_up_tile.0` ... `.K-1`: export `vae_tiling.up_parts`), else the two classic graphs
    (bundles from before the list; a malformed one is reported by manifest_check)."""
    names = block.get("components")
    if isinstance(names, list) and len(names) >= 2 and names[0] == TILED_DECODER[0] and tuple(names[1:]) == up_tile_parts(len(names) - 1):
        return tuple(names)
    return TILED_DECODER


def decoder_components(man: dict) -> tuple[str, ...]:
    """The decoder's components: the tiled graphs (head, then the up path's) when the manifest has a vae_tiling block."""
    return tiled_components(man["vae_tiling"]) if isinstance(man.get("vae_tiling"), dict) else (VAE_DECODER,)


def stage_parts(man: dict, component: str) -> tuple[str, ...]:
    """The models a stage's component runs as: its chunks, its tiled parts, or itself."""
    if component == VAE_DECODER:
        return decoder_components(man)
    return parts_of(man, component) if component in CHUNKABLE else (component,)


def whole_inputs(man: dict, component: str) -> Optional[list[dict]]:
    """The whole component's declared inputs ({name, shape, dtype}): its entry's, its chunks block's, or (tiled)
    the decoder head's. None when the manifest does not hold them."""
    comps = man.get("components") if isinstance(man.get("components"), dict) else {}
    block = man.get(block_key(component)) if component in CHUNKABLE else None
    if isinstance(block, dict):
        entry = block
    else:
        entry = comps.get(stage_parts(man, component)[0])
    items = entry.get("inputs") if isinstance(entry, dict) else None
    return items if isinstance(items, list) else None


def _roles_of(man: dict, component: str) -> dict[str, str]:
    reg = REGISTRY[component]
    table = bool(man.get("time_embedding"))
    slots = man.get("lora_slots") if isinstance(man.get("lora_slots"), dict) else {}
    slotted = {n for m in slots.get("targets") or [] if isinstance(m, str) for n in slot_input_names(m)}
    roles = {}
    for item in whole_inputs(man, component) or [{"name": n} for n in reg.inputs]:
        name = item.get("name") if isinstance(item, dict) else None
        role = reg.role_of(name) if isinstance(name, str) else None
        if role == "timestep" and table:
            role = "timestep_embedding"  # the UNet's time embedding computed outside the graph: the table's row
        if role is None and name in slotted:
            role = "lora_factors"  # a LoRA slot's factor (export lora_slots)
        roles[str(name)] = role or "unknown"
    return roles


def derive_pipeline(man: dict, family: str = "sd", tasks: tuple = ("text_to_image",)) -> dict:
    """The pipeline block of a manifest from the registry: `family`'s stages, with the stages `tasks` add
    (components.TASK_STAGES: image-to-image's encode_image) before the denoise stage, each input's role. Export writes
    it; a bundle from before the block (schema_version 1, 2) is read as this."""
    added = list(dict.fromkeys(s for t in tasks for s in TASK_STAGES[t]))
    if "inpaint" in tasks and inpainting_unet(man):  # the masked picture's latents too, for the UNet's extra channels
        added.append(MASKED_IMAGE_STAGE)
    stages = []
    for stage, kind, component, tokenizer in FAMILIES[family]:
        for row in (added if kind == DENOISE else []) + [(stage, kind, component, tokenizer)]:
            io = ({"pixels": "masked_image"}, ["masked_image_latents"]) if row == MASKED_IMAGE_STAGE else (
                _roles_of(man, row[2]), list(REGISTRY[row[2]].output_roles))
            stages.append({"stage": row[0], "kind": row[1], "component": row[2], **({"tokenizer": row[3]} if row[3] else {}),
                           "inputs": io[0], "outputs": io[1]})
    return {"family": family, "tasks": list(tasks), "conditioning": {}, "stages": stages}


def inpainting_unet(man: dict) -> bool:
    """The bundle's UNet takes the inpainting roles (a 9-channel StableDiffusionInpaintPipeline UNet)."""
    return any(r in INPAINT_UNET_ROLES for r in _roles_of(man, "unet").values())


def pipeline_of(man: dict) -> dict:
    """The manifest's pipeline block, or (a bundle from before it) the one its layout implies."""
    block = man.get("pipeline")
    return block if isinstance(block, dict) else derive_pipeline(man)


# ------------------------------------------------------------------------------- checks


def _where(i: int, stage: Any) -> str:
    name = stage.get("stage") if isinstance(stage, dict) else None
    return f"pipeline.stages[{i}]" + (f" ({name})" if isinstance(name, str) else "")


def _check_stage_fields(i: int, stage: Any, comps: dict, man: dict, found, require_present: bool = True) -> Optional[bool]:
    """The stage's own fields: kind, component (present, whole or in parts), inputs and outputs by known roles. None:
    its component is absent from a bundle that need not run whole (`require_present` False)."""
    where = _where(i, stage)
    if not isinstance(stage, dict):
        found.add(where, "type", "must be an object {stage, kind, component, inputs, outputs}")
        return False
    kind, comp = stage.get("kind"), stage.get("component")
    if kind not in STAGE_KINDS:
        found.add(f"{where}.kind", "value", f"{kind!r} is no stage a runner knows ({', '.join(STAGE_KINDS)})")
        return False
    if comp not in REGISTRY or REGISTRY[comp].part_of is not None:
        found.add(f"{where}.component", "value", f"{comp!r} is not a component of the registry ({', '.join(REGISTRY)})")
        return False
    missing = [p for p in stage_parts(man, comp) if p not in comps]
    if missing and not require_present:  # a partial bundle (verify-bundle, export of some components): not run whole
        return None
    if missing:
        found.add(f"{where}.component", "present", f"stage {stage.get('stage')} runs {comp}: "
                  f"{', '.join(f'components.{m}' for m in missing)} missing (the bundle has {', '.join(comps)})")
        return False
    ins, outs = stage.get("inputs"), stage.get("outputs")
    if not isinstance(ins, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ins.items()):
        found.add(f"{where}.inputs", "type", "must map each graph input's name to its role")
        return False
    if not isinstance(outs, list) or not outs or not all(isinstance(r, str) for r in outs):
        found.add(f"{where}.outputs", "type", "must list the role of each output, in order")
        return False
    ok = True
    for name, role in ins.items():
        if role not in ROLES or role in NOT_FED:
            found.add(f"{where}.inputs.{name}", "value", f"component {comp}, input {name}: role {role!r} is not one a runner feeds")
            ok = False
    for role in outs:
        if role not in OUTPUT_ROLES[kind]:
            found.add(f"{where}.outputs", "value", f"component {comp}: a {kind} stage makes {', '.join(OUTPUT_ROLES[kind])}, not {role!r}")
            ok = False
    if kind == ENCODE_PROMPT and not isinstance(man.get(stage.get("tokenizer")), dict):
        found.add(f"{where}.tokenizer", "present", f"names {stage.get('tokenizer')!r}, which is no tokenizer block of the manifest")
        ok = False
    return ok


def _check_order(stages: list, man: dict, found) -> None:
    """Each role a stage reads is made before it (by the runner's sources, or an earlier stage's outputs)."""
    made = {r for r, spec in ROLES.items() if spec.source not in ("stage", "none")}
    if "time_ids" not in ((man.get("pipeline") or {}).get("conditioning") or {}):
        made.discard("time_ids")
    if not man.get("time_embedding"):
        made.discard("timestep_embedding")
    if not isinstance(man.get("lora_slots"), dict):
        made.discard("lora_factors")
    for i, stage in enumerate(stages):
        for name, role in stage["inputs"].items():
            if role not in made and ROLES[role].source != "none":
                found.add(f"{_where(i, stage)}.inputs.{name}", "consistency",
                          f"component {stage['component']}, input {name}: no earlier stage or bundle field makes {role}")
        made.update(stage["outputs"])
    kinds = [s["kind"] for s in stages]
    if kinds.count(DENOISE) != 1 or kinds.count(DECODE) != 1 or kinds.index(DENOISE) > kinds.index(DECODE):
        found.add("pipeline.stages", "consistency", f"one denoise stage then one decode stage, got kinds {kinds}")
    elif kinds.count(ENCODE_IMAGE) > 2 or (ENCODE_IMAGE in kinds and len(kinds) - kinds[::-1].index(ENCODE_IMAGE) - 1 > kinds.index(DENOISE)):
        found.add("pipeline.stages", "consistency", f"at most two encode_image stages (the picture, the masked picture), before "
                  f"the denoise stage, got kinds {kinds}")
    tasks = pipeline_of(man).get("tasks")
    image_tasks = [t for t in tasks if t in IMAGE_TASKS] if isinstance(tasks, list) else []
    if image_tasks and ENCODE_IMAGE not in kinds:
        found.add("pipeline.tasks", "consistency", f"{', '.join(image_tasks)} start from the user's picture: the stages need an "
                  f"encode_image stage, got kinds {kinds}")
    inpaint_roles = sorted({r for s in stages if s["kind"] == DENOISE for r in s["inputs"].values() if r in INPAINT_UNET_ROLES})
    if inpaint_roles and tasks != ["inpaint"]:
        found.add("pipeline.tasks", "consistency", f"the denoise stage reads {', '.join(inpaint_roles)} (an inpainting UNet): "
                  f"the bundle serves inpaint only, got tasks {tasks!r}")


def pipeline_problems(man: dict, ios: dict, found, lacking: frozenset = frozenset(), require_present: bool = True) -> None:
    """The pipeline block (or the derived one) against the registry and the manifest: stages, roles, shapes
    (`ios`: component -> declared (inputs, outputs), chunked models as one; `lacking`: components already reported
    for an input the registry requires; `require_present` False: a partial bundle, whose absent stages are skipped)."""
    block = man.get("pipeline")
    if block is not None and not isinstance(block, dict):
        found.add("pipeline", "type", "must be an object {family, tasks, stages}")
        return
    pipe = pipeline_of(man)
    stages = pipe.get("stages")
    if not isinstance(stages, list) or not stages:
        found.add("pipeline.stages", "present", "must list the stages in order")
        return
    tasks = pipe.get("tasks")
    if not isinstance(tasks, list) or not tasks or any(t not in TASKS for t in tasks):
        found.add("pipeline.tasks", "value", f"must list tasks of {', '.join(TASKS)}, got {tasks!r}")
    zero = (pipe.get("conditioning") or {}).get("zero_unconditional") if isinstance(pipe.get("conditioning") or {}, dict) else None
    if zero is not None and not isinstance(zero, bool):
        found.add("pipeline.conditioning.zero_unconditional", "type", f"must be true or false, got {zero!r}")
    comps = man.get("components") if isinstance(man.get("components"), dict) else {}
    fields = [_check_stage_fields(i, s, comps, man, found, require_present) for i, s in enumerate(stages)]
    if False in fields:
        return
    if None in fields:  # a partial bundle: the stages it holds are checked on their own, not as one pipeline
        check_stage_shapes(man, [s for s, ok in zip(stages, fields) if ok], ios, found, lacking)
        return
    _check_order(stages, man, found)
    check_stage_shapes(man, stages, ios, found, lacking)
