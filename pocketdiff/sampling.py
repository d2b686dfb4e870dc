"""The one DDIM sampler every stage uses (teacher sampling, distillation targets, calibration
data collection, evaluation).

It reproduces diffusers' `DDIMScheduler` (eta = 0) step for step, reading everything from
the scheduler it is given: `alphas_cumprod`, `final_alpha_cumprod` (`set_alpha_to_one`),
`timestep_spacing`, `steps_offset`, `clip_sample`, `prediction_type`. With SD's scheduler
(`leading` spacing, offset 1) `ddim_sample` + `decode_latents` give what a stock
`StableDiffusionPipeline` with a DDIM scheduler gives for the same latents (tested).

Guidance: classifier-free guidance runs as one fused batch ``cat([uncond, cond])``. A
guidance-conditioned student (UNet with ``time_cond_proj_dim``, from guided distillation)
is called once per step with ``timestep_cond = embedding(guidance_scale - 1)``, the same
convention as a stock `StableDiffusionPipeline`, so a distilled student folder samples
the same here and in diffusers.

A consistency-distilled student (its folder holds diffusers' LCMScheduler) samples through
`consistency_sample` instead, as LCMScheduler does; `generate` picks it from the scheduler.

Image-to-image and inpainting (`ImageInput`: the picture's latents from `encode_images`, a strength, a mask) run in
the same two samplers, as diffusers' img2img / inpaint pipelines do: the last int(steps x strength) of the schedule
(LCM: the grid's first int(K x strength) points; pocketdiff/scheduler_blocks.py), the start noised from the picture's
latents at the first kept timestep, and under a mask (1 = repaint) the kept part replaced after every step by the
picture's latents noised to the next timestep (none after the last). The picture's latents are the VAE's mean, not a
sample (runtime/BUNDLE.md), as the bundle's encoder gives them.

Conventions: latents are kept in float32 between steps; the UNet sees them in its own
dtype. ``alpha_bar`` means the cumulative product of alphas (diffusers' alphas_cumprod).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import dataclasses

import numpy as np
import torch
from torch import nn

from . import scheduler_blocks
from .conditioning import Conditioning, as_conditioning, check_conditioning, encode_conditioning, encode_unconditional
from .conditioning import encode_prompts  # noqa: F401  (its home was here; callers import it from sampling)
from .consistency_sampling import boundary_scalings, is_consistency_scheduler, scheduler_lcm_timesteps
from .errors import PocketdiffError
from .names import PREDICTION_TYPES



# --------------------------------------------------------------------------------------
# Parameterisations
# --------------------------------------------------------------------------------------

def _bcast(alpha_bar: Union[float, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """alpha_bar as a tensor broadcastable against `like` ([B] -> [B, 1, 1, 1])."""
    a = torch.as_tensor(alpha_bar, device=like.device)
    if not a.is_floating_point():
        a = a.to(torch.float32)
    a = a.to(like.dtype if like.is_floating_point() else torch.float32)
    if a.dim() == 1 and like.dim() > 1:
        a = a.view(-1, *([1] * (like.dim() - 1)))
    return a


def predict_x0_eps(
    model_out: torch.Tensor, x_t: torch.Tensor, alpha_bar_t: Union[float, torch.Tensor], prediction_type: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x0, eps) from a model output under `prediction_type` (epsilon | v_prediction | sample).

    x_t = sqrt(a) x0 + sqrt(1-a) eps;  v = sqrt(a) eps - sqrt(1-a) x0.
    `alpha_bar_t` is a scalar or a per-sample [B] tensor.
    """
    a = _bcast(alpha_bar_t, x_t)
    sa, s1 = a ** 0.5, (1 - a) ** 0.5
    if prediction_type == "epsilon":
        return (x_t - s1 * model_out) / sa, model_out
    if prediction_type == "v_prediction":
        return sa * x_t - s1 * model_out, sa * model_out + s1 * x_t
    if prediction_type == "sample":
        return model_out, (x_t - sa * model_out) / s1
    raise PocketdiffError(f"prediction_type must be one of {PREDICTION_TYPES}, got {prediction_type!r}")


