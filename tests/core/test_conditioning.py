"""The conditioning seam (pocketdiff.conditioning): one `Conditioning` object through every UNet call.

- its batch operations and `unet_kwargs` on their own, one-line errors naming the field;
- an SDXL-style UNet (``addition_embed_type="text_time"``: pooled text embeddings and added time ids)
  sampled through the SD path's own `ddim_sample`, against hand-written diffusers calls, and traced
  on the meta device from `placeholder_conditioning` (the distillation and calibration helpers:
  tests/train/test_distill_conditioning.py, tests/compress/quant/test_calib_conditioning.py);
- the SDXL adapter's prompt encoding against diffusers' StableDiffusionXLPipeline.encode_prompt;
- the SD path's sampling bit-identical to direct ``encoder_hidden_states=`` calls.
"""
from __future__ import annotations


import pytest
import torch
from diffusers import UNet2DConditionModel

from pocketdiff.conditioning import (
    Conditioning,
    as_conditioning,
    encode_conditioning,
    encode_prompts,
    family_of,
    placeholder_conditioning,
)
from pocketdiff.errors import PocketdiffError
from pocketdiff.sampling import ddim_sample, ddim_step, step_alphas

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

from tiny_sdxl import CROSS, POOLED, ddim_scheduler, noise as _noise, xl_cond as _xl_cond, xl_unet as _xl_unet  # tests/tiny_sdxl.py

@pytest.fixture(scope="module")
def xl_unet():
    return _xl_unet()


@pytest.fixture(scope="module")
def sched():
    return ddim_scheduler()


# ------------------------------------------------------------------ the object


def test_unet_kwargs_are_what_a_diffusers_unet_takes():
    e, p, ids = torch.randn(2, 5, 16), torch.randn(2, 8), torch.zeros(2, 6)
    assert Conditioning(e).unet_kwargs().keys() == {"encoder_hidden_states"}
    kw = Conditioning(e, p, ids).unet_kwargs()
    assert kw["encoder_hidden_states"] is e
    assert kw["added_cond_kwargs"]["text_embeds"] is p and kw["added_cond_kwargs"]["time_ids"] is ids


def test_batch_operations_act_on_every_field():
    c, u = _xl_cond(2, 1), _xl_cond(1, 2)
    both = Conditioning.cat([u.expand(2), c])
    assert both.batch_size == len(both) == 4
    assert torch.equal(both.pooled_embeds[2:], c.pooled_embeds) and torch.equal(both.time_ids[:2], u.time_ids.expand(2, 6))
    lo, hi = both.chunk(2)
    assert torch.equal(hi.prompt_embeds, c.prompt_embeds) and torch.equal(lo.time_ids, u.time_ids.expand(2, 6))
    assert torch.equal(c.repeat(2).pooled_embeds, torch.cat([c.pooled_embeds] * 2))
    assert torch.equal(c[1].time_ids, c.time_ids[1:2]) and c[1].batch_size == 1 and torch.equal(c[-1].pooled_embeds, c.pooled_embeds[1:])
    half = c.to(dtype=torch.float16)
    assert {v.dtype for v in half.tensors().values()} == {torch.float16}
    assert c.expand(2) is c
    assert as_conditioning(c) is c and as_conditioning(None) is None
    assert torch.equal(as_conditioning(c.prompt_embeds).prompt_embeds, c.prompt_embeds)


@pytest.mark.parametrize("make, field", [
    (lambda: Conditioning(torch.zeros(2, 5, 16), torch.zeros(3, 8)), "conditioning.pooled_embeds"),
    (lambda: Conditioning(torch.zeros(2, 5, 16), time_ids=torch.zeros(2, 6, 1)), "conditioning.time_ids"),
    (lambda: Conditioning(torch.zeros(2, 16)), "conditioning.prompt_embeds"),
    (lambda: Conditioning(None), "conditioning.prompt_embeds"),
    (lambda: Conditioning(torch.zeros(1, 5, 16), [1.0]), "conditioning.pooled_embeds"),
    (lambda: Conditioning.cat([_xl_cond(1, 0), Conditioning(torch.zeros(1, 5, 16))]), "conditioning.pooled_embeds"),
    (lambda: _xl_cond(2, 0).expand(3, "uncond_emb"), "uncond_emb"),
    (lambda: _xl_cond(2, 0)[2], "conditioning row 2"),
    (lambda: family_of({"addition_embed_type": "image"}), "unet.addition_embed_type"),
])
def test_bad_conditioning_is_one_line_naming_the_field(make, field):
    with pytest.raises(PocketdiffError, match=field) as e:
        make()
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ SDXL-style UNet through the SD path's helpers


