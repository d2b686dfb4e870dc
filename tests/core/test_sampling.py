"""The shared DDIM sampler (pocketdiff.sampling) against diffusers' own DDIM + pipeline."""
from __future__ import annotations

import pytest
import torch
from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

from pocketdiff.errors import PocketdiffError
from pocketdiff.models import ModelConfig, build_pipeline, perturb_norm_affines, scheduler_config
from pocketdiff.sampling import (
    ddim_sample,
    ddim_step,
    ddim_timesteps,
    decode_latents,
    encode_prompts,
    generate,
    guidance_scale_embedding,
    model_target,
    predict_x0_eps,
)

PROMPTS = ["a red circle on a white background", "a blue star"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _tiny(prediction_type: str) -> StableDiffusionPipeline:
    pipe = build_pipeline(ModelConfig(prediction_type=prediction_type), captions=PROMPTS)
    perturb_norm_affines(pipe.unet, 0)  # trained-like norms so the UNet output is not degenerate
    return pipe


@pytest.fixture(scope="module")
def eps_pipe():
    return _tiny("epsilon")


@pytest.fixture(scope="module")
def v_pipe():
    return _tiny("v_prediction")


def _noise(n: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 4, 8, 8, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- timesteps


@pytest.mark.parametrize("spacing", ["leading", "trailing", "linspace"])
@pytest.mark.parametrize("steps", [1, 2, 3, 7, 10, 25, 50, 333])
def test_ddim_timesteps_match_diffusers(steps, spacing):
    sched = DDIMScheduler(**{**scheduler_config(), "timestep_spacing": spacing})
    sched.set_timesteps(steps)
    ours = ddim_timesteps(1000, steps, steps_offset=1, spacing=spacing)
    assert ours.dtype == torch.long
    assert torch.equal(ours, sched.timesteps)
    assert (ours[:-1] > ours[1:]).all()


def test_ddim_timesteps_sd_offset_is_explicit():
    assert ddim_timesteps(1000, 4, steps_offset=1).tolist() == [751, 501, 251, 1]  # SD's scheduler
    assert ddim_timesteps(1000, 4, steps_offset=0).tolist() == [750, 500, 250, 0]  # diffusers' config default
    with pytest.raises(TypeError):
        ddim_timesteps(1000, 4)  # no default offset: the two defaults disagree
    with pytest.raises(PocketdiffError):
        ddim_timesteps(1000, 0, steps_offset=1)


# ---------------------------------------------------------------------------- parameterisations


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_conversion_identities(prediction_type):
    g = torch.Generator().manual_seed(1)
    x0, eps = torch.randn(3, 4, 5, 5, generator=g), torch.randn(3, 4, 5, 5, generator=g)
    alpha = torch.tensor([0.999, 0.5, 0.02])  # per-sample alpha_bar
    a = alpha.view(-1, 1, 1, 1)
    x_t = a.sqrt() * x0 + (1 - a).sqrt() * eps
    out = model_target(x0, eps, alpha, prediction_type)
    if prediction_type == "v_prediction":
        torch.testing.assert_close(out, a.sqrt() * eps - (1 - a).sqrt() * x0)
    rx0, reps = predict_x0_eps(out, x_t, alpha, prediction_type)
    torch.testing.assert_close(rx0, x0, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(reps, eps, atol=1e-4, rtol=1e-4)
    # scalar alpha too
    rx0, reps = predict_x0_eps(model_target(x0[1:2], eps[1:2], 0.5, prediction_type), x_t[1:2], 0.5, prediction_type)
    torch.testing.assert_close(rx0, x0[1:2], atol=1e-5, rtol=1e-5)
    # a DDIM step to alpha_prev lands on the same (x0, eps) at the new noise level
    prev = ddim_step(x_t, out, alpha, 0.9, prediction_type)
    torch.testing.assert_close(prev, 0.9 ** 0.5 * x0 + 0.1 ** 0.5 * eps, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("clip", [False, True])
def test_ddim_step_matches_scheduler_step(prediction_type, clip):
    sched = DDIMScheduler(**{**scheduler_config(prediction_type), "clip_sample": clip, "clip_sample_range": 0.5})
    sched.set_timesteps(7)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 8, 8, generator=g) * 3
    for t in sched.timesteps.tolist():
        out = torch.randn(2, 4, 8, 8, generator=g)
        ref = sched.step(out, t, x, eta=0.0).prev_sample
        prev_t = t - 1000 // 7
        a_prev = sched.alphas_cumprod[prev_t] if prev_t >= 0 else sched.final_alpha_cumprod
        ours = ddim_step(x, out, sched.alphas_cumprod[t], a_prev, prediction_type, 0.5 if clip else None)
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)
        x = ref


# ---------------------------------------------------------------------------- sampler vs diffusers pipeline


@pytest.mark.parametrize("which", ["eps_pipe", "v_pipe"])
@pytest.mark.parametrize("steps,guidance", [(7, 4.0), (4, 1.0)])
def test_ddim_sample_matches_stock_pipeline(request, which, steps, guidance):
    pipe = request.getfixturevalue(which)
    noise = _noise()
    ref_latents = pipe(PROMPTS, num_inference_steps=steps, guidance_scale=guidance, latents=noise.clone(),
                       output_type="latent").images
    ref_images = pipe(PROMPTS, num_inference_steps=steps, guidance_scale=guidance, latents=noise.clone(),
                      output_type="pt").images
    cond = encode_prompts(pipe, PROMPTS)
    uncond = encode_prompts(pipe, ["", ""])
    with torch.no_grad():
        latents = ddim_sample(pipe.unet, pipe.scheduler, cond, uncond, steps=steps, guidance_scale=guidance,
                              latents=noise.clone())
        images = decode_latents(pipe.vae, latents)
    scale = ref_latents.abs().max().item()
    assert (ref_latents - noise).abs().max() > 0.1 * scale  # the sampler actually moved
    torch.testing.assert_close(latents, ref_latents, atol=1e-5 * max(scale, 1.0), rtol=1e-5)
    torch.testing.assert_close(images, ref_images, atol=1e-5, rtol=0)
    # the guidance actually matters (the comparison is not vacuous)
    if guidance != 1.0:
        with torch.no_grad():
            unguided = ddim_sample(pipe.unet, pipe.scheduler, cond, uncond, steps=steps, guidance_scale=1.0,
                                   latents=noise.clone())
        assert (unguided - latents).abs().max() > 1e-3 * scale


def test_guidance_conditioned_unet_matches_stock_pipeline(eps_pipe):
    """A guided-distillation student (time_cond_proj_dim) samples identically here and in diffusers."""
    student = UNet2DConditionModel.from_config(eps_pipe.unet.config, time_cond_proj_dim=32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.02 * torch.randn_like(p))
    stock = StableDiffusionPipeline(**{**eps_pipe.components, "unet": student})
    stock.set_progress_bar_config(disable=True)
    noise = _noise()
    ref = stock(PROMPTS, num_inference_steps=5, guidance_scale=5.0, latents=noise.clone(), output_type="latent").images
    calls = []
    with torch.no_grad():
        ours = ddim_sample(student, eps_pipe.scheduler, encode_prompts(eps_pipe, PROMPTS),
                           encode_prompts(eps_pipe, ["", ""]), steps=5, guidance_scale=5.0, latents=noise.clone(),
                           callback=lambda i, t, x, tb, emb: calls.append(x.shape[0]))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    assert calls == [2] * 5  # one pass per step, no CFG batch
    emb = guidance_scale_embedding(torch.tensor([4.0]), 32)
    assert torch.allclose(emb, stock.get_guidance_scale_embedding(torch.tensor([4.0]), 32))


def test_callback_sees_unet_inputs(eps_pipe):
    seen = []

    def record(i, t, x_in, t_batch, emb):
        seen.append((i, t, x_in.clone(), t_batch.clone(), emb.prompt_embeds.shape))

    cond, uncond = encode_prompts(eps_pipe, PROMPTS), encode_prompts(eps_pipe, ["", ""])
    with torch.no_grad():
        ddim_sample(eps_pipe.unet, eps_pipe.scheduler, cond, uncond, steps=4, guidance_scale=3.0, latents=_noise(),
                    callback=record)
    assert [s[1] for s in seen] == ddim_timesteps(1000, 4, steps_offset=1).tolist()
    assert [s[0] for s in seen] == [0, 1, 2, 3]
    for _, t, x_in, t_batch, emb_shape in seen:
        assert x_in.shape == (4, 4, 8, 8) and emb_shape == (4, 77, 64)
        assert torch.equal(x_in[:2], x_in[2:])  # uncond half, cond half
        assert (t_batch == t).all() and t_batch.shape == (4,)
    assert torch.equal(seen[0][2][:2], _noise())


def test_ddim_sample_generator_and_plain_tensor_unet(eps_pipe):
    cond = encode_prompts(eps_pipe, PROMPTS)

    class TupleUnet(torch.nn.Module):  # e.g. a quantized or exported wrapper returning a tuple
        def __init__(self, unet):
            super().__init__()
            self.unet = unet

        def forward(self, x, t, encoder_hidden_states):
            return (self.unet(x, t, encoder_hidden_states=encoder_hidden_states).sample,)

    with torch.no_grad():
        a = ddim_sample(eps_pipe.unet, eps_pipe.scheduler, cond, steps=3, latent_shape=(2, 4, 8, 8),
                        generator=torch.Generator().manual_seed(0))
        b = ddim_sample(TupleUnet(eps_pipe.unet), eps_pipe.scheduler, cond, steps=3, latents=_noise())
    torch.testing.assert_close(a, b)
    with pytest.raises(PocketdiffError, match="latents"):
        ddim_sample(eps_pipe.unet, eps_pipe.scheduler, cond, steps=3)


# ---------------------------------------------------------------------------- generate


def test_generate_seeds_do_not_depend_on_batch_size(eps_pipe):
    prompts = PROMPTS + ["a green square"]
    a = generate(eps_pipe, prompts, steps=3, guidance_scale=3.0, seed=10, batch_size=3)
    b = generate(eps_pipe, prompts, steps=3, guidance_scale=3.0, seed=10, batch_size=2)
    assert a.shape == (3, 3, 32, 32) and a.dtype == torch.float32
    assert 0.0 <= a.min() and a.max() <= 1.0
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # image i is seeded with seed + i
    c = generate(eps_pipe, prompts[2:], steps=3, guidance_scale=3.0, seed=12)
    torch.testing.assert_close(a[2:], c, atol=1e-5, rtol=0)
    assert (a[0] - a[1]).abs().max() > 1e-3


def test_generate_matches_stock_pipeline_and_pil(eps_pipe):
    imgs = generate(eps_pipe, PROMPTS, steps=5, guidance_scale=2.5, seed=3)
    gens = [torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)]
    ref = eps_pipe(PROMPTS, num_inference_steps=5, guidance_scale=2.5, generator=gens, output_type="pt").images
    torch.testing.assert_close(imgs, ref, atol=1e-5, rtol=0)
    pil = generate(eps_pipe, PROMPTS[:1], steps=2, output_type="pil", resolution=64)
    assert len(pil) == 1 and pil[0].size == (64, 64) and pil[0].mode == "RGB"
    latents = generate(eps_pipe, PROMPTS, steps=5, guidance_scale=2.5, seed=3, output_type="latent")
    assert latents.shape[:2] == (2, eps_pipe.unet.config.in_channels)
    torch.testing.assert_close(decode_latents(eps_pipe.vae, latents), imgs, atol=1e-5, rtol=0)  # the same samples, undecoded
    # a replacement UNet (student / pruned / quantized) is used instead of pipe.unet
    other = UNet2DConditionModel.from_config(eps_pipe.unet.config)
    alt = generate(eps_pipe, PROMPTS, steps=5, guidance_scale=2.5, seed=3, unet=other)
    assert (alt - imgs).abs().max() > 1e-3


def test_encode_prompts_shape(eps_pipe):
    emb = encode_prompts(eps_pipe, PROMPTS + ["x"])
    assert emb.shape == (3, 77, 64)
    torch.testing.assert_close(emb[:2], encode_prompts(eps_pipe, PROMPTS))
    ref, _ = eps_pipe.encode_prompt(PROMPTS, "cpu", 1, False)
    torch.testing.assert_close(emb[:2], ref)


def test_a_prompt_over_77_tokens_warns_once_naming_its_token_count(eps_pipe, capsys):
    long_prompt = " ".join(["a red circle on a white background"] * 20)
    n = len(eps_pipe.tokenizer(long_prompt, truncation=False).input_ids)
    assert n > 77
    capsys.readouterr()
    encode_prompts(eps_pipe, PROMPTS)
    assert "warning" not in capsys.readouterr().err
    emb = encode_prompts(eps_pipe, [long_prompt, PROMPTS[0]])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning")]
    assert emb.shape == (2, 77, 64)
    assert len(lines) == 1 and f"{n} tokens" in lines[0] and "77" in lines[0]
    encode_prompts(eps_pipe, [long_prompt])
    assert "warning" not in capsys.readouterr().err
