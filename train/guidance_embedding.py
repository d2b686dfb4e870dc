"""The guidance-scale (w) conditioning of guided-distillation students.

A w-conditioned student is a stock `diffusers.UNet2DConditionModel` with
``time_cond_proj_dim = D``: diffusers then builds ``time_embedding.cond_proj``
(Linear(D -> C, no bias)) and adds ``cond_proj(timestep_cond)`` to the sinusoidal timestep
projection before the time MLP, i.e. a w embedding added to the timestep embedding.

Why this route and not ``class_embed_type`` / ``class_labels``: a stock
`StableDiffusionPipeline` cannot pass ``class_labels``, but it does pass ``timestep_cond``
for a UNet with ``time_cond_proj_dim``: it computes
``get_guidance_scale_embedding(guidance_scale - 1, D)`` itself and runs a single UNet pass
per step (no classifier-free guidance batch). So a saved student needs no baked-in w and no
extra folder: ``pipe(prompt, num_inference_steps=N, guidance_scale=w)`` is all it takes.
pocketdiff's sampler follows the same convention (`pocketdiff.sampling.default_w_embedding_fn`).

The new projection starts at zero, so the student equals its teacher before training.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from pocketdiff.errors import PocketdiffError
from pocketdiff.sampling import guidance_scale_embedding

DEFAULT_EMBED_DIM = 256  # as in diffusers' LCM students

USAGE = (
    "w (the classifier-free guidance scale the student imitates) is passed as "
    "`timestep_cond = get_guidance_scale_embedding(w - 1, time_cond_proj_dim)` (sinusoidal features of 1000*(w-1)); "
    "a stock StableDiffusionPipeline does this itself: pipe(prompt, num_inference_steps=N, guidance_scale=w) "
    "runs one UNet pass per step (no unconditional batch)."
)


def is_w_conditioned(unet) -> bool:
    """True when `unet` takes a guidance embedding (``time_cond_proj_dim`` set)."""
    config = getattr(unet, "config", None)
    dim = config.get("time_cond_proj_dim") if isinstance(config, dict) else getattr(config, "time_cond_proj_dim", None)
    return dim is not None


def embed_dim(unet_or_dim: Union[int, object]) -> int:
    if isinstance(unet_or_dim, int):
        return unet_or_dim
    config = getattr(unet_or_dim, "config", None)
    dim = getattr(config, "time_cond_proj_dim", None) if config is not None else None
    if dim is None:
        raise PocketdiffError("this UNet is not guidance-conditioned (no time_cond_proj_dim)")
    return int(dim)


def w_condition(w, unet_or_dim: Union[int, object] = DEFAULT_EMBED_DIM, dtype: torch.dtype = torch.float32,
                device=None) -> torch.Tensor:
    """The ``timestep_cond`` for guidance scale(s) `w`: [B, D] sinusoidal features of 1000*(w-1).

    Identical to what `StableDiffusionPipeline` computes for ``guidance_scale=w``.
    `unet_or_dim` is the student UNet (its ``time_cond_proj_dim``) or the dimension itself.
    """
    w = torch.as_tensor(w, dtype=torch.float32).reshape(-1)
    if device is not None:
        w = w.to(device)
    return guidance_scale_embedding(w - 1.0, embed_dim(unet_or_dim)).to(dtype)


def w_embedding_fn(unet_or_dim: Union[int, object] = DEFAULT_EMBED_DIM) -> Callable[[torch.Tensor], torch.Tensor]:
    """A ``w_embedding_fn`` for `pocketdiff.sampling.ddim_sample` (w [B] -> [B, D])."""
    dim = embed_dim(unet_or_dim)
    return lambda w: w_condition(w, dim, device=torch.as_tensor(w).device)


def add_guidance_embedding(unet, dim: int = DEFAULT_EMBED_DIM):
    """A copy of `unet` with a zero-initialised w embedding (``time_cond_proj_dim = dim``).

    The returned student computes exactly what `unet` computes, whatever w is, until trained.
    A UNet that already has one is copied as is (its dimension must equal `dim`).
    """
    from diffusers import UNet2DConditionModel

    if is_w_conditioned(unet):
        if embed_dim(unet) != dim:
            raise PocketdiffError(f"the UNet already has a guidance embedding of dimension {embed_dim(unet)}, not {dim}")
        student = UNet2DConditionModel.from_config(unet.config)
        student.load_state_dict(unet.state_dict())
    else:
        # private keys (e.g. "_use_default_values") would reset time_cond_proj_dim to its default
        config = {k: v for k, v in unet.config.items() if not k.startswith("_")}
        config["time_cond_proj_dim"] = int(dim)
        student = UNet2DConditionModel.from_config(config)
        missing, unexpected = student.load_state_dict(unet.state_dict(), strict=False)
        if unexpected or set(missing) != {"time_embedding.cond_proj.weight"}:
            raise PocketdiffError(f"cannot add a guidance embedding: missing {missing}, unexpected {unexpected}")
        with torch.no_grad():
            student.time_embedding.cond_proj.weight.zero_()
    param = next(unet.parameters())
    student.to(device=param.device)
    return student if param.dtype == torch.float32 else student.to(dtype=param.dtype)


def default_embedding_for(unet) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """`w_embedding_fn(unet)` for a w-conditioned UNet, else None."""
    return w_embedding_fn(unet) if is_w_conditioned(unet) else None