def model_target(
    x0: torch.Tensor, eps: torch.Tensor, alpha_bar_t: Union[float, torch.Tensor], prediction_type: str
) -> torch.Tensor:
    """What a model of `prediction_type` should output at x_t = sqrt(a) x0 + sqrt(1-a) eps."""
    a = _bcast(alpha_bar_t, x0)
    if prediction_type == "epsilon":
        return eps
    if prediction_type == "v_prediction":
        return a ** 0.5 * eps - (1 - a) ** 0.5 * x0
    if prediction_type == "sample":
        return x0
    raise PocketdiffError(f"prediction_type must be one of {PREDICTION_TYPES}, got {prediction_type!r}")


def ddim_step(
    x_t: torch.Tensor,
    model_out: torch.Tensor,
    alpha_bar_t: Union[float, torch.Tensor],
    alpha_bar_prev: Union[float, torch.Tensor],
    prediction_type: str,
    clip_x0: Optional[float] = None,
) -> torch.Tensor:
    """One deterministic DDIM update (eta = 0): x_prev = sqrt(a_prev) x0 + sqrt(1 - a_prev) eps.

    With `clip_x0`, x0 is clamped to [-clip_x0, clip_x0] and eps is kept as predicted
    (diffusers' ``clip_sample`` with ``use_clipped_model_output=False``).
    """
    x0, eps = predict_x0_eps(model_out, x_t, alpha_bar_t, prediction_type)
    if clip_x0 is not None:
        x0 = x0.clamp(-clip_x0, clip_x0)
    ap = _bcast(alpha_bar_prev, x_t)
    return ap ** 0.5 * x0 + (1 - ap) ** 0.5 * eps


# --------------------------------------------------------------------------------------
# Timesteps and scheduler constants
# --------------------------------------------------------------------------------------

def ddim_timesteps(num_train_timesteps: int, steps: int, *, steps_offset: int, spacing: str = "leading") -> torch.LongTensor:
    """Descending DDIM timesteps, identical to `DDIMScheduler.set_timesteps` (pocketdiff/scheduler_blocks.py's rule,
    the one the bundle's manifest and runners use). `steps_offset` has no default: SD's scheduler says 1, diffusers'
    DDIMScheduler config 0; `scheduler_timesteps` reads the scheduler's own."""
    return torch.tensor(scheduler_blocks.ddim_timesteps(num_train_timesteps, steps, spacing=spacing, steps_offset=steps_offset),
                        dtype=torch.long)


def _cfg_get(config: Any, key: str, default: Any = None) -> Any:
    if config is None:
        return default
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def scheduler_timesteps(scheduler, steps: int) -> torch.LongTensor:
    """`ddim_timesteps` with the scheduler's own spacing and offset (diffusers' defaults where its config has none:
    what the scheduler object itself runs with)."""
    c = scheduler.config
    fields = scheduler_blocks.ddim_fields(c)
    return ddim_timesteps(c.num_train_timesteps, steps, steps_offset=fields["steps_offset"], spacing=fields["timestep_spacing"])


def final_alpha_cumprod(scheduler) -> torch.Tensor:
    """alpha_bar used after the last step: 1 with set_alpha_to_one, else alphas_cumprod[0]."""
    final = getattr(scheduler, "final_alpha_cumprod", None)
    if final is not None:
        return torch.as_tensor(final)
    if _cfg_get(scheduler.config, "set_alpha_to_one", False):
        return torch.tensor(1.0)
    return scheduler.alphas_cumprod[0]


