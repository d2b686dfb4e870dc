"""The three exported graphs as torch modules with fixed shapes, and their fixed inputs.

- `TextEncoderGraph`: input_ids int32 [1, L] -> last_hidden_state [1, L, D] (the SDXL family: the penultimate
  layer's [1, L, D], and for its second encoder also the projected pooled embedding [1, P])
- `UNetGraph`: sample [B, C, h, w], timestep [B] (or the precomputed time embedding
  [B, T] when the time embedding is computed outside the graph), encoder_hidden_states
  [B, L, D] (+ timestep_cond [B, W] for guidance-embedded students) -> model output
- `VaeDecoderGraph`: latents [1, C, h, w] (as the sampler produces them, unscaled) ->
  image [1, 3, H, W] in [0, 1] (before clipping)

B is 2 for classifier-free guidance (uncond + cond in one batch), 1 for a student whose
guidance is distilled into the weights.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Optional

import numpy as np
import torch
from diffusers import UNet2DConditionModel
from torch import nn

from pocketdiff.errors import PocketdiffError
from pocketdiff.models import check_resolution, vae_scale_factor
from pocketdiff.runtime.components import COMPONENTS  # noqa: F401  (the registry's names; the graphs below convert them)

from .inpaint_check import inpaints


class TextEncoderGraph(nn.Module):
    """A CLIP text encoder's graph: input_ids int32 [1, L] -> its output for the family.

    - `hidden="last"` (SD 1.x / 2.x): the last hidden state after the final layer norm [1, L, D];
    - `hidden="penultimate"` (the SDXL family, as StableDiffusionXLPipeline.encode_prompt takes
      ``hidden_states[-2]``): the output of the last layer but one, no final norm (the last layer is not run);
    - `pooled=True` (SDXL's second encoder, a CLIPTextModelWithProjection): also its ``text_embeds``, the
      final-normed state at the end token projected by ``text_projection``: (hidden, pooled), two outputs in that
      order (export/text_pooling.py picks the token with delegate-friendly ops).
    """

    def __init__(self, text_encoder: nn.Module, hidden: str = "last", pooled: bool = False):
        super().__init__()
        if hidden not in ("last", "penultimate") or (pooled and hidden != "penultimate"):
            raise PocketdiffError(f"TextEncoderGraph: hidden={hidden!r}, pooled={pooled} is no family's text encoder output")
        self.text_encoder = text_encoder
        self.hidden, self.pooled = hidden, pooled
        self.pool = None
        if pooled:
            from .text_pooling import EndTokenPool

            self.pool = EndTokenPool(text_encoder.config)

    def unused_modules(self) -> tuple[str, ...]:
        """Prefixes of the module names `forward` never runs (the penultimate state alone: the last encoder layer);
        int8 leaves their layers out of the graph (export/int8.py `pieces_for`: reported outside the graph)."""
        if self.hidden != "penultimate" or self.pooled:
            return ()
        for name, m in self.text_encoder.named_modules():
            if isinstance(m, nn.ModuleList) and name.endswith("layers") and len(m):
                return (f"text_encoder.{name}.{len(m) - 1}.",)
        return ()

    def forward(self, input_ids: torch.Tensor):
        if self.hidden == "last":
            return self.text_encoder(input_ids, return_dict=False)[0]
        from .text_pooling import run_clip

        penultimate, last = run_clip(self.text_encoder, input_ids, final=self.pooled)
        if not self.pooled:
            return penultimate
        return penultimate, self.text_encoder.text_projection(self.pool(input_ids, last))


def _fed_time_embed(self, sample, timestep):
    return timestep.to(sample.dtype)


class ExternalTimeUNet(UNet2DConditionModel):
    """UNet2DConditionModel whose `timestep` input already is the time embedding."""

    def get_time_embed(self, sample, timestep):
        return _fed_time_embed(self, sample, timestep)


class _PassThrough(nn.Module):
    """Stands in for the time embedding MLP: returns its first argument."""

    def forward(self, x, *args, **kwargs):
        return x


def added_conditioning_inputs(unet) -> tuple[str, ...]:
    """The graph inputs a UNet's added embedding takes besides the text: SDXL's (`addition_embed_type: text_time`)
    pooled text embedding and time ids, computed inside the graph from them (they depend on the prompt, so no
    per-timestep table can hold them: runtime/BUNDLE.md), else none."""
    return ("text_embeds", "time_ids") if getattr(unet.config, "addition_embed_type", None) == "text_time" else ()


def inpainting_unet(unet) -> bool:
    """An inpainting UNet (StableDiffusionInpaintPipeline's): in_channels = latents + mask + masked-picture latents."""
    return inpaints(unet.config)


class UNetGraph(nn.Module):
    """UNet2DConditionModel with its time embedding inside the graph or fed in, and its conditioning's fields as inputs:
    (sample, timestep, encoder_hidden_states[, timestep_cond][, text_embeds, time_ids][, mask, masked_image_latents]) in
    that order, the order the export passes them and the manifest's pipeline block names them by role
    (runtime/components.py). An inpainting UNet's mask [B, 1, h, w] and masked-picture latents [B, C, h, w] are inputs
    of their own, concatenated after the latents in the graph, as StableDiffusionInpaintPipeline concatenates them."""

    def __init__(self, unet: nn.Module, external_time_embedding: bool = False, timestep_cond: bool = False):
        super().__init__()
        self.unet = unet
        self.external_time_embedding = external_time_embedding
        self.takes_timestep_cond = timestep_cond and not external_time_embedding
        self.extra_inputs = (("timestep_cond",) if self.takes_timestep_cond else ()) + added_conditioning_inputs(unet)
        self.inpainting = inpainting_unet(unet)
        if self.inpainting:
            self.extra_inputs += ("mask", "masked_image_latents")
        if external_time_embedding:
            # get_time_embed returns what we feed; time_embedding becomes the identity
            if type(unet) is UNet2DConditionModel:
                unet.__class__ = ExternalTimeUNet  # a module-level class: the graph stays picklable
            else:
                unet.get_time_embed = types.MethodType(_fed_time_embed, unet)
            unet.time_embedding = _PassThrough()

    def forward(self, sample, timestep, encoder_hidden_states, *extra):
        fed = dict(zip(self.extra_inputs, extra))
        kwargs = {}
        if self.takes_timestep_cond:
            kwargs["timestep_cond"] = fed["timestep_cond"]
        if "text_embeds" in fed:  # the added embedding, from the prompt's pooled embedding and the size / crop ids
            kwargs["added_cond_kwargs"] = {"text_embeds": fed["text_embeds"], "time_ids": fed["time_ids"]}
        if self.inpainting:
            sample = torch.cat([sample, fed["mask"], fed["masked_image_latents"]], dim=1)
        return self.unet(sample, timestep, encoder_hidden_states=encoder_hidden_states, return_dict=False, **kwargs)[0]


class VaeDecoderGraph(nn.Module):
    def __init__(self, vae: nn.Module):
        super().__init__()
        self.post_quant_conv = getattr(vae, "post_quant_conv", None)
        self.decoder = vae.decoder
        self.scaling_factor = float(vae.config.scaling_factor)
        shift = getattr(vae.config, "shift_factor", None)
        self.shift_factor = float(shift) if shift is not None else 0.0

    def decoder_input(self, latents: torch.Tensor) -> torch.Tensor:
        """The sampler's latents as the decoder takes them: unscaled, unshifted, post_quant_conv."""
        z = latents * (1.0 / self.scaling_factor)
        if self.shift_factor:
            z = z + self.shift_factor
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return z

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        image = self.decoder(self.decoder_input(latents))
        # [0, 1] up to the clamp, which the runner applies (clamp(0, 1) lowers to
        # RELU_0_TO_1, which the GPU delegate rejects)
        return image * 0.5 + 0.5


@dataclasses.dataclass
class Shapes:
    """Fixed shapes of one export."""

    resolution: int
    latent_channels: int
    latent_size: int
    vae_factor: int
    text_length: int
    text_dim: int
    unet_batch: int
    time_embed_dim: int
    timestep_cond_dim: Optional[int]


def time_embed_dim(unet) -> int:
    te = unet.time_embedding
    lin2 = getattr(te, "linear_2", None)
    if lin2 is None:
        raise PocketdiffError("the UNet's time embedding has no linear_2: cannot compute it outside the graph")
    return int(lin2.out_features)


def shapes_for(pipe, resolution: Optional[int], unet_batch: int) -> Shapes:
    vae_factor = vae_scale_factor(pipe)
    res = int(resolution or pipe.unet.config.sample_size * vae_factor)
    check_resolution(pipe, res, "resolution")
    return Shapes(
        resolution=res,
        latent_channels=int(pipe.unet.config.out_channels if inpainting_unet(pipe.unet) else pipe.unet.config.in_channels),
        latent_size=res // vae_factor,
        vae_factor=vae_factor,
        text_length=int(pipe.tokenizer.model_max_length),
        text_dim=int(pipe.text_encoder.config.hidden_size),
        unet_batch=int(unet_batch),
        time_embed_dim=time_embed_dim(pipe.unet),
        timestep_cond_dim=getattr(pipe.unet.config, "time_cond_proj_dim", None),
    )


@torch.no_grad()
def time_embedding_table(unet, num_train_timesteps: int, w_embedding: Optional[torch.Tensor] = None) -> np.ndarray:
    """[num_train_timesteps, T] float32: the UNet's time embedding of every training timestep
    (with the guidance embedding folded in for guidance-embedded students)."""
    t = torch.arange(num_train_timesteps)
    t_emb = unet.time_proj(t).to(torch.float32)
    cond = None
    if w_embedding is not None:
        cond = w_embedding.reshape(1, -1).expand(num_train_timesteps, -1).to(torch.float32)
    emb = unet.time_embedding(t_emb, cond)
    return emb.to(torch.float32).cpu().numpy()


def tokenize(tokenizer, prompts: list[str]) -> np.ndarray:
    enc = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="np")
    return enc["input_ids"].astype(np.int32)
