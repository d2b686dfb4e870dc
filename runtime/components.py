"""The component registry: every model a bundle may hold, in one table that the exporter, the
manifest check, int8 and the runner read (plain data: no numpy, no torch).

A component is one `Component` entry plus its converter in `export/` (the graph that
`export_components.ComponentExport._graph_for` builds for its name). An entry says:

- `name`, the manifest's key and the `.tflite` file's stem; `role` (text, denoise, decode);
- `inputs`: the inputs the runner feeds it, by manifest name (`optional_inputs`: fed only by
  some layouts: the guidance-embedded student's `timestep_cond`);
- what it may be split into: `chunks` (K files run in turn, `<name>_chunks` in the manifest,
  runtime/chunks.py) and/or `tiles` (the parts a tiled decoder runs instead of it);
- `roles`: each input's role in the pipeline (what a runner feeds it: runtime/pipeline_spec.py `ROLES`) and
  `output_roles`, its outputs' roles in order; the stages of a model family (`FAMILIES`) name components, and
  export writes both into the manifest's `pipeline` block;
- its `checks`: what verify-bundle and the export hold it to (`golden` cosine / PSNR at fp16 and
  fp32 against the PyTorch outputs; `tiled_psnr` the tiled decode against the whole one);
- for the converter: the diffusers pipeline attribute holding its weights (`pipeline_attr`), the
  prefix of its parameter names in the exported graph (`graph_prefix`, int8 maps codes by it) and
  the modules int8 round-to-nearest leaves float (`int8_skip`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Component:
    name: str
    role: str  # text | denoise | decode | encode (an image into latents)
    inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    chunks: bool = False  # may be exported as K chunk files (`<name>_chunks` block)
    tiles: tuple[str, ...] = ()  # the components a tiled layout runs instead of this one
    part_of: Optional[str] = None  # a tile of this component
    comes_with: Optional[str] = None  # exported with that component whenever the model holds its weights (SDXL's text_encoder_2)
    checks: tuple[str, ...] = ("golden",)
    pipeline_attr: Optional[str] = None  # where its weights are in a diffusers pipeline
    graph_prefix: str = ""  # its parameter names' prefix in the exported graph module
    int8_skip: tuple[str, ...] = ()  # module prefixes int8 RTN keeps float
    residual_scaled: bool = False  # its residual stream may be scaled for the fp16 range (rewrites.residual_scale)
    roles: tuple[tuple[str, str], ...] = ()  # (input name, role): what the pipeline feeds each input
    output_roles: tuple[str, ...] = ()  # the roles of its outputs, in order

    def role_of(self, input_name: str) -> Optional[str]:
        """The role of one of its inputs (None: an input this component's pipeline does not feed)."""
        return dict(self.roles).get(input_name)


TEXT_ENCODER = "text_encoder"
TEXT_ENCODER_2 = "text_encoder_2"
UNET = "unet"
VAE_DECODER = "vae_decoder"
VAE_DECODER_HEAD = "vae_decoder_head"
VAE_UP_TILE = "vae_up_tile"
VAE_ENCODER = "vae_encoder"

REGISTRY: dict[str, Component] = {c.name: c for c in (
    Component(TEXT_ENCODER, "text", ("input_ids",), chunks=True, pipeline_attr="text_encoder", graph_prefix="text_encoder.",
              roles=(("input_ids", "token_ids"),), output_roles=("prompt_embeds",)),
    # the SDXL family's second text encoder: its penultimate states (beside the first's) and its projected pooled embedding
    Component(TEXT_ENCODER_2, "text", ("input_ids",), comes_with=TEXT_ENCODER, pipeline_attr="text_encoder_2",
              graph_prefix="text_encoder.", roles=(("input_ids", "token_ids"),), output_roles=("prompt_embeds", "pooled_embeds")),
    Component(UNET, "denoise", ("sample", "timestep", "encoder_hidden_states"), ("timestep_cond", "mask", "masked_image_latents"),
              chunks=True, pipeline_attr="unet", graph_prefix="unet.", residual_scaled=True,
              # `timestep` is fed a row of the bundle's time-embedding table when it has one (`timestep_embedding`);
              # an inpainting UNet (9 input channels) also takes the latent mask and the masked picture's latents
              roles=(("sample", "latents"), ("timestep", "timestep"), ("encoder_hidden_states", "prompt_embeds"),
                     ("timestep_cond", "guidance_embedding"), ("text_embeds", "pooled_embeds"), ("time_ids", "time_ids"),
                     ("mask", "mask"), ("masked_image_latents", "masked_image_latents")),
              output_roles=("noise_pred",)),
    Component(VAE_DECODER, "decode", ("latents",), tiles=(VAE_DECODER_HEAD, VAE_UP_TILE), checks=("golden", "tiled_psnr"),
              pipeline_attr="vae", int8_skip=("encoder.", "quant_conv."), residual_scaled=True,
              roles=(("latents", "latents"),), output_roles=("image",)),
    Component(VAE_DECODER_HEAD, "decode", ("latents",), part_of=VAE_DECODER, pipeline_attr="vae"),
    Component(VAE_UP_TILE, "decode", ("features", "weight", "stats", "own"), part_of=VAE_DECODER, pipeline_attr="vae"),
    # image-to-image and inpainting: the user's picture [1, 3, H, W] in [0, 1] -> its latents (the distribution's mean x
    # scaling_factor); int8 RTN leaves the decoder and the 1x1 quant conv (sliced to its mean half in the graph) float
    Component(VAE_ENCODER, "encode", ("pixels",), pipeline_attr="vae", int8_skip=("decoder", "post_quant_conv", "quant_conv"),
              roles=(("pixels", "init_image"),), output_roles=("image_latents",)),
)}

ENCODE_PROMPT, DENOISE, DECODE = "encode_prompt", "denoise", "decode"  # the stage kinds a runner knows (pipeline_spec)
ENCODE_IMAGE = "encode_image"  # image-to-image and inpainting: the user's picture into latents, before the denoise stage

# A model family's pipeline: its stages in order, each (stage name, kind, component, tokenizer block or None). A new
# family is a new entry (and its components above); the runners know the kinds (runtime/pipeline_spec.py STAGE_KINDS).
FAMILIES: dict[str, tuple[tuple[str, str, str, Optional[str]], ...]] = {
    "sd": (("encode_prompt", ENCODE_PROMPT, TEXT_ENCODER, "tokenizer"),
           ("denoise", DENOISE, UNET, None),
           ("decode", DECODE, VAE_DECODER, None)),
    # SDXL: two text encoders (prompt_embeds side by side, the second's pooled_embeds), size / crop time ids
    "sdxl": (("encode_prompt", ENCODE_PROMPT, TEXT_ENCODER, "tokenizer"),
             ("encode_prompt_2", ENCODE_PROMPT, TEXT_ENCODER_2, "tokenizer_2"),
             ("denoise", DENOISE, UNET, None),
             ("decode", DECODE, VAE_DECODER, None)),
}
# The stages a task adds to its family's (before the denoise stage), and the components they need exported.
TASK_STAGES: dict[str, tuple[tuple[str, str, str, Optional[str]], ...]] = {
    "text_to_image": (),
    "image_to_image": (("encode_image", ENCODE_IMAGE, VAE_ENCODER, None),),
    "inpaint": (("encode_image", ENCODE_IMAGE, VAE_ENCODER, None),),  # latent blending with any text-to-image UNet
}
# An inpainting UNet (StableDiffusionInpaintPipeline, 9 input channels) also reads the masked picture's latents: a second
# encode_image stage of the same encoder, on the picture with the repainted part grey, before the denoise stage.
MASKED_IMAGE_STAGE: tuple[str, str, str, Optional[str]] = ("encode_masked_image", ENCODE_IMAGE, VAE_ENCODER, None)
INPAINT_UNET_ROLES: tuple[str, ...] = ("mask", "masked_image_latents")  # the roles that make a UNet an inpainting one

# the components an export config names (parts of a tiled layout come with their whole, a family's second text encoder
# with the first), in call order; STAGE_COMPONENTS: every whole component a pipeline stage may name
COMPONENTS: tuple[str, ...] = tuple(n for n, c in REGISTRY.items() if c.part_of is None and c.comes_with is None)
STAGE_COMPONENTS: tuple[str, ...] = tuple(n for n, c in REGISTRY.items() if c.part_of is None)
CHUNKABLE: tuple[str, ...] = tuple(n for n in COMPONENTS if REGISTRY[n].chunks)
TILED_DECODER: tuple[str, ...] = REGISTRY[VAE_DECODER].tiles
# the components a task other than text-to-image adds (export `tasks`); the rest is what a text-to-image bundle holds
TASK_COMPONENTS: tuple[str, ...] = tuple(dict.fromkeys(s[2] for stages in TASK_STAGES.values() for s in stages))
TEXT_TO_IMAGE_COMPONENTS: tuple[str, ...] = tuple(n for n in COMPONENTS if n not in TASK_COMPONENTS)


def up_tile_parts(k: int) -> tuple[str, ...]:
    """The names of a one-pass up path exported as `k` graphs (export `vae_tiling.up_parts`): `vae_up_tile`
    alone, or `vae_up_tile.0` ... `vae_up_tile.k-1`, run one after another on each tile."""
    return (VAE_UP_TILE,) if k == 1 else tuple(f"{VAE_UP_TILE}.{i}" for i in range(k))


def component(name: str) -> Component:
    """The registry's entry of `name` (a chunk `unet.3` is its component's, an up-path part `vae_up_tile.1`
    the up tile's)."""
    head, _, tail = name.rpartition(".")
    base = head if head in (*CHUNKABLE, VAE_UP_TILE) and tail.isdigit() else name
    if base not in REGISTRY:
        raise KeyError(f"unknown component {name!r}; the registry has {', '.join(REGISTRY)}")
    return REGISTRY[base]


def whole_of(name: str) -> str:
    """The whole component a model belongs to: a chunk's (`unet.3` -> unet), a tiled part's (`vae_up_tile.1`,
    `vae_decoder_head` -> vae_decoder), else itself (a name outside the registry too)."""
    try:
        entry = component(name)
    except KeyError:
        return name
    return entry.part_of or entry.name


def expand(names: list[str] | tuple[str, ...], tiled: bool, up_parts: int = 1) -> list[str]:
    """The component names of an export: a tiled layout's parts in place of their whole, its up tile as `up_parts`
    graphs (`up_tile_parts`)."""
    out: list[str] = []
    for n in names:
        for t in (REGISTRY[n].tiles if tiled and REGISTRY[n].tiles else (n,)):
            out += list(up_tile_parts(up_parts)) if t == VAE_UP_TILE else [t]
    return out