def step_alphas(scheduler, steps: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """[(t, alpha_bar_t, alpha_bar_prev)] for a `steps`-step DDIM run, exactly as DDIMScheduler.step
    picks them (prev = t - T // steps, `final_alpha_cumprod` when negative)."""
    T = scheduler.config.num_train_timesteps
    alphas = scheduler.alphas_cumprod
    final = final_alpha_cumprod(scheduler)
    out = []
    for t in scheduler_timesteps(scheduler, steps).tolist():
        prev = t - T // steps
        out.append((t, alphas[t], alphas[prev] if prev >= 0 else final))
    return out


# --------------------------------------------------------------------------------------
# Guidance embedding (guided distillation students)
# --------------------------------------------------------------------------------------

def guidance_scale_embedding(w: torch.Tensor, embedding_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sinusoidal embedding of w * 1000, [len(w), embedding_dim] (diffusers' get_guidance_scale_embedding)."""
    w = torch.as_tensor(w).reshape(-1).to(dtype) * 1000.0
    half = embedding_dim // 2
    freqs = torch.exp(torch.arange(half, dtype=dtype, device=w.device) * -(np.log(10000.0) / (half - 1)))
    emb = w[:, None] * freqs[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1)
    if embedding_dim % 2 == 1:
        emb = torch.nn.functional.pad(emb, (0, 1))
    return emb


def default_w_embedding_fn(unet) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """For a UNet with ``time_cond_proj_dim``: w -> embedding(w - 1), as StableDiffusionPipeline does."""
    dim = _cfg_get(getattr(unet, "config", None), "time_cond_proj_dim", None)
    if dim is None:
        return None
    return lambda w: guidance_scale_embedding(torch.as_tensor(w) - 1.0, int(dim))


# --------------------------------------------------------------------------------------
# Image-to-image and inpainting
# --------------------------------------------------------------------------------------

@torch.no_grad()
def encode_images(vae, images: torch.Tensor) -> torch.Tensor:
    """Pictures [N, 3, H, W] in [0, 1] -> the sampler's latents: the VAE's mean (its mode), shifted and scaled."""
    x = (images * 2 - 1).to(device=_module_device(vae, images.device), dtype=_module_dtype(vae, images.dtype))
    mean = vae.encode(x).latent_dist.mode().to(torch.float32)
    shift = getattr(vae.config, "shift_factor", None)
    return (mean - shift if shift is not None else mean) * vae.config.scaling_factor


@dataclasses.dataclass
class ImageInput:
    """A run from a picture: its latents [B or 1, C, h, w] (`encode_images`), `strength` in (0, 1], and for
    inpainting `mask` [B or 1, 1, h, w] (1 = repaint, 0 = keep the picture)."""

    latents: torch.Tensor
    strength: float = 0.8
    mask: Optional[torch.Tensor] = None
    # an inpainting UNet's (9 input channels): the masked picture's latents [B or 1, C, h, w] (`inpaint_input`); the
    # UNet then takes cat([x, mask, masked_latents]) every step, as StableDiffusionInpaintPipeline feeds it, and no blend
    masked_latents: Optional[torch.Tensor] = None

    def unet_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the UNet takes for the latents `x` [N, C, h, w]: `x` itself, or an inpainting UNet's 9 channels."""
        if self.masked_latents is None:
            return x
        n = x.shape[0]
        m = self.mask.to(device=x.device, dtype=x.dtype)
        lat = self.masked_latents.to(device=x.device, dtype=x.dtype)
        return torch.cat([x, m.expand(n, *m.shape[1:]), lat.expand(n, *lat.shape[1:])], dim=1)

    def start(self, noise: torch.Tensor, alpha_bar: torch.Tensor) -> torch.Tensor:
        """The first latents: the picture noised to the first kept timestep (inpainting at strength 1: the noise)."""
        if self.mask is not None and float(self.strength) == 1.0:
            return noise
        a = alpha_bar.to(device=noise.device, dtype=torch.float32)
        return a ** 0.5 * self.latents.to(noise.device) + (1 - a) ** 0.5 * noise

    def blend(self, x: torch.Tensor, noise: torch.Tensor, alpha_next: Optional[torch.Tensor]) -> torch.Tensor:
        """After a step: outside the mask, the picture noised to the next timestep (None: after the last, as it is); an
        inpainting UNet's run is not blended."""
        if self.mask is None or self.masked_latents is not None:
            return x
        picture = self.latents.to(x.device)
        if alpha_next is not None:
            a = alpha_next.to(device=x.device, dtype=torch.float32)
            picture = a ** 0.5 * picture + (1 - a) ** 0.5 * noise
        m = self.mask.to(device=x.device, dtype=x.dtype)
        return m * x + (1 - m) * picture


def masked_pictures(images: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Pictures [N, 3, H, W] in [0, 1] with the repainted part (binary `mask` [N or 1, 1, H, W], 1 = repaint) grey:
    0.5, diffusers' 0 in [-1, 1] (StableDiffusionInpaintPipeline's masked image)."""
    m = (mask >= 0.5).to(images.dtype)
    return images * (1 - m) + 0.5 * m


def inpaint_input(vae, unet, images: torch.Tensor, mask: torch.Tensor, strength: float = 1.0) -> ImageInput:
    """Inpainting from pictures [N, 3, H, W] in [0, 1] and a pixel mask [N or 1, 1, H, W] (>= 0.5 = repaint): the
    pictures' latents, the mask on the latent grid (nearest, as diffusers' F.interpolate), and for an inpainting UNet
    (in_channels = 2 x latent channels + 1) the masked pictures' latents."""
    lat = encode_images(vae, images)
    m = torch.nn.functional.interpolate((mask >= 0.5).to(torch.float32), size=lat.shape[-2:])
    channels = int(lat.shape[1])
    if int(unet.config.in_channels) == channels:
        return ImageInput(lat, strength, m)
    if int(unet.config.in_channels) != 2 * channels + 1:
        raise PocketdiffError(f"the UNet takes {unet.config.in_channels} channels: neither the latents' {channels} nor an "
                              f"inpainting UNet's {2 * channels + 1}")
    return ImageInput(lat, strength, m, encode_images(vae, masked_pictures(images, mask)))


# --------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------

def _module_dtype(module: Any, fallback: torch.dtype) -> torch.dtype:
    d = getattr(module, "dtype", None)
    if isinstance(d, torch.dtype) and d.is_floating_point:
        return d
    if isinstance(module, nn.Module):
        for p in module.parameters():
            if p.is_floating_point():
                return p.dtype
    return fallback


def _module_device(module: Any, fallback: torch.device) -> torch.device:
    d = getattr(module, "device", None)
    if isinstance(d, torch.device):
        return d
    if isinstance(module, nn.Module):
        for p in module.parameters():
            return p.device
    return fallback


def _unet_output(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "sample"):
        return out.sample
    if isinstance(out, (tuple, list)):
        return out[0]
    raise PocketdiffError(f"UNet returned {type(out).__name__}, expected a tensor, a tuple or an output with .sample")


def randn_latents(
    shape: Sequence[int],
    generator: Union[torch.Generator, Sequence[torch.Generator], None] = None,
    device: Optional[torch.device] = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Gaussian latents drawn on the generator's device and moved to `device`.

    A list of generators draws sample i from generator i (results independent of batching).
    """
    shape = tuple(int(s) for s in shape)
    if isinstance(generator, (list, tuple)):
        if len(generator) != shape[0]:
            raise PocketdiffError(f"{len(generator)} generators for a batch of {shape[0]}")
        parts = [torch.randn((1,) + shape[1:], generator=g, device=g.device, dtype=dtype) for g in generator]
        x = torch.cat(parts)
    else:
        gdev = generator.device if generator is not None else torch.device("cpu")
        x = torch.randn(shape, generator=generator, device=gdev, dtype=dtype)
    return x.to(device) if device is not None else x


def ddim_sample(
    unet,
    scheduler,
    cond_emb: Union[Conditioning, torch.Tensor],
    uncond_emb: Union[Conditioning, torch.Tensor, None] = None,
    steps: int = 25,
    guidance_scale: float = 1.0,
    latents: Optional[torch.Tensor] = None,
    generator: Union[torch.Generator, Sequence[torch.Generator], None] = None,
    latent_shape: Optional[Sequence[int]] = None,
    w_embedding_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    extra_unet_kwargs: Optional[dict] = None,
    callback: Optional[Callable[..., Any]] = None,
    progress: bool = False,
    *,
    prediction_type: Optional[str] = None,
    image: Optional[ImageInput] = None,
) -> torch.Tensor:
    """Run `steps` deterministic DDIM steps from noise and return the final latents (float32).

    - `cond_emb`: a `Conditioning` of batch B (or 1, broadcast to the latent batch), or a tensor of
      prompt embeddings [B, L, D] (`as_conditioning`); `uncond_emb` likewise.
    - Classifier-free guidance (one fused batch, uncond first) when `guidance_scale != 1` and
      `uncond_emb` is given, unless the UNet is guidance-conditioned.
    - Guidance-conditioned UNet: `w_embedding_fn(w)` ([B] guidance scales -> [B, time_cond_proj_dim])
      is passed as ``timestep_cond``; when None and the UNet config has ``time_cond_proj_dim``,
      `default_w_embedding_fn` (diffusers' convention) is used.
    - `latents` (noise) or `latent_shape` + `generator` (one generator or one per sample).
    - `callback(i, t, latent_model_input, t_batch, emb)` runs right before each UNet call with
      exactly the UNet's inputs, `emb` being the `Conditioning` (calibration records them); its return value is ignored.
    - `prediction_type` overrides ``scheduler.config.prediction_type``.
    - `image` (img2img / inpainting): the last int(steps x strength) steps from the picture's latents noised with
      `latents` (the module docstring); the stride stays T // steps, as diffusers' img2img pipeline keeps it.
    """
    config = scheduler.config
    if _cfg_get(config, "thresholding", False):
        raise PocketdiffError("scheduler uses dynamic thresholding, which pocketdiff's DDIM sampler does not implement")
    ptype = prediction_type or _cfg_get(config, "prediction_type", "epsilon")
    if ptype not in PREDICTION_TYPES:
        raise PocketdiffError(f"prediction_type must be one of {PREDICTION_TYPES}, got {ptype!r}")
    clip_x0 = float(_cfg_get(config, "clip_sample_range", 1.0)) if _cfg_get(config, "clip_sample", False) else None

    cond_emb, uncond_emb = check_conditioning(unet, as_conditioning(cond_emb)), as_conditioning(uncond_emb)
    device = cond_emb.device
    unet_dtype = _module_dtype(unet, cond_emb.dtype)
    if latents is None:
        if latent_shape is None:
            raise PocketdiffError("ddim_sample needs `latents` or `latent_shape`")
        latents = randn_latents(latent_shape, generator, device)
    latents = latents.to(device=device, dtype=torch.float32) * float(getattr(scheduler, "init_noise_sigma", 1.0))
    B = latents.shape[0]

    cond = cond_emb.expand(B, "cond_emb")
    if w_embedding_fn is None:
        w_embedding_fn = default_w_embedding_fn(unet)
    use_cfg = w_embedding_fn is None and uncond_emb is not None and float(guidance_scale) != 1.0
    if use_cfg:
        emb = Conditioning.cat([uncond_emb.to(device).expand(B, "uncond_emb"), cond])
    else:
        emb = cond
    emb = emb.to(dtype=unet_dtype)

    unet_kwargs = dict(extra_unet_kwargs or {})
    if w_embedding_fn is not None:
        w = torch.full((B,), float(guidance_scale), device=device, dtype=torch.float32)
        unet_kwargs["timestep_cond"] = w_embedding_fn(w).to(device=device, dtype=unet_dtype)

    schedule = step_alphas(scheduler, steps)
    noise = latents
    if image is not None:
        keep = len(scheduler_blocks.strength_timesteps([t for t, _, _ in schedule], image.strength))
        schedule = schedule[len(schedule) - keep:]
        latents = image.start(noise, schedule[0][1])
    iterator = enumerate(schedule)
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(iterator, total=len(schedule), desc="ddim", leave=False)
    for i, (t, a_t, a_prev) in iterator:
        x_in = torch.cat([latents, latents]) if use_cfg else latents
        x_in = (image.unet_input(x_in) if image is not None else x_in).to(unet_dtype)
        t_batch = torch.full((x_in.shape[0],), t, device=device, dtype=torch.long)
        if callback is not None:
            callback(i, t, x_in, t_batch, emb)
        out = _unet_output(unet(x_in, t_batch, **emb.unet_kwargs(), **unet_kwargs)).to(torch.float32)
        if use_cfg:
            out_uncond, out_cond = out.chunk(2)
            out = out_uncond + guidance_scale * (out_cond - out_uncond)
        latents = ddim_step(latents, out, a_t.to(device), a_prev.to(device), ptype, clip_x0)
        if image is not None:
            latents = image.blend(latents, noise, schedule[i + 1][1] if i + 1 < len(schedule) else None)
    return latents


def consistency_sample(
    unet,
    scheduler,
    cond: Union[Conditioning, torch.Tensor],
    latents: torch.Tensor,
    steps: int,
    guidance_scale: float = 1.0,
    generator: Union[torch.Generator, Sequence[torch.Generator], None] = None,
    w_embedding_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    prediction_type: Optional[str] = None,
    image: Optional[ImageInput] = None,
    callback: Optional[Callable[..., Any]] = None,
) -> torch.Tensor:
    """`steps` consistency steps from the noise `latents` (float32 result, the final estimate); with `image`
    (img2img / inpainting) from the picture's latents noised with `latents`, on the grid's first int(K x strength) points.

    w goes in as ``timestep_cond`` (the pipeline's convention) when the UNet takes it; a student
    without a w embedding folded its guidance in and gets one conditional pass. The noise of
    step i > 0 comes from `generator` (one per sample: image i's noise does not depend on the batch).
    `cond`: a `Conditioning` of batch B or 1, or a tensor of prompt embeddings (`as_conditioning`).
    `callback(i, t, latent_model_input, t_batch, emb)`: as `ddim_sample`'s, right before each UNet call with exactly
    the UNet's inputs (the re-noised latents of step i; calibration records them); its return value is ignored.
    """
    config = scheduler.config
    if _cfg_get(config, "thresholding", False):
        raise PocketdiffError("scheduler uses dynamic thresholding, which pocketdiff's consistency sampler does not implement")
    ptype = prediction_type or _cfg_get(config, "prediction_type", "epsilon")
    clip = float(_cfg_get(config, "clip_sample_range", 1.0)) if _cfg_get(config, "clip_sample", False) else None
    scaling = float(_cfg_get(config, "timestep_scaling", 10.0))
    alphas = scheduler.alphas_cumprod.to(torch.float32)
    cond = check_conditioning(unet, as_conditioning(cond))
    device, B = cond.device, latents.shape[0]
    dtype = _module_dtype(unet, cond.dtype)
    kwargs = {}
    w_embedding_fn = w_embedding_fn or default_w_embedding_fn(unet)
    if w_embedding_fn is not None:
        w = torch.full((B,), float(guidance_scale), device=device, dtype=torch.float32)
        kwargs["timestep_cond"] = w_embedding_fn(w).to(device=device, dtype=dtype)
    emb = cond.expand(B, "cond").to(dtype=dtype)
    z = latents.to(device=device, dtype=torch.float32)
    ts = scheduler_lcm_timesteps(scheduler, steps, 1.0 if image is None else image.strength)
    noise0 = z
    if image is not None:
        z = image.start(noise0, alphas[ts[0]])
    for i, t in enumerate(ts):
        a_t = alphas[t].to(device)
        t_batch = torch.full((B,), t, device=device, dtype=torch.long)
        z_in = (image.unet_input(z) if image is not None else z).to(dtype)
        if callback is not None:
            callback(i, t, z_in, t_batch, emb)
        out = _unet_output(unet(z_in, t_batch, **emb.unet_kwargs(), **kwargs)).to(torch.float32)
        x0, _ = predict_x0_eps(out, z, a_t, ptype)
        if clip is not None:
            x0 = x0.clamp(-clip, clip)
        c_skip, c_out = boundary_scalings(t, scaling)
        denoised = c_out.to(device) * x0 + c_skip.to(device) * z
        if i == len(ts) - 1:
            return denoised if image is None else image.blend(denoised, noise0, None)
        a_next = alphas[ts[i + 1]].to(device)
        noise = randn_latents(z.shape, generator, device)
        z = a_next.sqrt() * denoised + (1 - a_next).sqrt() * noise
        if image is not None:
            z = image.blend(z, noise0, a_next)
    return z


# --------------------------------------------------------------------------------------
# Pipelines: prompts in, images out
# --------------------------------------------------------------------------------------

@torch.no_grad()
def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """VAE-decode latents (divided by ``scaling_factor``, plus ``shift_factor`` if any) to float32 images in [0, 1]."""
    z = latents / vae.config.scaling_factor
    shift = getattr(vae.config, "shift_factor", None)
    if shift is not None:
        z = z + shift
    z = z.to(device=_module_device(vae, latents.device), dtype=_module_dtype(vae, latents.dtype))
    images = vae.decode(z, return_dict=False)[0]
    return (images.to(torch.float32) / 2 + 0.5).clamp(0, 1)


def to_pil(images: torch.Tensor) -> list:
    """[N, 3, H, W] floats in [0, 1] -> PIL images (rounded as diffusers does)."""
    from PIL import Image

    arr = (images.detach().to("cpu", torch.float32).permute(0, 2, 3, 1).numpy() * 255).round().astype("uint8")
    return [Image.fromarray(a) for a in arr]


@torch.no_grad()
def generate(
    pipe,
    prompts: Union[str, Sequence[str]],
    steps: int = 25,
    guidance_scale: float = 3.0,
    seed: int = 0,
    resolution: Optional[int] = None,
    negative_prompt: str = "",
    output_type: str = "pt",
    batch_size: int = 16,
    progress: bool = False,
    unet=None,
):
    """Text to images with `ddim_sample` (`consistency_sample` under an LCMScheduler) + `decode_latents`.

    Image i starts from noise drawn by ``torch.Generator("cpu").manual_seed(seed + i)``, so
    results do not depend on `batch_size`. `unet` replaces ``pipe.unet`` (a student, a
    pruned or quantized model); `resolution` defaults to the UNet's sample size times the VAE
    factor. Returns float [N, 3, H, W] in [0, 1] on the CPU (`output_type="pt"`), a list of
    PIL images (`"pil"`), or the sampler's latents [N, C, h, w] before decoding (`"latent"`, float32,
    on the CPU: what a decoder takes).
    """
    from .models import check_resolution, vae_scale_factor

    if output_type not in ("pt", "pil", "latent"):
        raise PocketdiffError(f"output_type must be 'pt', 'pil' or 'latent', got {output_type!r}")
    if batch_size < 1:
        raise PocketdiffError(f"batch_size must be >= 1, got {batch_size}")
    if isinstance(prompts, str):
        prompts = [prompts]
    prompts = list(prompts)
    unet = pipe.unet if unet is None else unet
    ucfg = getattr(unet, "config", None) or pipe.unet.config
    factor = vae_scale_factor(pipe.vae)
    resolution = int(resolution or _cfg_get(ucfg, "sample_size") * factor)
    check_resolution(pipe, resolution, "resolution", unet)
    channels = _cfg_get(ucfg, "in_channels", pipe.unet.config.in_channels)
    if channels == 2 * _cfg_get(ucfg, "out_channels", channels) + 1:  # a StableDiffusionInpaintPipeline folder's UNet
        raise PocketdiffError(f"the UNet inpaints ({channels} input channels: latents, mask, masked-picture latents): it "
                              "cannot draw from text alone; sample it from a picture and a mask (inpaint_input, ddim_sample)")
    side = resolution // factor
    device = _module_device(unet, _module_device(pipe.unet, torch.device("cpu")))

    results = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        gens = [torch.Generator("cpu").manual_seed(int(seed) + start + j) for j in range(len(chunk))]
        noise = randn_latents((len(chunk), channels, side, side), gens, device)
        cond = encode_conditioning(pipe, chunk, device, unet=ucfg, resolution=resolution)
        uncond = (encode_unconditional(pipe, [negative_prompt] * len(chunk), device, unet=ucfg, resolution=resolution)
                  if float(guidance_scale) != 1.0 else None)
        if is_consistency_scheduler(pipe.scheduler):  # a consistency (LCM) student: LCMScheduler's steps
            latents = consistency_sample(unet, pipe.scheduler, cond, noise, steps, guidance_scale, gens)
        else:
            latents = ddim_sample(unet, pipe.scheduler, cond, uncond, steps=steps, guidance_scale=guidance_scale, latents=noise,
                                  progress=progress)
        results.append(latents.float().cpu() if output_type == "latent" else decode_latents(pipe.vae, latents).cpu())
    if output_type == "latent":
        return torch.cat(results) if results else torch.empty(0, channels, side, side)
    images = torch.cat(results) if results else torch.empty(0, 3, resolution, resolution)
    return to_pil(images) if output_type == "pil" else images
