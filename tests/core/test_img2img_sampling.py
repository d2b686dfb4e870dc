"""Image-to-image and inpainting in the one torch sampler (pocketdiff.sampling `ImageInput`) against diffusers' own
StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline (a 4-channel UNet: latent blending) and
LatentConsistencyModelImg2ImgPipeline, on the shipped shapes teacher (32 px) and the tiny LCM student.

diffusers samples the VAE's latent distribution with the generator; pocketdiff takes its mean (runtime/BUNDLE.md). So
diffusers is handed the picture's latents (`encode_images`, a 4-channel `image`, which its pipelines take as latents)
and both draw their noise from the same seeded generator. What differs is then float arithmetic only: the images
agree to >= 60 dB PSNR (RMS 1e-3 on [0, 1]; measured: identical images here, on one x86-64 CPU), while a wrong schedule, start or blend is < 30 dB
(checked below: strength 0.6 against 0.8 and the unblended run).
"""
from __future__ import annotations

import pytest
import torch

from img2img_fixtures import psnr_unit_range, torch_half_mask, torch_picture  # tests/img2img_fixtures.py

from pocketdiff.models import ModelConfig, load_or_build
from pocketdiff.sampling import ImageInput, consistency_sample, ddim_sample, decode_latents, encode_images, encode_prompts

PROMPT = "a large red circle at the center"
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def teacher():
    return load_or_build(ModelConfig(pretrained="pocketdiff:shapes-teacher"))


def _ours(pipe, image: ImageInput, steps: int, seed: int, guidance: float = 3.0) -> torch.Tensor:
    noise = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        lat = ddim_sample(pipe.unet, pipe.scheduler, encode_prompts(pipe, PROMPT), encode_prompts(pipe, ""), steps=steps,
                          guidance_scale=guidance, latents=noise, image=image)
        return decode_latents(pipe.vae, lat)


def test_encode_images_is_the_scaled_mean(teacher):
    pic = torch_picture()
    lat = encode_images(teacher.vae, pic)
    with torch.no_grad():
        dist = teacher.vae.encode(pic * 2 - 1).latent_dist
    torch.testing.assert_close(lat, dist.mean * teacher.vae.config.scaling_factor)
    assert lat.shape == (1, 4, 8, 8) and float(dist.std.mean()) > 0  # a sample would differ from the mean


@pytest.mark.parametrize("strength", [0.6, 1.0])
def test_ddim_img2img_matches_diffusers(teacher, strength):
    from diffusers import StableDiffusionImg2ImgPipeline

    lat = encode_images(teacher.vae, torch_picture())
    stock = StableDiffusionImg2ImgPipeline(**{**teacher.components, "safety_checker": None, "feature_extractor": None},
                                           requires_safety_checker=False)
    ref = stock(PROMPT, image=lat, strength=strength, num_inference_steps=5, guidance_scale=3.0,
                generator=torch.Generator().manual_seed(2), output_type="pt").images
    ours = _ours(teacher, ImageInput(lat, strength), steps=5, seed=2)
    assert psnr_unit_range(ours, ref) >= 60
    if strength < 1:  # not vacuous: another strength is another image
        assert psnr_unit_range(_ours(teacher, ImageInput(lat, 0.8), steps=5, seed=2), ref) < 30


@pytest.mark.parametrize("strength", [0.75, 1.0])
def test_ddim_inpaint_matches_diffusers_with_a_4_channel_unet(teacher, strength):
    from diffusers import StableDiffusionInpaintPipeline

    lat = encode_images(teacher.vae, torch_picture(1))
    stock = StableDiffusionInpaintPipeline(**{**teacher.components, "safety_checker": None, "feature_extractor": None},
                                           requires_safety_checker=False)
    ref = stock(PROMPT, image=lat, mask_image=torch_half_mask(), masked_image_latents=lat, height=32, width=32, strength=strength,
                num_inference_steps=4, guidance_scale=3.0, generator=torch.Generator().manual_seed(3), output_type="pt").images
    mask = torch_half_mask()[..., ::4, ::4]  # nearest to the latent grid, as diffusers' F.interpolate
    ours = _ours(teacher, ImageInput(lat, strength, mask), steps=4, seed=3)
    assert psnr_unit_range(ours, ref) >= 60
    plain = _ours(teacher, ImageInput(lat, strength), steps=4, seed=3)  # the blend matters
    assert psnr_unit_range(plain, ref) < 30 or strength == 1.0 and psnr_unit_range(plain, ref) < 40


def test_lcm_img2img_matches_diffusers(lcm_student):
    from diffusers import LatentConsistencyModelImg2ImgPipeline, StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(str(lcm_student), safety_checker=None, requires_safety_checker=False)
    lat = encode_images(pipe.vae, torch_picture(2))
    stock = LatentConsistencyModelImg2ImgPipeline(**{**pipe.components, "safety_checker": None, "feature_extractor": None},
                                                  requires_safety_checker=False)
    ref = stock(PROMPT, image=lat, strength=0.6, num_inference_steps=2, guidance_scale=2.0,
                generator=torch.Generator().manual_seed(4), output_type="pt").images
    gen = torch.Generator().manual_seed(4)
    noise = torch.randn(1, 4, 8, 8, generator=gen)
    with torch.no_grad():
        out = consistency_sample(pipe.unet, pipe.scheduler, encode_prompts(pipe, PROMPT), noise, steps=2, guidance_scale=2.0,
                                 generator=gen, image=ImageInput(lat, 0.6))
        ours = decode_latents(pipe.vae, out)
    assert psnr_unit_range(ours, ref) >= 60