def _hand_cfg_ddim(unet, sched, cond: Conditioning, uncond: Conditioning, steps, scale, latents):
    """ddim_sample written out: diffusers-style kwargs by hand, one fused cat([uncond, cond]) batch."""
    ehs = torch.cat([uncond.prompt_embeds, cond.prompt_embeds])
    added = {"text_embeds": torch.cat([uncond.pooled_embeds, cond.pooled_embeds]),
             "time_ids": torch.cat([uncond.time_ids, cond.time_ids])}
    x = latents.clone()
    for t, a_t, a_prev in step_alphas(sched, steps):
        tb = torch.full((2 * x.shape[0],), t, dtype=torch.long)
        out = unet(torch.cat([x, x]), tb, encoder_hidden_states=ehs, added_cond_kwargs=added).sample
        u, c = out.chunk(2)
        x = ddim_step(x, u + scale * (c - u), a_t, a_prev, "epsilon")
    return x


def test_text_time_unet_samples_through_ddim_sample(xl_unet, sched):
    cond, uncond = _xl_cond(2, 1), _xl_cond(2, 2)
    with torch.no_grad():
        ours = ddim_sample(xl_unet, sched, cond, uncond, steps=3, guidance_scale=4.0, latents=_noise())
        ref = _hand_cfg_ddim(xl_unet, sched, cond, uncond, 3, 4.0, _noise())
        other = ddim_sample(xl_unet, sched, _xl_cond(2, 3), uncond, steps=3, guidance_scale=4.0, latents=_noise())
    assert torch.equal(ours, ref)
    assert not torch.allclose(ours, other)  # the pooled embeddings and time ids reach the UNet
    with pytest.raises(PocketdiffError, match="conditioning.pooled_embeds is required"):  # prompt embeddings alone
        ddim_sample(xl_unet, sched, cond.prompt_embeds, steps=1, latents=_noise())


def test_placeholders_trace_either_family_on_meta(xl_unet):
    from pocketdiff.models import ModelConfig, build_pipeline

    for unet in (xl_unet, build_pipeline(ModelConfig()).unet):
        meta = UNet2DConditionModel.from_config(unet.config).to("meta")
        cond = placeholder_conditioning(meta, batch=1, tokens=4, device="meta")
        out = meta(torch.zeros(1, 4, 8, 8, device="meta"), torch.tensor([1], device="meta"), **cond.unet_kwargs()).sample
        assert out.shape == (1, 4, 8, 8)
    assert family_of(xl_unet).name == "sdxl" and family_of(build_pipeline(ModelConfig()).unet.config).name == "sd"


def test_drawn_conditioning_draws_every_field_then_takes_the_pipelines_time_ids(xl_unet):
    from pocketdiff.conditioning import drawn_conditioning
    from pocketdiff.models import ModelConfig, build_pipeline

    g = torch.Generator().manual_seed(0)
    draw = lambda v: torch.randn(v.shape, generator=g)  # noqa: E731
    xl = drawn_conditioning(xl_unet, 3, draw, 48)
    assert xl.time_ids.tolist() == [[48.0, 48.0, 0.0, 0.0, 48.0, 48.0]] * 3  # StableDiffusionXLPipeline's at 48 px
    assert float(xl.prompt_embeds.std()) > 0.5 and float(xl.pooled_embeds.std()) > 0.5  # drawn, not zeros
    sd_unet = build_pipeline(ModelConfig()).unet
    g.manual_seed(1)
    sd = drawn_conditioning(sd_unet, 2, draw, 32)
    g.manual_seed(1)
    assert sd.time_ids is None and torch.equal(sd.prompt_embeds, placeholder_conditioning(sd_unet, 2).map(draw).prompt_embeds)


# ------------------------------------------------------------------ the SDXL adapter's prompt encoding


