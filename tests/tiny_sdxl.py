"""A tiny SDXL-style UNet (``addition_embed_type="text_time"``) and conditionings for it, shared by the
conditioning-seam tests (tests/core, tests/train, tests/compress/quant). Importable as `tiny_sdxl`:
tests/conftest.py puts this folder on sys.path."""
from __future__ import annotations

import torch
from diffusers import DDIMScheduler, UNet2DConditionModel

from pocketdiff.conditioning import Conditioning
from pocketdiff.models import scheduler_config

POOLED, TIME_DIM, CROSS = 8, 4, 16  # pooled text embedding width, time-id embedding width, cross-attention width


def xl_unet(**extra) -> UNet2DConditionModel:
    """Random weights (seed 0), 8x8 latents, 4 channels; `extra` adds config (e.g. time_cond_proj_dim)."""
    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=CROSS, attention_head_dim=2, norm_num_groups=4, addition_embed_type="text_time",
        addition_time_embed_dim=TIME_DIM, projection_class_embeddings_input_dim=POOLED + 6 * TIME_DIM, **extra).eval()


def xl_cond(batch: int, seed: int) -> Conditioning:
    """Random prompt embeddings [batch, 5, CROSS], pooled [batch, POOLED], time ids near (64, 64, 0, 0, 64, 64)."""
    g = torch.Generator().manual_seed(seed)
    time_ids = torch.tensor([64.0, 64.0, 0.0, 0.0, 64.0, 64.0]).expand(batch, 6) + torch.randint(0, 8, (batch, 6), generator=g)
    return Conditioning(torch.randn(batch, 5, CROSS, generator=g), torch.randn(batch, POOLED, generator=g), time_ids)


def noise(n: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 4, 8, 8, generator=torch.Generator().manual_seed(seed))


def ddim_scheduler() -> DDIMScheduler:
    return DDIMScheduler(**scheduler_config())
