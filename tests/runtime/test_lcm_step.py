"""The bundle's numpy consistency step (runtime/lcm_step.py, run by runtime/schedulers.py) against pocketdiff's torch sampler
(pocketdiff.sampling.consistency_sample) on a stand-in UNet, fed the same noise; its grid against
diffusers' LCMScheduler's; the lcm block's checks (pocketdiff/scheduler_blocks.py). No model files: milliseconds."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pocketdiff.runtime.lcm_step import boundary_scalings
from pocketdiff.scheduler_blocks import lcm_field_problems as check_lcm_block
from pocketdiff.scheduler_blocks import lcm_timesteps
from pocketdiff.runtime.schedulers import sample_loop, scheduler_for


class _LinearUnet(torch.nn.Module):
    """out = a * z + b * t / 1000: any prediction type, a known function of the input and timestep."""

    def __init__(self, a: float, b: float):
        super().__init__()
        self.a, self.b = a, b
        self.dummy = torch.nn.Parameter(torch.zeros(()))  # float32 parameters: the sampler's dtype

    def forward(self, z, t, encoder_hidden_states=None, **kw):
        return (self.a * z + self.b * t.to(torch.float32).reshape(-1, 1, 1, 1) / 1000.0,)


def _scheduler(prediction_type: str, clip: bool = False):
    from diffusers import LCMScheduler

    return LCMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, prediction_type=prediction_type,
                        original_inference_steps=10, timestep_scaling=10.0, clip_sample=clip, clip_sample_range=1.5)


def _block(sched, steps: int) -> dict:
    c = sched.config
    return {"type": "lcm", "prediction_type": c.prediction_type, "num_train_timesteps": c.num_train_timesteps, "steps": steps,
            "timesteps": lcm_timesteps(c.num_train_timesteps, c.original_inference_steps, steps),
            "alphas_cumprod": sched.alphas_cumprod.to(torch.float64).numpy(), "original_inference_steps": c.original_inference_steps,
            "timestep_scaling": c.timestep_scaling, "sigma_data": 0.5, "clip_sample_range": c.clip_sample_range if c.clip_sample else None}


def test_lcm_timesteps_equal_diffusers_lcm_scheduler():
    """The rule against diffusers' LCMScheduler (the torch sampler takes the same function from
    pocketdiff/scheduler_blocks.py, so comparing with it could not fail)."""
    from diffusers import LCMScheduler

    for T, K in ((1000, 50), (1000, 10), (1000, 7), (100, 100), (999, 4)):
        for n in range(1, K + 1):
            ref = LCMScheduler(num_train_timesteps=T, original_inference_steps=K)
            ref.set_timesteps(n)
            assert lcm_timesteps(T, K, n) == ref.timesteps.tolist(), (T, K, n)
    assert lcm_timesteps(1000, 10, 2) == [999, 499]


def test_boundary_scalings_equal_the_torch_ones():
    from pocketdiff.consistency_sampling import boundary_scalings as torch_side

    for t in (0, 1, 19, 499, 999):
        c_skip, c_out = torch_side(t, 10.0)
        assert np.allclose(boundary_scalings(t, 10.0, 0.5), (float(c_skip), float(c_out)), rtol=1e-6, atol=0)
    assert boundary_scalings(0, 10.0, 0.5) == (1.0, 0.0)  # the boundary condition f(z, 0) = z


@pytest.mark.parametrize("prediction_type,clip", [("epsilon", False), ("v_prediction", False), ("sample", True), ("epsilon", True)])
def test_numpy_loop_equals_the_torch_sampler_fed_the_same_noise(prediction_type, clip, monkeypatch):
    """4 steps (3 re-noisings): the numpy loop's noise comes from its generator; the torch sampler is fed
    those same draws. Both in float32 on the same linear 'UNet': equal to float32 rounding."""
    import pocketdiff.sampling as sampling

    sched = _scheduler(prediction_type, clip)
    unet = _LinearUnet(0.7, 0.3)
    shape = (1, 4, 6, 6)
    rng = np.random.default_rng(3)
    z = rng.standard_normal(shape).astype(np.float32)
    draws = np.random.default_rng(11)
    noises = [draws.standard_normal(shape).astype(np.float32) for _ in range(3)]
    fed = iter(noises)
    monkeypatch.setattr(sampling, "randn_latents", lambda shape, generator=None, device=None: torch.from_numpy(next(fed)))
    with torch.no_grad():
        ref = sampling.consistency_sample(unet, sched, torch.zeros(1, 3, 8), torch.from_numpy(z), steps=4).numpy()
    seen = []

    def model(x, t):
        seen.append(t)
        return unet(torch.from_numpy(x), torch.tensor([t]))[0].numpy()

    ours = sample_loop(scheduler_for(_block(sched, 4)), z, model, np.random.default_rng(11))
    assert seen == [999, 799, 499, 299]
    assert ours.dtype == np.float32 and ours.shape == shape
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)
    if clip:  # clipping changed something, or the case tests nothing
        unclipped = sample_loop(scheduler_for({**_block(sched, 4), "clip_sample_range": None}), z, model, np.random.default_rng(11))
        assert np.abs(unclipped - ours).max() > 1e-3


def test_one_step_draws_no_noise():
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    sched = _scheduler("epsilon")
    sample_loop(scheduler_for(_block(sched, 1)), np.ones((1, 4, 2, 2), np.float32), lambda x, t: 0.1 * x, rng)
    assert rng.bit_generator.state == state


def test_check_lcm_block_names_each_malformed_field():
    good = _block(_scheduler("epsilon"), 2)
    good["timesteps"] = list(good["timesteps"])
    assert check_lcm_block(good, 1000, 2, True) == []
    cases = {
        "scheduler.original_inference_steps": {"original_inference_steps": None},
        "scheduler.steps": {"steps": 11, "timesteps": list(range(999, 988, -1))},
        "scheduler.timesteps[1]": {"timesteps": [999, 500]},
        "scheduler.timestep_scaling": {"timestep_scaling": "10"},
        "scheduler.sigma_data": {"sigma_data": 0.0},
        "scheduler.clip_sample_range": {"clip_sample_range": float("nan")},
    }
    for field, change in cases.items():
        block = {**good, **change}
        problems = check_lcm_block(block, 1000, block["steps"], True)
        assert [p[0] for p in problems] == [field], (field, problems)
