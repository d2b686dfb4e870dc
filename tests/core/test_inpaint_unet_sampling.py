"""A 9-channel inpainting UNet (StableDiffusionInpaintPipeline folders) in the one torch sampler: pocketdiff.sampling
`inpaint_input` (the picture's latents, the mask on the latent grid, the masked picture's latents) and `ddim_sample`
feeding the UNet cat([x, mask, masked latents]) without blending, against diffusers' StableDiffusionInpaintPipeline on
a tiny inpainting folder saved here (tests/img2img_fixtures.py).

diffusers samples the VAE's latent distribution; pocketdiff takes its mean, so diffusers is handed our latents (a
4-channel `image` and `masked_image_latents`) and both draw the noise from one seeded generator: what differs is float
arithmetic only, >= 60 dB PSNR on [0, 1] (identical images on one x86-64 CPU); the masked latents' role is checked by
zeroing them (< 30 dB) and the blend's absence by a 4-channel-style blended run (< 40 dB)."""
from __future__ import annotations

import pytest
import torch

from img2img_fixtures import psnr_unit_range, save_inpaint_folder, torch_half_mask, torch_picture  # tests/img2img_fixtures.py

from pocketdiff.errors import PocketdiffError
from pocketdiff.models import ModelConfig, load_or_build
from pocketdiff.sampling import ImageInput, ddim_sample, decode_latents, encode_prompts, generate, inpaint_input, masked_pictures

PROMPT = "a large red circle at the center"
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def inpainter(tmp_path_factory):
    """The saved folder, loaded as every stage loads a model (StableDiffusionPipeline.from_pretrained: a 9-channel UNet)."""
    folder = save_inpaint_folder(tmp_path_factory.mktemp("inpaint9") / "model")
    return load_or_build(ModelConfig(pretrained=str(folder)))


def _ours(pipe, image: ImageInput, seed: int) -> torch.Tensor:
    noise = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        lat = ddim_sample(pipe.unet, pipe.scheduler, encode_prompts(pipe, PROMPT), encode_prompts(pipe, ""), steps=4,
                          guidance_scale=3.0, latents=noise, image=image)
        return decode_latents(pipe.vae, lat)


def test_the_folder_loads_with_its_9_channel_unet(inpainter):
    assert inpainter.unet.config.in_channels == 9 and inpainter.unet.config.out_channels == 4


@pytest.mark.parametrize("strength", [0.75, 1.0])
def test_ddim_inpaint_matches_diffusers_with_a_9_channel_unet(inpainter, strength):
    from diffusers import StableDiffusionInpaintPipeline

    image = inpaint_input(inpainter.vae, inpainter.unet, torch_picture(1), torch_half_mask(), strength)
    assert image.masked_latents is not None and image.mask.shape == (1, 1, 8, 8)
    stock = StableDiffusionInpaintPipeline(**{**inpainter.components, "safety_checker": None, "feature_extractor": None},
                                           requires_safety_checker=False)
    ref = stock(PROMPT, image=image.latents, mask_image=torch_half_mask(), masked_image_latents=image.masked_latents, height=32,
                width=32, strength=strength, num_inference_steps=4, guidance_scale=3.0,
                generator=torch.Generator().manual_seed(3), output_type="pt").images
    ours = _ours(inpainter, image, seed=3)
    assert psnr_unit_range(ours, ref) >= 60
    zeroed = ImageInput(image.latents, strength, image.mask, torch.zeros_like(image.masked_latents))
    assert psnr_unit_range(_ours(inpainter, zeroed, seed=3), ref) < 30  # the masked latents are read
    if strength < 1:  # no blend: the 4-channel path's blend on top of the 9-channel inputs is another image
        blended = _Blending(image.latents, strength, image.mask, image.masked_latents)
        assert psnr_unit_range(_ours(inpainter, blended, seed=3), ref) < 40


class _Blending(ImageInput):
    """The 9-channel UNet's inputs with the 4-channel path's per-step blend on top (what must not happen)."""

    def blend(self, x, noise, alpha_next):
        return ImageInput(self.latents, self.strength, self.mask).blend(x, noise, alpha_next)


def test_masked_pictures_are_grey_where_repainted():
    pic = torch_picture(2)
    out = masked_pictures(pic, torch_half_mask())
    assert torch.equal(out[..., :16], pic[..., :16]) and bool((out[..., 16:] == 0.5).all())


def test_a_unet_of_another_width_is_refused(inpainter):
    class Odd:
        class config:
            in_channels = 7

    with pytest.raises(PocketdiffError, match="takes 7 channels"):
        inpaint_input(inpainter.vae, Odd, torch_picture(), torch_half_mask())


def test_text_to_image_sampling_refuses_an_inpainting_unet_in_one_line(inpainter):
    """generate (every verb's sampler: evaluate, distill, export's fp16 scan) draws from text alone: a 9-channel UNet
    would otherwise stop in a torch shape error deep in the loop."""
    with pytest.raises(PocketdiffError, match=r"^the UNet inpaints \(9 input channels") as e:
        generate(inpainter, ["a red circle"], steps=2)
    assert "\n" not in str(e.value)
