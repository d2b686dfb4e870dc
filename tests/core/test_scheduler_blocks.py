"""pocketdiff/scheduler_blocks.py: the scheduler block written from a diffusers config and read back, the offset
never defaulted, img2img's strength refused outside (0, 1]. Its rules against diffusers' numbers:
tests/runtime/test_scheduler_vectors.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pocketdiff import scheduler_blocks as sb
from pocketdiff.errors import PocketdiffError
from pocketdiff.runtime.schedulers import scheduler_for

ALPHAS = np.cumprod(1 - np.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000) ** 2)
SD_DDIM = {"num_train_timesteps": 1000, "prediction_type": "epsilon", "set_alpha_to_one": False, "steps_offset": 1,
           "timestep_spacing": "leading"}
LCM = {"num_train_timesteps": 1000, "prediction_type": "epsilon", "original_inference_steps": 10, "timestep_scaling": 10.0,
       "clip_sample": False}


def test_block_for_writes_every_field_explicitly_in_the_manifest_order():
    block = sb.block_for(sb.DDIM, SD_DDIM, 4, ALPHAS)
    assert list(block) == ["type", "prediction_type", "num_train_timesteps", "steps", "timesteps", "alphas_cumprod",
                           "final_alpha_cumprod", "timestep_spacing", "steps_offset", "eta"]  # SD_DDIM: clip_sample off
    assert sb.block_for(sb.DDIM, {**SD_DDIM, "clip_sample": True}, 4, ALPHAS)["clip_sample_range"] == 1.0  # diffusers' default range
    assert block["timesteps"] == [751, 501, 251, 1] and block["final_alpha_cumprod"] == ALPHAS[0]  # set_alpha_to_one False
    # a config without the offset (diffusers' DDIMScheduler default): 0, written out
    bare = sb.block_for(sb.DDIM, {"num_train_timesteps": 1000}, 4, ALPHAS)
    assert bare["steps_offset"] == 0 and bare["timestep_spacing"] == "leading" and bare["timesteps"] == [750, 500, 250, 0]
    assert bare["final_alpha_cumprod"] == 1.0  # DDIMScheduler's set_alpha_to_one default
    assert sb.block_for(sb.DDIM, SD_DDIM, 4, ALPHAS, final_alpha_cumprod=0.5)["final_alpha_cumprod"] == 0.5
    lcm = sb.block_for(sb.LCM, LCM, 2, ALPHAS)
    assert list(lcm)[-4:] == ["original_inference_steps", "timestep_scaling", "sigma_data", "clip_sample_range"]
    assert lcm["timesteps"] == [999, 499] and lcm["clip_sample_range"] is None
    assert sb.block_for(sb.LCM, {**LCM, "clip_sample": True, "clip_sample_range": 1.5}, 2, ALPHAS)["clip_sample_range"] == 1.5
    json.dumps(block), json.dumps(lcm)  # plain JSON types


@pytest.mark.parametrize("spacing,offset,steps", [("leading", 1, 4), ("leading", 0, 7), ("trailing", 0, 16), ("trailing", 1, 3),
                                                  ("linspace", 0, 25), ("linspace", 1, 1)])
def test_written_blocks_read_back_clean_and_run(spacing, offset, steps):
    block = sb.block_for(sb.DDIM, {**SD_DDIM, "timestep_spacing": spacing, "steps_offset": offset}, steps, ALPHAS)
    assert sb.block_problems(block) == []
    assert scheduler_for(block).timesteps == block["timesteps"]
    lcm = sb.block_for(sb.LCM, LCM, min(steps, 10), ALPHAS)
    assert sb.block_problems(lcm) == [] and scheduler_for(lcm).timesteps == lcm["timesteps"]


def test_a_ddim_block_must_carry_its_offset_and_spacing():
    block = sb.block_for(sb.DDIM, SD_DDIM, 4, ALPHAS)
    for key in ("steps_offset", "timestep_spacing"):
        rest = {k: v for k, v in block.items() if k != key}
        assert [p[:2] for p in sb.block_problems(rest)] == [(f"scheduler.{key}", "present")]
        with pytest.raises(PocketdiffError, match=f"scheduler.{key}: a ddim block carries it"):
            scheduler_for(rest, strength=0.5)
    wrong = sb.block_problems({**block, "steps_offset": 0})  # [751, ...] are offset 1's
    assert [p[:2] for p in wrong] == [("scheduler.timesteps[0]", "spacing")] and "gives 750" in wrong[0][2]
    too_far = sb.block_problems({**block, "steps": 1, "timesteps": [1], "steps_offset": 1000})
    assert [p[:2] for p in too_far] == [("scheduler.steps_offset", "range")] and "1000, outside [0, 1000)" in too_far[0][2]


def test_a_ddim_blocks_clip_range_is_checked_and_thresholding_refused():
    block = sb.block_for(sb.DDIM, {**SD_DDIM, "clip_sample": True, "clip_sample_range": 1.5}, 4, ALPHAS)
    assert sb.block_problems(block) == [] and scheduler_for(block).config.clip_sample_range == 1.5
    for bad in (0, -1.0, float("nan"), "1"):
        assert [p[:2] for p in sb.block_problems({**block, "clip_sample_range": bad})] == [("scheduler.clip_sample_range", "value")]
    with pytest.raises(PocketdiffError, match="model.pretrained: the scheduler uses dynamic thresholding"):
        sb.block_for(sb.DDIM, {**SD_DDIM, "thresholding": True}, 4, ALPHAS)


def test_strength_and_refusals():
    assert sb.strength_timesteps([751, 501, 251, 1], 0.5) == [251, 1]
    assert sb.strength_timesteps([751, 501, 251, 1], 0.3) == [1]  # int(1.2) = 1
    for bad in (0, 0.0, 1.5, float("nan"), -0.1, "0.5", True, None):
        with pytest.raises(PocketdiffError, match="strength must be a number in"):
            sb.strength_timesteps([751, 501], bad)
    with pytest.raises(PocketdiffError, match="keeps none of the 2 steps"):
        sb.strength_timesteps([751, 501], 0.3)
    with pytest.raises(PocketdiffError, match="keeps 3 of the 10-point grid's points, fewer than the 4 steps"):
        sb.lcm_timesteps(1000, 10, 4, 0.3)
    with pytest.raises(PocketdiffError, match="outside"):
        sb.ddim_timesteps(1000, 61, spacing="trailing", steps_offset=0)  # numpy's arange: 62 values, the last -1
    with pytest.raises(PocketdiffError, match="steps: a consistency student trained on a 10-point grid samples with 1 to 10"):
        sb.block_for(sb.LCM, LCM, 11, ALPHAS)
    with pytest.raises(PocketdiffError, match="dynamic thresholding"):
        sb.block_for(sb.LCM, {**LCM, "thresholding": True}, 2, ALPHAS)
    with pytest.raises(PocketdiffError, match="'euler' has no manifest block"):
        sb.block_for("euler", SD_DDIM, 4, ALPHAS)


def test_scheduler_for_with_strength_keeps_the_full_stride():
    """img2img through the runtime: the last int(N s) timesteps; DDIM steps by T // N (not by the kept count)."""
    block = sb.block_for(sb.DDIM, SD_DDIM, 4, ALPHAS)
    sched = scheduler_for(block, strength=0.5)
    assert sched.timesteps == [251, 1] and sched.num_inference_steps == 4
    x = np.ones((1, 4, 2, 2), np.float32)
    out = sched.step(np.zeros_like(x), 251, x).prev_sample  # eps 0: x0 = x / sqrt(a_251), prev = 251 - 250 = 1
    np.testing.assert_allclose(out, x * np.sqrt(ALPHAS[1] / ALPHAS[251]), rtol=1e-6)
    lcm = scheduler_for(sb.block_for(sb.LCM, LCM, 2, ALPHAS), strength=0.5)
    assert lcm.timesteps == [499, 299]  # 2 points of the grid's first 5 [499, 399, 299, 199, 99]: indices floor(0), floor(2.5)