@pytest.fixture(scope="module")
def xl_pipe(xl_unet, sched):
    """A StableDiffusionXLPipeline of tiny parts: two text encoders (the second projects a pooled embedding)."""
    from diffusers import StableDiffusionXLPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from pocketdiff.models import ModelConfig, build_pipeline

    sd = build_pipeline(ModelConfig(), captions=["a red circle", "a blue star"])
    tok = sd.tokenizer
    common = dict(vocab_size=len(tok), intermediate_size=16, num_attention_heads=2, num_hidden_layers=2, max_position_embeddings=77,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(1)
    te1 = CLIPTextModel(CLIPTextConfig(hidden_size=8, **common)).eval()
    te2 = CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=CROSS - 8, projection_dim=POOLED, **common)).eval()
    return StableDiffusionXLPipeline(vae=sd.vae, text_encoder=te1, text_encoder_2=te2, tokenizer=tok, tokenizer_2=tok,
                                     unet=xl_unet, scheduler=sched)


def test_sdxl_adapter_encodes_as_stable_diffusion_xl_pipeline(xl_pipe, xl_unet):
    from pocketdiff.models import ModelConfig, build_pipeline

    pipe, sd = xl_pipe, build_pipeline(ModelConfig(), captions=["a red circle"])
    prompts = ["a red circle", "a blue star"]
    ours = encode_conditioning(pipe, prompts)
    with torch.no_grad():
        emb, _, pooled, _ = pipe.encode_prompt(prompts, device="cpu", do_classifier_free_guidance=False)
    size = xl_unet.config.sample_size * pipe.vae_scale_factor
    ids = pipe._get_add_time_ids((size, size), (0, 0), (size, size), emb.dtype, text_encoder_projection_dim=POOLED)
    assert torch.equal(ours.prompt_embeds, emb) and torch.equal(ours.pooled_embeds, pooled)
    assert torch.equal(ours.time_ids, ids.expand(2, 6))
    with pytest.raises(PocketdiffError, match="pipe.text_encoder_2"):
        encode_conditioning(sd, prompts, unet=xl_unet)


@pytest.mark.parametrize("zeros", [True, False])
def test_generate_samples_an_sdxl_style_pipeline_as_diffusers_does(xl_pipe, zeros):
    """The SD path's own `generate` on the SDXL-style pipeline (the adapter is the only family-specific
    piece) against StableDiffusionXLPipeline with the same scheduler and noise, with no negative prompt: the
    folder's force_zeros_for_empty_prompt decides whether the unconditional row is zeros (true, diffusers'
    negative_prompt=None path) or the encoding of "" (false)."""
    from pocketdiff.sampling import generate, randn_latents

    prompts = ["a red circle", "a blue star"]
    before = xl_pipe.config.force_zeros_for_empty_prompt
    xl_pipe.register_to_config(force_zeros_for_empty_prompt=zeros)
    try:
        ours = generate(xl_pipe, prompts, steps=3, guidance_scale=4.0, seed=0, output_type="latent")
        gens = [torch.Generator("cpu").manual_seed(i) for i in range(2)]
        with torch.no_grad():
            ref = xl_pipe(prompts, num_inference_steps=3, guidance_scale=4.0, output_type="latent",
                          latents=randn_latents((2, 4, 8, 8), gens)).images
            other = xl_pipe(prompts, negative_prompt=["", ""] if zeros else None, num_inference_steps=3, guidance_scale=4.0,
                            output_type="latent", latents=randn_latents((2, 4, 8, 8), gens))
    finally:
        xl_pipe.register_to_config(force_zeros_for_empty_prompt=before)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-4, atol=1e-5)
    assert (ours - other.images.float()).abs().max() > 1e-3  # the two rules give different images here


def test_sdxl_time_ids_follow_the_generation_resolution(xl_pipe):
    """Original size = target size = the resolution asked for, crop (0, 0), as StableDiffusionXLPipeline's
    defaults at height = width = that resolution; default: the UNet's native size."""
    from diffusers import StableDiffusionXLPipeline

    native = encode_conditioning(xl_pipe, ["a red circle"]).time_ids
    assert native.tolist() == [[32.0, 32.0, 0.0, 0.0, 32.0, 32.0]]  # 8 x 8 latents, the tiny VAE's factor 4
    at = encode_conditioning(xl_pipe, ["a red circle"], resolution=48).time_ids
    ref = StableDiffusionXLPipeline._get_add_time_ids(xl_pipe, (48, 48), (0, 0), (48, 48), torch.float32,
                                                      text_encoder_projection_dim=POOLED)
    assert torch.equal(at, ref)


# ------------------------------------------------------------------ the SD path: bit-identical to encoder_hidden_states=


@pytest.fixture(scope="module")
def sd_pipe():
    from pocketdiff.models import ModelConfig, build_pipeline, perturb_norm_affines

    pipe = build_pipeline(ModelConfig(), captions=["a red circle", "a blue star"])
    perturb_norm_affines(pipe.unet, 0)
    return pipe


