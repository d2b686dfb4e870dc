"""Architecture configs of the SDXL family (`StableDiffusionXLPipeline`: two CLIP text encoders, the second
with a projection for the pooled text embedding, and a UNet with SDXL's added "text_time" embedding), as
diffusers / transformers config dicts; nothing is downloaded. `pocketdiff.archs` dispatches here for the
archs in `XL_ARCHS`:

- `tiny_xl`: a few-hundred-kB SDXL-shaped pipeline for tests (32 px, VAE factor 4, 8x8 latents);
- `small_xl`: a few-MB SDXL-shaped teacher for 64 px domains (OpenMoji);
- `sdxl`: SDXL base's shapes (CLIP ViT-L + OpenCLIP bigG text towers, the 2.6 B-parameter UNet, 1024 px),
  random weights, for export and benchmarks.

The UNet's added embedding takes the second encoder's pooled embedding (its `projection_dim`) and 6 time ids
(original size, crop top-left, target size) of `addition_time_embed_dim` each:
`projection_class_embeddings_input_dim = projection_dim + 6 * addition_time_embed_dim`, and its
`cross_attention_dim` is the two encoders' widths side by side.
"""
from __future__ import annotations

from typing import Optional

XL_ARCHS = ("tiny_xl", "small_xl", "sdxl")
XL_DEFAULT_RESOLUTION = {"tiny_xl": 32, "small_xl": 64, "sdxl": 1024}
TIME_IDS = 6  # original H, W, crop top, left, target H, W (StableDiffusionXLPipeline._get_add_time_ids)

# per arch: the two text towers (hidden, intermediate, layers, heads, activation; the second's projection), the
# UNet's levels and widths, and the added time embedding's width
_TEXT = {
    "tiny_xl": ((32, 64, 2, 2, "quick_gelu"), (32, 64, 2, 2, "gelu", 32)),
    "small_xl": ((64, 256, 3, 4, "quick_gelu"), (64, 256, 3, 4, "gelu", 64)),
    "sdxl": ((768, 3072, 12, 12, "quick_gelu"), (1280, 5120, 32, 20, "gelu", 1280)),
}
_UNET = {
    "tiny_xl": dict(block_out_channels=(32, 64), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), layers_per_block=1, transformer_layers_per_block=(1, 1),
                    attention_head_dim=(2, 4), norm_num_groups=8, addition_time_embed_dim=8),
    "small_xl": dict(block_out_channels=(64, 128, 128), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                     up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), layers_per_block=2,
                     transformer_layers_per_block=(1, 1, 2), attention_head_dim=(2, 4, 4), norm_num_groups=16,
                     addition_time_embed_dim=32),
    "sdxl": dict(block_out_channels=(320, 640, 1280), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), layers_per_block=2,
                 transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), norm_num_groups=32,
                 addition_time_embed_dim=256),
}
_VAE = {"tiny_xl": "tiny", "small_xl": "small", "sdxl": "sd15"}  # the SD arch whose VAE shape each uses (sdxl: SDXL's latent scale)
SDXL_VAE_SCALING = 0.13025  # SDXL's VAE latent scale (SD 1.x / 2.x: 0.18215)


def is_xl(arch: str) -> bool:
    return arch in XL_ARCHS


def xl_vae_arch(arch: str) -> str:
    """The SD arch whose VAE shape an XL arch uses (`archs.vae_config` gives `sdxl` SDXL's latent scale)."""
    return _VAE[arch]


def xl_unet_config(arch: str) -> dict:
    """The UNet config of an XL arch, before sizes (sample_size, channels) are set by `archs.unet_config`."""
    cfg = dict(_UNET[arch])
    (h1, *_), (h2, *_, proj) = _TEXT[arch]
    cfg.update(cross_attention_dim=h1 + h2, use_linear_projection=True, addition_embed_type="text_time",
               projection_class_embeddings_input_dim=proj + TIME_IDS * cfg["addition_time_embed_dim"])
    return cfg


def xl_text_dims(arch: str, which: int) -> dict:
    """CLIPTextConfig sizes of text encoder `which` (1 or 2) of an XL arch."""
    hidden, inter, layers, heads, act, *proj = _TEXT[arch][which - 1]
    return dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                hidden_act=act, projection_dim=proj[0] if proj else hidden)


def time_ids_width(unet_config, pooled_dim: int) -> Optional[float]:
    """How many time ids a text_time UNet's added embedding takes beside a `pooled_dim`-wide pooled embedding (6
    for SDXL base; 5 for the refiner, whose ids carry an aesthetic score instead of the target size). None when
    the config has no added time embedding."""
    get = unet_config.get if isinstance(unet_config, dict) else (lambda k, d=None: getattr(unet_config, k, d))
    width, total = get("addition_time_embed_dim"), get("projection_class_embeddings_input_dim")
    if not width or not total:
        return None
    return (int(total) - int(pooled_dim)) / int(width)
