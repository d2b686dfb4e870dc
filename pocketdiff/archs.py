"""Architecture configs of the Stable-Diffusion family, as diffusers config dicts (nothing is
downloaded): `ARCHS` (tiny, small, sd15, sd21; and the SDXL family's tiny_xl, small_xl, sdxl from
`pocketdiff.archs_xl`) and the UNet, VAE, text encoder and scheduler configs `pocketdiff.models.build_pipeline`
constructs from.
"""
from __future__ import annotations

from typing import Optional

from .archs_xl import SDXL_VAE_SCALING, XL_ARCHS, XL_DEFAULT_RESOLUTION, is_xl, xl_text_dims, xl_unet_config, xl_vae_arch
from .errors import PocketdiffError, require
from .names import MODEL_PREDICTION_TYPES

ARCHS = ("tiny", "small", "sd15", "sd21", *XL_ARCHS)

# Image size each architecture is built for when no resolution is given.
DEFAULT_RESOLUTION = {"tiny": 32, "small": 64, "sd15": 512, "sd21": 768, **XL_DEFAULT_RESOLUTION}


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise PocketdiffError(f"unknown model arch {arch!r}; choose one of {ARCHS}")


def default_resolution(arch: str, prediction_type: str = "epsilon") -> int:
    """Image size an arch is built for: SD-2.1 is 768 px (v-prediction) or 512 px (2.1-base, epsilon)."""
    _check_arch(arch)
    if arch == "sd21" and prediction_type != "v_prediction":
        return 512
    return DEFAULT_RESOLUTION[arch]


def vae_config(arch: str, resolution: Optional[int] = None) -> dict:
    """AutoencoderKL config dict. Factor 4 for tiny/small (and tiny_xl/small_xl), 8 for the SD archs."""
    _check_arch(arch)
    if is_xl(arch):  # the SD arch's VAE of the same size; sdxl's latents are scaled as SDXL's VAE scales them
        cfg = vae_config(xl_vae_arch(arch), resolution or DEFAULT_RESOLUTION[arch])
        return {**cfg, "scaling_factor": SDXL_VAE_SCALING} if arch == "sdxl" else cfg
    if arch == "tiny":
        cfg = dict(block_out_channels=(32, 64, 64), layers_per_block=1, norm_num_groups=8)
    elif arch == "small":
        cfg = dict(block_out_channels=(32, 64, 128), layers_per_block=1, norm_num_groups=16)
    else:  # sd15 / sd21 share the SD VAE
        cfg = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32)
    n = len(cfg["block_out_channels"])
    cfg.update(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        latent_channels=4,
        act_fn="silu",
        sample_size=int(resolution or DEFAULT_RESOLUTION[arch]),
        scaling_factor=0.18215,
    )
    return cfg


def unet_config(
    arch: str,
    prediction_type: str = "epsilon",
    resolution: Optional[int] = None,
    latent_channels: int = 4,
    vae_factor: Optional[int] = None,
) -> dict:
    """UNet2DConditionModel config dict; `sample_size` is the latent size for `resolution`.

    `prediction_type` only picks the default resolution (SD-2.1: 768 px v-prediction,
    512 px epsilon); it is the scheduler that carries the prediction type.
    """
    _check_arch(arch)
    require(prediction_type in MODEL_PREDICTION_TYPES, "model.prediction_type", f"must be one of {MODEL_PREDICTION_TYPES}, got {prediction_type!r}")
    resolution = int(resolution or default_resolution(arch, prediction_type))
    if vae_factor is None:
        vae_factor = 2 ** (len(vae_config(arch)["block_out_channels"]) - 1)
    if is_xl(arch):
        cfg = xl_unet_config(arch)
    elif arch == "tiny":
        cfg = dict(
            block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            layers_per_block=1,
            cross_attention_dim=64,
            attention_head_dim=8,
            norm_num_groups=8,
        )
    elif arch == "small":
        cfg = dict(
            block_out_channels=(64, 128, 128),
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
            layers_per_block=2,
            cross_attention_dim=128,
            attention_head_dim=4,
            norm_num_groups=16,
        )
    elif arch == "sd15":
        cfg = dict(
            block_out_channels=(320, 640, 1280, 1280),
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
            layers_per_block=2,
            cross_attention_dim=768,
            attention_head_dim=8,
            norm_num_groups=32,
        )
    else:  # sd21
        cfg = dict(
            block_out_channels=(320, 640, 1280, 1280),
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
            layers_per_block=2,
            cross_attention_dim=1024,
            attention_head_dim=(5, 10, 20, 20),
            use_linear_projection=True,
            upcast_attention=True,
            norm_num_groups=32,
        )
    n_down = len(cfg["block_out_channels"])
    multiple = vae_factor * 2 ** (n_down - 1)
    if resolution % multiple:
        raise PocketdiffError(
            f"resolution {resolution} does not fit arch {arch!r}: must be a multiple of {multiple} "
            f"(VAE factor {vae_factor} x UNet downsampling {2 ** (n_down - 1)})"
        )
    cfg.update(
        sample_size=resolution // vae_factor,
        in_channels=latent_channels,
        out_channels=latent_channels,
        act_fn="silu",
        center_input_sample=False,
        downsample_padding=1,
        flip_sin_to_cos=True,
        freq_shift=0,
        mid_block_scale_factor=1,
        norm_eps=1e-5,
    )
    return cfg


def text_encoder_config(
    arch: str,
    vocab_size: int = 49408,
    bos_token_id: Optional[int] = None,
    eos_token_id: Optional[int] = None,
    pad_token_id: Optional[int] = None,
    max_position_embeddings: int = 77,
    which: int = 1,
):
    """transformers.CLIPTextConfig. Token ids default to CLIP's layout (bos, eos = last two ids).

    sd15: CLIP ViT-L/14 text tower; sd21: OpenCLIP ViT-H/14 text tower (23 layers, gelu). An XL arch has two
    (`which` 1 or 2; the second's `projection_dim` is the pooled embedding's width).
    """
    from transformers import CLIPTextConfig

    _check_arch(arch)
    require(which == 1 or (which == 2 and is_xl(arch)), "model.arch", f"{arch!r} has no text encoder {which}")
    if is_xl(arch):
        dims = xl_text_dims(arch, which)
    elif arch == "tiny":
        dims = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, projection_dim=64, hidden_act="quick_gelu")
    elif arch == "small":
        dims = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, projection_dim=128, hidden_act="quick_gelu")
    elif arch == "sd15":
        dims = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, projection_dim=768, hidden_act="quick_gelu")
    else:
        dims = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=23, num_attention_heads=16, projection_dim=512, hidden_act="gelu")
    bos = vocab_size - 2 if bos_token_id is None else bos_token_id
    eos = vocab_size - 1 if eos_token_id is None else eos_token_id
    pad = eos if pad_token_id is None else pad_token_id
    return CLIPTextConfig(
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        layer_norm_eps=1e-5,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        **dims,
    )


def scheduler_config(prediction_type: str = "epsilon") -> dict:
    """DDIMScheduler config of the SD family (scaled-linear betas, leading spacing, offset 1)."""
    require(prediction_type in MODEL_PREDICTION_TYPES, "model.prediction_type", f"must be one of {MODEL_PREDICTION_TYPES}, got {prediction_type!r}")
    return dict(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        timestep_spacing="leading",
        prediction_type=prediction_type,
    )