def test_sd_conditioning_is_the_prompt_embeddings(sd_pipe):
    c = encode_conditioning(sd_pipe, ["a red circle", "a blue star"])
    assert c.tensors().keys() == {"prompt_embeds"} and family_of(sd_pipe.unet).name == "sd"
    assert torch.equal(c.prompt_embeds, encode_prompts(sd_pipe, ["a red circle", "a blue star"]))


def test_sd_sampling_is_bit_identical_to_encoder_hidden_states_calls(sd_pipe):
    unet, sched = sd_pipe.unet, sd_pipe.scheduler
    cond, uncond = encode_prompts(sd_pipe, ["a red circle", "a blue star"]), encode_prompts(sd_pipe, [""])
    with torch.no_grad():
        ours = ddim_sample(unet, sched, encode_conditioning(sd_pipe, ["a red circle", "a blue star"]),
                           encode_conditioning(sd_pipe, [""]), steps=3, guidance_scale=3.0, latents=_noise())
        from_tensors = ddim_sample(unet, sched, cond, uncond, steps=3, guidance_scale=3.0, latents=_noise())
        x, emb = _noise(), torch.cat([uncond.expand(2, -1, -1), cond])
        for t, a_t, a_prev in step_alphas(sched, 3):
            out = unet(torch.cat([x, x]), torch.full((4,), t), encoder_hidden_states=emb).sample
            u, c = out.chunk(2)
            x = ddim_step(x, u + 3.0 * (c - u), a_t, a_prev, "epsilon")
    assert torch.equal(ours, from_tensors) and torch.equal(ours, x)


def test_ids_path_is_the_prompt_path_and_carries_gradients(xl_pipe, sd_pipe):
    """conditioning_from_ids (train-teacher's, with autograd) gives encode_conditioning's tensors for both families,
    and a loss on it reaches both SDXL text encoders."""
    from pocketdiff.conditioning import conditioning_from_ids, text_encoders, tokenize_prompts

    prompts = ["a red circle", "a blue star"]
    for pipe, size in ((sd_pipe, 32), (xl_pipe, 32)):
        want = encode_conditioning(pipe, prompts)
        got = conditioning_from_ids(text_encoders(pipe), tokenize_prompts(pipe, prompts), pipe.unet.config, size)
        assert got.tensors().keys() == want.tensors().keys()
        for k, v in want.tensors().items():
            torch.testing.assert_close(got.tensors()[k], v, rtol=0, atol=0)  # the same modules on the same ids
    encoders = text_encoders(xl_pipe)
    for e in encoders:
        e.zero_grad()
    got = conditioning_from_ids(encoders, tokenize_prompts(xl_pipe, prompts), xl_pipe.unet.config, 32)
    (got.prompt_embeds.sum() + got.pooled_embeds.sum()).backward()
    assert all(any(p.grad is not None and p.grad.abs().sum() > 0 for p in e.parameters()) for e in encoders)
    for e in encoders:
        e.zero_grad(set_to_none=True)


def test_the_unconditional_rule_zeroes_only_empty_negative_prompts(xl_pipe):
    """Under force_zeros_for_empty_prompt an empty negative prompt's text fields are zeros (time ids kept); a
    non-empty one is encoded; without the flag "" is encoded."""
    from pocketdiff.conditioning import encode_unconditional

    before = xl_pipe.config.force_zeros_for_empty_prompt
    try:
        xl_pipe.register_to_config(force_zeros_for_empty_prompt=True)
        got = encode_unconditional(xl_pipe, ["", "blurry"])
        want = encode_conditioning(xl_pipe, ["", "blurry"])
        assert float(got.prompt_embeds[0].abs().max()) == 0 and float(got.pooled_embeds[0].abs().max()) == 0
        assert torch.equal(got.time_ids, want.time_ids)
        assert torch.equal(got.prompt_embeds[1], want.prompt_embeds[1]) and torch.equal(got.pooled_embeds[1], want.pooled_embeds[1])
        xl_pipe.register_to_config(force_zeros_for_empty_prompt=False)
        assert torch.equal(encode_unconditional(xl_pipe, [""]).prompt_embeds, encode_conditioning(xl_pipe, [""]).prompt_embeds)
    finally:
        xl_pipe.register_to_config(force_zeros_for_empty_prompt=before)
