"""The conditioning seam in distillation: an SDXL-style UNet (pooled text embeddings, added time ids)
through the trainer's own teacher, student and target-network calls, and the SD path's guided step
bit-identical to the same step written with direct ``encoder_hidden_states=`` UNet calls."""
from __future__ import annotations

import copy

import pytest
import torch

from pocketdiff.conditioning import encode_conditioning, encode_prompts
from pocketdiff.sampling import consistency_sample

from tiny_sdxl import ddim_scheduler, noise as _noise, xl_cond as _xl_cond, xl_unet as _xl_unet  # tests/tiny_sdxl.py

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def sched():
    return ddim_scheduler()


@pytest.fixture(scope="module")
def sd_pipe():
    from pocketdiff.models import ModelConfig, build_pipeline, perturb_norm_affines

    pipe = build_pipeline(ModelConfig(), captions=["a red circle", "a blue star"])
    perturb_norm_affines(pipe.unet, 0)
    return pipe


UNET_BATCH_ROUNDING = 2e-6  # a tiny UNet's output across batch sizes (summation order), |out| ~ 1


def test_text_time_student_through_consistency_sample_and_distillation(sched):
    from pocketdiff.train.consistency_targets import TargetNetwork
    from pocketdiff.train.distill_targets import GuidedTeacher, student_forward
    from pocketdiff.train.guidance_embedding import w_condition

    student = _xl_unet(time_cond_proj_dim=8)
    cond, uncond = _xl_cond(2, 4), _xl_cond(1, 5)
    z, t, w = _noise(), torch.tensor([10, 600]), torch.tensor([2.0, 5.0])
    kw = lambda c: {"encoder_hidden_states": c.prompt_embeds,  # noqa: E731
                    "added_cond_kwargs": {"text_embeds": c.pooled_embeds, "time_ids": c.time_ids}}
    with torch.no_grad():
        ref = student(z, t, timestep_cond=w_condition(w, 8), **kw(cond)).sample
        assert torch.equal(student_forward(student, z, t, cond, w, embed_dim=8), ref)
        assert torch.equal(TargetNetwork(student, 0.0)(z, t, cond, w_condition(w, 8)), ref)
        plain = _xl_unet()
        fused = GuidedTeacher(plain, "epsilon", fused_cfg=True)(z, t, cond, uncond, w)
        split = GuidedTeacher(plain, "epsilon", fused_cfg=False)(z, t, cond, uncond, w)
        u, c = plain(z, t, **kw(uncond.expand(2))).sample, plain(z, t, **kw(cond)).sample
        # fused CFG runs one batch-4 call, split two batch-2 ones: a batch size changes the kernels' summation order,
        # so each UNet output differs by float32 rounding (measured <= 7.2e-7 at |out| ~ 1 under AVX-512, AVX2 and
        # default; 2e-6 leaves ~3x) and u + w (c - u) multiplies that by up to 1 + 2w (4.7e-6 seen at w = 5)
        atol = UNET_BATCH_ROUNDING * (1 + 2 * float(w.max()))
        torch.testing.assert_close(fused, u + w.view(-1, 1, 1, 1) * (c - u), rtol=1e-5, atol=atol)
        torch.testing.assert_close(split, fused, rtol=1e-5, atol=atol)
        lcm = consistency_sample(student, sched, cond, _noise(), steps=1, guidance_scale=3.0)
    assert lcm.shape == z.shape and torch.isfinite(lcm).all()


def test_sd_distill_step_is_bit_identical_to_encoder_hidden_states_calls(sd_pipe):
    """One guided-distillation loss and its gradients, against the step written with direct UNet calls."""
    from pocketdiff.config import load_config
    from pocketdiff.sampling import predict_x0_eps
    from pocketdiff.train.batch import BatchRandom
    from pocketdiff.train.distill_config import Config
    from pocketdiff.train.distill_loss import make_loss_fn
    from pocketdiff.train.distill_rounds import plan_rounds
    from pocketdiff.train.distill_targets import GuidedTeacher, noisy_latents, x_space_loss
    from pocketdiff.train.guidance_embedding import add_guidance_embedding, w_condition

    cfg = load_config(Config, None, ["guidance.embed_dim=8"])
    spec, sched, prompts = plan_rounds(cfg)[0], sd_pipe.scheduler, ["a red circle", "a blue star"]
    student = add_guidance_embedding(copy.deepcopy(sd_pipe.unet), 8)
    student.time_embedding.cond_proj.weight.data.normal_(generator=torch.Generator().manual_seed(3))
    twin = copy.deepcopy(student)
    g = torch.Generator().manual_seed(5)
    batch = {"text": prompts, "mean": torch.randn(2, 4, 8, 8, generator=g), "std": torch.rand(2, 4, 8, 8, generator=g) * 0.1}
    teacher = GuidedTeacher(copy.deepcopy(sd_pipe.unet), "epsilon")
    fn = make_loss_fn(cfg, spec, teacher, None, sd_pipe, sched, encode_conditioning(sd_pipe, [""]), 8, "cpu")
    loss = fn(student, batch, BatchRandom(torch.Generator().manual_seed(9), 2))
    loss.backward()

    rng = BatchRandom(torch.Generator().manual_seed(9), 2)  # the same draws, in the loss function's order
    x0 = (batch["mean"] + batch["std"] * rng.randn(4, 8, 8)) * sd_pipe.vae.config.scaling_factor
    eps, u = rng.randn(4, 8, 8), rng.rand()
    w = cfg.guidance.w_min + (cfg.guidance.w_max - cfg.guidance.w_min) * u
    t = rng.randint(0, sched.config.num_train_timesteps)
    a_t = sched.alphas_cumprod.to(torch.float32)[t]
    z = noisy_latents(x0, eps, a_t)
    cond, uncond = encode_prompts(sd_pipe, prompts), encode_prompts(sd_pipe, [""]).expand(2, -1, -1)
    with torch.no_grad():
        out_u, out_c = sd_pipe.unet(torch.cat([z, z]), torch.cat([t, t]), encoder_hidden_states=torch.cat([uncond, cond]),
                                    return_dict=False)[0].float().chunk(2)
    target, _ = predict_x0_eps(out_u + w.view(-1, 1, 1, 1) * (out_c - out_u), z, a_t, "epsilon")
    out = twin(z, t, encoder_hidden_states=cond, timestep_cond=w_condition(w, 8), return_dict=False)[0]
    ref = x_space_loss(out, z, a_t, target, "epsilon", cfg.loss_weighting)
    ref.backward()
    assert torch.equal(loss, ref)
    for (name, p), q in zip(student.named_parameters(), twin.parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), name
