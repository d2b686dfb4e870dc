"""Calibration follows the model's sampler: under an LCMScheduler (a consistency student, tests/conftest.py
`lcm_student`) the recorded UNet inputs are `consistency_sample`'s (the LCM grid's timesteps, the re-noised latents
the student sees), not DDIM's; every other scheduler keeps DDIM."""
from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

PROMPTS = ["a red circle", "a blue square", "a green triangle", "a yellow star"]
STEPS = 4


@pytest.fixture(scope="module")
def student(lcm_student):
    from pocketdiff.conditioning import encode_conditioning
    from pocketdiff.models import ModelConfig, load_or_build

    pipe = load_or_build(ModelConfig(pretrained=str(lcm_student)))
    pipe.unet.eval().requires_grad_(False)
    with torch.no_grad():
        cond = encode_conditioning(pipe, PROMPTS[:2], torch.device("cpu")).to(dtype=torch.float32)
    side = pipe.unet.config.sample_size
    return pipe, cond, (pipe.unet.config.in_channels, side, side)


def _collect(pipe, scheduler, cond, shape, **kw):
    from pocketdiff.compress.quant.calib_data import collect_unet_inputs

    return collect_unet_inputs(pipe.unet, scheduler, cond, None, steps=STEPS, guidance_scale=2.0, latent_shape=shape,
                               seed=5, **kw)


def test_timesteps_are_the_lcm_grid_not_ddims(student):
    from diffusers import DDIMScheduler

    pipe, cond, shape = student
    calib = _collect(pipe, pipe.scheduler, cond, shape)
    ref = pipe.scheduler.__class__.from_config(pipe.scheduler.config)
    ref.set_timesteps(STEPS)  # diffusers' own LCMScheduler grid
    lcm = [int(t) for t in ref.timesteps]
    assert calib.meta["sampler"] == "consistency" and calib.meta["timesteps"] == lcm
    assert [int(t) for t in calib.timestep] == [lcm[i] for i in calib.meta["step_of"]]
    assert calib.meta["step_of"] == [i for i in range(STEPS) for _ in range(2)] and not calib.meta["cfg"]
    assert calib.timestep_cond.shape == (2 * STEPS, 16)  # w-conditioned: w through its embedding, one pass

    ddim = DDIMScheduler.from_config(pipe.scheduler.config)
    other = _collect(pipe, ddim, cond, shape)
    ddim.set_timesteps(STEPS)
    assert other.meta["sampler"] == "ddim" and other.meta["timesteps"] == [int(t) for t in ddim.timesteps]
    assert [int(t) for t in other.timestep] == [other.meta["timesteps"][i] for i in other.meta["step_of"]]
    assert set(other.meta["timesteps"]).isdisjoint(lcm)  # the test could fail: the two samplers' grids differ here
    assert torch.equal(calib.sample[:2], other.sample[:2])  # same start noise; the later latents are the sampler's own
    assert not torch.equal(calib.sample[2:], other.sample[2:])


def test_recorded_latents_are_what_the_unet_received(student):
    from pocketdiff.compress.quant.calib_data import collect_unet_inputs
    from pocketdiff.sampling import consistency_sample, randn_latents

    pipe, cond, shape = student
    seen = []

    def hook(module, args, kwargs):
        seen.append({"sample": args[0].clone(), "timestep": args[1].clone(),
                     "encoder_hidden_states": kwargs["encoder_hidden_states"].clone(),
                     "timestep_cond": kwargs["timestep_cond"].clone()})

    gens = [torch.Generator("cpu").manual_seed(5 + i) for i in range(2)]
    noise = randn_latents((2, *shape), gens, torch.device("cpu"))
    handle = pipe.unet.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            consistency_sample(pipe.unet, pipe.scheduler, cond, noise, STEPS, 2.0, gens)
    finally:
        handle.remove()
    calib = collect_unet_inputs(pipe.unet, pipe.scheduler, cond, None, steps=STEPS, guidance_scale=2.0,
                                latent_shape=shape, seed=5, per_trajectory=3)
    assert calib.meta["step_indices"] == [0, 2, 3] and len(seen) == STEPS
    for j, i in enumerate(calib.meta["step_indices"]):
        rows = slice(2 * j, 2 * j + 2)
        for key in ("sample", "timestep", "encoder_hidden_states", "timestep_cond"):
            assert torch.equal(getattr(calib, key)[rows], seen[i][key]), (i, key)


def test_folded_student_runs_one_unguided_pass():
    from diffusers import LCMScheduler, UNet2DConditionModel

    from pocketdiff.compress.quant.calib_data import collect_unet_inputs
    from pocketdiff.models import scheduler_config, unet_config

    torch.manual_seed(0)
    unet = UNet2DConditionModel(**unet_config("tiny", resolution=32)).eval().requires_grad_(False)
    sched = LCMScheduler(**scheduler_config(), original_inference_steps=10)
    calib = collect_unet_inputs(unet, sched, torch.randn(3, 77, 64), torch.randn(1, 77, 64), steps=2, guidance_scale=3.0,
                                latent_shape=(4, 8, 8), seed=0)
    assert len(calib) == 3 * 2 and not calib.meta["cfg"] and calib.timestep_cond is None
    assert calib.meta["sampler"] == "consistency" and calib.meta["guidance_scale"] == 1.0


def test_calibrate_on_a_consistency_student(lcm_student, tmp_path):
    from pocketdiff.compress.quant.calibrate import Config, run
    from pocketdiff.compress.quant.int8_format import load_quantized
    from pocketdiff.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text(f"""
device: cpu
model: {{pretrained: {lcm_student}}}
calib: {{prompts: {json.dumps(PROMPTS)}, num_prompts: 3, holdout_prompts: 1, steps: 2, guidance_scale: 2.0}}
recon: {{iters: 4, batch_size: 8}}
output: {{samples: 0}}
""")
    out = tmp_path / "out"
    out.mkdir()
    report = run(load_config(Config, path), out)
    cal = report["calibration"]
    assert cal["sampler"] == "consistency" and cal["timesteps"] == [999, 499]  # LCMScheduler, 10-point grid, 2 steps
    assert cal["samples"] == 3 * 2 and not cal["cond_and_uncond"]
    assert report["parity"]["passed"] and (out / "unet_int8.safetensors").is_file()
    _, recipe = load_quantized(out / "unet_int8.safetensors")
    assert recipe.extra["calibration"]["sampler"] == "consistency"  # the checkpoint's recipe names the sampler too
